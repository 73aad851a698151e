"""Late starts and long tasks: what the schedule does not explain, found in traces."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from flowtrain.cli import main
from flowtrain.graph import StepSpec, compile_steps
from flowtrain.runtime import TraceRecorder, run_graph, write_chrome_trace
from flowtrain.viz.analysis import blockers
from flowtrain.viz.html import TraceView
from flowtrain.viz.load import load_input, trace_from_json
from flowtrain.viz.outliers import LATE, late_starts, long_tasks, outlier_lines
from flowtrain.viz.steps import Window

from viz_helpers import doc, ev

MS = 1000.0  # the hand traces' times are microseconds


def _adam_trace():
    """Two steps of: a backward, its gradient's offload, then CPU AdamW on it. Step 1's AdamW
    starts 1 ms after its offload ends (prompt); step 2's first 60 ms after (late); its second
    waits on its lane, busy with the first until 0.2 ms before it starts (not late)."""
    return trace_from_json(doc(
        ev("b1", "compute", 0, 10 * MS, kind="backward"),
        ev("o1", "d2h", 10 * MS, 20 * MS, kind="offload_grad", deps=("b1",)),
        ev("a1", "cpu:0", 21 * MS, 40 * MS, kind="cpu_adam", deps=("o1",)),
        ev("b2", "compute", 90 * MS, 100 * MS, kind="backward", step=1),
        ev("o2", "d2h", 100 * MS, 110 * MS, kind="offload_grad", deps=("b2",), step=1),
        ev("a2", "cpu:0", 170 * MS, 200 * MS, kind="cpu_adam", deps=("o2",), step=1),
        ev("o3", "d2h", 110 * MS, 120 * MS, kind="offload_grad", step=1),
        ev("a3", "cpu:0", 200.2 * MS, 230 * MS, kind="cpu_adam", deps=("o3",), step=1),
    ), name="adam")


def test_a_task_started_long_after_what_it_waited_for_is_late():
    tr = _adam_trace()
    late = late_starts(tr, blockers(tr))
    assert [tr.tasks[x.task].id for x in late] == ["a2"]
    (x,) = late
    assert x.ready == pytest.approx(0.110) and x.delay == pytest.approx(0.060)
    assert x.waited.cause == "dep" and tr.tasks[x.waited.task].id == "o2"


def test_the_threshold_decides_what_is_late():
    tr = _adam_trace()
    waits = blockers(tr)
    assert {tr.tasks[x.task].id for x in late_starts(tr, waits, late=0.5e-3)} == {"a1", "a2"}
    assert late_starts(tr, waits, late=0.061) == []
    # a task whose lane was the last thing it waited for counts from when the lane went free
    assert {tr.tasks[x.task].id for x in late_starts(tr, waits, late=0.1e-3)} == {"a1", "a2", "a3"}


def test_only_the_window_counts():
    tr = _adam_trace()
    waits = blockers(tr)
    first = Window(1, 1, 0.0, 0.1, 1, 2)
    second = Window(2, 2, 0.1, 0.23, 1, 2)
    assert late_starts(tr, waits, first) == []
    assert [tr.tasks[x.task].id for x in late_starts(tr, waits, second)] == ["a2"]


def _forwards(durations_ms, *, step_of=lambda i: 0):
    """Forwards back to back on the compute lane, 1 ms apart, with these durations."""
    events, t = [], 0.0
    for i, d in enumerate(durations_ms):
        events.append(ev(f"f{i}", "compute", t * MS, (t + d) * MS, kind="forward", step=step_of(i)))
        t += d + 1
    return trace_from_json(doc(*events), name="fw")


def test_a_task_far_past_its_kinds_median_is_long():
    tr = _forwards([6, 6.2, 6.1, 377, 5.9, 6.0])
    (y,) = long_tasks(tr)
    assert tr.tasks[y.task].id == "f3" and y.median == pytest.approx(0.00605)


def test_long_needs_both_the_factor_and_the_margin():
    # 4 ms against a 1 ms median is four times it but only 3 ms more: within LATE
    assert long_tasks(_forwards([1, 1, 1, 4, 1])) == []
    # 2.5 times the median is not long, however many milliseconds that is
    assert long_tasks(_forwards([100, 100, 100, 250, 100])) == []
    # too few tasks of the kind to have a median worth comparing to
    assert long_tasks(_forwards([6, 6, 400])) == []


def test_the_lines_say_how_many_how_late_which_and_when():
    tr = _adam_trace()
    late = late_starts(tr, blockers(tr), late=0.5e-3)
    (line,) = outlier_lines(tr, late, [])
    assert line == ("late starts on cpu: 2 tasks began 1.0-60.0 ms after all they waited for had finished, "
                    "in steps 1, 2 (a2 60.0 ms, a1 1.0 ms)")
    whole = Window(1, 2, 0.0, 0.23, 2, 2)
    assert "in every step" in outlier_lines(tr, late, [], whole)[0]
    tr = _forwards([6, 6, 300, 6, 6, 500, 6, 6], step_of=lambda i: i // 4)
    (line,) = outlier_lines(tr, [], long_tasks(tr), most=1)
    assert line == ("long forward tasks on compute: 2 took over 3x their median of 6.0 ms, in steps 1, 2 "
                    "(f5 500.0 ms and 1 more)")
    assert outlier_lines(tr, [], []) == []


def test_a_blocked_event_loop_shows_as_a_late_start_in_a_real_trace(tmp_path):
    """What the engine does when something holds its event loop (a long read, a slow callback):
    a lane finishes a task, nobody hears of it, and the CPU work that was waiting starts late.
    One gradient offload has the loop sleep 0.3 s, and returns once the loop is asleep."""
    graph = compile_steps(StepSpec(layers=3, micro_batches=1), 2)
    blocking = threading.Event()
    loop: dict = {}

    def hold_the_loop() -> None:
        blocking.set()
        time.sleep(0.3)

    def program(task, ctx):
        if task.kind == "offload_grad" and task.layer == 1 and task.step == 1 and not blocking.is_set():
            loop["it"].call_soon_threadsafe(hold_the_loop)
            blocking.wait()  # the loop is asleep from now on: this task ends while it sleeps
        return 1000 if task.kind in ("fetch", "offload_grad") else 0

    rec = TraceRecorder()

    async def run() -> None:
        loop["it"] = asyncio.get_running_loop()
        await run_graph(graph, program, "double_buffer", instruments=[rec])

    asyncio.run(run())
    path = tmp_path / "t.json"
    write_chrome_trace(path, rec.records, meta={"policy": "double_buffer"})
    tr = load_input(path)
    late = late_starts(tr, blockers(tr))
    assert all(x.delay > LATE for x in late)
    blocked_from = next(t.start for t in tr.tasks if t.name == "offload_grad L1 s2")
    # Whatever became ready while the loop slept started once it woke: 0.3 s, less the few
    # milliseconds the lanes took to finish the work they already had.
    assert any(x.delay > 0.1 and x.ready >= blocked_from for x in late)


def test_flowtrain_viz_prints_what_it_found(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc(
        ev("o1", "d2h", 0, 10 * MS, kind="offload_grad"),
        ev("a1", "cpu:0", 11 * MS, 40 * MS, kind="cpu_adam", deps=("o1",)),
        ev("o2", "d2h", 100 * MS, 110 * MS, kind="offload_grad", step=1),
        ev("a2", "cpu:0", 170 * MS, 200 * MS, kind="cpu_adam", deps=("o2",), step=1),
    )))
    assert main(["viz", str(path), "--steps", "1:", "--out", str(tmp_path / "r.html")]) == 0
    out = capsys.readouterr().out
    assert ("late starts on cpu: 1 task began 60.0 ms after all they waited for had finished, "
            "in step 2 (a2 60.0 ms)") in out
    view = TraceView(load_input(path), steps="1:")
    assert [view.trace.tasks[x.task].id for x in view.late] == ["a2"] and view.long == []
