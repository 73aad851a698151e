"""The same functions on a GPU in bf16: close to the fp32 CPU reference, and lean on memory."""

from __future__ import annotations

import pytest
import torch
from model_helpers import flats_from_hf, hf_model, rel_err, small_cfg

from flowtrain.model import (
    bind,
    decoder_layer,
    head_loss_and_grads,
    model_flat_maps,
    rope_tables,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.filterwarnings("ignore:Attempting to run cuBLAS"),
]


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_decoder_layer_bf16_cuda_close_to_fp32(kv_heads):
    cfg = small_cfg(hidden_size=256, num_heads=8, num_kv_heads=kv_heads, intermediate_size=512,
                    num_layers=1)
    model = hf_model(cfg, seed=1)
    lay, flat = model_flat_maps(cfg)[1], flats_from_hf(model, cfg)[1]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 300, cfg.hidden_size, generator=gen)
    with torch.no_grad():
        ref = decoder_layer(x, bind(flat, lay), *rope_tables(cfg, 300), cfg)
        xg, fg = x.cuda().bfloat16(), flat.cuda().bfloat16()
        got = decoder_layer(xg, bind(fg, lay), *rope_tables(cfg, 300, "cuda", torch.bfloat16), cfg)
    assert got.dtype == torch.bfloat16 and got.is_cuda
    assert rel_err(got.float().cpu() - x, ref - x) < 3e-2


def test_head_grads_bf16_cuda_close_to_fp32():
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(4, 500, 128, generator=gen)
    norm_w = 1 + 0.2 * torch.randn(128, generator=gen)
    head_w = 0.1 * torch.randn(3000, 128, generator=gen)
    targets = torch.randint(0, 3000, (4, 500), generator=gen)
    targets[:, 400:] = -100
    ref = head_loss_and_grads(hidden, norm_w, head_w, targets, 1e-5, 1e-3)
    cuda = [t.cuda().bfloat16() for t in (hidden, norm_w, head_w)]
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    got = head_loss_and_grads(*cuda, targets.cuda(), 1e-5, 1e-3, chunk_tokens=256)
    peak = torch.cuda.max_memory_allocated() - base
    full_logits = 4 * 500 * 3000 * 4  # what an unchunked fp32 logits tensor alone would take
    assert peak < full_logits
    for g, r in zip(got, ref):
        assert rel_err(g.float().cpu(), r) < 2e-2


def _experts_case(seed: int = 0):
    """600 tokens routed in fp32 among 16 experts (4 each), the experts' weights and an output
    gradient, on the CPU. The routing is fixed here: bf16 logits would pick other experts for
    near ties, which is the dtype's, not the experts', difference."""
    import msgspec

    from flowtrain.model.presets import PRESETS
    from flowtrain.model.moe import route

    gen = torch.Generator().manual_seed(seed)
    e, h, inter, tokens = 16, 256, 128, 600
    cfg = msgspec.structs.replace(PRESETS["qwen3-moe-12l"], num_experts=e, num_experts_per_tok=4, hidden_size=h,
                                  moe_intermediate_size=inter)
    x = torch.randn(tokens, h, generator=gen)
    r = route(x, torch.randn(e, h, generator=gen) / h**0.5, cfg)
    leaves = [x, r.weights, torch.randn(e, inter, h, generator=gen) / h**0.5,
              torch.randn(e, inter, h, generator=gen) / h**0.5, torch.randn(e, h, inter, generator=gen) / inter**0.5]
    return r, leaves, torch.randn(tokens, h, generator=gen)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="torch._grouped_mm needs compute capability 9.0")
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")  # dynamo tracing _Gather
def test_grouped_experts_bf16_cuda_close_to_the_fp32_loop(compiled):
    """The grouped path as training runs it (CUDA, bf16, eager or compiled) against the exact
    loop in fp32 on the CPU, on the same routing: outputs and every gradient (input, routing
    weights, the three projections)."""
    from flowtrain.model.moe import Routing, experts_grouped, experts_loop, grouped_available

    r, leaves, dy = _experts_case()

    def run(fn, ts):
        ts = [t.detach().requires_grad_(True) for t in ts]
        routed = Routing(logits=r.logits, probs=r.probs, experts=r.experts.to(ts[0].device), weights=ts[1])
        y = fn(ts[0], routed, *ts[2:])
        return (y, *torch.autograd.grad(y, ts, dy.to(y.device, y.dtype)))

    want = run(experts_loop, leaves)
    gpu = [t.cuda().bfloat16() for t in leaves]
    assert grouped_available(gpu[0])
    grouped = torch.compile(experts_grouped, dynamic=False) if compiled else experts_grouped
    got = run(grouped, gpu)
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16 and g.is_cuda
        assert rel_err(g.float().cpu(), w) < 3e-2
