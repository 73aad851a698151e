"""Where compute's time goes: by kind and layer, per window, and model FLOP/s from the trace's
metadata; checked exactly on hand-made traces and against the sums of real H200 traces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pytest import approx
from viz_helpers import doc, ev, hand_trace

from flowtrain.viz.compute import compute_table, flops_per_step, kind_steps
from flowtrain.viz.html import TraceView, render_report
from flowtrain.viz.load import load_input, trace_from_json

BENCH = Path(__file__).parents[2] / "docs" / "bench"
REAL = {  # the three kinds of trace the report must explain: a fast run, a 10 GB card, a mixture of experts
    "w1": BENCH / "2026-12-02" / "w1-trace.json",
    "8b-10gb": BENCH / "2026-12-04" / "gate-8b10o-trace.json",
    "moe": BENCH / "2026-12-04" / "moe-trace.json",
}


def page_data(page: str) -> dict:
    import re

    m = re.search(r'<script type="application/json" id="ft-data">(.*?)</script>', page, re.S)
    assert m
    return json.loads(m.group(1))


def test_compute_time_by_kind_on_the_hand_trace():
    """hand_trace's compute lane: forward uA 20 + uC 5 (step 1), uD 10 (step 2); backward uB 8;
    zero_grad zA 2 + zB 2 (us)."""
    view = TraceView(hand_trace(), steps=":")
    t = view.compute
    assert [(r.kind, r.tasks, r.seconds) for r in t.kinds] == [
        ("forward", 3, approx(35e-6)), ("backward", 1, approx(8e-6)), ("zero_grad", 2, approx(4e-6))]
    assert t.busy == approx(view.summary.busy["compute"]) and sum(r.share for r in t.kinds) == approx(1.0)
    assert t.flops_per_step is None and t.model_flops is None  # the trace records no FLOPs
    steady = TraceView(hand_trace()).compute  # the default window: step 2 alone
    assert [(r.kind, r.tasks, r.share) for r in steady.kinds] == [("forward", 1, 1.0)]
    ck = page_data(render_report([hand_trace()]))["traces"][0]["steps"][0]["ck"]
    assert ck["forward"][:2] == [2, 25.0] and ck["zero_grad"][:2] == [2, 4.0]  # the page sums these per window


def layered(slow: int | None = None, flops: dict | None = None):
    """Two steps of forward L0..L3, 10 us each (layer ``slow`` 15 us), and a 20 us loss."""
    events, t = [], 0
    for step in range(2):
        for layer in range(4):
            d = 15 if layer == slow else 10
            e = ev(f"forward L{layer} s{step}", "compute", t, t + d, kind="forward", step=step)
            e["args"]["layer"] = layer
            events.append(e)
            t += d
        events.append(ev(f"loss s{step}", "compute", t, t + 20, kind="loss", step=step))
        t += 20
    return trace_from_json(doc(*events, **(flops or {})))


def test_a_slow_layer_stands_out_and_an_even_one_does_not():
    even = TraceView(layered(), steps=":").compute
    assert even.kinds[0].kind == "forward" and even.kinds[0].layer_mean == approx({i: 10e-6 for i in range(4)})
    assert even.kinds[0].slow_layer is None and even.kinds[1].layer_mean == {}
    slow = TraceView(layered(slow=2), steps=":").compute.kinds[0]
    assert slow.slow_layer == (2, approx(1.5))  # 15 us against a median layer of 10


def test_model_flops_come_from_the_trace_metadata():
    tr = layered(flops={"model_flops_per_token": 1e6, "tokens_per_step": 256})
    assert flops_per_step(tr) == 256e6
    view = TraceView(tr, steps="2")
    assert view.compute.model_flops == approx(256e6 / (view.window.end - view.window.start))
    assert page_data(render_report([tr]))["traces"][0]["flopsPerStep"] == 256e6
    assert flops_per_step(layered(flops={"model_flops_per_token": "many", "tokens_per_step": 256})) is None


@pytest.mark.parametrize("name", sorted(REAL))
def test_the_shares_match_the_real_traces_sums(name):
    """Each kind's share of compute, summed straight from the file's events over the window's
    steps, within 1% of what the report says (the MoE run's loss is a fifth of its compute)."""
    path = REAL[name]
    view = TraceView(load_input(path))
    first, last = view.window.first - 1, view.window.last - 1  # the file counts steps from 0
    sums: dict[str, float] = {}
    for e in json.loads(path.read_text())["traceEvents"]:
        a = e.get("args") or {}
        if e.get("ph") == "X" and a.get("lane_name") == "compute" and first <= a.get("step", 0) <= last:
            sums[a["kind"]] = sums.get(a["kind"], 0.0) + e["dur"]
    total = sum(sums.values())
    shares = {r.kind: r.share for r in view.compute.kinds}
    assert shares.keys() == sums.keys()
    for kind, us in sums.items():
        assert shares[kind] == approx(us / total, abs=0.01), kind
    if name == "moe":
        assert 0.12 < shares["loss"] < 0.3


def test_every_step_of_a_window_sums_to_the_table():
    tr = load_input(REAL["moe"])
    per_step = kind_steps(tr)
    view = TraceView(tr, steps=":")
    whole = compute_table(tr, per_step, view.window)
    assert whole.busy == approx(view.summary.busy["compute"], rel=1e-9)


def test_a_trace_records_what_an_acts_slot_holds():
    """llama-8b on a 10 GB card offloads its checkpoints: an ``acts`` slot holds one layer's
    checkpoint of one micro-batch (2 x 4096 tokens x 4096 x bf16 = 64 MiB), what each
    ``fetch_act`` of the H200 run copied."""
    import torch

    from flowtrain.model import preset
    from flowtrain.plan.planner import plan_run
    from flowtrain.plan.request import RunRequest
    from flowtrain.train.run import _acts_slot_bytes

    plan = plan_run(preset("llama-8b"), RunRequest(seq_len=4096, batch_size=16, micro_batch_size=2, host_mem=118.0,
                                                   gpu_mem=10), device=torch.device("cuda"), dtype=torch.bfloat16)
    assert plan.budgets["acts"] == 2 and _acts_slot_bytes(plan) == {"acts": 64 << 20}
    fetched = {e["args"]["bytes"] for e in json.loads(REAL["8b-10gb"].read_text())["traceEvents"]
               if e.get("ph") == "X" and e["args"].get("kind") == "fetch_act"}
    assert fetched == {64 << 20}
