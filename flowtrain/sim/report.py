"""What a simulated run says: step time, throughput, busy lanes and the critical chain.

The numbers are the ones ``flowtrain bench`` measures, computed the same way from simulated
records: the step time is the median time between the ends of consecutive steps, leaving out
the gap after the first step (nothing overlapped its start, which that gap still carries);
tokens/s and model TFLOP/s follow from it, and a lane's busy fraction is its busy time
(:func:`~flowtrain.runtime.trace.lane_busy`) over the steps after the first::

    summary = summarize(steps_records, tokens_per_step, shape.flops_per_token, sim.cause)
    summary.tokens_per_s, summary.busy_fraction["compute"], summary.critical_chain[:3]

The *critical chain* walks back from the last task of the last step: at each task, to what its
start waited for last (the previous task on its lane, a fence, or a dependency's completion),
and groups the walk into runs of one lane and kind. Whatever dominates it is what to speed up.
"""

from __future__ import annotations

import statistics
from typing import Sequence

import msgspec

from ..graph.tasks import Task
from ..runtime.trace import TaskRecord, lane_busy


class Summary(msgspec.Struct, kw_only=True):
    step_seconds: float
    step_ends: list[float]
    tokens_per_s: float
    model_tflops: float
    busy_fraction: dict[str, float]
    #: (lane, kind, tasks, seconds) runs along the chain, last first
    critical_chain: list[tuple[str, str, int, float]]
    #: seconds of the chain per lane (the lanes that set the step time)
    critical_by_lane: dict[str, float]
    #: model FLOPs per trained token (:func:`flowtrain.model.counts.model_flops_per_token`)
    model_flops_per_token: float = 0.0

    def to_dict(self) -> dict:
        return {
            "step_seconds": round(self.step_seconds, 4), "tokens_per_s": round(self.tokens_per_s, 1),
            "model_tflops": round(self.model_tflops, 1), "model_flops_per_token": round(self.model_flops_per_token),
            "busy_fraction": {k: round(v, 4) for k, v in self.busy_fraction.items()},
            "step_ends": [round(t, 4) for t in self.step_ends],
            "critical_by_lane": {k: round(v, 4) for k, v in self.critical_by_lane.items()},
            "critical_chain": [{"lane": lane, "kind": kind, "tasks": n, "seconds": round(s, 5)}
                               for lane, kind, n, s in self.critical_chain],
        }


def summarize(steps: Sequence[Sequence[TaskRecord]], tokens_per_step: int, flops_per_token: float,
              cause: dict[Task, Task | None]) -> Summary:
    """Summarize the per-step records of :meth:`VirtualRun.run_steps`."""
    ends = [max(r.end for r in recs) for recs in steps]
    # the gap after step 0 still carries its start-up (nothing overlapped it): steady gaps only
    diffs = [b - a for a, b in zip(ends, ends[1:])]
    gaps = diffs[1:] or diffs or [ends[0]]
    step_s = statistics.median(gaps)
    window = [r for recs in steps[1:] or steps for r in recs]
    t0, t1 = min(r.start for r in window), max(r.end for r in window)
    busy = {lane: b / (t1 - t0) for lane, b in lane_busy(window).items()} if t1 > t0 else {}
    tok_s = tokens_per_step / step_s
    # from the end of the last step's GPU work: host work that overlaps the next step (the top
    # layers' Adam) ends later but holds nothing up
    device = [r for r in steps[-1] if r.lane == "compute"]
    chain = critical_chain([r for recs in steps for r in recs], cause, since=ends[-2] if len(ends) > 1 else 0.0,
                           last=max(device, key=lambda r: r.end).task if device else None)
    by_lane: dict[str, float] = {}
    for lane, _, _, s in chain:
        by_lane[lane] = by_lane.get(lane, 0.0) + s
    return Summary(step_seconds=step_s, step_ends=ends, tokens_per_s=tok_s, model_tflops=tok_s * flops_per_token / 1e12,
                   busy_fraction=busy, critical_chain=chain, critical_by_lane=by_lane, model_flops_per_token=flops_per_token)


def critical_chain(records: Sequence[TaskRecord], cause: dict[Task, Task | None],
                   since: float = 0.0, last: Task | None = None) -> list[tuple[str, str, int, float]]:
    """Runs of (lane, kind, number of tasks, seconds) on the chain that ends with ``last`` (by
    default the last task to end), walked back until ``since``. Waiting between two links
    counts as ``idle`` on the later one."""
    by_task = {r.task: r for r in records}
    cur: TaskRecord | None = by_task[last] if last is not None else max(records, key=lambda r: r.end)
    runs: list[list] = []
    while cur is not None and cur.end > since:
        start = max(cur.start, since)
        link = (cur.lane, cur.task.kind)
        if runs and runs[-1][0] == link[0] and runs[-1][1] == link[1]:
            runs[-1][2] += 1
            runs[-1][3] += cur.end - start
        else:
            runs.append([link[0], link[1], 1, cur.end - start])
        prev_task = cause.get(cur.task)
        prev = by_task.get(prev_task) if prev_task is not None else None
        if prev is not None and prev.end < cur.start - 1e-9 and prev.end > since:
            runs.append(["wait", "idle", 1, cur.start - max(prev.end, since)])
        cur = prev
    return [(str(lane), str(kind), int(n), float(s)) for lane, kind, n, s in runs]


def format_summary(s: Summary, header: str = "") -> str:
    lines = [header] if header else []
    lines.append(f"predicted: {s.tokens_per_s:,.0f} tokens/s, {s.model_tflops:.1f} model TFLOP/s, "
                 f"{s.step_seconds:.3f} s per step")
    lines.append("busy fraction: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(s.busy_fraction.items())))
    total = sum(s.critical_by_lane.values()) or 1.0
    lines.append("critical chain of the last step, by lane: " + ", ".join(
        f"{k} {v:.3f} s ({v / total:.0%})" for k, v in sorted(s.critical_by_lane.items(), key=lambda kv: -kv[1])))
    kinds: dict[tuple[str, str], list] = {}
    for lane, kind, n, sec in s.critical_chain:
        k = kinds.setdefault((lane, kind), [0, 0.0])
        k[0] += n
        k[1] += sec
    top = sorted(kinds.items(), key=lambda kv: -kv[1][1])[:6]
    lines.append("on it, by kind: " + "; ".join(f"{kind} ({lane}) x{n} {sec * 1e3:.1f} ms"
                                               for (lane, kind), (n, sec) in top))
    return "\n".join(lines)
