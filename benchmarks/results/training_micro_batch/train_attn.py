"""One memory-training forward+backward (library's teacher forcing), one attention kernel per process.
usage: train_attn.py KERNEL ROWS PROMPT COMPLETION REPEATS  -> one JSON line (seconds, peak RSS growth)"""
import json, resource, statistics, sys, time
import torch
from elm_memory.backends.base import PromptInput
from elm_memory.backends.teacher_forcing import completion_logprobs
from elm_memory.config import ELMConfig
from elm_memory.models.loading import load_model

kernel, rows, prompt, completion, repeats = sys.argv[1], *map(int, sys.argv[2:6])
cfg = ELMConfig.load(preset="cpu-demo", overrides={"model": {"attn_implementation": kernel, "num_threads": 1}})
loaded = load_model(cfg.model)
model = loaded.model
share = cfg.training.share_prompt_kv
gen = torch.Generator().manual_seed(0)
ids = tuple(torch.randint(100, 20000, (prompt,), generator=gen).tolist())
comps = [torch.randint(100, 20000, (completion,), generator=gen).tolist() for _ in range(rows)]
soft0 = model.get_input_embeddings().weight[100:120].detach().clone()

def rss_kb():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1])

base = rss_kb()
times = []
for _ in range(repeats):
    soft = soft0.clone().requires_grad_(True)
    t0 = time.perf_counter()
    logps, mask = completion_logprobs(model, [PromptInput(ids, soft_prompt=soft, soft_prompt_at=0)], comps,
                                      temperature=0.7, share_prompt_kv=share, pad_id=0)
    (logps * mask).sum().backward()
    times.append(time.perf_counter() - t0)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"kernel": kernel, "rows": rows, "tokens": prompt + 20 + completion, "share_prompt_kv": share,
                  "seconds": [round(t, 2) for t in times], "median_s": round(statistics.median(times), 2),
                  "rss_after_load_gib": round(base / 2**20, 2), "peak_rss_gib": round(peak / 2**20, 2),
                  "peak_growth_gib": round((peak - base) / 2**20, 2),
                  "grad_norm": round(float(soft.grad.float().norm()), 4)}), flush=True)
