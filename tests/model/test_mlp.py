"""The gated MLP in pieces along the sequence: same values and gradients, a piece's memory.

The threshold is lowered so that a CPU-sized layer takes the long-sequence path; the reference
is the plain expression (and, through a whole layer, transformers' layer in test_families.py
and the training parity tests, which run the plain path).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flowtrain.model import mlp as mlp_module
from flowtrain.model.mlp import gated_mlp, gelu_tanh

sys.path.insert(0, str(Path(__file__).parent))
from model_helpers import rel_err


def _plain(h, g, u, d, act):
    return F.linear(act(F.linear(h, g)) * F.linear(h, u), d)


def _weights(hidden=32, inter=80, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=dtype) * 0.1 for shape in ((inter, hidden), (inter, hidden), (hidden, inter))]


@pytest.mark.parametrize("act", [F.silu, gelu_tanh], ids=["swiglu", "geglu"])
@pytest.mark.parametrize("batch, seq, chunk", [(2, 50, 16), (3, 17, 7), (1, 64, 63)])
def test_pieces_give_the_plain_mlp_and_its_gradients(monkeypatch, act, batch, seq, chunk):
    monkeypatch.setattr(mlp_module, "MLP_CHUNK_TOKENS", chunk)
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(batch, seq, 32, generator=gen)
    ws = _weights()
    leaves = [t.clone().requires_grad_(True) for t in (h, *ws)]
    ref_leaves = [t.clone().requires_grad_(True) for t in (h, *ws)]
    out = gated_mlp(*leaves, act)
    ref = _plain(*ref_leaves, act)
    d_out = torch.randn(ref.shape, generator=gen)
    assert rel_err(out, ref) < 1e-6
    grads = torch.autograd.grad(out, leaves, d_out)
    ref_grads = torch.autograd.grad(ref, ref_leaves, d_out)
    for name, g, r in zip(("h", "gate", "up", "down"), grads, ref_grads):
        assert g.dtype == r.dtype and g.shape == r.shape
        assert rel_err(g, r) < 1e-5, name


def test_the_backward_holds_one_piece_of_intermediates_not_the_sequence(monkeypatch):
    """What autograd saves for the backward: the plain MLP keeps tokens x intermediate tensors;
    in pieces only the input and the weights are kept."""
    monkeypatch.setattr(mlp_module, "MLP_CHUNK_TOKENS", 64)
    h = torch.randn(1, 1024, 32, requires_grad=True)
    ws = [w.requires_grad_(True) for w in _weights(inter=256)]

    def saved(fn) -> int:
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(h, *ws, F.silu)
        return total

    plain, pieces = saved(_plain), saved(gated_mlp)
    weights = sum(w.numel() * 4 for w in ws)
    assert plain >= 1024 * 256 * 4 * 3  # gate, up and the product at least
    assert pieces <= h.numel() * 4 + weights  # its input and the weights, nothing per token


def test_short_micro_batches_take_the_plain_path(monkeypatch):
    """Below the threshold nothing changes: the same autograd graph as the plain expression."""
    h = torch.randn(2, 8, 32, requires_grad=True)
    ws = _weights()
    assert "Piecewise" not in type(gated_mlp(h, *ws, F.silu).grad_fn).__name__
    monkeypatch.setattr(mlp_module, "MLP_CHUNK_TOKENS", 4)
    assert "Piecewise" in type(gated_mlp(h, *ws, F.silu).grad_fn).__name__


def test_training_with_the_mlp_in_pieces_matches_the_plain_mlp(tmp_path, monkeypatch):
    """A whole training run (3 steps, fp32, CPU) with every MLP in pieces of 5 tokens ends at
    the weights of the plain run, within 1e-4 as the parity tests against transformers: pieces
    add the weight gradients in another order, and Adam, dividing each update by the root of
    the gradient's square, turns the last bits of a small gradient into a visible difference
    (1.3e-5 on one CPU, under 1e-5 on another). Pieces that lost or doubled a token would be
    off by far more."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "train"))
    from test_kept import _train
    from test_train_vs_hf import make_checkpoint, make_data

    make_checkpoint(tmp_path / "model", layers=2, seed=3)
    make_data(tmp_path / "data.jsonl", seed=4)
    plain = _train(tmp_path, "plain", tmp_path / "model", tmp_path / "data.jsonl")
    monkeypatch.setattr(mlp_module, "MLP_CHUNK_TOKENS", 5)
    pieces = _train(tmp_path, "pieces", tmp_path / "model", tmp_path / "data.jsonl")
    for name, t in plain.items():
        assert rel_err(pieces[name], t) < 1e-4, name
    assert any(not torch.equal(pieces[n], plain[n]) for n in plain if "mlp" in n)  # the pieces ran
