#!/usr/bin/env bash
# Training forward+backward, eager vs sdpa, 4 rows and 1 row, alternated, one thread
cd "$(dirname "$0")/../../.."
for round in 1 2; do
  for rows in 4 1; do
    for k in eager sdpa; do
      .venv/bin/python benchmarks/results/training_micro_batch/train_attn.py $k $rows 140 384 3 >> benchmarks/results/training_micro_batch/train_attn.jsonl 2>/dev/null
    done
  done
done

