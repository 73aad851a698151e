"""Soak: 200 steps of a tiny model with random delays in every lane give exactly the reference
executor's weights (the slow tier; the default tier runs the same test for 20 steps).

The reference runs each step's graph one task at a time in topological order, steps strictly
one after another; the engine overlaps two steps on four lanes while every task sleeps a random
0-1 ms first (``FLOWTRAIN_FAULT='*:delay=0.001'``), so tasks finish in ever different orders.
With checkpoints written every 50 steps (every 5 of 20) on the way, the masters, Adam moments and
step counts must still be bit-identical.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from flowtrain.data.source import step_batches
from flowtrain.graph.compiler import compile_step
from flowtrain.runtime.reference import run_reference
from flowtrain.train.run import TrainConfig, build_state, train
from flowtrain.train.prepare import prepare

CFG = dict(model="tiny", batch_size=4, micro_batch_size=2, seq_len=32, lr=1e-3, warmup_steps=10,
           lr_schedule="cosine", device="cpu", progress=False)


def reference_state(cfg: TrainConfig):
    run = prepare(cfg)
    # The reference takes a fresh slot whenever none is free in its order: give it one per taker.
    takers = Counter(t.takes for t in compile_step(run.plan.spec) if t.takes is not None)
    run.plan.budgets.update(takers)
    state, program = build_state(run)
    batches = step_batches(run.seqs, cfg.batch_size, shuffle=cfg.shuffle, seed=cfg.seed)
    for s in range(cfg.steps):
        mbs = next(batches).micro_batches(cfg.micro_batch_size)
        program.begin_step(s, [mb.input_ids for mb in mbs], [mb.targets for mb in mbs], run.schedule(s))
        run_reference(compile_step(run.plan.spec, step=s), program)
        assert not program.end_step(s)[2]
    return state


@pytest.mark.parametrize("steps, save_every", [(20, 5), pytest.param(200, 50, marks=pytest.mark.slow)],
                         ids=["20-steps", "200-steps"])
def test_random_delays_in_every_lane_give_the_reference_weights(tmp_path, monkeypatch, steps, save_every):
    ref = reference_state(TrainConfig(**CFG, steps=steps))
    captured = {}

    import flowtrain.train.run as run_module

    real_build = run_module.build_state

    def keep(run):
        captured["state"], program = real_build(run)
        return captured["state"], program

    monkeypatch.setattr(run_module, "build_state", keep)
    monkeypatch.setenv("FLOWTRAIN_FAULT", "*:delay=0.001;seed=3")
    train(TrainConfig(**CFG, steps=steps, policy="lookahead", out=str(tmp_path / "out"), save_every=save_every,
                      save_total_limit=1))
    state = captured["state"]
    for a, b in zip(ref.units, state.units):
        for name in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (a.flat_map.key, name)
        assert [float(x) for x in a.steps] == [float(x) for x in b.steps] == [steps] * len(a.steps)
    assert [p.name for p in (tmp_path / "out").glob("checkpoint-*")] == [f"checkpoint-{steps}"]
