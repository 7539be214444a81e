"""One memory's teacher-forced forward and backward (8 x 256 tokens, soft prompt): three timed steps,
or with --profile one profiled step.

    python benchmarks/results/teacher_forcing_backward/step_bwd.py [--profile]
"""

import sys
import time

import torch

from elm_memory.backends.base import PromptInput
from elm_memory.backends.teacher_forcing import completion_logprobs
from elm_memory.config import ModelConfig
from elm_memory.models.loading import load_model

loaded = load_model(ModelConfig(name_or_path="packaged:qwen2.5-coder-0.5b", device="cpu"))
model = loaded.model
torch.manual_seed(0)
emb = model.get_input_embeddings()
prompt_ids = tuple(torch.randint(1000, 20000, (100,)).tolist())
soft = emb(torch.tensor(prompt_ids[:20])).detach().clone().requires_grad_(True)
comps = [torch.randint(1000, 20000, (256,)).tolist() for _ in range(8)]


def step():
    lp, mask = completion_logprobs(
        model,
        [PromptInput(prompt_ids, soft_prompt=soft, soft_prompt_at=0)],
        comps,
        temperature=0.8,
        share_prompt_kv=True,
    )
    loss = -(lp * mask).sum() / mask.sum()
    loss.backward()


step()
if "--profile" in sys.argv:  # one profiled step (what found the fills)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))
else:  # three timed steps
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        step()
        ts.append(round(time.perf_counter() - t, 2))
    print("steps s", ts, flush=True)
