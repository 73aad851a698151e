"""Which fused attention kernel a decoder layer runs, and what it costs: one llama-3b layer
on W1's shape (4 x 4096 tokens), forward + backward, eager and compiled, under each
``--attention-backend``, and the attention kernels the profiler saw::

    python docs/bench/attention_kernels.py        # JSON lines
"""

import json
import sys
import time
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from flowtrain.model import bind, decoder_layer, model_flat_maps, preset, rope_tables
from flowtrain.model.attention import attention_backends

warnings.filterwarnings("ignore")
cfg = preset(sys.argv[1] if len(sys.argv) > 1 else "llama-3b")
lay = model_flat_maps(cfg)[1]
B, S = 4, 4096
flat = (torch.randn(lay.numel, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
cos, sin = rope_tables(cfg, S, "cuda", torch.bfloat16)
x = torch.randn(B, S, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn_like(x)


def timed(fn, reps=10):
    for _ in range(3):
        fn(x, bind(flat, lay), cos, sin, cfg, None, None).backward(dy)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn(x, bind(flat, lay), cos, sin, cfg, None, None).backward(dy)
    torch.cuda.synchronize()
    ms = round((time.perf_counter() - t) / reps * 1e3, 2)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(x, bind(flat, lay), cos, sin, cfg, None, None).backward(dy)
        torch.cuda.synchronize()
    names = sorted({e.key[:90] for e in prof.key_averages()
                    if any(w in e.key.lower() for w in ("flash", "cudnn", "fmha", "attention", "sdpa"))})
    return ms, names


for backend in ("auto", "flash"):
    with attention_backends(backend, "cuda"):
        out = {"job": "attention_kernels", "model": sys.argv[1] if len(sys.argv) > 1 else "llama-3b", "backend": backend}
        for mode in ("eager", "compiled"):
            torch._dynamo.reset()
            fn = decoder_layer if mode == "eager" else torch.compile(decoder_layer, backend="inductor", dynamic=False)
            out[f"{mode}_ms"], out[f"{mode}_kernels"] = timed(fn)
        print(json.dumps(out), flush=True)
