# A/B on the CPU, alternating processes, each run from its own tree (python -m puts the cwd first on sys.path)
set -u
for round in 1 2; do
  for side in before after; do
    if [ $side = before ]; then W=/tmp/wt_before_eager; else W=/work/main; fi
    cd $W
    echo "== round $round $side $(date -u +%T) $(python3 -c 'import sys;print(sys.argv[1])' $W)"
    PYTHONPATH=$W HF_HUB_OFFLINE=1 timeout 400 /work/main/.venv/bin/python -c "import elm_memory.backends.decode as d; print('decode from', d.__file__)"
    PYTHONPATH=$W HF_HUB_OFFLINE=1 timeout 400 /work/main/.venv/bin/python -m benchmarks.decode_graphs --config-dir /work/main/.gpu/qwen \
      --paths off --device cpu --cases "rollouts x8,rollouts x64" --steps 32 --short-tokens 8 --repeats 2 \
      --out /tmp/abcpu/decode2_${side}_r${round}.json 2>&1 | grep '"case"'
  done
done
echo "== done $(date -u +%T)"
