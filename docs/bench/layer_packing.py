"""Time one compiled llama-8b decoder layer, forward + backward, on 4 x 4096 tokens: rows
of one sequence each (plain causal attention) against rows of packed chat-like documents
(document-masked variable-length attention traced into the compiled layer, and the same kernel
called eagerly, outside the compiled graph)::

    python docs/bench/layer_packing.py        # one JSON line
"""

import json
import time
import warnings

import numpy as np
import torch

import flowtrain.model.attention as attention
from flowtrain.model import bind, decoder_layer, model_flat_maps, preset, rope_tables
from flowtrain.model.attention import Documents, rotary_for

warnings.filterwarnings("ignore")
cfg = preset("llama-8b")
lay = model_flat_maps(cfg)[1]
B, S = 4, 4096
flat = (torch.randn(lay.numel, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
cos, sin = rope_tables(cfg, S, "cuda", torch.bfloat16)
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
x = torch.randn(B, S, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn_like(x)


def timed(docs, reps=10):
    torch._dynamo.reset()
    fn = torch.compile(decoder_layer, backend="inductor", dynamic=False)
    c, s = rotary_for(cos, sin, docs)
    for _ in range(3):
        fn(x, bind(flat, lay), c, s, cfg, docs, None).backward(dy)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn(x, bind(flat, lay), c, s, cfg, docs, None).backward(dy)
    torch.cuda.synchronize()
    return round((time.perf_counter() - t) / reps * 1e3, 2)


out = {"job": "layer_packing", "documents": docs.count, "plain_ms": timed(None), "packed_traced_ms": timed(docs)}
attention._varlen = torch.compiler.disable(attention._varlen)
out["packed_eager_kernel_ms"] = timed(docs)
print(json.dumps(out))
