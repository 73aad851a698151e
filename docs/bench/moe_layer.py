"""Where a mixture-of-experts layer's time goes: one decoder layer of a preset (default
``qwen3-moe-12l``, Qwen3-30B-A3B's layer), forward then backward as training runs them (weights
as leaves, their gradients added into an fp32 buffer one at a time), on ``--tokens`` tokens per
micro-batch; prints one JSON line with the forward and backward times and their model TFLOP/s,
then the CUDA kernels that took the most time in the backward::

    python docs/bench/moe_layer.py                       # 4 x 4096 tokens, the grouped experts
    python docs/bench/moe_layer.py --batch 1 --top 25    # one sequence
    python docs/bench/moe_layer.py --compile --ops       # compiled as training runs it; ops and shapes

On a machine without CUDA it runs one tiny step on the CPU (the experts' loop), to show that it
runs; the numbers mean nothing there.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from flowtrain.model import bind, decoder_layer, model_flat_maps, preset, rope_tables
from flowtrain.model.init import init_unit
from flowtrain.train.weight_grads import backward_into, weight_leaves


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-moe-12l")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--top", type=int, default=15, help="kernels listed from the profiled backward")
    ap.add_argument("--compile", action="store_true", help="the layer compiled by inductor, as training runs it on CUDA")
    ap.add_argument("--ops", action="store_true", help="list torch ops with their input shapes instead of kernels")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    cfg = preset(args.model)
    if not cuda:  # a smoke run: the same code on a layer small enough for a CPU
        import msgspec

        cfg = msgspec.structs.replace(cfg, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                                      moe_intermediate_size=32, intermediate_size=64, num_experts=8,
                                      num_experts_per_tok=2)
        args.batch, args.seq_len, args.reps = 1, 64, 1
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    i = min(cfg.sparse_layers())  # the first layer with experts
    lay = next(u for u in model_flat_maps(cfg) if u.key == f"layer.{i}")
    master = torch.empty(lay.numel)
    init_unit(master, lay, cfg, seed=0)
    flat = master.to(device=device, dtype=dtype)
    grads = torch.zeros(lay.numel, device=device)
    cos, sin = rope_tables(cfg, args.seq_len, device, dtype)
    x = torch.randn(args.batch, args.seq_len, cfg.hidden_size, device=device, dtype=dtype)
    dy = torch.randn_like(x)

    views = bind(flat, lay)
    layer = torch.compile(decoder_layer, dynamic=False) if args.compile else decoder_layer

    def forward() -> None:
        with torch.no_grad():
            layer(x, views, cos, sin, cfg)

    def backward() -> None:  # the forward rebuilt under autograd, then its backward, as training runs it
        with torch.enable_grad():
            xl = x.detach().requires_grad_(True)
            leaves = weight_leaves(flat, lay)
            backward_into(layer(xl, leaves, cos, sin, cfg), dy, xl, leaves, lay, grads)

    fwd_s = timed(forward, args.reps, cuda)
    bwd_s = timed(backward, args.reps, cuda) - fwd_s  # the backward without the forward it rebuilds
    tokens = args.batch * args.seq_len
    active = lay.numel - (cfg.mlp_parameters(i) - cfg.mlp_parameters(i, active=True))  # the layer's, per token
    # a forward's model FLOPs: 2 per active parameter per token, and causal attention's 2 S q per token
    flops = 2 * active * tokens + 2 * tokens * args.seq_len * cfg.num_heads * cfg.head_dim
    print(json.dumps({"model": args.model, "tokens": tokens, "compiled": args.compile, "forward_ms": round(fwd_s * 1e3, 2),
                      "backward_ms": round(bwd_s * 1e3, 2), "forward_tflops": round(flops / fwd_s / 1e12, 1),
                      "backward_tflops": round(2 * flops / bwd_s / 1e12, 1), "device": device}))
    if cuda:
        kinds = [torch.profiler.ProfilerActivity.CUDA] + ([torch.profiler.ProfilerActivity.CPU] if args.ops else [])
        with torch.profiler.profile(activities=kinds, record_shapes=args.ops) as prof:
            backward()
            torch.cuda.synchronize()
        table = prof.key_averages(group_by_input_shape=args.ops).table(
            sort_by="self_device_time_total" if args.ops else "cuda_time_total", row_limit=args.top,
            max_name_column_width=50, max_shapes_column_width=90)
        print(table)


def timed(run, reps: int, cuda: bool) -> float:
    """Median seconds of ``run`` after one warm-up."""
    run()
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    main()
