#!/usr/bin/env bash
# Eight memories learning together (S=4, G=8, 256-token rollouts), the whole group per backward against
# one rollout per backward, in one run, quiet, two threads.
cd "$(dirname "$0")/../../.."
.venv/bin/python -m benchmarks.learn_throughput --sections learning \
    --learn-variants "native M=8 group backward,native M=8" --out benchmarks/results/training_micro_batch/learn_throughput_m8_ab.json
