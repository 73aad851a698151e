"""What bounds a stall: a verdict for each compute gap, and for each gap pattern.

"forward waited for fetch" does not say whether the copy engine was saturated or sat idle
because the weights pool was full. Each gap gets one of five verdicts, tried in the order below, decided on the chain of
waits that explains it (:func:`flowtrain.viz.analysis.compute_gaps`) and on the lanes during
the gap::

    v = gap_verdicts(trace, gaps, waits, budgets, mem)   # one GapVerdict per gap
    v[0].key, v[0].text                                   # "budget-bound weights", "budget-bound: ..."

- **budget-bound**: a task of the chain waited for a slot, or the copy compute waited on had
  itself waited for one (its lane idle while the pool was full, perhaps before the gap began).
  Names the pool and what one more slot would cost, from the slot size the trace records (the
  plan's) or else the most bytes one of its copies moved.
- **CPU-bound**: the chain, or the copy compute waited on, waits on work on a CPU lane (the
  Adam lane's ``cpu_adam``).
- **copy-bound**: the copy compute waited on ran on a copy lane (``h2d``, ``d2h``) busy back to
  back: it started as the copy before it ended, or the lane was busy at least
  :data:`SATURATED` of the gap. More slots would not help; fewer or faster copies would.
- **dependency**: compute waited for a task that none of the above held back: work had to
  finish first.
- **launch overhead**: nothing held the task back (the gap's reason ``host``).

A pattern's verdict is the one with the most idle time among its gaps in the window.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from typing import Sequence

import msgspec

from .analysis import Gap, Span, Wait, a_slot, lane_spans
from .load import Trace
from .memory import Memory

#: A copy lane busy at least this much of a gap was copying back to back.
SATURATED = 0.9

COPY_LANES = ("h2d", "d2h")


class GapVerdict(msgspec.Struct, frozen=True):
    """``key`` is what gaps are grouped by (``copy-bound h2d``, ``budget-bound weights``,
    ``CPU-bound``, ``dependency``, ``launch overhead``); ``text`` says it in words; for a
    copy-bound gap ``lane`` is the copy lane and ``lane_busy`` its busy seconds inside the gap."""

    key: str
    text: str
    lane: str | None = None
    lane_busy: float = 0.0


def _busy_in(spans: Sequence[Span], starts: Sequence[float], s: float, e: float) -> float:
    """Seconds of the sorted, disjoint ``spans`` between ``s`` and ``e``."""
    i = max(bisect_right(starts, s) - 1, 0)
    total = 0.0
    while i < len(spans) and spans[i][0] < e:
        total += max(0.0, min(e, spans[i][1]) - max(s, spans[i][0]))
        i += 1
    return total


def _links(gap: Gap, waits: Sequence[Wait | None]) -> list[Wait]:
    """The waits of the gap's chain, in order: what ended the gap waited for chain[0], which
    waited for chain[1], ..."""
    out: list[Wait] = []
    for prev in (gap.after, *gap.chain[:-1]):
        w = waits[prev]
        if w is None:
            break
        out.append(w)
    return out


def slot_cost(pool: str, budgets: dict[str, int], mem: Memory, recorded: dict) -> str:
    """What one more slot of ``pool`` costs, in words: ``one more weights slot costs 1.16 GiB
    on the GPU (the plan's slot size)``."""
    size = mem.slot_bytes.get(pool)
    if not size:
        return f"the trace records no slot size for {pool}"
    where = "in pinned host memory" if mem.place.get(pool) == "pinned" else "on the GPU"
    source = "the plan's slot size" if pool in recorded else "the most one of its copies moved"
    return f"one more {pool} slot costs {size / 2**30:.2f} GiB {where} ({source})"


def gap_verdicts(trace: Trace, gaps: Sequence[Gap], waits: Sequence[Wait | None], budgets: dict[str, int],
                 mem: Memory) -> list[GapVerdict]:
    """One :class:`GapVerdict` per gap (see the module's rules)."""
    spans = {lane: lane_spans(trace, [lane]) for lane in COPY_LANES}
    starts = {lane: [s for s, _ in sp] for lane, sp in spans.items()}
    given = trace.meta.get("slot_bytes")
    recorded: dict = given if isinstance(given, dict) else {}
    out = []
    for g in gaps:
        links = _links(g, waits)
        tasks = [trace.tasks[w.task] for w in links]
        c = next((t for t in tasks if t.lane in COPY_LANES), None)  # the copy compute waited on
        copy = c.lane if c is not None else None
        busy = _busy_in(spans[copy], starts[copy], g.start, g.end) if copy else 0.0
        # what held the copy back, even before the gap (a copy already running when compute went
        # idle ends the chain): another copy (back to back), a slot, or work it depends on
        held = waits[c.index] if c is not None else None
        slot = next((w for w in links if w.cause == "slot"), None)
        waiter = None
        if slot is not None:
            i = links.index(slot)
            waiter = trace.tasks[g.after] if i == 0 else tasks[i - 1]
        elif held is not None and held.cause == "slot":
            slot, waiter = held, c
        cpu = next((t for t in tasks if t.lane == "cpu"), None)
        if cpu is None and held is not None and held.cause == "dep" and trace.tasks[held.task].lane == "cpu":
            cpu = trace.tasks[held.task]
        saturated = copy is not None and g.duration > 0 and busy >= SATURATED * g.duration
        if g.reason == "host" or not links:
            v = GapVerdict("launch overhead", "launch overhead: nothing held the task back")
        elif slot is not None and slot.pool is not None and waiter is not None:
            what = f"{waiter.lane_name} sat idle" if waiter.lane in COPY_LANES else f"{waiter.kind} waited"
            v = GapVerdict(f"budget-bound {slot.pool}",
                           f"budget-bound: the {slot.pool} pool was full (budget {budgets.get(slot.pool, '?')}) while "
                           f"{what} for {a_slot(slot.pool)}; {slot_cost(slot.pool, budgets, mem, recorded)}")
        elif cpu is not None:
            v = GapVerdict("CPU-bound", f"CPU-bound: the chain waits on {cpu.kind} on the CPU lanes")
        elif copy is not None and (saturated or (held is not None and held.cause == "lane")):
            v = GapVerdict(f"copy-bound {copy}", f"copy-bound: {copy} copied back to back; more slots would not help, "
                           "fewer or faster copies would", copy, busy)
        else:
            v = GapVerdict("dependency", f"dependency: compute waited for {tasks[0].kind} to finish; no copy lane was "
                           "saturated, no pool full and no CPU work in the way")
        out.append(v)
    return out


def pattern_verdicts(gaps: Sequence[Gap], verdicts: Sequence[GapVerdict], start: float, end: float) -> dict[str, str]:
    """Per gap pattern, the verdict of most idle time between ``start`` and ``end``, with the
    copy lane's busy share of those gaps where it looked at one."""
    time: dict[str, dict[str, float]] = {}
    busy: dict[tuple[str, str], list[float]] = {}
    text: dict[str, GapVerdict] = {}
    for g, v in zip(gaps, verdicts):
        d = min(g.end, end) - max(g.start, start)
        if d <= 0:
            continue
        per = time.setdefault(g.pattern, {})
        per[v.key] = per.get(v.key, 0.0) + d
        b = busy.setdefault((g.pattern, v.key), [0.0, 0.0])
        b[0], b[1] = b[0] + v.lane_busy, b[1] + g.duration
        text.setdefault(v.key, v)
    out = {}
    for pattern, per in time.items():
        key = max(per, key=lambda k: (per[k], k))
        out[pattern] = verdict_text(text[key], *busy[(pattern, key)])
    return out


def verdict_text(v: GapVerdict, lane_busy: float, gap_time: float) -> str:
    """The verdict's words, with its copy lane's busy share of the gaps (as the page says it)."""
    if v.lane is None or gap_time <= 0:
        return v.text
    return f"{v.text} ({v.lane} busy {math.floor(100 * lane_busy / gap_time + 0.5)}% of these gaps)"  # as JS rounds
