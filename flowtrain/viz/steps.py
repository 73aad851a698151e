"""Steps and windows: the numbers of each training step, and of a steady-state window of them.

The first step of a run is not like the others (nothing is prefetched yet, caches are cold, a
compiler may be warming up), so a whole-trace average says little about the steady state. Here
time is cut where compute starts each step: step ``k`` owns the time from its first compute
task to the first compute task of step ``k + 1`` (the first step from the trace's start, the
last to the trace's end), so steps tile the trace, every compute task lies in its own step,
and the next step's prefetch and the previous step's optimizer work, which overlap compute,
are counted where they ran. Every number that adds up over time (busy seconds, overlap, idle
by reason, slot-seconds, tasks, bytes) is kept per step. A window of steps is then a sum of
rows, which is also how the page's brush recomputes its summary::

    rows = step_stats(trace, gaps, uses)          # one StepStats per step, in step order
    win = choose_window(rows, "2:")               # steps 2.. (None: the default window)
    s = window_summary(rows, win, budgets)        # step time, busy %, overlap, idle, slots
    print(win.label, s.step_time, s.busy_fraction["compute"])

Steps are numbered from 1, as training's progress lines and ``checkpoint-N`` number them.
``--steps A:B`` is steps A to B, both included: ``1:5`` is training steps 1 to 5, ``2:`` every
step from 2 on, ``:3`` steps up to 3, ``3`` step 3 alone. By default the first step is left
out, and so is any step at the start that took more than three times the median step
(warm-up); a warm-up step later on is kept but flagged.

**Busy, idle and tail.** Compute's time in a step is cut three ways that add up to the step:
*busy* (its tasks), *idle* (gaps before compute's last task of the trace) and *tail* (after
that last task: the last step's optimizer work, with nothing left to hide it behind). Compute
busy as a fraction is busy over busy + idle, the time compute had work coming, for a step and a
window alike, so a window's figure is its steps' figures weighted by their time and the tail
never drags the last step down.
"""

from __future__ import annotations

import statistics
from bisect import bisect_left
from typing import Sequence

import msgspec

from ..errors import ConfigError
from .analysis import Gap, Overlap, SlotUse, intersect, lane_spans, occupancy, union
from .load import Trace

Span = tuple[float, float]

#: A step that took more than this many times the median step is warm-up.
WARMUP_FACTOR = 3.0


class StepStats(msgspec.Struct, frozen=True, kw_only=True):
    """One step's share of the trace: the time from its first compute task to the next step's,
    and what happened in it (seconds; per lane name or per pool). ``busy["compute"] +
    idle_compute + tail`` is the step's duration."""

    step: int
    start: float
    end: float
    tasks: dict[str, int]  # tasks that started in the step's time, per lane
    busy: dict[str, float]
    bytes: dict[str, int]
    compute_copy: float
    copy: float
    compute_cpu: float
    cpu: float
    idle_compute: float  # compute idle before its last task ends
    tail: float  # the step's time after compute's last task (in the trace): nothing left to compute
    idle_by_reason: dict[str, float]  # marked compute gaps, clipped to the step
    slot_seconds: dict[str, float]  # slots in use integrated over time, per pool
    peak_slots: dict[str, int]
    warmup: bool = False

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def compute_busy(self) -> float:
        """Compute busy over busy + idle (the step's time less its tail): 0.0 .. 1.0."""
        return _fraction(self.busy.get("compute", 0.0), self.duration - self.tail)


class Window(msgspec.Struct, frozen=True):
    """Steps ``first`` to ``last`` (inclusive), covering ``start`` to ``end`` seconds."""

    first: int
    last: int
    start: float
    end: float
    steps: int
    total: int  # steps in the trace
    why: str = ""  # how it was chosen, in words

    @property
    def label(self) -> str:
        which = f"step {self.first}" if self.first == self.last else f"steps {self.first}\u2013{self.last}"
        return f"{which} ({self.steps} of {self.total} steps, {fmt_time(self.end - self.start)})"


class WindowSummary(msgspec.Struct, frozen=True):
    """The summary numbers of a window. ``busy_fraction`` is each lane's busy time over the
    window's duration; ``compute_busy`` is compute's over busy + idle, the basis of the per-step
    figures (:attr:`StepStats.compute_busy`). ``busy["compute"] + idle_compute + tail ==
    duration``."""

    window: Window
    duration: float
    step_time: float  # the window's duration over its steps
    tasks: dict[str, int]
    busy: dict[str, float]
    busy_fraction: dict[str, float]
    bytes: dict[str, int]
    overlap: Overlap
    idle_compute: float
    idle_by_reason: dict[str, float]
    peak_slots: dict[str, int]
    mean_slots: dict[str, float]
    budgets: dict[str, int]
    tail: float = 0.0
    compute_busy: float = 0.0


def _fraction(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0


def fmt_time(seconds: float) -> str:
    """``850 ns``, ``12.3 us``, ``4.56 ms``, ``1.23 s``: three significant digits."""
    a = abs(seconds)
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("\u00b5s", 1e-6)):
        if a >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns"


def fmt_bytes(n: float) -> str:
    """``512 B``, ``1.5 KiB``, ``2.0 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# ---- cutting time where each step's compute starts ------------------------------------------


def step_bounds(trace: Trace) -> list[tuple[int, float, float]]:
    """``(step, start, end)`` per step in step order. A step starts at its first compute task
    (a step without one: its first task), the first step at the trace's start (its first
    fetches come before any compute); each ends where the next starts, the last at the trace's
    end. Starts never go back in time, so the steps tile the trace."""
    first: dict[int, float] = {}
    first_compute: dict[int, float] = {}
    for t in trace.tasks:  # sorted by start: the first seen is the earliest
        first.setdefault(t.step, t.start)
        if t.lane == "compute":
            first_compute.setdefault(t.step, t.start)
    steps = sorted(first)
    starts: list[float] = []
    for n, step in enumerate(steps):
        starts.append(0.0 if n == 0 else max(first_compute.get(step, first[step]), starts[-1]))
    ends = starts[1:] + [max(trace.wall, starts[-1])] if steps else []
    return list(zip(steps, starts, ends))


def split(spans: Sequence[Span], cuts: Sequence[float], weights: Sequence[float] | None = None) -> list[float]:
    """How much of the sorted, disjoint ``spans`` (each times its weight) falls between each
    pair of consecutive ``cuts``: ``len(cuts) - 1`` sums, in one pass over both."""
    out = [0.0] * (len(cuts) - 1)
    for n, (s, e) in enumerate(spans):
        w = 1.0 if weights is None else weights[n]
        i = max(bisect_left(cuts, s) - 1, 0)
        while i < len(out) and cuts[i] < e:
            lo, hi = max(s, cuts[i]), min(e, cuts[i + 1])
            if hi > lo:
                out[i] += (hi - lo) * w
            i += 1
    return out


def _per_step(values: dict[str, list[float]], n: int) -> list[dict[str, float]]:
    return [{k: v[i] for k, v in values.items()} for i in range(n)]


def step_stats(trace: Trace, gaps: Sequence[Gap], uses: Sequence[SlotUse]) -> list[StepStats]:
    """One :class:`StepStats` per step; their sums are the whole trace's numbers."""
    bounds = step_bounds(trace)
    cuts = [bounds[0][1]] + [e for _, _, e in bounds]
    n = len(bounds)
    busy = _per_step({lane: split(union((t.start, t.end) for t in ts), cuts)
                      for lane, ts in trace.by_lane.items()}, n)
    comp, copy, cpu = lane_spans(trace, ["compute"]), lane_spans(trace, ["h2d", "d2h"]), lane_spans(trace, ["cpu"])
    cc, co = split(intersect(comp, copy), cuts), split(copy, cuts)
    cu, cp = split(intersect(comp, cpu), cuts), split(cpu, cuts)
    last_compute = comp[-1][1] if comp else cuts[0]
    tail = split([(last_compute, cuts[-1])], cuts)  # the part of each step after compute's end
    comp_busy = split(comp, cuts)
    reasons: dict[str, list[Span]] = {}
    for g in gaps:
        reasons.setdefault(g.reason, []).append((g.start, g.end))
    idle = _per_step({r: split(union(sp), cuts) for r, sp in reasons.items()}, n)
    area, peak = _slot_numbers(trace, uses, cuts)
    counts: list[dict[str, int]] = [{} for _ in range(n)]
    nbytes: list[dict[str, int]] = [{} for _ in range(n)]
    for t in trace.tasks:
        i = min(max(bisect_left(cuts, t.start, hi=len(cuts) - 1) - 1, 0), n - 1)
        if t.start == cuts[i + 1] and i + 1 < n:
            i += 1  # a task that starts at a step's end belongs to the next step
        counts[i][t.lane_name] = counts[i].get(t.lane_name, 0) + 1
        nbytes[i][t.lane_name] = nbytes[i].get(t.lane_name, 0) + t.bytes
    times = [e - s for _, s, e in bounds]
    median = statistics.median(times)
    return [StepStats(step=step, start=s, end=e, tasks=counts[i], busy=busy[i], bytes=nbytes[i],
                      compute_copy=cc[i], copy=co[i], compute_cpu=cu[i], cpu=cp[i], tail=tail[i],
                      idle_compute=max((e - s) - comp_busy[i] - tail[i], 0.0), idle_by_reason=idle[i],
                      slot_seconds=area[i], peak_slots=peak[i],
                      warmup=i == 0 or times[i] > WARMUP_FACTOR * median)
            for i, (step, s, e) in enumerate(bounds)]


def _slot_numbers(trace: Trace, uses: Sequence[SlotUse], cuts: Sequence[float]):
    n = len(cuts) - 1
    area: list[dict[str, float]] = [{} for _ in range(n)]
    peak: list[dict[str, int]] = [{} for _ in range(n)]
    for pool, points in occupancy(trace, uses).items():
        ends = [t for t, _ in points[1:]] + [max(cuts[-1], points[-1][0])]
        spans = [(t, e) for (t, _), e in zip(points, ends)]
        counts = [c for _, c in points]
        for i, a in enumerate(split(spans, cuts, counts)):
            area[i][pool] = a
        for (s, e), c in zip(spans, counts):  # the highest count in each step it overlaps
            i = max(bisect_left(cuts, s) - 1, 0)
            while i < n and cuts[i] < e:
                if max(s, cuts[i]) < min(e, cuts[i + 1]):
                    peak[i][pool] = max(peak[i].get(pool, 0), c)
                i += 1
    return area, peak


# ---- windows ----------------------------------------------------------------------------------


def parse_steps(text: str) -> tuple[int | None, int | None]:
    """``"A:B"`` (either side may be empty) or ``"A"`` as (first, last), both included."""
    a, colon, b = text.partition(":")
    try:
        first = int(a) if a.strip() else None
        last = (int(b) if b.strip() else None) if colon else first
    except ValueError:
        raise ConfigError(f"--steps {text}: expected A:B, A: or :B with step numbers (e.g. --steps 2:)") from None
    if first is not None and last is not None and last < first:
        raise ConfigError(f"--steps {text}: the window is empty (B must be at least A)")
    return first, last


def default_window(rows: Sequence[StepStats]) -> Window:
    """Every step but the first and any warm-up step right after it; all steps if that
    leaves none."""
    i = 0
    while i < len(rows) and rows[i].warmup:
        i += 1
    if i == len(rows):
        return _window(rows, 0, len(rows), "the whole trace (too few steps to leave out warm-up)")
    dropped = ", ".join(str(r.step) for r in rows[:i])
    return _window(rows, i, len(rows), f"steady state: leaves out warm-up step{'s' if i > 1 else ''} {dropped}")


def choose_window(rows: Sequence[StepStats], steps: str | None = None, source: str | None = None) -> Window:
    """The window ``--steps`` names (see :func:`parse_steps`), or :func:`default_window`.
    ``source`` (the trace's file) is named in the error when the trace has none of the steps."""
    if steps is None:
        return default_window(rows)
    first, last = parse_steps(steps)
    idx = [i for i, r in enumerate(rows) if (first is None or r.step >= first) and (last is None or r.step <= last)]
    if not idx:
        have = f"{rows[0].step}\u2013{rows[-1].step}" if rows else "none"
        where = f"{source}: " if source else ""
        raise ConfigError(f"{where}--steps {steps}: no such steps in the trace (it has steps {have})")
    return _window(rows, idx[0], idx[-1] + 1, f"--steps {steps}")


def _window(rows: Sequence[StepStats], i: int, j: int, why: str) -> Window:
    return Window(rows[i].step, rows[j - 1].step, rows[i].start, rows[j - 1].end, j - i, len(rows), why)


def window_rows(rows: Sequence[StepStats], window: Window) -> list[StepStats]:
    return [r for r in rows if window.first <= r.step <= window.last]


def _add(dicts: Sequence[dict], how=sum) -> dict:
    keys = sorted({k for d in dicts for k in d})
    return {k: how(d.get(k, 0) for d in dicts) for k in keys}


def window_summary(rows: Sequence[StepStats], window: Window, budgets: dict[str, int]) -> WindowSummary:
    """The window's numbers: sums of its steps' rows, fractions of its duration."""
    rs = window_rows(rows, window)
    d = window.end - window.start
    busy = _add([r.busy for r in rs])
    cc, co = sum(r.compute_copy for r in rs), sum(r.copy for r in rs)
    cu, cp = sum(r.compute_cpu for r in rs), sum(r.cpu for r in rs)
    idle = _add([r.idle_by_reason for r in rs])
    tail = sum(r.tail for r in rs)
    return WindowSummary(
        window=window,
        duration=d,
        step_time=d / len(rs),
        tasks=_add([r.tasks for r in rs]),
        busy=busy,
        busy_fraction={k: v / d if d else 0.0 for k, v in busy.items()},
        bytes=_add([r.bytes for r in rs]),
        overlap=Overlap(cc, co, cu, cp, cc / co if co else 0.0, cu / cp if cp else 0.0),
        idle_compute=sum(r.idle_compute for r in rs),
        idle_by_reason=dict(sorted(idle.items(), key=lambda kv: -kv[1])),
        peak_slots=_add([r.peak_slots for r in rs], max),
        mean_slots={k: v / d if d else 0.0 for k, v in _add([r.slot_seconds for r in rs]).items()},
        budgets=budgets,
        tail=tail,
        compute_busy=_fraction(busy.get("compute", 0.0), d - tail),
    )


def brush_scale(rows: Sequence[StepStats]) -> float:
    """The step time the window brush draws at full height: the longest step that is not
    warm-up, so that steady steps of 0.7 and 0.8 s read as different bars rather than flat
    lines under a warm-up step ten times longer (warm-up bars are drawn cut at full height);
    the longest step when every step is warm-up."""
    steady = [r.duration for r in rows if not r.warmup]
    return max(steady or [r.duration for r in rows] or [0.0])


def step_table(rows: Sequence[StepStats]) -> dict[str, tuple[float, float, float]]:
    """(min, median, max) over steps of the step time and of each lane kind's busy fraction
    (compute's as :attr:`StepStats.compute_busy`, the others' of the step's time)."""
    out = {"step time": _mmm([r.duration for r in rows])}
    kinds = sorted({lane.partition(":")[0] for r in rows for lane in r.busy},
                   key=lambda k: ("compute", "h2d", "d2h", "cpu", "io").index(k)
                   if k in ("compute", "h2d", "d2h", "cpu", "io") else 9)
    for kind in kinds:
        fr = [r.compute_busy if kind == "compute" else
              _fraction(max((v for lane, v in r.busy.items() if lane.partition(":")[0] == kind), default=0.0), r.duration)
              for r in rows]
        out[f"{kind} busy"] = _mmm(fr)
    return out


def _mmm(xs: Sequence[float]) -> tuple[float, float, float]:
    return (min(xs), statistics.median(xs), max(xs)) if xs else (0.0, 0.0, 0.0)
