#!/usr/bin/env bash
# One GPU check for issue 37, ready for a session that is lent a GPU (about 7 minutes on an H200).
# Run from the repository root through the device tool, carrying .gpu (the default model's config.json and
# tokenizer files, no weights; shared/bench/hf_decode_limits.py copied in) and .whl (transformers 5.23, peft,
# pydantic and its needs, tokenizers; not huggingface_hub 2.x, which needs httpx2: the image's 1.33 serves):
#   bash benchmarks/gpu_session.sh 2>&1 | tee $OUT/run.log
# Order: the captured steps with packed attention against the same steps with transformers' copied key/value
# heads (the change being measured), the CUDA tests (tokens equal the plain loop's, memories equal the CPU's),
# a memory at S=10, G=8, then the reference rows (hf_decode_limits.py on the image's own transformers,
# as the issue measured them; its compiled generate is the row the 1.5x target names), last because its
# compiles take the longest. The plain loop is left out: 25-28 ms a step on every earlier run.
set -u
T0=$(date +%s); el() { echo "== $1 at +$(( $(date +%s) - T0 ))s"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 ELM_TEST_TOKENIZER_DIR=$PWD/.gpu/qwen
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
nvidia-smi -L; python3 -c "import torch,transformers;print(torch.__version__,transformers.__version__)"
quiet() { grep -v -i "warn\|shards\|weights\|profiler_st"; }
# --short-tokens 120: both timed calls of a case fall in one cache bucket (one compile and capture per case)
el decode_graphs_packed_vs_repeat
timeout 190 python3 -m benchmarks.decode_graphs --config-dir .gpu/qwen --paths on,on-repeat --profile $OUT \
  --cases "rollouts x64,rollouts x8" --steps 128 --short-tokens 120 --repeats 3 \
  --out $OUT/decode_graphs.json 2>&1 | quiet | tail -6
el tests
timeout 110 python3 -m pytest -q -m cuda tests/test_cuda.py -p no:cacheprovider 2>&1 | tee $OUT/cuda_tests.log | tail -4
el gpu_check
timeout 90 python3 -m benchmarks.gpu_check --config-dir .gpu/qwen --runs 10x256 --out $OUT/gpu_check_gpu.json 2>&1 | tail -3
[ -n "${SKIP_LIMITS:-}" ] && { el done; exit 0; }  # the reference rows ran already in this session
el hf_decode_limits
# the image's transformers (no /tmp/site): the version the reference rows were measured with
PYTHONPATH= timeout 190 python3 .gpu/hf_decode_limits.py .gpu/qwen --out $OUT/hf_decode_limits.json 2>&1 | quiet | tail -3
el done
