"""A/B: model.cpu_allocator system vs auto (reuse), decode steps of hf generate and the elm loop,
batch 8 and 32, 128-token random prompt, 48 sampled tokens; one process per mode (process-wide)."""

import json
import sys
import time

import torch
from transformers import GenerationConfig

from elm_memory.backends.decode import DecodeOptions, sample
from elm_memory.config import ModelConfig
from elm_memory.models.loading import load_model

mode = sys.argv[1]
loaded = load_model(ModelConfig(name_or_path="packaged:qwen2.5-coder-0.5b", device="cpu", cpu_allocator=mode))
model = loaded.model
torch.manual_seed(0)
prompt = torch.randint(1000, 20000, (1, 128))
for batch in (8, 32):
    ids = prompt.expand(batch, -1).contiguous()
    mask = torch.ones_like(ids)

    def hf(n, ids=ids, mask=mask):
        cfg = GenerationConfig(
            max_new_tokens=n, min_new_tokens=n, do_sample=True, temperature=0.8, top_k=None, top_p=None, pad_token_id=0
        )
        model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)

    def loop(n, ids=ids, mask=mask):
        sample(model, mask, DecodeOptions(max_new_tokens=n, temperature=0.8), input_ids=ids)

    for name, fn in (("hf-generate", hf), ("elm-loop", loop)):
        fn(2)
        t = time.perf_counter()
        fn(8)
        a = time.perf_counter() - t
        t = time.perf_counter()
        fn(48)
        b = time.perf_counter() - t
        print(
            json.dumps(
                {
                    "mode": mode,
                    "placement": loaded.placement.cpu_allocator,
                    "backend": name,
                    "batch": batch,
                    "step_ms": round((b - a) / 40 * 1000, 1),
                }
            ),
            flush=True,
        )
