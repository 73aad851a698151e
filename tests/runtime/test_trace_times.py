"""A trace file's clock is whole nanoseconds: everything the writer decides compares integers.

Seconds from CUDA events and thread clocks are floats; two of them that name one instant can
differ below a nanosecond, and in the file they are one instant. The writer rounds each time
once (``TaskRecord.start_ns``/``end_ns``) and decides on those integers which tenancy of a slot a
reader belongs to and when a counter changes, so what it writes is what any reader of the
file computes from it.
"""

from __future__ import annotations

from flowtrain.graph import StepSpec, compile_step
from flowtrain.runtime import TaskRecord, chrome_trace
from flowtrain.runtime.trace import slot_tenancies


def _tasks(n: int):
    tasks = [t for t in compile_step(StepSpec(layers=2)) if t.lane == "compute"]
    assert len(tasks) >= n
    return tasks[:n]


def _ns(us: float) -> int:
    return round(us * 1000)


def test_an_end_in_the_file_is_exactly_the_next_start():
    """0.1 s + 0.2 s ends at 0.30000000000000004 s: the same nanosecond as a start at 0.3 s."""
    a, b = _tasks(2)
    first = TaskRecord(task=a, lane="compute", start=0.1, end=0.1 + 0.2)
    second = TaskRecord(task=b, lane="compute", start=0.3, end=0.45)
    assert first.end > second.start and first.end_ns == second.start_ns == 300_000_000
    xs = [e for e in chrome_trace([first, second])["traceEvents"] if e["ph"] == "X"]
    assert _ns(xs[0]["ts"]) + _ns(xs[0]["dur"]) == _ns(xs[1]["ts"]) == 300_000_000
    assert _ns(xs[1]["ts"]) + _ns(xs[1]["dur"]) == 450_000_000


def test_a_reader_at_a_takers_nanosecond_reads_the_new_buffer():
    """``a`` holds weights #0; ``c`` takes it again at 2.0000000004 us and ``r``, reading
    weights #0, starts at 2.0000000001 us: in floats before ``c``, in the file (2000 ns) at the
    same instant, so it reads ``c``'s buffer, as a reader of the file (the visualizer) finds.
    Decided on floats, ``r`` kept ``a``'s tenancy open past ``c``'s start and the counter
    showed two slots of a one-slot pool in use."""
    from flowtrain.viz.analysis import occupancy
    from flowtrain.viz.load import trace_from_json

    a, c, r = [t for t in compile_step(StepSpec(layers=2)) if t.kind == "fetch"][:2] + _tasks(1)
    records = [
        TaskRecord(task=a, lane="h2d", start=0.0, end=1e-6, slot=0),
        TaskRecord(task=c, lane="h2d", start=2.0000000004e-6, end=3e-6, slot=0),
        TaskRecord(task=r, lane="compute", start=2.0000000001e-6, end=4e-6, reads={"weights": [0]}),
    ]
    assert records[2].start < records[1].start and records[2].start_ns == records[1].start_ns == 2000
    assert [(s, e) for _, _, s, e, _ in slot_tenancies(records)] == [(0.0, 1e-6), (2e-6, 4e-6)]
    data = chrome_trace(records)
    counter = [e["args"]["in use"] for e in data["traceEvents"] if e["ph"] == "C" and e["name"] == "weights slots"]
    assert max(counter) == 1
    assert max(n for _, n in occupancy(trace_from_json(data))["weights"]) == 1
