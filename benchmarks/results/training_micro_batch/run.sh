#!/usr/bin/env bash
# A memory's learning step on a GSM8K question (long answers): the whole group in one backward (@mbG)
# against one rollout per backward (@mb1) and two (@mb2), the same rollouts; G=4 then G=8, 384-token cap,
# one thread (a GSM8K stream ran on the other core). Peak RSS per variant (each in its own process).
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/training_micro_batch
Q="Tim has a box with 7 blue shoe boxes and 9 red shoe boxes. If he uses 3 blue shoeboxes and 1/3 red of his shoeboxes to go fishing, how many red and blue shoe boxes are left in Tim's box?"
.venv/bin/python -m benchmarks.learn_step --threads 1 --generations 4 --max-len 384 --steps 2 --question "$Q" \
    --variants native-faithful@mb4,native-faithful@mb1,native-faithful@mb2,native-faithful@mb4,native-faithful@mb1 \
    --out $OUT/learn_step_g4.json
.venv/bin/python -m benchmarks.learn_step --threads 1 --generations 8 --max-len 384 --steps 1 --question "$Q" \
    --variants native-faithful@mb8,native-faithful@mb1 --out $OUT/learn_step_g8.json
