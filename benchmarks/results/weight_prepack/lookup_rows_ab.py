"""Lookup drafts by batch size: rollouts (G=8 rows per question, 1 / 2 / 8 questions, 256-token cap,
stop at end of turn, temperature 1.0, seeded) with lookup_draft_tokens 0 and 3, weights prepacked
(the default), alternating, two rounds. Drafting and not draw different tokens, so compare the time
per generated token.

    python benchmarks/results/weight_prepack/lookup_rows_ab.py
"""

import json
import time

import torch

from elm_memory.backends.decode import DecodeOptions, sample
from elm_memory.config import ModelConfig
from elm_memory.models.loading import load_model

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
loaded = load_model(ModelConfig(name_or_path="packaged:qwen2.5-coder-0.5b", device="cpu"))
model, tok = loaded.model, loaded.tokenizer
eos = [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
for rnd in range(2):
    for questions in (1, 2, 8):
        texts = [
            tok.apply_chat_template(
                [{"role": "user", "content": q + " Put the final answer in \\boxed{}."}],
                tokenize=False,
                add_generation_prompt=True,
            )
            for q in QS[:questions]
        ]
        enc = tok(texts, return_tensors="pt", padding=True, padding_side="left")
        for drafts in (0, 3) if rnd == 0 else (3, 0):
            options = DecodeOptions(max_new_tokens=256, temperature=1.0, n=8, lookup_draft_tokens=drafts)
            gens = [torch.Generator().manual_seed(100 + i) for i in range(questions)]
            t = time.perf_counter()
            rows = sample(
                model, enc["attention_mask"], options, input_ids=enc["input_ids"], generators=gens, eos_ids=eos
            )
            s = time.perf_counter() - t
            tokens = sum(len(r[0]) for r in rows)
            print(
                json.dumps(
                    {
                        "round": rnd,
                        "rows": 8 * questions,
                        "drafts": drafts,
                        "seconds": round(s, 1),
                        "tokens": tokens,
                        "longest": max(len(r[0]) for r in rows),
                        "ms_per_token": round(s / tokens * 1000, 2),
                    }
                ),
                flush=True,
            )
