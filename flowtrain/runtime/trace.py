"""What ran where and when: task records, instruments, and Chrome trace export.

Every executed task leaves a :class:`TaskRecord` (lane, worker, start, end, slot, bytes).
Times are seconds from the start of the run: on CUDA lanes they come from CUDA events recorded
around the task's kernels, elsewhere from the worker thread's clock.

A trace file counts time in **whole nanoseconds**: every time is rounded once
(:attr:`TaskRecord.start_ns`, :attr:`TaskRecord.end_ns`) and everything the writer decides (which
task came first, which tenancy a reader belongs to, a counter's instant) compares those
integers. So a task that ends the instant the next one starts (on its lane, or on the slot it
frees) ends at exactly that next start in the file, and a reader that rounds ``ts * 1000``
and ``(ts + dur) * 1000`` to integers finds them equal, never one nanosecond apart.

Instruments are hooks with no-op defaults; the trace is one more instrument::

    recorder = TraceRecorder()
    engine = Engine(program, policy, instruments=[recorder])
    ...
    write_chrome_trace("trace.json", recorder.records, recorder.meta(policy="double_buffer"))

The Chrome trace event format is what Perfetto and chrome://tracing open: one complete
(``"ph": "X"``) event per task, one thread per lane, the task's fields under ``args``, every
dependency as a flow arrow and slot occupancy as counters (see :func:`chrome_trace`).
"""

from __future__ import annotations

import json
from bisect import bisect_right
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

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
    def start_ns(self) -> int:
        """``start`` in whole nanoseconds: the trace file's clock."""
        return _ns(self.start)

    @property
    def end_ns(self) -> int:
        """``end`` in whole nanoseconds, never before :attr:`start_ns`."""
        return max(_ns(self.end), _ns(self.start))

    @property
    def lane_name(self) -> str:
        """``compute``, ``h2d``, ``d2h``, or ``cpu:N`` / ``io:N`` for each worker thread."""
        return f"{self.lane}:{self.worker}" if self.lane in HOST_POOL_LANES else self.lane


class Instrument:
    """Hooks the engine calls; override what you need. All default to doing nothing."""

    def on_budgets(self, budgets: dict[str, int]) -> None:
        """The slot budgets (slots per pool) the engine runs with, once, before any launch."""

    def on_launch(self, task: Task, lane: str) -> None:
        """``task`` was handed to its lane."""

    def on_record(self, record: TaskRecord) -> None:
        """``task`` finished and its times are known."""

    def on_error(self, task: Task | None, error: BaseException) -> None:
        """``task`` raised (None: the engine itself failed or was cancelled); the step is being
        cancelled."""


class TraceRecorder(Instrument):
    """Keeps every record, and the slot budgets when the engine reports them; :meth:`meta` is
    what a trace file should say about the run (``write_chrome_trace(path, rec.records,
    rec.meta(policy="double_buffer"))``)."""

    def __init__(self) -> None:
        self.records: list[TaskRecord] = []
        self.budgets: dict[str, int] = {}

    def on_budgets(self, budgets: dict[str, int]) -> None:
        self.budgets = dict(budgets)

    def on_record(self, record: TaskRecord) -> None:
        self.records.append(record)

    def meta(self, **more: object) -> dict[str, object]:
        """``{"budgets": ...}`` (when known) updated with ``more``."""
        return {**({"budgets": self.budgets} if self.budgets else {}), **more}


LANE_ORDER = ("compute", "h2d", "d2h", "cpu", "io")


def _tid(lane_name: str) -> int:
    lane, _, worker = lane_name.partition(":")
    return LANE_ORDER.index(lane) * 100 + int(worker or 0) if lane in LANE_ORDER else 999


def task_id(task: Task) -> str:
    """A stable string id for a task (its fields as JSON): how traces name a task across runs."""
    return msgspec.json.encode(task).decode()


def _ns(seconds: float) -> int:
    """Seconds as whole nanoseconds, the one rounding every time in a trace file goes through."""
    return round(seconds * 1e9)


def _us(ns: int) -> int | float:
    """Integer nanoseconds as the format's microseconds: ``12345`` ns is ``12.345``, which a
    reader that rounds ``ts * 1000`` (Perfetto) turns back into exactly 12345. Only ever
    applied to an integer, so an end and a start that are the same instant are the same text."""
    return ns // 1000 if ns % 1000 == 0 else ns / 1000


def _dep_positions(records: Sequence[TaskRecord]) -> list[list[int]]:
    """For each record, the positions of its dependencies among ``records``. A task recorded
    twice (a graph run again) means its latest run that started no later than the dependent."""
    runs: dict[Task, list[int]] = {}
    for n, r in enumerate(records):
        runs.setdefault(r.task, []).append(n)
    out = []
    for r in records:
        found = []
        for d in r.deps:
            cands = [n for n in runs.get(d, ()) if records[n].start_ns <= r.start_ns]
            if cands:
                found.append(max(cands, key=lambda n: records[n].start_ns))
        out.append(found)
    return out


def _tenancies_ns(records: Sequence[TaskRecord]) -> list[tuple[str, int, int, int, int]]:
    """:func:`slot_tenancies` in whole nanoseconds, decided on those integers: a reader that
    starts the nanosecond a new taker does reads the new taker's buffer, as in the file."""
    takers: dict[tuple[str, int], list[TaskRecord]] = {}
    for r in records:
        if r.task.takes is not None and r.slot is not None:
            takers.setdefault((r.task.takes, r.slot), []).append(r)
    starts, ends = {}, {}
    for key, rs in takers.items():
        rs.sort(key=lambda r: r.start_ns)
        starts[key] = [r.start_ns for r in rs]
        ends[key] = [r.end_ns for r in rs]
    for r in records:
        for pool, slots in r.reads.items():
            for s in slots:
                key = (pool, s)
                j = bisect_right(starts.get(key, []), r.start_ns) - 1
                if j >= 0 and takers[key][j] is r:
                    j -= 1
                if j >= 0:
                    ends[key][j] = max(ends[key][j], r.end_ns)
    return sorted((key[0], key[1], r.start_ns, ends[key][j], r.bytes)
                  for key, rs in takers.items() for j, r in enumerate(rs))


def slot_tenancies(records: Sequence[TaskRecord]) -> list[tuple[str, int, float, float, int]]:
    """``(pool, slot, start, end, bytes)`` per slot taken: from the taker's start until the last
    task that read the slot under it (the latest taker that started no later than the reader)
    has finished, since the buffer is needed until then. ``bytes`` are the taker's. Times are
    seconds, each a whole number of nanoseconds (the trace file's clock)."""
    return [(pool, slot, start / 1e9, end / 1e9, nbytes) for pool, slot, start, end, nbytes in _tenancies_ns(records)]


def _counter_events(records: Sequence[TaskRecord], pid: int) -> list[dict[str, object]]:
    """Slots in use per pool, and bytes held in taken slots per pool, as counter ("C") events
    in time order: one value per instant, releases counted before takes at the same instant."""
    changes: dict[str, list[tuple[int, int, int]]] = {}
    for pool, _, start, end, nbytes in _tenancies_ns(records):
        changes.setdefault(pool, []).extend([(start, 1, nbytes), (end, -1, -nbytes)])
    events: list[dict[str, object]] = []
    for pool, cs in sorted(changes.items()):
        cs.sort(key=lambda c: (c[0], c[1]))
        slots = held = 0
        points: list[tuple[int, int, int]] = []
        for ts, d, b in cs:
            slots, held = slots + d, held + b
            if points and points[-1][0] == ts:
                points[-1] = (ts, slots, held)
            else:
                points.append((ts, slots, held))
        for ts, n, b in points:
            events.append({"ph": "C", "name": f"{pool} slots", "pid": pid, "ts": _us(ts), "args": {"in use": n}})
            events.append({"ph": "C", "name": f"{pool} bytes", "pid": pid, "ts": _us(ts), "args": {"held": b}})
    return events


def chrome_trace(records: Sequence[TaskRecord], meta: Mapping[str, object] | None = None) -> dict[str, Any]:
    """The records as a Chrome trace event document (``traceEvents`` + ``otherData``).

    What each event is, so that Perfetto reads the whole file:

    - one complete event (``"ph": "X"``) per task on its lane's thread; ``ts`` and ``dur`` come
      from the same whole-nanosecond ends (``dur = end - start``), so back-to-back tasks on a
      lane touch but never overlap (Perfetto drops a slice that overlaps its neighbour), and
      ``round(ts * 1000) + round(dur * 1000)`` is exactly the end in nanoseconds;
    - ``args`` holds the task's fields without nulls, ``id`` (the record's position: compact),
      ``lane_name``, and ``slot``, ``reads`` and ``bytes`` where there are any;
    - every dependency is a flow: ``"ph": "s"`` at the producer's start, ``"ph": "f"`` with
      ``"bp": "e"`` at the consumer's start (each binds to the slice enclosing it), one ``id``
      per edge;
    - counters (``"ph": "C"``): slots in use and bytes held, per pool.
    """
    pid = 0
    events: list[dict[str, object]] = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": "flowtrain"}}]
    for name in sorted({r.lane_name for r in records}, key=_tid):
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": _tid(name), "args": {"name": name}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": _tid(name), "args": {"sort_index": _tid(name)}})
    spans = [(r.start_ns, r.end_ns) for r in records]
    for n, r in enumerate(records):
        args = {k: v for k, v in task_to_dict(r.task).items() if v is not None}
        args.update(id=n, lane_name=r.lane_name)
        if r.slot is not None:
            args["slot"] = r.slot
        if r.reads:
            args["reads"] = r.reads
        if r.bytes:
            args["bytes"] = r.bytes
        s, e = spans[n]
        events.append({"name": r.task.label, "cat": r.task.kind, "ph": "X", "ts": _us(s), "dur": _us(e - s),
                       "pid": pid, "tid": _tid(r.lane_name), "args": args})
    flow = 0
    for n, deps in enumerate(_dep_positions(records)):
        for d in deps:
            flow += 1
            events.append({"ph": "s", "name": "dep", "cat": "dep", "id": flow, "pid": pid,
                           "tid": _tid(records[d].lane_name), "ts": _us(spans[d][0])})
            events.append({"ph": "f", "bp": "e", "name": "dep", "cat": "dep", "id": flow, "pid": pid,
                           "tid": _tid(records[n].lane_name), "ts": _us(spans[n][0])})
    events += _counter_events(records, pid)
    other = {"flowtrain": {"version": 2, **(meta or {})}}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def write_chrome_trace(path: str | Path, records: Sequence[TaskRecord], meta: Mapping[str, object] | None = None) -> None:
    """Write :func:`chrome_trace` as JSON to ``path``."""
    Path(path).write_text(json.dumps(chrome_trace(records, meta), separators=(",", ":")))


def lane_busy(records: Iterable[TaskRecord]) -> dict[str, float]:
    """Busy seconds per lane kind (union of intervals, so overlapping CPU workers count once)."""
    by_lane: dict[str, list[tuple[float, float]]] = {}
    for r in records:
        by_lane.setdefault(r.lane, []).append((r.start, r.end))
    busy = {}
    for lane, spans in by_lane.items():
        spans.sort()
        total = 0.0
        current: tuple[float, float] | None = None  # the union's open interval
        for s, e in spans:
            if current is None or s > current[1]:
                if current is not None:
                    total += current[1] - current[0]
                current = (s, e)
            else:
                current = (current[0], max(current[1], e))
        if current is not None:
            total += current[1] - current[0]
        busy[lane] = total
    return busy
