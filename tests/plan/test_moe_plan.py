"""The memory plan of a mixture of experts: a sparse layer's unit holds every expert, and its
work counts the routing and the T k expert rows a grouped GEMM gathers (any routing, the worst
case of every token on one expert included)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from flowtrain.model import model_flat_maps, preset
from flowtrain.model.moe import experts_grouped, experts_loop, route
from flowtrain.plan.experts import expert_bytes_per_token, expert_kept_bytes_per_token, grouped_experts
from flowtrain.plan.memory import layer_work_bytes
from flowtrain.plan.request import RunRequest
from flowtrain.plan.planner import plan_run

CUDA, BF16 = torch.device("cuda"), torch.bfloat16


def test_a_sparse_layer_unit_holds_its_router_and_every_expert():
    cfg = preset("qwen3-30b-a3b")
    layer = model_flat_maps(cfg)[1]
    h, e, inter = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    experts = sum(x.numel for x in layer.entries if x.key.startswith("experts_"))
    assert experts == 3 * e * h * inter and layer.entry("router").shape == (e, h)
    assert layer.numel >= cfg.layer_parameters(0) > 3 * e * h * inter
    p = plan_run(cfg, RunRequest(seq_len=4096, batch_size=16, micro_batch_size=4, host_mem=500.0, gpu_mem=140.0),
                 device=CUDA, dtype=BF16)
    assert p.fits
    assert p.gpu["weight_slots"] >= 2 * layer.numel  # a slot holds a whole layer: every expert


def _saved_by_experts(cfg, tokens: int, run=experts_grouped) -> int:
    """Bytes autograd saves for the routing's and the experts' backward (bf16, CPU), weights and
    input excluded (the kept layer refers to those by place)."""
    torch.manual_seed(0)
    h, e, inter = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    x = torch.randn(tokens, h, dtype=BF16, requires_grad=True)
    router_w = torch.randn(e, h, dtype=BF16, requires_grad=True)
    ws = [torch.randn(e, inter, h, dtype=BF16, requires_grad=True) for _ in range(2)]
    ws.append(torch.randn(e, h, inter, dtype=BF16, requires_grad=True))
    known = {t.untyped_storage().data_ptr() for t in (x, router_w, *ws)}
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in known:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = run(x, route(x, router_w, cfg), *ws)
    y.float().sum().backward()  # the saved tensors were all a backward needs
    assert ws[2].grad is not None and x.grad is not None
    return sum(saved.values())


@pytest.mark.parametrize("name", ["mixtral-4l", "qwen3-moe-12l"])
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "loop"])
def test_kept_count_holds_what_the_experts_save(name, grouped):
    """Under eager autograd the count is at or above what routing and the experts save (the
    grouped GEMMs, or the loop that runs everywhere else) and within a fifth of it; inductor's
    partitioner keeps fewer of the grouped path's, counted apart."""
    cfg = msgspec.structs.replace(preset(name), hidden_size=64, moe_intermediate_size=32)
    tokens = 48
    counted = tokens * expert_kept_bytes_per_token(cfg, 2, False, grouped)
    saved = _saved_by_experts(cfg, tokens, experts_grouped if grouped else experts_loop)
    assert saved <= counted <= 1.2 * saved
    assert expert_kept_bytes_per_token(cfg, 2, True) < expert_kept_bytes_per_token(cfg, 2, False)
    assert expert_kept_bytes_per_token(cfg, 2, False) < expert_kept_bytes_per_token(cfg, 2, False, grouped=False)


def test_the_grouped_count_only_where_this_computer_runs_the_grouped_experts():
    has_hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
    assert grouped_experts("cuda", torch.bfloat16) == has_hopper
    assert not grouped_experts("cuda", torch.float32) and not grouped_experts("cpu", torch.bfloat16)


def test_layer_work_counts_routing_and_every_gathered_expert_row():
    cfg = preset("mixtral-4l")
    tokens, c = 8192, 2
    one = msgspec.structs.replace(cfg, num_experts_per_tok=1)
    grown = layer_work_bytes(cfg, tokens, c, False) - layer_work_bytes(one, tokens, c, False)
    assert grown == tokens * (expert_bytes_per_token(cfg, c) - expert_bytes_per_token(one, c))


def test_a_dense_layer_of_a_mixture_counts_when_it_needs_more():
    """Qwen3-MoE's mlp_only_layers: the dense MLP (intermediate_size 6144) of one layer beside
    the experts' rows (8 x 768 wide) and one stacked weight's gradient (the grouped experts); the
    larger of the two is what a layer's work may need."""
    cfg = preset("qwen3-moe-12l")
    dense_one = msgspec.structs.replace(cfg, mlp_only_layers=(3,), intermediate_size=4 * 6144)
    assert layer_work_bytes(dense_one, 4096, 2, False, grouped=True) > layer_work_bytes(cfg, 4096, 2, False, grouped=True)


@pytest.mark.parametrize("name", ["qwen3-moe-12l", "mixtral-4l"])
def test_a_sparse_layers_weight_gradients_count_as_its_experts_run(name):
    """Grown by E more experts, a sparse layer's eager work grows by their routing and by one
    stacked weight's gradient growth where the grouped experts run (one stack alive at a time),
    by ``LOOP_GRADIENT_STACKS`` of them where the loop runs, and by the whole layer's growth for
    a frozen base (tests/train/test_weight_grads.py traces what is alive)."""
    from flowtrain.plan.memory import LOOP_GRADIENT_STACKS

    cfg = preset(name)
    more = msgspec.structs.replace(cfg, num_experts=2 * cfg.num_experts)
    tokens, c = 4096, 2
    rows = tokens * (expert_bytes_per_token(more, c) - expert_bytes_per_token(cfg, c))
    stack = cfg.num_experts * cfg.moe_intermediate_size * cfg.hidden_size  # the stack's growth
    layer = model_flat_maps(more)[1].numel - model_flat_maps(cfg)[1].numel

    def grown(**kw):
        return layer_work_bytes(more, tokens, c, False, **kw) - layer_work_bytes(cfg, tokens, c, False, **kw)

    assert grown(grouped=True) == rows + c * stack
    assert grown(grouped=False) == rows + c * LOOP_GRADIENT_STACKS * stack
    assert grown(grouped=True, frozen_base=True) == grown(grouped=False, frozen_base=True) == rows + c * layer


@pytest.mark.parametrize("name", ["qwen3-moe-12l", "mixtral-4l"])
def test_a_compiled_sparse_layer_counts_its_whole_gradient_where_that_outgrows_its_rows(name):
    """A compiled layer's backward graph hands every weight's gradient over at its end: with few
    tokens (rows smaller than the stacks) its work grows with E more experts by the whole
    layer's gradient growth; with many, by the rows and one stack, as the eager layer's."""
    cfg = preset(name)
    more = msgspec.structs.replace(cfg, num_experts=2 * cfg.num_experts)
    c = 2
    stack = cfg.num_experts * cfg.moe_intermediate_size * cfg.hidden_size
    layer = model_flat_maps(more)[1].numel - model_flat_maps(cfg)[1].numel

    def grown(tokens, compiled):
        return (layer_work_bytes(more, tokens, c, compiled, grouped=True)
                - layer_work_bytes(cfg, tokens, c, compiled, grouped=True))

    assert grown(64, True) == c * layer
    assert grown(64, False) < c * layer  # eager: one stack at a time
    many = 1 << 16
    rows = many * (expert_bytes_per_token(more, c) - expert_bytes_per_token(cfg, c))
    assert grown(many, True) == grown(many, False) == rows + c * stack
