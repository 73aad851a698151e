"""What a trace says about a schedule: busy lanes, overlap, slots, and why compute sat idle.

Everything here is plain arithmetic on a :class:`~flowtrain.viz.load.Trace` (seconds) or a
compiled graph; nothing is drawn. Tests feed hand-made traces and check exact numbers::

    s = summarize(trace)
    s.busy_fraction["compute"]     # 0.0 .. 1.0
    for gap in compute_gaps(trace):
        print(gap.start, gap.end, gap.reason, gap.text)   # 0.004 0.005 fetch waited for fetch L3 ...

**Why was a task late?** A task starts once three things are true: its lane has finished the
task before it, every dependency has finished (device lanes wait on fences, which is the same
thing in time), and, if it takes a slot, the previous holder's readers are done with that slot.
:func:`blocker` returns whichever of these finished last. An idle gap on the compute lane is
explained by the blocker of the task that ended it, followed back while the blame stays inside
the gap ("fetch L3, which waited for a weights slot, freed when forward L1 m1 finished").
"""

from __future__ import annotations

import statistics
from bisect import bisect_right
from typing import Iterable, Sequence

import msgspec
import networkx as nx

from ..graph.tasks import Task
from ..policy import Policy, resolve_policy
from .load import Trace, TraceTask

Span = tuple[float, float]

# ---- intervals ------------------------------------------------------------------------------


def union(spans: Iterable[Span]) -> list[Span]:
    """Sorted, disjoint spans covering the same time."""
    out: list[list[float]] = []
    for s, e in sorted(spans):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def length(spans: Iterable[Span]) -> float:
    return sum(e - s for s, e in union(spans))


def intersect(a: Sequence[Span], b: Sequence[Span]) -> list[Span]:
    """Intersection of two unions (both sorted and disjoint)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def lane_spans(trace: Trace, lanes: Iterable[str]) -> list[Span]:
    """Union of the busy time of lanes, given by lane name (``cpu:0``) or lane kind (``cpu``)."""
    wanted = set(lanes)
    return union((t.start, t.end) for t in trace.tasks if t.lane_name in wanted or t.lane in wanted)


# ---- slots ---------------------------------------------------------------------------------


class SlotUse(msgspec.Struct, frozen=True):
    """One tenancy of a slot: ``holder`` took slot ``slot`` of ``pool`` at ``start``; the
    buffer stays in use until the last of its ``readers`` finished (``end``)."""

    pool: str
    slot: int
    holder: int
    readers: tuple[int, ...]
    start: float
    end: float


def slot_uses(trace: Trace) -> list[SlotUse]:
    """Every slot tenancy, in order of the holders' starts.

    A reader's holder is the dependency that took the slot it reads; without ``deps`` in the
    trace, the latest taker of that slot that started no later than the reader."""
    holders = [(t, t.takes, t.slot) for t in trace.tasks if t.takes is not None and t.slot is not None]
    by_slot: dict[tuple[str, int], list[TraceTask]] = {}
    for h, pool, slot in holders:  # tasks are sorted by start, so each list is too
        by_slot.setdefault((pool, slot), []).append(h)
    starts = {k: [h.start for h in v] for k, v in by_slot.items()}
    readers: dict[int, list[int]] = {h.index: [] for h, _, _ in holders}
    for t in trace.tasks:
        deps = trace.dep_indices[t.index]
        for pool, slots in t.reads.items():
            for s in slots:
                owner = next((d for d in deps if trace.tasks[d].takes == pool and trace.tasks[d].slot == s), None)
                if owner is None and (pool, s) in by_slot:
                    j = bisect_right(starts[(pool, s)], t.start) - 1
                    while j >= 0 and by_slot[(pool, s)][j].index == t.index:
                        j -= 1
                    owner = by_slot[(pool, s)][j].index if j >= 0 else None
                if owner is not None:
                    readers[owner].append(t.index)
    out = []
    for h, pool, slot in holders:
        rs = tuple(readers[h.index])
        end = max([h.end, *(trace.tasks[r].end for r in rs)])
        out.append(SlotUse(pool, slot, h.index, rs, h.start, end))
    return out


def pool_budgets(trace: Trace, uses: Sequence[SlotUse] | None = None) -> dict[str, int]:
    """Slots per pool: the producer's ``budgets`` where given, else the highest slot seen + 1."""
    uses = slot_uses(trace) if uses is None else uses
    seen: dict[str, int] = {}
    for u in uses:
        seen[u.pool] = max(seen.get(u.pool, 0), u.slot + 1)
    for t in trace.tasks:
        for pool, slots in t.reads.items():
            seen[pool] = max([seen.get(pool, 0), *(s + 1 for s in slots)])
    meta = trace.meta.get("budgets")
    if isinstance(meta, dict):
        for pool, n in meta.items():
            if isinstance(n, int):
                seen[pool] = max(n, seen.get(pool, 0))
    return dict(sorted(seen.items()))


def inferred_budgets(trace: Trace, budgets: dict[str, int]) -> list[str]:
    """The pools of ``budgets`` whose budget the trace does not record (``budgets`` metadata,
    absent from older traces): :func:`pool_budgets` inferred them from the highest slot seen,
    and the report says so beside them."""
    meta = trace.meta.get("budgets")
    given = {p for p, n in meta.items() if isinstance(n, int)} if isinstance(meta, dict) else set()
    return sorted(p for p in budgets if p not in given)


def occupancy(trace: Trace, uses: Sequence[SlotUse] | None = None) -> dict[str, list[tuple[float, int]]]:
    """Slots in use per pool as a step function: ``[(time, count from then on), ...]``."""
    uses = slot_uses(trace) if uses is None else uses
    events: dict[str, list[tuple[float, int]]] = {}
    for u in uses:
        events.setdefault(u.pool, []).extend([(u.start, 1), (u.end, -1)])
    out = {}
    for pool, evs in sorted(events.items()):
        evs.sort(key=lambda e: (e[0], e[1]))  # a release before a take at the same instant
        steps: list[tuple[float, int]] = [(0.0, 0)]
        count = 0
        for t, d in evs:
            count += d
            if steps[-1][0] == t:
                steps[-1] = (t, count)
            else:
                steps.append((t, count))
        out[pool] = [p for n, p in enumerate(steps) if n == 0 or p[1] != steps[n - 1][1]]
    return out


# ---- waiting --------------------------------------------------------------------------------


def partial_fetches(trace: Trace) -> dict[int, float]:
    """Fetches that copied only part of their unit, by task index: the fraction of the most any
    fetch of the same unit copied. A layer that skips idle experts (``train
    --skip-idle-experts``) copies every expert for its forward but, before its recompute and
    backward, only those its routing reached."""
    most: dict[tuple, int] = {}
    fetches = [t for t in trace.tasks if t.kind == "fetch" and t.bytes > 0]
    for t in fetches:
        key = (t.unit, t.layer)
        most[key] = max(most.get(key, 0), t.bytes)
    return {t.index: t.bytes / most[(t.unit, t.layer)] for t in fetches if t.bytes < most[(t.unit, t.layer)]}


class Wait(msgspec.Struct, frozen=True):
    """What a task waited for: ``cause`` is ``"dep"`` (a dependency), ``"lane"`` (the task
    before it on its lane) or ``"slot"`` (the last reader of the slot it took, under its
    previous holder); ``task`` is that task's index and ``end`` when it finished."""

    cause: str
    task: int
    end: float
    pool: str | None = None


def _slot_fences(trace: Trace, uses: Sequence[SlotUse]) -> dict[int, Wait]:
    """For each slot taker, the moment its slot's previous tenancy ended."""
    out: dict[int, Wait] = {}
    last: dict[tuple[str, int], SlotUse] = {}
    for u in sorted(uses, key=lambda u: (u.start, u.holder)):
        prev = last.get((u.pool, u.slot))
        if prev is not None:
            rs = prev.readers or (prev.holder,)
            r = max(rs, key=lambda i: (trace.tasks[i].end, i))
            out[u.holder] = Wait("slot", r, trace.tasks[r].end, u.pool)
        last[(u.pool, u.slot)] = u
    return out


def blockers(trace: Trace, uses: Sequence[SlotUse] | None = None) -> list[Wait | None]:
    """For every task, the :class:`Wait` that finished last before it started (``None`` for
    a task nothing held back). Ties go to a dependency, then a slot, then the lane."""
    uses = slot_uses(trace) if uses is None else uses
    fences = _slot_fences(trace, uses)
    prev_on_lane: dict[int, int] = {}
    for tasks in trace.by_lane.values():
        for a, b in zip(tasks, tasks[1:]):
            prev_on_lane[b.index] = a.index
    rank = {"dep": 2, "slot": 1, "lane": 0}
    out: list[Wait | None] = []
    for t in trace.tasks:
        cands = [Wait("dep", d, trace.tasks[d].end) for d in trace.dep_indices[t.index]]
        if t.index in fences:
            cands.append(fences[t.index])
        if t.index in prev_on_lane:
            p = prev_on_lane[t.index]
            cands.append(Wait("lane", p, trace.tasks[p].end))
        # What finished after the task started cannot have held it back (2 ns: the trace
        # rounds times to 1 ns).
        cands = [c for c in cands if c.end <= t.start + 2e-9]
        out.append(max(cands, key=lambda c: (c.end, rank[c.cause])) if cands else None)
    return out


def a_slot(pool: str | None) -> str:
    """``a weights slot``, ``an acts slot``."""
    return f"{'an' if (pool or 'x')[0] in 'aeiou' else 'a'} {pool} slot"


def describe_wait(trace: Trace, w: Wait) -> str:
    other = trace.tasks[w.task]
    if w.cause == "slot":
        return f"{a_slot(w.pool)}, freed when {other.name} finished"
    if w.cause == "lane":
        return f"its lane ({other.lane_name}), busy with {other.name}"
    return other.name


class Gap(msgspec.Struct, frozen=True):
    """An idle stretch of a lane, ``start`` to ``end``, ended by task ``after``.

    ``reason`` names the first thing waited for: a task kind (``fetch``, ``cpu_adam``, ...),
    ``slot``, or ``host`` when everything it needed had finished before the lane went idle
    (launch overhead). ``chain`` follows the blame back while it stays inside the gap: the
    indices of the tasks waited for, in order; ``text`` says it in words."""

    start: float
    end: float
    after: int
    reason: str
    chain: tuple[int, ...]
    text: str
    pattern: str = ""  # the text with kinds for tasks: "forward waited for fetch, which waited for a weights slot"

    @property
    def duration(self) -> float:
        return self.end - self.start


def default_min_gap(trace: Trace, lane: str = "compute") -> float:
    """Gaps shorter than this are launch overhead, not worth a marker: 5% of the median task
    duration on the lane (at least a microsecond)."""
    durations = [t.duration for t in trace.by_lane.get(lane, [])]
    return max(1e-6, 0.05 * statistics.median(durations)) if durations else 1e-6


def compute_gaps(trace: Trace, lane: str = "compute", min_gap: float | None = None,
                 waits: Sequence[Wait | None] | None = None) -> list[Gap]:
    """Idle gaps of ``lane`` (from time 0 to its last task) longer than ``min_gap`` seconds,
    each with what the task that ended it was waiting for."""
    min_gap = default_min_gap(trace, lane) if min_gap is None else min_gap
    waits = blockers(trace) if waits is None else waits
    gaps = []
    idle_since = 0.0
    for t in trace.by_lane.get(lane, []):
        if t.start - idle_since > min_gap:
            gaps.append(_explain(trace, t, idle_since, waits))
        idle_since = max(idle_since, t.end)
    return gaps


def _explain(trace: Trace, task: TraceTask, idle_since: float, waits: Sequence[Wait | None]) -> Gap:
    chain: list[int] = []
    words: list[str] = []
    kinds: list[str] = []
    reason = "host"
    cur = task
    for _ in range(8):
        w = waits[cur.index]
        if w is None or w.task in chain or w.end < idle_since:
            break
        if not chain and w.end == idle_since:
            break  # the lane's own last task: nothing outside the lane held it back
        if not chain:
            reason = "slot" if w.cause == "slot" else trace.tasks[w.task].kind
        chain.append(w.task)
        words.append(describe_wait(trace, w))
        kinds.append(_wait_kind(trace, w))
        cur = trace.tasks[w.task]
        if w.cause == "slot" or cur.start < idle_since:
            break  # the blamed task was already running when the lane went idle
        # A blamed task that started during the gap (or the instant it began) was itself
        # held back: follow it, even to a slot freed by the lane's own last task.
    if not words:
        text = f"{task.name} had all it needed before the lane went idle (launch overhead)"
        pattern = f"{task.kind} had all it needed (launch overhead)"
    else:
        text = f"{task.name} waited for " + ", which waited for ".join(_collapse_words(trace, chain, words))
        pattern = f"{task.kind} waited for " + ", which waited for ".join(_collapse(kinds))
    return Gap(idle_since, task.start, task.index, reason, tuple(chain), text, pattern)


def _collapse(links: list[str]) -> list[str]:
    """Repeated links said once: ``its lane (cpu)`` three times in a row is ``its lane (cpu) ×3``."""
    out: list[tuple[str, int]] = []
    for link in links:
        if out and out[-1][0] == link:
            out[-1] = (link, out[-1][1] + 1)
        else:
            out.append((link, 1))
    return [link if n == 1 else f"{link} \u00d7{n}" for link, n in out]


def _collapse_words(trace: Trace, chain: list[int], words: list[str]) -> list[str]:
    """Consecutive waits for the same lane said once, naming each task it was busy with:
    ``its lane (cpu:0), busy with A, then B, then C``."""
    out: list[str] = []
    prev_lane = None
    for i, w in zip(chain, words):
        lane = trace.tasks[i].lane_name if w.startswith("its lane (") else None
        if lane is not None and lane == prev_lane:
            out[-1] += f", then {trace.tasks[i].name}"
        else:
            out.append(w)
        prev_lane = lane
    return out


def _wait_kind(trace: Trace, w: Wait) -> str:
    """What ``w`` waited for, by kind rather than by task: the same for every layer and step."""
    if w.cause == "slot":
        return a_slot(w.pool)
    if w.cause == "lane":
        return f"its lane ({trace.tasks[w.task].lane})"
    return trace.tasks[w.task].kind


def gap_patterns(gaps: Sequence[Gap]) -> list[tuple[str, str, list[Gap]]]:
    """Gaps grouped by pattern, ``(pattern, reason, gaps)``, the most idle time first."""
    groups: dict[str, list[Gap]] = {}
    for g in gaps:
        groups.setdefault(g.pattern, []).append(g)
    rows = [(p, gs[0].reason, gs) for p, gs in groups.items()]
    return sorted(rows, key=lambda r: (-sum(g.duration for g in r[2]), r[0]))


def critical_chain(trace: Trace, waits: Sequence[Wait | None] | None = None) -> list[int]:
    """The executed critical path: from the task that finished last, back through what each
    task waited for, to a task nothing held back. Indices, earliest first."""
    if not trace.tasks:
        return []
    waits = blockers(trace) if waits is None else waits
    cur = max(trace.tasks, key=lambda t: (t.end, t.index)).index
    chain, seen = [cur], {cur}
    while (w := waits[cur]) is not None and w.task not in seen:
        cur = w.task
        chain.append(cur)
        seen.add(cur)
    return chain[::-1]


# ---- summary ------------------------------------------------------------------------------


class Overlap(msgspec.Struct, frozen=True):
    """Seconds that work overlapped, and how much of the copying and CPU work compute hid."""

    compute_copy: float  # compute busy while h2d or d2h is busy
    copy: float  # h2d or d2h busy
    compute_cpu: float  # compute busy while a cpu worker is busy
    cpu: float
    copy_hidden: float  # compute_copy / copy (0 if no copies)
    cpu_hidden: float


def overlap(trace: Trace) -> Overlap:
    comp = lane_spans(trace, ["compute"])
    copy = lane_spans(trace, ["h2d", "d2h"])
    cpu = lane_spans(trace, ["cpu"])
    cc, cu = length(intersect(comp, copy)), length(intersect(comp, cpu))
    lc, lu = length(copy), length(cpu)
    return Overlap(cc, lc, cu, lu, cc / lc if lc else 0.0, cu / lu if lu else 0.0)


class StepSpan(msgspec.Struct, frozen=True):
    step: int
    start: float
    end: float
    tasks: int


class Summary(msgspec.Struct, frozen=True):
    """The numbers a report shows for one trace (seconds and fractions of ``wall``)."""

    tasks: int
    wall: float
    steps: tuple[StepSpan, ...]
    step_time: float  # mean time between consecutive step ends (wall if one step)
    busy: dict[str, float]  # per lane name
    busy_fraction: dict[str, float]
    tasks_per_lane: dict[str, int]
    overlap: Overlap
    bytes_per_lane: dict[str, int]
    idle_by_reason: dict[str, float]  # marked compute gaps, seconds per reason
    idle_compute: float  # all compute idle time between 0 and the end of the trace
    min_gap: float
    budgets: dict[str, int]
    peak_slots: dict[str, int]
    mean_slots: dict[str, float]  # time-averaged slots in use over the wall


def step_spans(trace: Trace) -> tuple[StepSpan, ...]:
    spans: dict[int, list[float]] = {}
    counts: dict[int, int] = {}
    for t in trace.tasks:
        s = spans.setdefault(t.step, [t.start, t.end])
        s[0], s[1] = min(s[0], t.start), max(s[1], t.end)
        counts[t.step] = counts.get(t.step, 0) + 1
    return tuple(StepSpan(k, v[0], v[1], counts[k]) for k, v in sorted(spans.items()))


def summarize(trace: Trace, min_gap: float | None = None, gaps: Sequence[Gap] | None = None,
              uses: Sequence[SlotUse] | None = None) -> Summary:
    wall = trace.wall
    uses = slot_uses(trace) if uses is None else uses
    min_gap = default_min_gap(trace) if min_gap is None else min_gap
    gaps = compute_gaps(trace, min_gap=min_gap, waits=blockers(trace, uses)) if gaps is None else gaps
    busy = {lane: length((t.start, t.end) for t in ts) for lane, ts in trace.by_lane.items()}
    steps = step_spans(trace)
    ends = [s.end for s in steps]
    step_time = (ends[-1] - ends[0]) / (len(ends) - 1) if len(ends) > 1 else wall
    idle: dict[str, float] = {}
    for g in gaps:
        idle[g.reason] = idle.get(g.reason, 0.0) + g.duration
    comp = trace.by_lane.get("compute", [])
    idle_compute = comp[-1].end - busy["compute"] if comp else 0.0
    occ = occupancy(trace, uses)
    peak, mean = {}, {}
    for pool, steps_ in occ.items():
        peak[pool] = max(c for _, c in steps_)
        area = sum(c * (t1 - t0) for (t0, c), (t1, _) in zip(steps_, steps_[1:]))
        mean[pool] = area / wall if wall else 0.0
    nbytes: dict[str, int] = {}
    for t in trace.tasks:
        nbytes[t.lane_name] = nbytes.get(t.lane_name, 0) + t.bytes
    return Summary(
        tasks=len(trace.tasks),
        wall=wall,
        steps=steps,
        step_time=step_time,
        busy=busy,
        busy_fraction={k: (v / wall if wall else 0.0) for k, v in busy.items()},
        tasks_per_lane={k: len(v) for k, v in trace.by_lane.items()},
        overlap=overlap(trace),
        bytes_per_lane=nbytes,
        idle_by_reason=dict(sorted(idle.items(), key=lambda kv: -kv[1])),
        idle_compute=idle_compute,
        min_gap=min_gap,
        budgets=pool_budgets(trace, uses),
        peak_slots=peak,
        mean_slots=mean,
    )


# ---- graphs -----------------------------------------------------------------------------------


def critical_path(graph: nx.DiGraph, cost: dict[str, float] | None = None) -> tuple[list[Task], float]:
    """The longest chain of dependent tasks, by the sum of ``cost[kind]`` (1 per task when a
    kind has no cost). Ties go to the task the compiler inserted first. Returns the path,
    sources first, and its length."""
    index = {t: i for i, t in enumerate(graph.nodes)}
    order = list(nx.lexicographical_topological_sort(graph, key=index.__getitem__))
    best: dict[Task, float] = {}
    via: dict[Task, Task | None] = {}
    weight = (lambda t: cost.get(t.kind, 1.0)) if cost else (lambda t: 1.0)
    for t in order:
        preds = sorted(graph.predecessors(t), key=index.__getitem__)
        p = max(preds, key=lambda q: best[q], default=None)  # max keeps the first of equals
        best[t] = weight(t) + (best[p] if p is not None else 0.0)
        via[t] = p
    if not best:
        return [], 0.0
    end = max(order, key=lambda t: best[t])
    path = [end]
    while (p := via[path[-1]]) is not None:
        path.append(p)
    return path[::-1], best[end]


def mean_durations(traces: Iterable[Trace]) -> dict[str, float]:
    """Mean seconds per task kind over traces: a cost model for :func:`critical_path`."""
    sums: dict[str, list[float]] = {}
    for tr in traces:
        for t in tr.tasks:
            sums.setdefault(t.kind, []).append(t.duration)
    return {k: sum(v) / len(v) for k, v in sums.items()}


def planned_order(graph: nx.DiGraph, policy: str | Policy = "double_buffer") -> tuple[list[Task], dict[str, int]]:
    """The order and slot budgets a policy (a registered name or an object) proposes."""
    proposal = resolve_policy(policy).propose(graph)
    return list(proposal.order), dict(proposal.budgets)


def depths(graph: nx.DiGraph) -> dict[Task, int]:
    """Longest number of edges from a source: the column a task is drawn in."""
    out: dict[Task, int] = {}
    for t in nx.topological_sort(graph):
        out[t] = max((out[p] + 1 for p in graph.predecessors(t)), default=0)
    return out
