set -u
for side in before after; do
  if [ $side = before ]; then W=/tmp/wt_before_eager; else W=/work/main; fi
  cd $W; echo "== $side $(date -u +%T)"
  PYTHONPATH=$W HF_HUB_OFFLINE=1 timeout 420 /work/main/.venv/bin/python -m benchmarks.learn_throughput --sections learning \
    --learn-variants "native M=1" --out /tmp/abcpu/mem_${side}.json 2>&1 | grep -v -i "loading\|warn" | tail -4
done
echo "== done $(date -u +%T)"
