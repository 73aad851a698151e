"""Tasks the schedule does not explain: ones that started late, and ones that ran long.

A task can start once everything it waits for has finished (:func:`~flowtrain.viz.analysis.blockers`
names the last of its dependency, its slot and its lane). The schedule explains the wait up
to that moment; whatever comes after it does not. Two things show up that way, and both are
invisible in busy fractions:

- a **late start**: a task that began more than ``late`` seconds after everything it waited
  for had finished. On a CPU lane that is the executor not dispatching ready work (the event
  loop busy with something else, the thread pool starved); on a copy or compute lane it is the
  host enqueuing late. Device lanes hide a short stall, since the work queued ahead keeps them
  busy; the CPU lane shows it at once.
- a **long task**: one that took more than ``factor`` times the median of its kind on its lane
  in the same window, and at least ``late`` seconds more. On the compute lane that is, for
  instance, a GPU allocator at its cap retrying inside a forward; on a copy lane, a link shared
  with something the trace does not show.

Both are counted in a window of steps (by default the steady state, as every other summary)::

    late = late_starts(trace, waits, window)      # [Late(task=12, ready=0.40, delay=0.093, ...)]
    slow = long_tasks(trace, window)              # [Long(task=31, median=0.0062)]
    for line in outlier_lines(trace, late, slow):
        print(line)

Everything is plain arithmetic on the trace; nothing here knows what caused a delay, only where
it was and how long.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Sequence

import msgspec

from .analysis import Wait
from .load import Trace, TraceTask
from .steps import Window

#: A task starting later than this after everything it waited for counts as late (seconds);
#: the executor dispatches ready work within about a millisecond on a loaded machine.
LATE = 5e-3

#: A task taking this many times its kind's median (and :data:`LATE` more) counts as long.
FACTOR = 3.0

#: Fewer tasks of a kind than this on a lane in the window give no median worth comparing to.
MIN_SAMPLES = 4


class Late(msgspec.Struct, frozen=True):
    """Task ``task`` could start at ``ready`` (when ``waited``, a :class:`Wait`, finished) and
    started ``delay`` seconds later."""

    task: int
    ready: float
    delay: float
    waited: Wait


class Long(msgspec.Struct, frozen=True):
    """Task ``task`` ran more than ``factor`` times ``median``, the median duration of its
    kind on its lane in the window (seconds)."""

    task: int
    median: float
    factor: float = FACTOR


def _in_window(t: TraceTask, window: Window | None) -> bool:
    return window is None or window.start <= t.start < window.end


def ready_wait(trace: Trace, waits: Sequence[Wait | None], i: int) -> Wait | None:
    """What task ``i`` last waited for, whose end is when it could have started; None where
    that moment is unknown. Only tasks whose dependencies the trace records have one: for a
    task without any (a trace that leaves ``deps`` out, a task the graph starts from), the end
    of the task before it on its lane is no sign that it could have started then."""
    return waits[i] if trace.dep_indices[i] else None


def late_starts(trace: Trace, waits: Sequence[Wait | None], window: Window | None = None,
                late: float = LATE) -> list[Late]:
    """Tasks of the window that started more than ``late`` seconds after the last thing they
    waited for finished (:func:`ready_wait`), in start order."""
    out: list[Late] = []
    for t in trace.tasks:
        w = ready_wait(trace, waits, t.index)
        if w is None or not _in_window(t, window):
            continue
        delay = t.start - w.end
        if delay > late:
            out.append(Late(t.index, w.end, delay, w))
    return out


def long_tasks(trace: Trace, window: Window | None = None, factor: float = FACTOR,
               late: float = LATE) -> list[Long]:
    """Tasks of the window that took more than ``factor`` times the median of their kind on
    their lane kind in the window, and more than ``late`` seconds beyond it; in start order."""
    groups: dict[tuple[str, str], list[TraceTask]] = defaultdict(list)
    for t in trace.tasks:
        if _in_window(t, window):
            groups[(t.kind, t.lane)].append(t)
    out: list[Long] = []
    for tasks in groups.values():
        if len(tasks) < MIN_SAMPLES:
            continue
        median = statistics.median(t.duration for t in tasks)
        out.extend(Long(t.index, median, factor) for t in tasks
                   if t.duration > factor * median and t.duration - median > late)
    return sorted(out, key=lambda x: trace.tasks[x.task].start)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _span(values: Sequence[float]) -> str:
    lo, hi = min(values), max(values)
    return _ms(lo) if f"{lo * 1e3:.1f}" == f"{hi * 1e3:.1f}" else f"{lo * 1e3:.1f}-{hi * 1e3:.1f} ms"


def _names(trace: Trace, indices: Sequence[int], value, most: int) -> str:
    """The first ``most`` tasks by name with their value, then how many more."""
    shown = ", ".join(f"{trace.tasks[i].name} {_ms(value(i))}" for i in indices[:most])
    return shown + (f" and {len(indices) - most} more" if len(indices) > most else "")


def _steps(trace: Trace, indices: Sequence[int], window: Window | None) -> str:
    steps = sorted({trace.tasks[i].step for i in indices})
    if window is not None and len(steps) == window.steps and window.steps > 1:
        return "in every step"
    return ("in step " if len(steps) == 1 else "in steps ") + ", ".join(map(str, steps))


def outlier_lines(trace: Trace, late: Sequence[Late], slow: Sequence[Long], window: Window | None = None,
                  most: int = 3) -> list[str]:
    """What :func:`late_starts` and :func:`long_tasks` found, in a few lines of words: per lane
    kind the late starts (how many, how late, which), then per kind the long tasks, the worst
    first in each. Empty when the window has neither."""
    lines = []
    by_lane: dict[str, list[Late]] = defaultdict(list)
    for x in late:
        by_lane[trace.tasks[x.task].lane].append(x)
    for lane, xs in sorted(by_lane.items(), key=lambda kv: -max(x.delay for x in kv[1])):  # worst first
        delay = {x.task: x.delay for x in xs}
        worst = sorted(delay, key=lambda i: -delay[i])
        lines.append(f"late starts on {lane}: {len(xs)} task{'s' if len(xs) != 1 else ''} began "
                     f"{_span(list(delay.values()))} after all they waited for had finished, "
                     f"{_steps(trace, worst, window)} ({_names(trace, worst, delay.__getitem__, most)})")
    by_kind: dict[tuple[str, str], list[Long]] = defaultdict(list)
    for y in slow:
        t = trace.tasks[y.task]
        by_kind[(t.kind, t.lane)].append(y)
    excess = {key: max(trace.tasks[y.task].duration - y.median for y in ys) for key, ys in by_kind.items()}
    for (kind, lane), ys in sorted(by_kind.items(), key=lambda kv: -excess[kv[0]]):  # worst first
        worst = sorted((y.task for y in ys), key=lambda i: -trace.tasks[i].duration)
        lines.append(f"long {kind} tasks on {lane}: {len(ys)} took over {ys[0].factor:g}x their median of "
                     f"{_ms(ys[0].median)}, {_steps(trace, worst, window)} "
                     f"({_names(trace, worst, lambda i: trace.tasks[i].duration, most)})")
    return lines
