#!/usr/bin/env bash
# One GPU check for issue 37, ready for a session that is lent a GPU (about 7 minutes on an H200).
# Run from the repository root through the device tool, carrying .gpu (the default model's config.json and
# tokenizer files, no weights) and .whl (transformers 5.23, peft, pydantic and its needs, tokenizers):
#   bash benchmarks/gpu_session.sh 2>&1 | tee $OUT/run.log
# Order: what the targets need first (tests, captured steps beside the bare reference, a memory at
# S=10), the plain loop last (it is slow and only gives the speedup).
set -u
T0=$(date +%s); el() { echo "== $1 at +$(( $(date +%s) - T0 ))s"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 ELM_TEST_TOKENIZER_DIR=$PWD/.gpu/qwen
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
nvidia-smi -L; python3 -c "import torch,transformers;print(torch.__version__,transformers.__version__)"
el tests
timeout 100 python3 -m pytest -q -m cuda tests/test_cuda.py -p no:cacheprovider 2>&1 | tee $OUT/cuda_tests.log | tail -6
el token_choice
timeout 40 python3 -m benchmarks.token_choice --device cuda --out $OUT/token_choice_gpu.json 2>&1 | tail -3
el decode_graphs
timeout 200 python3 -m benchmarks.decode_graphs --config-dir .gpu/qwen --paths on,bare --steps 128 --repeats 2 \
  --out $OUT/decode_graphs_gpu.json --profile $OUT 2>&1 | grep -v -i "warn\|shards\|weights" | tail -8
el gpu_check
timeout 100 python3 -m benchmarks.gpu_check --config-dir .gpu/qwen --runs 10x256 --out $OUT/gpu_check_gpu.json 2>&1 | tail -3
el plain_loop
timeout 100 python3 -m benchmarks.decode_graphs --config-dir .gpu/qwen --paths off --steps 128 --repeats 1 \
  --out $OUT/decode_graphs_off_gpu.json 2>&1 | grep -v -i "warn\|shards\|weights" | tail -4
el done
