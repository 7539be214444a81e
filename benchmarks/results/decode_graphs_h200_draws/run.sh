#!/usr/bin/env bash
# GPU check for issue 37 (session 5): counter-based draws, the token picked inside the captured step,
# tokens read back every 8 steps. CUDA tests, decode steps (captured, plain, bare reference), a memory at S=10.
set -u
T0=$(date +%s); el() { echo "== $1 at +$(( $(date +%s) - T0 ))s"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 ELM_TEST_TOKENIZER_DIR=$PWD/.gpu/qwen
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
nvidia-smi -L; python3 -c "import torch,transformers;print(torch.__version__,transformers.__version__)"
el tests
timeout 110 python3 -m pytest -q -m cuda tests/test_cuda.py -p no:cacheprovider 2>&1 | tee $OUT/cuda_tests.log | tail -12
el decode_graphs
timeout 290 python3 -m benchmarks.decode_graphs --config-dir .gpu/qwen --paths on,off,bare --steps 128 --repeats 2 \
  --out $OUT/decode_graphs_h200.json --profile $OUT 2>&1 | grep -v -i "warn\|shards\|weights" | tail -14
el gpu_check
timeout 100 python3 -m benchmarks.gpu_check --config-dir .gpu/qwen --runs 10x256 --out $OUT/gpu_check_graphs_h200.json 2>&1 | tail -5
el done
