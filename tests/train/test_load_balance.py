"""The streamed load-balancing loss against transformers' ``load_balancing_loss_func``: tallied
layer by layer in the forward, its value after the last layer and each layer's gradient taken
alone in the backward equal the function's value and autograd gradient over all layers at once."""

from __future__ import annotations

import msgspec
import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from flowtrain.model.presets import PRESETS
from flowtrain.train.load_balance import LoadBalance, real_tokens


def test_real_tokens_run_to_one_past_the_last_target():
    targets = torch.tensor([[5, 6, -100, -100, -100], [-100, 7, 8, 9, -100], [1, 2, 3, 4, -100]])
    assert real_tokens(targets).view(3, 5).tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_tallied_loss_and_per_layer_gradients_match_transformers(micro_batches):
    cfg = msgspec.structs.replace(PRESETS["qwen3-moe-12l"], num_layers=3, num_experts=6, num_experts_per_tok=2,
                                  mlp_only_layers=(1,), output_router_logits=True, router_aux_loss_coef=0.3)
    layers, rows, seq, E = cfg.sparse_layers(), 2, 5, cfg.num_experts
    assert layers == [0, 2]
    targets = torch.tensor([[3, 4, 5, -100, -100], [1, 2, 3, 4, -100]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    logits = [torch.randn(rows * seq, E, dtype=torch.float64).float().requires_grad_(True) for _ in layers]
    want = cfg.router_aux_loss_coef * load_balancing_loss_func(tuple(logits), E, cfg.num_experts_per_tok, mask)
    want_grads = torch.autograd.grad(want, logits)

    lb = LoadBalance.of_model(cfg)
    assert lb is not None
    lb.begin(0, [targets], torch.device("cpu"), micro_batches)
    for i, lg in zip(layers, logits):  # the forward: no gradient
        probs = torch.softmax(lg.detach(), -1)
        lb.counting(0, i, 0)(probs, torch.topk(probs, cfg.num_experts_per_tok, -1).indices)
    torch.testing.assert_close(lb.loss(0, 0) * micro_batches, want.detach())
    for i, lg, g in zip(layers, logits, want_grads):  # the backward, one layer at a time
        terms: list[torch.Tensor] = []
        probs = torch.softmax(lg, -1)
        lb.gradient(0, 0, terms)(probs, torch.topk(probs, cfg.num_experts_per_tok, -1).indices)
        (got,) = torch.autograd.grad(terms[0], lg)
        torch.testing.assert_close(got * micro_batches, g)
    lb.end(0)
