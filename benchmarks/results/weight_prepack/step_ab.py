"""A/B: one memory's teacher-forced forward and backward (8 x 256 tokens, soft prompt) with the weights
prepacked or plain, one process, alternating, three rounds; also checks the loss and the soft prompt's
gradient are the same bit for bit.

    python benchmarks/results/weight_prepack/step_ab.py
"""

import json
import time

import torch

from elm_memory.backends.base import PromptInput
from elm_memory.backends.teacher_forcing import completion_logprobs
from elm_memory.config import ModelConfig
from elm_memory.models.loading import load_model
from elm_memory.models.prepack import prepack_linears, unpack_linears

loaded = load_model(ModelConfig(name_or_path="packaged:qwen2.5-coder-0.5b", device="cpu", cpu_weight_prepack="off"))
model = loaded.model
torch.manual_seed(0)
emb = model.get_input_embeddings()
prompt_ids = tuple(torch.randint(1000, 20000, (100,)).tolist())
init = emb(torch.tensor(prompt_ids[:20])).detach().clone()
comps = [torch.randint(1000, 20000, (256,)).tolist() for _ in range(8)]


def step():
    soft = init.clone().requires_grad_(True)
    lp, mask = completion_logprobs(
        model, [PromptInput(prompt_ids, soft_prompt=soft, soft_prompt_at=0)], comps, temperature=0.8
    )
    loss = -(lp * mask).sum() / mask.sum()
    loss.backward()
    return loss.detach(), soft.grad


step()
seen = {}
for rnd in range(3):
    for mode in ("plain", "packed") if rnd % 2 == 0 else ("packed", "plain"):
        if mode == "packed":
            prepack_linears(model)
        t = time.perf_counter()
        seen[mode] = step()
        print(json.dumps({"round": rnd, "mode": mode, "step_s": round(time.perf_counter() - t, 2)}), flush=True)
        if mode == "packed":
            unpack_linears(model)
same = all(torch.equal(a, b) for a, b in zip(seen["plain"], seen["packed"], strict=True))
print(json.dumps({"same_loss_and_gradient": same}), flush=True)
