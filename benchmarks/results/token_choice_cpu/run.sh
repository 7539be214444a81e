#!/usr/bin/env bash
# The plain loop's decode steps on this CPU, before (0ec4a73) and after (b9a868b) counter-based draws and
# the two-level CDF, alternating, one run.
set -u
OUT=/work/scratch/cpu_cmp; mkdir -p $OUT
CFG=$HOME/.cache/elm-memory/models/qwen2.5-coder-0.5b
for round in 1 2; do
  for v in old new; do
    cd /work/wt-$v && PYTHONPATH=$PWD HF_HUB_OFFLINE=1 /work/main/.venv/bin/python -m benchmarks.decode_graphs \
      --config-dir $CFG --paths off --device cpu --steps 32 --repeats 2 --cases "rollouts x8,rollouts x64" \
      --out $OUT/${v}_$round.json 2>&1 | grep '"case"'
  done
done
cd /work/wt-new && PYTHONPATH=$PWD /work/main/.venv/bin/python -m benchmarks.token_choice --out $OUT/token_choice_cpu.json
