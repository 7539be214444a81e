"""One memory (S=2, G=8, 256 tokens, packaged 0.5B, CPU): the backward's seconds per step and the soft prompt."""

import hashlib
import json
import sys
import time

from elm_memory.backends.hf import HFBackend
from elm_memory.backends.prompting import PromptBuilder
from elm_memory.config import ELMConfig
from elm_memory.eval.datasets import load_problems
from elm_memory.models.loading import load_model
from elm_memory.training import native
from elm_memory.training.learn import learn_memory

cfg = ELMConfig.load(
    overrides={
        "model": {"device": "cpu"},
        "training": {
            "engine": "native",
            "steps": 2,
            "num_generations": 8,
            "max_completion_length": 256,
            "seed": 0,
            "skip_uniform_rewards": False,
        },
    }
)
loaded = load_model(cfg.model)
backend = HFBackend.from_config(cfg, loaded)
prompts = PromptBuilder(loaded.tokenizer, cfg.prompt, loaded.info.max_context)
q = load_problems("gsm8k", limit=1, seed=17)[0].question
orig = native.NativeTrainer._backward
times = []


def wrapped(self, mems, active, batch):
    t = time.perf_counter()
    out = orig(self, mems, active, batch)
    times.append(round(time.perf_counter() - t, 2))
    return out


native.NativeTrainer._backward = wrapped
m = learn_memory(q, config=cfg, loaded=loaded, backend=backend, prompts=prompts, progress=False)
digest = hashlib.sha256(m.soft_prompt.float().numpy().tobytes()).hexdigest()[:16]
print(
    json.dumps(
        {
            "label": sys.argv[1],
            "backward_s": times,
            "gen_s": round(m.meta.stats.generation_seconds, 1),
            "tokens": m.meta.stats.completion_tokens,
            "soft_prompt_sha": digest,
        }
    ),
    flush=True,
)
