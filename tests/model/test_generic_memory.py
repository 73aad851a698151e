"""The generic layer path's memory, measured on the meta device, and the plan built from it.

A layer transformers runs has no formula of ours: :mod:`flowtrain.model.generic.activations`
counts what it saves and the most it holds at once over its forward and backward, and the
plan uses each layer's own count (a hybrid model's linear-attention and attention layers keep
different bytes). On the GPU, docs/bench/generic_plan.py compares the plan with the allocator.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parents[1] / "train"))

from generic_models import make_family

from flowtrain.model.generic.activations import _PeakMeter, head_bytes_per_token, layer_bytes_per_token
from flowtrain.model.hf_config import from_hf
from flowtrain.plan.memory import kept_bytes_per_token_by_layer
from flowtrain.plan.planner import plan_activations, plan_run
from flowtrain.plan.request import RunRequest

N = 1000  # elements of each tensor below: 4,000 bytes in fp32


def test_the_meter_counts_what_is_alive_at_once_not_what_was_made():
    meter = _PeakMeter(tokens=7)
    with meter:
        for _ in range(20):  # each one freed when the next takes its name
            t = torch.ones(N, device="meta") * 2
        assert meter.peak <= 3 * 4 * N  # the ones, the product, and the previous product
        kept = []
        for _ in range(20):  # a storage made just after one is freed may take its address
            gone = torch.ones(N, device="meta") * 2
            del gone
            kept.append(torch.ones(N, device="meta"))
    assert meter.peak >= 20 * 4 * N
    assert len(kept) == 20 and t.shape == (N,)


def test_the_meter_leaves_out_attention_score_matrices():
    meter = _PeakMeter(tokens=64)
    with meter:
        scores = torch.ones(2, 64, 64, device="meta") * 2  # a head's (tokens x tokens): fused kernels make none
        other = torch.ones(2, 64, 32, device="meta") * 2
    assert meter.peak == other.untyped_storage().nbytes() + 4 * 2 * 64 * 32  # the product and its ones
    assert scores.shape == (2, 64, 64)


@pytest.fixture(scope="module")
def hybrid():
    """Qwen3.5's layers alternate linear attention (gated delta-net) and full attention."""
    return from_hf(make_family(None, "Qwen3_5ForCausalLM").config.to_dict())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_layer_kind_is_measured_and_holds_at_least_what_it_saves(hybrid, dtype):
    by_layer = layer_bytes_per_token(hybrid, dtype)
    assert sorted(by_layer) == list(range(hybrid.num_layers))
    for i, b in by_layer.items():
        # at least the layer's output and the input's gradient beside what it saves
        assert b.work >= b.saved + 2 * hybrid.hidden_size * dtype.itemsize, (i, b)
        assert b.saved >= hybrid.hidden_size * dtype.itemsize
    kinds = {t: by_layer[i] for i, t in enumerate(hybrid.layer_types)}
    assert set(kinds) == {"linear_attention", "full_attention"}
    assert kinds["linear_attention"] != kinds["full_attention"]
    assert all(by_layer[i] == kinds[t] for i, t in enumerate(hybrid.layer_types))


def test_the_kept_bytes_of_each_layer_are_its_own_kinds(hybrid):
    kept = kept_bytes_per_token_by_layer(hybrid, torch.bfloat16)
    measured = layer_bytes_per_token(hybrid, torch.bfloat16)
    assert kept == [-(-measured[i].saved // 1) for i in range(hybrid.num_layers)]
    assert len(set(kept)) == 2


def test_the_plan_keeps_the_top_layers_whose_own_bytes_fit(hybrid):
    """A budget for the top two layers' own kept bytes keeps exactly those two, and counts
    their sum (not twice the larger kind's)."""
    req = RunRequest(seq_len=64, batch_size=4, micro_batch_size=2, activations="auto", compile="none")
    plan = plan_run(hybrid, req, device=torch.device("cpu"), dtype=torch.float32)
    tokens = 2 * 64 * 2
    per_layer = [b * tokens for b in kept_bytes_per_token_by_layer(hybrid, torch.bfloat16)]
    L = hybrid.num_layers
    plan.device, plan.gpu_limit = "cuda", plan.gpu_total + per_layer[L - 1] + per_layer[L - 2] + 1
    placed = plan_activations(plan, hybrid, req, torch.bfloat16)
    assert placed.spec.keep == (L - 2, L - 1)
    assert placed.gpu["kept_activations"] == per_layer[L - 2] + per_layer[L - 1] < 2 * max(per_layer)


def test_the_head_holds_the_logits_in_fp32_and_their_gradient(hybrid):
    """Per token of a loss chunk: at least the fp32 logits and the gradient of the logits."""
    for dtype in (torch.float32, torch.bfloat16):
        per_token = head_bytes_per_token(hybrid, dtype)
        assert per_token >= hybrid.vocab_size * (4 + dtype.itemsize)
        assert per_token < hybrid.vocab_size * 64 + hybrid.hidden_size * 64
