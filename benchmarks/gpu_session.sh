#!/usr/bin/env bash
# One GPU check for issue 37, ready for a session that is lent a GPU (about 6 minutes on an H200).
# Run from the repository root through the device tool, carrying .gpu (the default model's config.json and
# tokenizer files, no weights) and .whl (transformers 5.23, peft, pydantic and its needs, tokenizers):
#   bash benchmarks/gpu_session.sh 2>&1 | tee $OUT/run.log
# Order: the captured steps (the targets), the bare compiled reference beside them, the CUDA tests
# (tokens equal the plain loop's), a memory at S=10, G=8. The plain loop is left out: 25-28 ms a step on
# every earlier run, and slow to time. Ran as is on 2026-11-27 in 342 s (benchmarks/results/decode_graphs_h200_slots/).
# Not in it: transformers' compiled generate (hf_decode_limits.py), whose first call compiles for 3-6 minutes.
set -u
T0=$(date +%s); el() { echo "== $1 at +$(( $(date +%s) - T0 ))s"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 ELM_TEST_TOKENIZER_DIR=$PWD/.gpu/qwen
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
nvidia-smi -L; python3 -c "import torch,transformers;print(torch.__version__,transformers.__version__)"
quiet() { grep -v -i "warn\|shards\|weights\|profiler_st"; }
# --short-tokens 120: both timed calls of a case fall in one cache bucket (one compile and capture per case)
el decode_graphs_on
timeout 150 python3 -m benchmarks.decode_graphs --config-dir .gpu/qwen --paths on --steps 128 --short-tokens 120 \
  --repeats 3 --out $OUT/decode_graphs_on.json --profile $OUT 2>&1 | quiet | tail -5
el decode_graphs_bare
timeout 150 python3 -m benchmarks.decode_graphs --config-dir .gpu/qwen --paths bare --cases "rollouts x8,rollouts x64" \
  --steps 128 --repeats 3 --out $OUT/decode_graphs_bare.json 2>&1 | quiet | tail -3
el tests
timeout 130 python3 -m pytest -q -m cuda tests/test_cuda.py -p no:cacheprovider 2>&1 | tee $OUT/cuda_tests.log | tail -8
el gpu_check
timeout 110 python3 -m benchmarks.gpu_check --config-dir .gpu/qwen --runs 10x256 --out $OUT/gpu_check_gpu.json 2>&1 | tail -3
el done
