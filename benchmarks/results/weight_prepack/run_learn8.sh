#!/usr/bin/env bash
cd /work/main
QS=("A shop sells pencils at 3 dollars each and pens at 5 dollars each. Sam buys 4 pencils and 3 pens. How much does he spend?"
"Tom has 12 apples and gives away 5. Then he buys 9 more. How many apples does he have?"
"A train travels 60 km in 1.5 hours. What is its speed in km/h?"
"What is 17 times 23?"
"A rectangle is 7 cm wide and 12 cm long. What is its area?"
"Lisa reads 25 pages a day. How many pages does she read in 2 weeks?"
"A box holds 6 eggs. How many boxes are needed for 75 eggs?"
"What is the sum of the first 10 positive integers?")
i=0
for m in off auto auto off; do
  i=$((i+1))
  rm -rf /tmp/wp_store_${i}_$m
  t0=$(date +%s.%N)
  HF_HUB_OFFLINE=1 .venv/bin/elm learn -p cpu-demo --set store.path=/tmp/wp_store_${i}_$m --set model.cpu_weight_prepack=$m --set training.steps=1 --set training.num_generations=8 --json "${QS[@]}" > /tmp/wp8_${i}_$m.json 2>/tmp/wp8_err_${i}_$m.log
  t1=$(date +%s.%N)
  echo "$i $m $(echo "$t1 - $t0" | bc)"
done
