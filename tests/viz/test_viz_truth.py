"""The report tells the truth about a run: exact task ends, budgets and bytes said for what they
are, steps cut where compute starts them, busy + idle + tail = the window, and errors that name
the file.

Two fixtures are slices of real H200 traces (``tests/viz/fixtures``):

- ``gate-8b10o-backward-slice.json``: llama-8b under a 10 GB card with offloaded checkpoints,
  its tasks and dependency arrows between 35.60 s and 36.21 s (step 2's backward through layers
  24 to 21), where each ``fetch_act`` takes an ``acts`` slot (budget 2) the instant the
  backward reading the slot's previous checkpoint ends. Its metadata, like every bench trace
  of the time, records no budgets.
- ``w1-adam-order-steps0-3.json``: llama-3b (W1), the tasks of steps 0 to 3 (no arrows): a
  12 s warm-up step, then steps of 0.7 to 0.8 s.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
from pytest import approx
from viz_helpers import doc, engine_records, ev, hand_trace

from flowtrain.cli import main
from flowtrain.runtime import chrome_trace
from flowtrain.viz import analysis as A
from flowtrain.viz.graphview import color
from flowtrain.viz.html import TraceView, render_report
from flowtrain.viz.load import load_input, trace_from_json
from flowtrain.viz.memory import caption, memory
from flowtrain.viz.steps import brush_scale, choose_window, step_table, window_rows, window_summary

FIXTURES = Path(__file__).parent / "fixtures"
GATE = FIXTURES / "gate-8b10o-backward-slice.json"
W1 = FIXTURES / "w1-adam-order-steps0-3.json"


def page_data(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="ft-data">(.*?)</script>', page, re.S)
    assert m, "no data block"
    return json.loads(m.group(1))


def peaks(tr) -> dict[str, int]:
    return {pool: max(n for _, n in pts) for pool, pts in A.occupancy(tr).items()}


# ---- exact task ends -------------------------------------------------------------------------


def test_the_10gb_trace_shows_no_pool_over_its_budget():
    """Read with float ends (``ts + dur``), two ``fetch_act`` tasks start a hair before the
    backward that frees their slot ends, and the acts pool looks 3 deep on a budget of 2. Read
    in whole nanoseconds, the end and the next start are one instant."""
    data = json.loads(GATE.read_text())
    xs = {e["name"]: e for e in data["traceEvents"] if e["ph"] == "X"}
    free, take = xs["backward L24 m6 s2"], xs["fetch_act L23 m0 s2"]
    assert free["ts"] + free["dur"] > take["ts"]  # the float sum overlaps...
    assert round((free["ts"] + free["dur"]) * 1000) == round(take["ts"] * 1000)  # ...the instants are one

    tr = load_input(GATE)
    end = next(t for t in tr.tasks if t.name == "backward L24 m6 s3").end  # the file's step 2 is step 3
    assert next(t for t in tr.tasks if t.name == "fetch_act L23 m0 s3").start == end
    view = TraceView(tr)
    assert view.budgets == {"acts": 2, "grads": 2, "host_grads": 3, "weights": 2}
    assert all(n <= view.budgets[pool] for pool, n in peaks(tr).items()) and peaks(tr)["acts"] == 2
    assert all(r.peak_slots[p] <= view.budgets[p] for r in view.rows for p in r.peak_slots)
    for pool, pts in page_data(render_report([tr]))["traces"][0]["occ"].items():  # what the page draws
        assert max(n for _, n in pts) <= view.budgets[pool]


def test_an_end_and_the_next_start_are_one_instant_whatever_the_floats():
    """0.1 + 0.2 us is not 0.3 us in floating point; a task that ends then and the task that
    takes its slot at 0.3 us touch, they do not overlap."""
    events = [
        {"name": "a", "ph": "X", "ts": 0.1, "dur": 0.2, "pid": 0, "tid": 0,
         "args": {"kind": "fetch", "lane_name": "h2d", "takes": "acts", "slot": 0, "id": "a"}},
        {"name": "b", "ph": "X", "ts": 0.3, "dur": 0.5, "pid": 0, "tid": 0,
         "args": {"kind": "fetch", "lane_name": "h2d", "takes": "acts", "slot": 0, "id": "b"}},
    ]
    assert 0.1 + 0.2 > 0.3
    a, b = trace_from_json(doc(*events, budgets={"acts": 1})).tasks
    assert a.end == b.start == 2e-7 and a.duration == 2e-7
    assert peaks(trace_from_json(doc(*events))) == {"acts": 1}


def test_old_traces_with_finer_fractions_round_both_ends_to_one_grid():
    """A producer that wrote 0.7006 us + 0.9998 us and then 1.7004 us meant one instant. The
    float sum is 1.7004000000000001, and rounding ts and dur apart gives 701 + 1000 ns: each end
    is rounded to a whole nanosecond as a whole (1700 ns), as the next start is."""
    a = ev("a", "compute", 0.7006, 1.7004, kind="forward")
    a["dur"] = 0.9998
    assert 0.7006 + 0.9998 > 1.7004 and round(0.7006 * 1000) + round(0.9998 * 1000) == 1701
    tr = trace_from_json(doc(a, ev("b", "compute", 1.7004, 3.0, kind="forward")))
    assert tr.tasks[0].end == tr.tasks[1].start


# ---- the plan in the trace -------------------------------------------------------------------


def test_budgets_the_trace_does_not_record_are_inferred_and_said_so():
    tr = load_input(GATE)
    view = TraceView(tr)
    assert view.inferred == ["acts", "grads", "host_grads", "weights"]  # a bench trace of the time: none recorded
    assert page_data(render_report([tr]))["traces"][0]["inferred"] == view.inferred
    assert TraceView(hand_trace()).inferred == []  # its budgets are in its metadata


def test_the_bytes_row_says_what_its_number_is():
    """The slots of W1 hold 2.3 GiB on the GPU at most while the run peaked at 73.7 GiB: the
    caption names the slots' number as the slots', and the run's where the trace records it."""
    tr = load_input(W1)
    text = caption(TraceView(tr).memory)
    assert text.startswith("slots hold at most 2.3 GiB on the GPU, 4.5 GiB pinned (slot buffers only)")
    assert "the trace records no peak for the run's GPU memory" in text and "GPU peak" not in text
    tr.meta.update(measured={"gpu_peak": int(73.68 * 2**30), "gpu_reserved_peak": int(75.21 * 2**30)},
                   planned={"gpu": int(76.78 * 2**30), "host": int(26.5 * 2**30)},
                   capacities={"gpu": 80 * 2**30, "host": None})
    text = caption(memory(tr, A.slot_uses(tr)))
    assert text.endswith("the run on the GPU: 73.7 GiB measured peak (allocated), 75.2 GiB reserved, "
                         "76.8 GiB planned, limit 80.0 GiB")
    assert page_data(render_report([tr]))["traces"][0]["memCaption"] == text


def test_a_bench_trace_carries_what_a_train_trace_does(tmp_path, monkeypatch, capsys):
    """``flowtrain bench --trace`` and ``flowtrain train --trace`` on the same tiny run: the
    bench file records the same metadata (and the steps it left out as warm-up), so its page
    shows recorded budgets and the planned bytes."""
    monkeypatch.chdir(tmp_path)
    common = ["--model", "tiny", "--device", "cpu", "--seq-len", "64", "--batch-size", "4", "--micro-batch-size", "2"]
    assert main(["bench", *common, "--steps", "3", "--warmup", "1", "--trace", "bench.json"]) == 0
    assert main(["train", *common, "--steps", "3", "--no-progress", "--trace", "train.json"]) == 0
    capsys.readouterr()
    bench = json.loads(Path("bench.json").read_text())["otherData"]["flowtrain"]
    train = json.loads(Path("train.json").read_text())["otherData"]["flowtrain"]
    assert set(bench) == set(train) | {"warmup"} and bench["warmup"] == 1
    for key in ("budgets", "slot_bytes", "pool_memory", "planned", "layout", "precision", "policy", "device",
                "model_flops_per_token", "tokens_per_step"):
        assert bench[key] == train[key], key
    from flowtrain.model import preset
    from flowtrain.model.counts import model_flops_per_token

    assert train["model_flops_per_token"] == model_flops_per_token(preset("tiny"), 64)  # the one count
    assert train["tokens_per_step"] == 4 * 64
    assert set(bench["capacities"]) == {"gpu", "host"}  # the host's limit follows its free memory of the moment
    assert bench["pool_memory"] == {"weights": "gpu", "grads": "gpu", "host_grads": "pinned"}
    view = TraceView(load_input("bench.json"))
    assert view.inferred == [] and view.budgets == bench["budgets"]
    assert "planned" in caption(view.memory) and "records no peak" not in caption(view.memory)
    assert view.compute.model_flops == approx(4 * 64 * train["model_flops_per_token"] * view.window.steps
                                              / (view.window.end - view.window.start))


# ---- steps, the brush, and busy + idle + tail ------------------------------------------------


def test_every_compute_task_lies_in_its_own_steps_band():
    """W1's step k starts with its first compute task; cutting at the end of the previous
    step's CPU work instead put 22 to 27 of each step's compute tasks in the band before."""
    tr = load_input(W1)
    view = TraceView(tr)
    band = {r.step: r for r in view.rows}
    assert [r.step for r in view.rows] == [1, 2, 3, 4]  # the file's steps 0-3, counted from 1
    for t in tr.by_lane["compute"]:
        assert band[t.step].start <= t.start < band[t.step].end, t.name
    for r in view.rows[1:]:
        assert r.start == min(t.start for t in tr.by_lane["compute"] if t.step == r.step)  # align at step starts here
    assert view.rows[0].start == 0.0 and view.rows[-1].end == tr.wall  # the steps tile the trace


def test_the_brush_is_scaled_without_the_warm_up_step():
    view = TraceView(load_input(W1))
    steady = [r.duration for r in view.rows[1:]]
    assert [r.warmup for r in view.rows] == [True, False, False, False]
    assert brush_scale(view.rows) == max(steady) and 0.6 < min(steady) < max(steady) < 0.9
    assert view.rows[0].duration > 10 * brush_scale(view.rows)  # the warm-up bar is drawn cut
    assert page_data(render_report([view.trace]))["traces"][0]["brushMax"] == approx(max(steady) * 1e6, abs=1e-3)
    assert brush_scale(view.rows[:1]) == view.rows[0].duration  # all warm-up: the longest


def tail_trace():
    """Compute 0-40 with a gap 20-25 in step 1, 50-60 in step 2; step 2's Adam runs 60-90 on
    the CPU after compute's last task: a 30 us tail."""
    return trace_from_json(doc(
        ev("f0", "compute", 0, 20, kind="forward"),
        ev("b0", "compute", 25, 40, kind="backward"),
        ev("a0", "cpu:0", 40, 55, kind="cpu_adam"),
        ev("f1", "compute", 50, 60, kind="forward", step=1),
        ev("a1", "cpu:0", 60, 90, kind="cpu_adam", step=1),
        budgets={},
    ))


def test_busy_idle_and_tail_add_up_to_the_window():
    tr = tail_trace()
    rows = TraceView(tr, min_gap=0).rows
    r0, r1 = rows
    assert (r0.start, r0.end, r1.start, r1.end) == (0.0, 50e-6, 50e-6, 90e-6)
    assert (r0.busy["compute"], r0.idle_compute, r0.tail) == approx((35e-6, 15e-6, 0.0))
    assert (r1.busy["compute"], r1.idle_compute, r1.tail) == approx((10e-6, 0.0, 30e-6))
    assert r1.compute_busy == 1.0 and r0.compute_busy == approx(35 / 50)  # the tail is not idle
    s = window_summary(rows, choose_window(rows, ":"), {})
    assert s.busy["compute"] + s.idle_compute + s.tail == approx(s.duration)
    assert s.compute_busy == approx(45 / 60) and s.busy_fraction["compute"] == approx(45 / 90)


@pytest.mark.parametrize("source", ["w1", "engine"])
def test_the_headline_busy_is_the_per_step_figures_weighted_by_time(source):
    """For every window of whole steps: busy + idle + tail is the window, and the headline
    compute busy is the steps' own figures weighted by their busy + idle, so it lies within
    their min and max (W1's last step used to read 79% beside a median of 97%)."""
    tr = load_input(W1) if source == "w1" else trace_from_json(chrome_trace(engine_records(layers=3, steps=3)[1]))
    view = TraceView(tr)
    rows = view.rows
    for a, b in itertools.combinations_with_replacement(range(len(rows)), 2):
        win = choose_window(rows, f"{rows[a].step}:{rows[b].step}")
        s = window_summary(rows, win, view.budgets)
        rs = window_rows(rows, win)
        assert s.busy["compute"] + s.idle_compute + s.tail == approx(s.duration, rel=1e-12, abs=1e-12)
        active = [r.duration - r.tail for r in rs]
        assert s.compute_busy == approx(sum(r.compute_busy * d for r, d in zip(rs, active)) / sum(active))
        lo, _, hi = step_table(rs)["compute busy"]
        assert lo - 1e-12 <= s.compute_busy <= hi + 1e-12


# ---- colours and errors ----------------------------------------------------------------------


def _lab(hex_color: str) -> tuple[float, float, float]:
    """CIE L*a*b* of an sRGB colour (D65), for a perceptual distance."""
    def lin(c: float) -> float:
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (lin(int(hex_color[i:i + 2], 16) / 255) for i in (1, 3, 5))
    x = (0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047
    y = 0.2126 * r + 0.7152 * g + 0.0722 * b
    z = (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883

    def f(t: float) -> float:
        return t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116

    return 116 * f(y) - 16, 500 * (f(x) - f(y)), 200 * (f(y) - f(z))


def test_the_kinds_of_an_offloading_run_have_distinct_colours():
    """offload_grad and fetch_act were 4 apart (CIE76), the same teal to the eye, and
    offload_act 13 from offload_grad on the same d2h lane."""
    kinds = sorted({t.kind for t in load_input(GATE).tasks} | {"offload_act"})
    assert {"offload_grad", "fetch_act", "backward", "cpu_adam"} <= set(kinds)
    for a, b in itertools.combinations(kinds, 2):
        d = sum((p - q) ** 2 for p, q in zip(_lab(color(a)), _lab(color(b)))) ** 0.5
        assert d >= 20, (a, b, color(a), color(b), round(d, 1))


def test_a_steps_error_names_the_trace_file(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps(doc(ev("a", "compute", 0, 1))))
    assert main(["viz", "run.json", "--steps", "9:"]) == 2
    err = capsys.readouterr().err
    assert "run.json: --steps 9:: no such steps in the trace (it has steps 1\u20131)" in err and err.count("\n") == 1


@pytest.mark.parametrize("flags", [["--png", "missing-folder/out.png"], ["--out", "missing-folder/r.html"],
                                   ["--out", "r.html", "--png", "missing-folder/out.png"]])
def test_an_output_in_a_missing_folder_writes_nothing(tmp_path, capsys, monkeypatch, flags):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps(doc(ev("a", "compute", 0, 1))))
    assert main(["viz", "run.json", *flags]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "missing-folder does not exist" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]
