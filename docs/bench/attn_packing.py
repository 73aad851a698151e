"""Time causal attention (forward + backward) on one packed micro-batch, three ways.

plain causal SDPA over whole rows (packing without document masking), flowtrain's
document-masked attention (variable-length flash over the same rows, documents of chat-like
lengths), and one document per row as the same kernel sees it::

    python docs/bench/attn_packing.py            # prints one JSON line
"""

import json
import time

import numpy as np
import torch
import torch.nn.functional as F

from flowtrain.train.model.attention import _VARLEN_PARAMS, Documents, attend

B, S, H, KV, D = 4, 4096, 32, 8, 128
rng = np.random.default_rng(0)
rows = []
for _ in range(B):
    lengths, left = [], S
    while left > 0:
        n = int(min(left, max(32, rng.lognormal(np.log(600), 0.8))))
        lengths.append(n)
        left -= n
    rows.append(torch.cat([torch.arange(n) for n in lengths]))
docs = Documents.from_positions(torch.stack(rows)).to("cuda")
q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(B, KV, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(B, KV, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn_like(q)


def timed(fn, reps=20):
    for _ in range(3):
        fn().backward(dy)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn().backward(dy)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e3


plain = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
masked = timed(lambda: attend(q, k, v, docs, None))
print(json.dumps({"job": "attn_packing", "shape": [B, S, H, KV, D], "documents": len(docs.cu_seqlens) - 1,
                  "varlen": sorted(_VARLEN_PARAMS or []), "plain_causal_ms": round(plain, 3),
                  "document_masked_ms": round(masked, 3), "torch": torch.__version__}))
