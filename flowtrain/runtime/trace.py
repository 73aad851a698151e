"""What ran where and when: task records, instruments, and Chrome trace export.

Every executed task leaves a :class:`TaskRecord` (lane, worker, start, end, slot, bytes).
Times are seconds from the start of the run: on CUDA lanes they come from CUDA events recorded
around the task's kernels, elsewhere from the worker thread's clock.

Instruments are hooks with no-op defaults; the trace is one more instrument::

    recorder = TraceRecorder()
    engine = Engine(program, policy, instruments=[recorder])
    ...
    write_chrome_trace("trace.json", recorder.records, meta={"policy": "double_buffer"})

The Chrome trace event format is what Perfetto and chrome://tracing open: one complete
(``"ph": "X"``) event per task, one thread per lane, and the task's fields under ``args``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

import msgspec

from ..graph.tasks import Task, task_to_dict


#: Lanes run by a pool of worker threads: each worker is its own row in a trace.
HOST_POOL_LANES = ("cpu", "io")


class TaskRecord(msgspec.Struct, kw_only=True):
    """One executed task. ``start``/``end`` are seconds since the engine started."""

    task: Task
    lane: str
    worker: int = 0
    start: float = 0.0
    end: float = 0.0
    slot: int | None = None
    reads: dict[str, list[int]] = {}
    bytes: int = 0
    deps: list[Task] = []

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def lane_name(self) -> str:
        """``compute``, ``h2d``, ``d2h``, or ``cpu:N`` / ``io:N`` for each worker thread."""
        return f"{self.lane}:{self.worker}" if self.lane in HOST_POOL_LANES else self.lane


class Instrument:
    """Hooks the engine calls; override what you need. All default to doing nothing."""

    def on_launch(self, task: Task, lane: str) -> None:
        """``task`` was handed to its lane."""

    def on_record(self, record: TaskRecord) -> None:
        """``task`` finished and its times are known."""

    def on_error(self, task: Task, error: BaseException) -> None:
        """``task`` raised; the step is being cancelled."""


class TraceRecorder(Instrument):
    """Keeps every record (optionally at most ``limit`` of the most recent)."""

    def __init__(self) -> None:
        self.records: list[TaskRecord] = []

    def on_record(self, record: TaskRecord) -> None:
        self.records.append(record)


LANE_ORDER = ("compute", "h2d", "d2h", "cpu", "io")


def _tid(lane_name: str) -> int:
    lane, _, worker = lane_name.partition(":")
    return LANE_ORDER.index(lane) * 100 + int(worker or 0) if lane in LANE_ORDER else 999


def task_id(task: Task) -> str:
    """A stable string id for a task (used to cross-reference dependencies in traces)."""
    return msgspec.json.encode(task).decode()


def chrome_trace(records: Sequence[TaskRecord], meta: dict | None = None) -> dict:
    """The records as a Chrome trace event document (``traceEvents`` + ``otherData``)."""
    events: list[dict] = []
    lanes = sorted({r.lane_name for r in records}, key=_tid)
    for name in lanes:
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": _tid(name), "args": {"name": name}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": _tid(name), "args": {"sort_index": _tid(name)}})
    events.append({"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "flowtrain"}})
    for r in records:
        args = task_to_dict(r.task)
        args.update(
            id=task_id(r.task),
            lane_name=r.lane_name,
            slot=r.slot,
            reads=r.reads,
            bytes=r.bytes,
            deps=[task_id(d) for d in r.deps],
        )
        events.append(
            {
                "name": r.task.label,
                "cat": r.task.kind,
                "ph": "X",
                "ts": round(r.start * 1e6, 3),
                "dur": round(max(r.end - r.start, 0.0) * 1e6, 3),
                "pid": 0,
                "tid": _tid(r.lane_name),
                "args": args,
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"flowtrain": {"version": 1, **(meta or {})}}}


def write_chrome_trace(path: str | Path, records: Sequence[TaskRecord], meta: dict | None = None) -> None:
    """Write :func:`chrome_trace` as JSON to ``path``."""
    Path(path).write_text(json.dumps(chrome_trace(records, meta)))


def lane_busy(records: Iterable[TaskRecord]) -> dict[str, float]:
    """Busy seconds per lane kind (union of intervals, so overlapping CPU workers count once)."""
    by_lane: dict[str, list[tuple[float, float]]] = {}
    for r in records:
        by_lane.setdefault(r.lane, []).append((r.start, r.end))
    busy = {}
    for lane, spans in by_lane.items():
        spans.sort()
        total, cur_s, cur_e = 0.0, None, None
        for s, e in spans:
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    total += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        if cur_e is not None:
            total += cur_e - cur_s
        busy[lane] = total
    return busy
