#!/usr/bin/env bash
# Ten GSM8K questions of the paired recipe (seed 17, one thread), glibc's heap counters every 30 s
# (malloc_watch.py). Run once before and once after the one-rollout CPU backward (c4be52b); the first
# log is heap_counters_gsm8k10.log, the second heap_counters_gsm8k10_mb1.log.
cd "$(dirname "$0")/../../.."
LOG=${1:-/tmp/heap_counters.log}
.venv/bin/python benchmarks/results/training_micro_batch/malloc_watch.py "$LOG" 30 0 stream --dataset gsm8k \
    --limit 10 --seed 17 -m elm_input --preset cpu-demo --set verifier.name=consistency \
    --set verifier.consistency_max_new_tokens=384 --set training.steps=4 --set training.learning_rate=1e-3 \
    --set training.skip_below_majority_share=0.5 --set training.max_completion_length=384 \
    --set model.num_threads=1 --no-plots --out /tmp/heap_counters_stream
