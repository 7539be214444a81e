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
for m in plain tuned; do
  if [ $m = tuned ]; then export GLIBC_TUNABLES=glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=1073741824; else unset GLIBC_TUNABLES; fi
  rm -rf /tmp/ab_store_$m
  t0=$(date +%s.%N)
  HF_HUB_OFFLINE=1 .venv/bin/elm learn -p cpu-demo --set store.path=/tmp/ab_store_$m --set training.steps=1 --set training.num_generations=8 --json "${QS[@]}" > /tmp/ab8_$m.json 2>/tmp/ab8_err_$m.log
  t1=$(date +%s.%N)
  echo "$m $(echo "$t1 - $t0" | bc)"
done
