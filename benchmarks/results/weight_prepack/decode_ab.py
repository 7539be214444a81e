"""A/B: the library's decode loop with the frozen linear weights prepacked (model.cpu_weight_prepack) or
plain, one process, switched in place and alternating; 128-token random prompt, 40 sampled tokens (the
first 8 subtracted), batch 8 / 32 / 64, two rounds. Also checks that both give the same tokens.

    python benchmarks/results/weight_prepack/decode_ab.py
"""

import json
import time

import torch

from elm_memory.backends.decode import DecodeOptions, sample
from elm_memory.config import ModelConfig
from elm_memory.environment import collect_env
from elm_memory.models.loading import load_model
from elm_memory.models.prepack import prepack_linears, unpack_linears

loaded = load_model(ModelConfig(name_or_path="packaged:qwen2.5-coder-0.5b", device="cpu", cpu_weight_prepack="off"))
model = loaded.model
print(
    json.dumps(
        {
            "cpu": collect_env(__import__("elm_memory.config").config.ELMConfig())["cpu"]["name"],
            "placement": loaded.placement.summary(),
        }
    ),
    flush=True,
)
torch.manual_seed(0)
prompt = torch.randint(1000, 20000, (1, 128))
for rnd in range(2):
    for batch in (8, 32, 64):
        ids = prompt.expand(batch, -1).contiguous()
        mask = torch.ones_like(ids)
        tokens = {}
        for mode in ("plain", "packed") if rnd == 0 else ("packed", "plain"):
            if mode == "packed":
                prepack_linears(model)

            def loop(n, ids=ids, mask=mask, batch=batch):
                gens = [torch.Generator().manual_seed(i) for i in range(batch)]
                return sample(
                    model, mask, DecodeOptions(max_new_tokens=n, temperature=0.8), input_ids=ids, generators=gens
                )

            loop(2)
            t = time.perf_counter()
            loop(8)
            a = time.perf_counter() - t
            t = time.perf_counter()
            tokens[mode] = loop(40)
            b = time.perf_counter() - t
            print(
                json.dumps({"round": rnd, "mode": mode, "batch": batch, "step_ms": round((b - a) / 32 * 1000, 1)}),
                flush=True,
            )
            if mode == "packed":
                unpack_linears(model)
        print(
            json.dumps({"round": rnd, "batch": batch, "same_tokens": tokens["plain"] == tokens["packed"]}), flush=True
        )
