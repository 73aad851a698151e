"""Read what the visualizer draws: executed traces and compiled graphs.

A **trace** is Chrome trace event JSON (what ``write_chrome_trace`` and ``flowtrain train
--trace`` write, and what Perfetto opens): one complete event (``"ph": "X"``) per task, times
in microseconds, the task's fields under ``args``. A **graph** is ``flowtrain graph`` output
(``networkx`` node-link JSON). :func:`load_input` tells them apart by their keys::

    >>> item = load_input("trace.json")          # doctest: +SKIP
    >>> item.tasks[0].kind, item.lanes            # doctest: +SKIP
    ('fetch', ['compute', 'h2d', 'd2h', 'cpu:0'])

**Times are read as whole nanoseconds.** A file's ``ts`` and ``dur`` are microseconds, often
with a fraction; adding them in floating point can put a task's end a hair after the next
task's start at the same instant (``12.345 + 0.001`` is not ``12.346``), which would make a
slot look held twice at once. So each start (``ts``) and each end (``ts + dur``) is rounded to
a whole nanosecond first, and everything compares those integers: an end and a start that are
the same instant in the file are equal here, in any trace, old or new. Times are then
re-based so that the first task starts at 0 and kept in **seconds**, each the integer divided
by ``1e9`` (equal integers, equal seconds; order kept). Anything
malformed raises :class:`~flowtrain.errors.DataError` naming the file and what to fix; the
visualizer is written against the format, not against one producer, so fields it can do without
(``deps``, ``reads``, ``slot``, ``bytes``, ...) may be missing.

**Steps count from 1.** A trace's ``args.step`` counts from 0 (the compiled graph's step); viz
numbers steps as training's progress lines, metrics file and ``checkpoint-N`` do, from 1, so
a task of ``"step": 0`` is in step 1, and a name's step suffix follows (``fetch L3 s0`` is
``fetch L3 s1``). Every trace, old or new, is read this way.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_left, bisect_right
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator

import msgspec
import networkx as nx

from ..errors import DataError
from ..graph.export import graph_from_json
from ..graph.tasks import KINDS, legacy_activations

#: Lane kinds in the order rows are drawn; unknown lanes come after, by name.
LANE_KINDS = ("compute", "h2d", "d2h", "cpu", "io")


class TraceTask(msgspec.Struct, frozen=True, kw_only=True):
    """One executed task. ``start``/``end`` are seconds since the trace's first task started,
    each a whole number of nanoseconds (see the module's note on times)."""

    index: int  # position in Trace.tasks (sorted by start)
    id: str
    name: str
    kind: str
    lane: str  # lane kind: compute, h2d, d2h, cpu, io
    lane_name: str  # the row: compute, h2d, d2h, cpu:N, io:N
    start: float
    end: float
    step: int = 1  # counted from 1, as training's progress lines and checkpoint-N count
    unit: str | None = None
    layer: int | None = None
    micro_batch: int | None = None
    phase: str | None = None  # the pass it serves (a fetch's) or "eval"
    activations: str | None = None  # what a layer's forward and backward keep: "keep", "attn"
    takes: str | None = None  # pool the task takes a slot from
    slot: int | None = None  # the slot it took
    reads: dict[str, tuple[int, ...]] = {}  # pool -> slots it reads
    bytes: int = 0
    deps: tuple[str, ...] = ()  # ids of its dependencies

    @property
    def duration(self) -> float:
        return self.end - self.start


def lane_sort_key(lane_name: str) -> tuple:
    """compute, h2d, d2h, cpu:0, cpu:1, ..., then anything else by name."""
    kind, _, worker = lane_name.partition(":")
    if kind in LANE_KINDS:
        return (LANE_KINDS.index(kind), int(worker) if worker.isdigit() else 0, lane_name)
    return (len(LANE_KINDS), 0, lane_name)


class Trace:
    """An executed run: tasks sorted by start, lanes in drawing order, and the producer's
    metadata (``otherData.flowtrain``: policy, slot budgets, ...)."""

    def __init__(self, tasks: list[TraceTask], meta: dict | None = None, name: str = "trace",
                 path: str | None = None, offset: float = 0.0) -> None:
        self.tasks = tasks
        self.meta = dict(meta or {})
        self.name = name
        self.path = path
        self.offset = offset  # seconds: the original timestamp of time 0
        self.lanes = sorted({t.lane_name for t in tasks}, key=lane_sort_key)

    def __repr__(self) -> str:
        return f"<Trace {self.name!r}: {len(self.tasks)} tasks on {len(self.lanes)} lanes, {self.wall * 1e3:.3f} ms>"

    @property
    def wall(self) -> float:
        """Seconds from the first start to the last end."""
        return max((t.end for t in self.tasks), default=0.0)

    @property
    def policy(self) -> str | None:
        policy = self.meta.get("policy")
        return str(policy) if policy is not None else None

    @property
    def mode(self) -> str | None:
        """What the traced run trained (``flowtrain train --trace`` records it)."""
        mode = self.meta.get("mode")
        return str(mode) if mode else None

    @property
    def label(self) -> str:
        return f"{self.policy} ({self.name})" if self.policy else self.name

    @cached_property
    def by_lane(self) -> dict[str, list[TraceTask]]:
        """Tasks of each lane, sorted by start."""
        out: dict[str, list[TraceTask]] = {lane: [] for lane in self.lanes}
        for t in self.tasks:
            out[t.lane_name].append(t)
        return out

    @cached_property
    def dep_indices(self) -> list[tuple[int, ...]]:
        """For each task, the indices of its dependencies that appear in the trace. If an id
        occurs more than once (a producer that reuses ids), the latest occurrence that started
        no later than the dependent task is meant."""
        occurrences: dict[str, list[int]] = {}
        for t in self.tasks:
            occurrences.setdefault(t.id, []).append(t.index)
        starts = {k: [self.tasks[i].start for i in v] for k, v in occurrences.items()}
        out = []
        for t in self.tasks:
            found = []
            for d in t.deps:
                idx = occurrences.get(d)
                if not idx:
                    continue
                j = bisect_right(starts[d], t.start) - 1
                found.append(idx[max(j, 0)])
            out.append(tuple(i for i in found if i != t.index))
        return out


def _opt_int(value: Any, what: str, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise DataError(f"{where}: {what} must be an integer or null (got {value!r})")
    return int(value)


def _slot(value: Any, what: str, where: str) -> int:
    """A slot index: an integer (not null)."""
    slot = _opt_int(value, what, where)
    if slot is None:
        raise DataError(f"{where}: {what} must be an integer (got null)")
    return slot


def _number(value: Any, what: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DataError(f"{where}: {what!r} must be a finite number of microseconds (got {value!r})")
    return float(value)


def _reads(value: Any, where: str) -> dict[str, tuple[int, ...]]:
    if value in (None, {}):
        return {}
    if not isinstance(value, dict):
        raise DataError(f"{where}: args.reads must map a pool to a list of slot indices (got {value!r})")
    out = {}
    for pool, slots in value.items():
        if isinstance(slots, (int, float)) and not isinstance(slots, bool):
            slots = [slots]
        if not isinstance(slots, list):
            raise DataError(f"{where}: args.reads[{pool!r}] must be a list of slot indices (got {slots!r})")
        out[str(pool)] = tuple(_slot(s, f"args.reads[{pool!r}]", where) for s in slots)
    return out


def ns(us: float) -> int:
    """The file's microseconds as whole nanoseconds: ``12.345`` is ``12345``."""
    return round(us * 1000)


def _task_fields(ev: Any, n: int, src: str) -> dict:
    """The fields of one complete event, ``start``/``end`` in whole nanoseconds of the file's
    clock (the end is ``ts + dur`` rounded, so it equals the start of a task that begins at that
    instant); ``lane_name`` and ``lane`` are None where ``args`` does not say (see
    :func:`_name_lanes`)."""
    where = f"{src}: event {n} ({ev.name if ev.name is not None else '?'!r})"
    ts = _number(ev.ts, "ts", where)
    dur = _number(0.0 if ev.dur is None else ev.dur, "dur", where)
    if dur < 0:
        raise DataError(f"{where}: negative duration {dur}")
    args = ev.args or {}
    if not isinstance(args, dict):
        raise DataError(f"{where}: args must be an object")
    kind = str(args.get("kind") or ev.cat or ev.name or "task")
    step = _opt_int(args.get("step"), "args.step", where) or 0
    lane_name = args.get("lane_name")
    deps = args.get("deps") or []
    if not isinstance(deps, list):
        raise DataError(f"{where}: args.deps must be a list of task ids")
    return dict(
        id=str(args["id"]) if args.get("id") is not None else f"#{n}",
        name=_renumber(str(ev.name or kind), step),
        kind=kind,
        lane=None if args.get("lane") is None else str(args["lane"]),
        lane_name=None if lane_name is None else str(lane_name),
        start=ns(ts),
        end=ns(ts + dur),
        step=step + 1,  # the file counts from 0
        unit=None if args.get("unit") is None else str(args["unit"]),
        layer=_opt_int(args.get("layer"), "args.layer", where),
        micro_batch=_opt_int(args.get("micro_batch"), "args.micro_batch", where),
        **_phase_and_activations(kind, args),
        takes=None if args.get("takes") is None else str(args["takes"]),
        slot=_opt_int(args.get("slot"), "args.slot", where),
        reads=_reads(args.get("reads"), where),
        bytes=_opt_int(args.get("bytes"), "args.bytes", where) or 0,
        deps=tuple(str(d) for d in deps),
    )


def _renumber(name: str, step: int) -> str:
    """A task's name with its step suffix counted from 1 as the page counts: ``forward L3 m1
    s2`` (the file's step 2) is ``forward L3 m1 s3``; a name without one is kept."""
    head, _, last = name.rpartition(" ")
    return f"{head} s{step + 1}" if head and last == f"s{step}" else name


def _phase_and_activations(kind: str, args: dict) -> dict[str, str | None]:
    """``phase`` and ``activations`` from a task's ``args``; a trace written before
    ``activations`` was a field of its own gave a kept layer's forward and backward a ``phase``
    of ``keep`` or ``attn`` (:func:`flowtrain.graph.tasks.legacy_activations`)."""
    phase = None if args.get("phase") is None else str(args["phase"])
    activations = None if args.get("activations") is None else str(args["activations"])
    cls = KINDS.get(kind)
    if cls is not None:
        moved = legacy_activations(cls, phase, activations)
        phase, activations = moved.get("phase", phase), moved.get("activations", activations)
    return {"phase": phase, "activations": activations}


def _name_lanes(raw: list[dict], thread_of: list[tuple], threads: dict[Any, str]) -> None:
    """A task's row: ``args.lane_name``, else its thread's name, else ``args.lane``, else the
    thread id; its lane kind: ``args.lane``, else the row's name up to a colon."""
    for r, key in zip(raw, thread_of):
        if r["lane_name"] is None:
            r["lane_name"] = threads.get(key) or r["lane"] or f"tid {key[1]}"
        if r["lane"] is None:
            r["lane"] = r["lane_name"].partition(":")[0]


def _bind_flows(flows: list[tuple], raw: list[dict], thread_of: list[Any]) -> None:
    """Add flow arrows, ``(ph, thread, ts, cat, id, "bp" is "e")`` in file order (``"s"`` then
    ``"f"``, paired by category and id), to the tasks' ``deps``, binding each end the way
    Perfetto does: ``s`` to the slice enclosing it, ``f`` to the slice enclosing it when
    ``"bp": "e"``, else to the next slice to start on its thread.
    An end placed at a slice's start (as ``write_chrome_trace`` places both) is found by one
    lookup; any other by binary search. Times are whole nanoseconds, as the tasks' are."""
    at_start: dict[tuple, int] = {}
    lanes: dict[Any, list[tuple[int, int, int]]] = {}
    for pos, r in enumerate(raw):
        key = (thread_of[pos], r["start"])
        if key not in at_start or r["end"] > raw[at_start[key]]["end"]:
            at_start[key] = pos  # of slices starting together, the longest encloses
        lanes.setdefault(thread_of[pos], []).append((r["start"], r["end"], pos))
    for spans in lanes.values():
        spans.sort()
    starts = {k: [s for s, _, _ in v] for k, v in lanes.items()}

    def enclosing(key: Any, ts: int) -> int | None:
        pos = at_start.get((key, ts))
        if pos is not None:
            return pos
        j = bisect_right(starts.get(key, []), ts) - 1
        return lanes[key][j][2] if j >= 0 and lanes[key][j][1] >= ts else None

    def following(key: Any, ts: int) -> int | None:
        j = bisect_left(starts.get(key, []), ts)
        return lanes[key][j][2] if j < len(starts.get(key, [])) else None

    producers: dict[tuple, int] = {}
    for ph, key, ts, cat, fid, bind_enclosing in flows:
        flow = (cat, fid)
        if ph == "s":
            start = enclosing(key, ts)
            if start is not None:
                producers[flow] = start
        elif flow in producers:
            end = enclosing(key, ts) if bind_enclosing else following(key, ts)
            if end is not None and end != producers[flow]:
                raw[end]["deps"] += (raw[producers[flow]]["id"],)


class _Event(msgspec.Struct):
    """The fields of a trace event that viz reads; anything else in the file is skipped while
    decoding, which keeps a large trace small in memory. Types are checked where used."""

    ph: Any = None
    name: Any = None
    cat: Any = None
    ts: Any = None
    dur: Any = None
    pid: Any = None
    tid: Any = None
    id: Any = None
    bp: Any = None
    args: Any = None


class _TraceDoc(msgspec.Struct):
    """A trace file as ``load_input`` decodes it: each event left as its JSON text until it is
    read, so that a trace of 100,000 tasks and their dependency arrows never exists as half a
    million Python objects at once."""

    traceEvents: list[msgspec.Raw]
    otherData: Any = None


_EVENT = msgspec.json.Decoder(_Event)


def _each_event(events: list, src: str) -> Iterator[tuple[int, _Event]]:
    """``(n, _Event)`` for every event: raw JSON text is decoded, dicts converted."""
    for n, ev in enumerate(events):
        if isinstance(ev, msgspec.Raw):
            try:
                yield n, _EVENT.decode(ev)
            except msgspec.ValidationError:
                raise DataError(f"{src}: event {n} is not an object") from None
        elif isinstance(ev, dict):
            yield n, msgspec.convert(ev, _Event)
        else:
            raise DataError(f"{src}: event {n} is not an object")


def _read_events(events: list, src: str) -> tuple[list[dict], list[tuple], list[tuple]]:
    """One pass over the events: each task's fields, its thread, and the flow ends (see
    :func:`_bind_flows`), keeping no event once read."""
    threads: dict[Any, str] = {}
    shared: dict[Any, Any] = {}  # one (0, 0) thread key and one "dep" rather than 600,000 of each
    raw: list[dict] = []
    thread_of: list[tuple] = []
    flows: list[tuple] = []
    for n, ev in _each_event(events, src):
        if ev.ph == "X":
            raw.append(_task_fields(ev, n, src))
            thread_of.append(shared.setdefault((ev.pid, ev.tid), (ev.pid, ev.tid)))
        elif (ev.ph == "s" or ev.ph == "f") and isinstance(ev.ts, (int, float)) and not isinstance(ev.id, (list, dict)):
            key = shared.setdefault((ev.pid, ev.tid), (ev.pid, ev.tid))
            cat = shared.setdefault(ev.cat, ev.cat) if isinstance(ev.cat, str) else ev.cat
            flows.append((ev.ph, key, ns(ev.ts), cat, ev.id, ev.bp == "e"))
        elif ev.ph == "M" and ev.name == "thread_name" and isinstance(ev.args, dict):
            threads[(ev.pid, ev.tid)] = str(ev.args.get("name"))
    _name_lanes(raw, thread_of, threads)
    return raw, thread_of, flows


def trace_from_json(data: Any, name: str = "trace", path: str | None = None) -> Trace:
    """Build a :class:`Trace` from a decoded Chrome trace document (an object with
    ``traceEvents``, or a bare list of events). Dependencies come from flow events and from
    ``args.deps`` (task ids, as older files wrote them)."""
    src = path or name
    events: Any
    if isinstance(data, _TraceDoc):
        events, other = data.traceEvents, data.otherData or {}
    elif isinstance(data, dict):
        events, other = data.get("traceEvents"), data.get("otherData") or {}
    else:
        events, other = data, {}
    if not isinstance(events, list):
        raise DataError(f"{src}: 'traceEvents' must be a list of events")
    meta = other.get("flowtrain", {}) if isinstance(other, dict) else {}
    if not isinstance(meta, dict):
        raise DataError(f"{src}: otherData.flowtrain must be an object (got {type(meta).__name__})")
    raw, thread_of, flows = _read_events(events, src)
    if isinstance(data, _TraceDoc):
        events.clear()  # load_input's own decoding: the file's text goes before the tasks come
    if not raw:
        raise DataError(f"{src}: no task events (\"ph\": \"X\") in the trace; "
                        "was it written by write_chrome_trace or 'flowtrain train --trace'?")
    _bind_flows(flows, raw, thread_of)
    del flows
    raw.sort(key=lambda r: (r["start"], lane_sort_key(r["lane_name"]), r["end"]))
    t0 = raw[0]["start"]
    tasks: list[TraceTask] = []
    raw.reverse()  # popped from the end: each event's dict goes as its task comes
    while raw:
        r = raw.pop()
        r["start"] = (r["start"] - t0) / 1e9  # integer / 1e9: 45000 ns becomes exactly 45e-6
        r["end"] = (r["end"] - t0) / 1e9
        tasks.append(TraceTask(index=len(tasks), **r))
    return Trace(tasks, meta=meta, name=name, path=path, offset=t0 / 1e9)


class GraphInput:
    """A compiled step graph read from ``flowtrain graph`` JSON."""

    def __init__(self, graph: nx.DiGraph, name: str = "graph", path: str | None = None) -> None:
        self.graph = graph
        self.name = name
        self.path = path

    def __repr__(self) -> str:
        return f"<GraphInput {self.name!r}: {self.graph.number_of_nodes()} tasks, {self.graph.number_of_edges()} edges>"


def graph_input_from_json(data: dict, name: str = "graph", path: str | None = None) -> GraphInput:
    src = path or name
    if "edges" not in data and "links" in data:
        data = {**data, "edges": data["links"]}
    nodes = data.get("nodes")
    if not isinstance(nodes, list) or not isinstance(data.get("edges"), list):
        raise DataError(f"{src}: a graph needs 'nodes' and 'edges' lists (networkx node_link_data)")
    for n, node in enumerate(nodes):
        if not isinstance(node, dict) or "id" not in node:
            raise DataError(f"{src}: node {n} needs an 'id'")
        if node.get("kind") not in KINDS:
            raise DataError(f"{src}: node {node['id']!r} has unknown kind {node.get('kind')!r}; "
                            f"expected one of: {', '.join(KINDS)}")
    try:
        graph = graph_from_json(data)
    except (KeyError, TypeError, ValueError, nx.NetworkXError, msgspec.ValidationError) as exc:
        raise DataError(f"{src}: not a valid flowtrain graph ({type(exc).__name__}: {exc}); "
                        "write one with 'flowtrain graph --out FILE.json'") from None
    if not nx.is_directed_acyclic_graph(graph):
        raise DataError(f"{src}: the graph has a cycle, so it is not a training step")
    return GraphInput(graph, name=name, path=path)


def _decode(text: bytes, p: Path) -> Any:
    try:
        return msgspec.json.decode(text)
    except msgspec.DecodeError:
        try:
            json.loads(text.decode())  # for the line and column of the fault
        except UnicodeDecodeError as exc:
            raise DataError(f"{p}: cannot read it ({exc})") from None
        except json.JSONDecodeError as exc:
            raise DataError(f"{p}: not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
        raise DataError(f"{p}: not JSON") from None


def load_input(path: str | Path) -> Trace | GraphInput:
    """Read ``path`` as a trace or a graph, whichever it is."""
    p = Path(path)
    try:
        text = p.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{p}: no such file") from None
    except OSError as exc:
        raise DataError(f"{p}: cannot read it ({exc})") from None
    data: Any = None
    if b'"traceEvents"' in text:  # a trace: decode only the fields viz reads
        try:
            data = msgspec.json.decode(text, type=_TraceDoc)
        except (msgspec.DecodeError, msgspec.ValidationError):
            data = None  # malformed: decoded again below, for a precise message
    if data is None:
        data = _decode(text, p)
    del text
    name = p.name
    if isinstance(data, (list, _TraceDoc)) or (isinstance(data, dict) and "traceEvents" in data):
        return trace_from_json(data, name=name, path=str(p))
    if isinstance(data, dict) and "nodes" in data:
        return graph_input_from_json(data, name=name, path=str(p))
    raise DataError(f"{p}: neither a trace (Chrome trace JSON with 'traceEvents') nor a graph "
                    "(node-link JSON with 'nodes' and 'edges')")

