"""The in-process A/B of step_ab.txt: a decode step of the packaged model with transformers' eager
attention (stock) and with the query heads packed, alternated; `python step_ab.py` (linted after the run)."""

import statistics
import time

import torch
import transformers.models.qwen2.modeling_qwen2 as mq
from transformers import DynamicCache

from elm_memory.config import ELMConfig
from elm_memory.models.loading import load_model

stock = mq.eager_attention_forward


def packed(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
    B, Hq, T, D = query.shape
    Hkv = key.shape[1]
    if T != 1 or Hkv == Hq:
        return stock(module, query, key, value, attention_mask, scaling, dropout, **kw)
    q = query.reshape(B, Hkv, Hq // Hkv, D)
    w = torch.matmul(q, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        w = w + attention_mask
    w = torch.softmax(w, -1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(w, value).reshape(B, Hq, 1, D)
    return out.transpose(1, 2).contiguous(), None


cfg = ELMConfig.load(preset="cpu-demo")
model = load_model(cfg.model).model
print(model.config._attn_implementation)
g = torch.Generator().manual_seed(0)


def decode(B, P, steps=10):
    ids = torch.randint(100, 20000, (B, P), generator=g)
    cache = DynamicCache()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    mask = torch.ones(B, P + 1, dtype=torch.long)
    pos = torch.full((B, 1), P)
    times, toks = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = model(input_ids=nxt, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        times.append(time.perf_counter() - t0)
        nxt, pos = out.logits[:, -1].argmax(-1, keepdim=True), pos + 1
        toks.append(nxt)
        mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.long)], dim=1)
    return statistics.median(times[2:]) * 1e3, torch.cat(toks, 1)


with torch.no_grad():
    for B, P in ((8, 150), (32, 150), (32, 400)):
        res = {}
        for _ in range(2):
            for name, fn in (("stock", stock), ("packed", packed)):
                mq.eager_attention_forward = fn
                g.manual_seed(B * 1000 + P)
                ms, toks = decode(B, P)
                res.setdefault(name, []).append(ms)
                res[name + "_toks"] = toks
        print(
            B,
            P,
            {k: [round(x, 1) for x in v] for k, v in res.items() if not k.endswith("toks")},
            "same tokens",
            torch.equal(res["stock_toks"], res["packed_toks"]),
            flush=True,
        )
