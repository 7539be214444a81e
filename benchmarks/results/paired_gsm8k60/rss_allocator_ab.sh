#!/usr/bin/env bash
# peak RSS of a 4-question GSM8K stream (the paired recipe), cpu_allocator reuse then system; one thread
cd /work/main
for A in reuse system; do
  rm -rf /tmp/rss_$A
  /work/main/.venv/bin/python - "$A" <<'PY'
import resource, subprocess, sys, time
a = sys.argv[1]
args = [".venv/bin/elm", "stream", "--dataset", "gsm8k", "--limit", "4", "--seed", "17", "-m", "elm_input",
        "--preset", "cpu-demo", "--set", "verifier.name=consistency", "--set", "verifier.consistency_max_new_tokens=384",
        "--set", "training.steps=4", "--set", "training.learning_rate=1e-3", "--set", "training.skip_below_majority_share=0.5",
        "--set", "training.max_completion_length=384", "--set", "model.num_threads=1", "--set", f"model.cpu_allocator={a}",
        "--no-plots", "--out", f"/tmp/rss_{a}"]
t = time.time()
r = subprocess.run(args, capture_output=True, text=True)
print(a, "rc", r.returncode, "peak_rss_gib", round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, 2), "seconds", round(time.time() - t), flush=True)
print(r.stderr[-600:])
PY
done
