"""AdamW over pieces of a flat buffer, each with its own step count, equals torch.optim.AdamW over
the same pieces as parameters, of which those without a gradient are skipped."""

from __future__ import annotations

import torch

from flowtrain.train.optimizer import AdamWConfig, adamw_pieces


def test_pieces_step_like_torch_adamw_skipping_parameters_without_gradient():
    g = torch.Generator().manual_seed(0)
    n = 40
    cuts = [(0, 10), (10, 16), (16, 30), (30, 40)]  # piece 0 and 3 share a count: one parameter in two cuts
    owner = [0, 1, 2, 0]  # which parameter each piece is
    no_decay = [(12, 20)]  # crosses pieces 1 and 2
    cfg = AdamWConfig(lr=0.05, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.2)
    master = torch.randn(n, generator=g)
    m, v = torch.zeros(n), torch.zeros(n)
    steps = torch.zeros(3)
    # the reference: each parameter made of its pieces, split by decay into two groups' leaves
    ref = {}
    for p in range(3):
        for lo, hi in (c for c, o in zip(cuts, owner) if o == p):
            for a, b, decays in ((lo, min(hi, 12), True), (max(lo, 12), min(hi, 20), False), (max(lo, 20), hi, True)):
                if a < b:
                    ref[(p, a, b, decays)] = master[a:b].clone().requires_grad_(True)
    groups = [{"params": [t for k, t in ref.items() if k[3] == d], "weight_decay": cfg.weight_decay if d else 0.0}
              for d in (True, False)]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    trained = [{0, 1, 2}, {0, 2}, {1}, {0, 1, 2}]  # parameter 1 skips step 2, parameter 0 and 2 step 3
    for used in trained:
        grad = torch.randn(n, generator=g)
        for (p, a, b, _), t in ref.items():
            t.grad = grad[a:b].clone() if p in used else None
        opt.step()
        pieces = [(lo, hi, steps[o]) for (lo, hi), o in zip(cuts, owner) if o in used]
        adamw_pieces(master, grad, m, v, pieces, cfg, cfg.lr, no_decay=no_decay)
    for (p, a, b, _), t in ref.items():
        torch.testing.assert_close(master[a:b], t.detach(), rtol=1e-6, atol=1e-7)
    assert steps.tolist() == [3.0, 3.0, 3.0]
    assert steps.tolist() == [float(sum(p in u for u in trained)) for p in range(3)]


def test_a_gradient_of_a_piece_of_the_unit():
    """``grad_lo``: the gradient starts at the unit's element ``grad_lo``, as a staged chunk's."""
    cfg = AdamWConfig(lr=0.1, weight_decay=0.0)
    master, m, v = torch.ones(10), torch.zeros(10), torch.zeros(10)
    step = torch.zeros(())
    adamw_pieces(master, torch.full((4,), 2.0), m, v, [(6, 8, step)], cfg, cfg.lr, grad_lo=5)
    assert master[:6].eq(1).all() and master[8:].eq(1).all() and master[6:8].lt(1).all() and float(step) == 1
