"""The same functions on a GPU in bf16: close to the fp32 CPU reference, and lean on memory."""

from __future__ import annotations

import pytest
import torch
from model_helpers import flats_from_hf, hf_model, rel_err, small_cfg

from flowtrain.model import (
    bind,
    decoder_layer,
    head_loss_and_grads,
    model_layouts,
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
    lay, flat = model_layouts(cfg)[1], flats_from_hf(model, cfg)[1]
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
