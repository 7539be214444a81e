"""A/B: the M=8 learning's rollouts (8 questions x G=8 rows, 256-token cap, lookup drafts 3 as in
cpu-demo, temperature 1.0, seeded), weights prepacked or plain, one process, alternating, two rounds.
The two settings sample different tokens (rounding), so compare time per forward call and per token.

    python benchmarks/results/weight_prepack/rollouts_ab.py
"""

import json
import time

import torch

from elm_memory.backends.decode import DecodeOptions, sample
from elm_memory.config import ModelConfig
from elm_memory.models.loading import load_model
from elm_memory.models.prepack import prepack_linears, unpack_linears

QS = [
    "A shop sells pencils at 3 dollars each and pens at 5 dollars each. Sam buys 4 pencils and 3 pens. "
    "How much does he spend?",
    "Tom has 12 apples and gives away 5. Then he buys 9 more. How many apples does he have?",
    "A train travels 60 km in 1.5 hours. What is its speed in km/h?",
    "What is 17 times 23?",
    "A rectangle is 7 cm wide and 12 cm long. What is its area?",
    "Lisa reads 25 pages a day. How many pages does she read in 2 weeks?",
    "A box holds 6 eggs. How many boxes are needed for 75 eggs?",
    "What is the sum of the first 10 positive integers?",
]
loaded = load_model(ModelConfig(name_or_path="packaged:qwen2.5-coder-0.5b", device="cpu", cpu_weight_prepack="off"))
model, tok = loaded.model, loaded.tokenizer
texts = [
    tok.apply_chat_template(
        [{"role": "user", "content": q + " Put the final answer in \\boxed{}."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    for q in QS
]
enc = tok(texts, return_tensors="pt", padding=True, padding_side="left")
calls = [0]
forward = model.forward


def counted(*args, **kwargs):
    calls[0] += 1
    return forward(*args, **kwargs)


model.forward = counted
options = DecodeOptions(max_new_tokens=256, temperature=1.0, n=8, lookup_draft_tokens=3)
for rnd in range(2):
    for mode in ("plain", "packed") if rnd == 0 else ("packed", "plain"):
        if mode == "packed":
            prepack_linears(model)
        gens = [torch.Generator().manual_seed(100 + i) for i in range(len(QS))]
        calls[0] = 0
        t = time.perf_counter()
        rows = sample(model, enc["attention_mask"], options, input_ids=enc["input_ids"], generators=gens)
        s = time.perf_counter() - t
        tokens = sum(len(r[0]) for r in rows)
        print(
            json.dumps(
                {
                    "round": rnd,
                    "mode": mode,
                    "seconds": round(s, 1),
                    "tokens": tokens,
                    "forwards": calls[0],
                    "ms_per_forward": round(s / calls[0] * 1000, 1),
                    "ms_per_token": round(s / tokens * 1000, 2),
                }
            ),
            flush=True,
        )
        if mode == "packed":
            unpack_linears(model)
