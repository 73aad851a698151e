"""Offloaded checkpoints waiting on the device: never more than the planner counts.

A layer's input that goes to host memory stays on the device from the forward that writes it
until its ``offload_act`` copy has run. If the copy lane falls behind (a slow host, or buffers
being page-locked during the first step), nothing in the work itself stops the forward from
running on, leaving one more checkpoint per micro-batch and layer on the device: llama-8b under
a 10 GiB cap ran out of memory so, 1.1 GiB past its plan. The step graph holds each forward
until the offload ``offload_lag`` layers below it is issued, and the planner counts exactly
what that leaves (``offload_in_flight``). Here the copies are made 20 times slower than
everything else on the virtual clock, and the peak is checked against the planner's count::

    embed -> fwd L0 -> fwd L1 -> fwd L2 -> ... -> loss
               |         |  ^      |  ^
               v         v  |      v  |
           off L0 ------>+  |   off L1    (off Li -> fwd L(i+lag), lag 1 layer-major)
"""

from __future__ import annotations

import pytest

from flowtrain.graph.compiler import StepSpec, compile_step
from flowtrain.plan.memory import offload_act_slots, offload_in_flight
from flowtrain.plan.request import RunRequest
from flowtrain.sim.clock import VirtualRun


def _peak_checkpoints_on_device(spec: StepSpec, copy_seconds: float) -> int:
    """The most layer inputs alive on the device at once in one step: from the start of the
    task that writes one until its copy to the host has run (or, for the top layer's output,
    until the loss has read it)."""
    g = compile_step(spec)
    run = VirtualRun(lambda t: copy_seconds if t.kind == "offload_act" else 1.0)
    by = {(r.task.kind, r.task.layer, r.task.micro_batch): r for r in run.run(g)}
    events = []
    for m in range(spec.micro_batches):
        for i in range(spec.layers + 1):
            writer = by[("embed", None, m)] if i == 0 else by[("forward", i - 1, m)]
            gone = by[("loss", None, m)] if i == spec.layers else by[("offload_act", i, m)]
            events += [(writer.start, 1), (gone.end, -1)]
    live = peak = 0
    for _, d in sorted(events, key=lambda e: (e[0], e[1])):  # a free at t before an allocation at t
        live += d
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("order, micro_batches", [("layer", 4), ("layer", 1), ("micro", 3)])
def test_a_slow_copy_lane_holds_the_forward_back_to_the_planned_checkpoints(order, micro_batches):
    L = 8
    spec = StepSpec(layers=L, micro_batches=micro_batches, order=order, offload=tuple(range(L)))
    req = RunRequest(seq_len=16, batch_size=micro_batches, micro_batch_size=1, order=order, activations="offload")
    planned = offload_in_flight(req, hidden=1) - offload_act_slots(req)  # in forward no acts slot is used yet
    peak = _peak_checkpoints_on_device(spec, copy_seconds=20.0)
    assert peak <= planned, (order, micro_batches, peak, planned)
    # the bound is what holds it: with copies as fast as the rest the peak is lower
    assert _peak_checkpoints_on_device(spec, copy_seconds=1.0) <= peak


def test_without_the_bound_a_slow_copy_lane_would_pile_checkpoints_up():
    """What the edges prevent: the same step with the offload -> forward edges taken out runs
    its forward far past the copies (so the test above can fail)."""
    L, M = 8, 4
    spec = StepSpec(layers=L, micro_batches=M, offload=tuple(range(L)))
    g = compile_step(spec)
    held = [(u, v) for u, v in g.edges if u.kind == "offload_act" and v.kind in ("forward", "loss")]
    assert len(held) == L * M
    g.remove_edges_from(held)
    run = VirtualRun(lambda t: 20.0 if t.kind == "offload_act" else 1.0)
    records = run.run(g)
    last_forward = max(r.end for r in records if r.task.kind == "forward")
    copies_done_by_then = sum(1 for r in records if r.task.kind == "offload_act" and r.end <= last_forward)
    req = RunRequest(seq_len=16, batch_size=M, micro_batch_size=1, activations="offload")
    # every forward has run while most copies are still waiting: far more than planned are alive
    assert L * M - copies_done_by_then > offload_in_flight(req, hidden=1)
