"""A/B in one process: the elm loop's decode step with GrowingCache (in-place appends) vs transformers'
DynamicCache (torch.cat per step), batch 8/32/64, 128-token random prompt, (136 - 8) / 128 steps, alternating."""

import json
import sys
import time

import torch
from transformers import DynamicCache

import elm_memory.backends.growing_cache as gc
from elm_memory.backends.decode import DecodeOptions, sample
from elm_memory.config import ModelConfig
from elm_memory.models.loading import load_model

Growing = gc.GrowingCache
loaded = load_model(ModelConfig(name_or_path="packaged:qwen2.5-coder-0.5b", device="cpu"))
model = loaded.model
torch.manual_seed(0)
prompt = torch.randint(1000, 20000, (1, 128))
for batch in [int(b) for b in sys.argv[1].split(",")]:
    ids = prompt.expand(batch, -1).contiguous()
    mask = torch.ones_like(ids)

    def loop(n, ids=ids, mask=mask):
        sample(model, mask, DecodeOptions(max_new_tokens=n, temperature=0.8), input_ids=ids)

    for rnd in (1, 2):
        for name, cls in (("dynamic", DynamicCache), ("growing", Growing)):
            gc.GrowingCache = cls
            loop(2)
            t = time.perf_counter()
            loop(8)
            a = time.perf_counter() - t
            t = time.perf_counter()
            loop(136)
            b = time.perf_counter() - t
            print(
                json.dumps(
                    {
                        "cache": name,
                        "round": rnd,
                        "batch": batch,
                        "placement": loaded.placement.cpu_allocator,
                        "step_ms": round((b - a) / 128 * 1000, 1),
                    }
                ),
                flush=True,
            )
