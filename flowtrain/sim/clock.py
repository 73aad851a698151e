"""The virtual-clock simulator: the real scheduler, fed by a clock instead of lanes.

The engine (:mod:`flowtrain.runtime.engine`) is a shell around the pure
:class:`~flowtrain.runtime.scheduler.Scheduler`: it launches what ``poll()`` returns on lanes and
reports completions back. This module is a second shell around the *same* scheduler, the same
compiled graphs and the same policy object, whose lanes do no work: each task takes the time the
cost model says, on a clock that jumps from one event to the next::

    sim = VirtualRun(costs, policy, cpu_workers=1)
    records = sim.run_steps(spec, steps=4)     # TaskRecords, as the engine's, in virtual seconds

The lanes keep the engine's rules, so the order and slots are the engine's:

- a device lane (``h2d``, ``compute``, ``d2h``) runs one task at a time in the order it was
  launched, each after the *fences* of its launch (``Launch.waits``) have ended, like a stream;
- the ``cpu`` pool takes launched tasks in order onto ``cpu_workers`` workers; ``io`` has one;
- a task whose completion the host needs (``Scheduler.needs_completion``) is reported back
  ``sync_us`` after it ends, and only then may its host-side successors be launched;
- steps are added as the trainer adds them, through the same
  :class:`~flowtrain.graph.stream.StepStream`: two in flight, step ``s + 2`` once step ``s`` has
  finished, linked by :func:`~flowtrain.graph.compiler.cross_step_edges`.

Phases of one event: (1) *pump*: ``poll()`` the scheduler, queue its launches on their lanes;
(2) *dispatch*: start every lane head whose lane is free and whose fences have ended; (3)
*advance*: jump to the next end (or completion report) and handle it.

Each record also notes what its start waited for last (:attr:`VirtualRun.cause`), from which
:func:`flowtrain.sim.report.critical_chain` walks back from the step's end.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import networkx as nx

from ..graph.compiler import StepSpec, compile_step
from ..graph.stream import OpenStep, StepStream
from ..graph.tasks import LANES, Task
from ..policy import resolve_policy
from ..runtime.scheduler import Launch, Scheduler
from ..runtime.trace import TaskRecord

_END, _REPORT, _ADD = 0, 1, 2


class _Lane:
    __slots__ = ("name", "queue", "free_at", "running", "workers", "last")

    def __init__(self, name: str, workers: int) -> None:
        self.name = name
        self.queue: deque[Launch] = deque()
        self.workers = workers
        self.running: list[Task | None] = [None] * workers
        self.free_at = [0.0] * workers
        self.last: list[Task | None] = [None] * workers  # previous task on each worker


class _Copy:
    """A copy in flight on the shared link: the fraction of it still to move, the seconds it
    takes whole while the other direction is idle (``alone``) and while it copies too
    (``shared``), when its progress was last brought up to date, and the token of its
    scheduled end (an end scheduled before its rate last changed is stale)."""

    __slots__ = ("worker", "alone", "shared", "left", "since", "seconds", "token")

    def __init__(self, worker: int, alone: float, shared: float, now: float) -> None:
        self.worker, self.alone, self.shared = worker, alone, shared
        self.left, self.since, self.seconds, self.token = 1.0, now, alone, 0

    def advance(self, now: float) -> None:
        """Bring the fraction left up to ``now`` at the rate it has run at since."""
        if self.seconds > 0:
            self.left = max(0.0, self.left - (now - self.since) / self.seconds)
        self.since = now


class VirtualRun:
    """One simulated engine: a :class:`Scheduler`, virtual lanes and a clock.

    ``costs`` may be a :class:`~flowtrain.sim.costs.CostModel` (its ``seconds``/``copy_seconds``
    are used) or any callable ``task -> seconds`` (tests give exact durations).

    The two copy directions share the link (:class:`_Copy`): a copy runs at its own direction's
    rate while the other direction is idle and at its duplex share while both copy, switching
    each time a copy in the other direction starts or ends, so a gradient offload that a fetch
    overlaps for a tenth of its time is slowed for that tenth only.
    """

    def __init__(self, costs: Any, policy: Any = "double_buffer", *, cpu_workers: int = 1,
                 sync_us: float | None = None) -> None:
        self.policy = resolve_policy(policy)
        if callable(costs) and not hasattr(costs, "seconds"):
            self._seconds: Callable[[Task], float] = costs
            self._copy = None
        else:
            self._seconds, self._copy = costs.seconds, costs.copy_seconds
        self._bytes = getattr(costs, "copy_bytes", lambda t: 0)
        self.sync = (sync_us if sync_us is not None else getattr(getattr(costs, "m", None), "sync_us", 0.0)) * 1e-6
        self.lanes = {lane: _Lane(lane, cpu_workers if lane == "cpu" else 1) for lane in LANES}
        self.scheduler: Scheduler | None = None
        self.budgets: dict[str, int] | None = None
        self.now = 0.0
        self.end: dict[Task, float] = {}
        self.records: dict[Task, TaskRecord] = {}
        self.cause: dict[Task, Task | None] = {}  # what a task's start waited for last
        self.preds: dict[Task, list[Task]] = {}
        self.launch_time: dict[Task, float] = {}
        self.reported: dict[Task, float] = {}
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self._copies: dict[Task, _Copy] = {}  # copies in flight, at most one a direction

    # ---- adding work ------------------------------------------------------------------------
    def add(self, graph: nx.DiGraph, after: Iterable[tuple[Task, Task]] = ()) -> None:
        """Add a graph under the policy's proposal, as :meth:`Engine.add` does."""
        proposal = self.policy.propose(graph)
        if self.scheduler is None:
            self.scheduler = Scheduler(dict(proposal.budgets), workers={"cpu": self.lanes["cpu"].workers})
            self.budgets = dict(proposal.budgets)
        self.scheduler.add(proposal.order, graph, after, urgency=proposal.urgency)
        for t in graph:
            self.preds[t] = list(graph.predecessors(t))
        for u, v in after:
            self.preds[v].append(u)

    # ---- running ----------------------------------------------------------------------------
    def run(self, graph: nx.DiGraph) -> list[TaskRecord]:
        """Simulate one graph to its end; its records in start order."""
        self.add(graph)
        self._loop()
        return sorted((self.records[t] for t in graph), key=lambda r: (r.start, r.end))

    def run_steps(self, spec: StepSpec, steps: int = 4, in_flight: int = 2,
                  build: Callable[[StepSpec, int], nx.DiGraph] | None = None) -> list[list[TaskRecord]]:
        """Simulate ``steps`` training steps as the trainer runs them (``in_flight`` at once,
        through the same :class:`~flowtrain.graph.stream.StepStream`); the records of each step."""
        build = build or (lambda sp, s: compile_step(sp, step=s))
        stream = StepStream(spec, in_flight)
        graphs: list[nx.DiGraph] = []
        waiting: dict[int, set[Task]] = {}
        step_of: dict[Task, int] = {}

        def finish(done: OpenStep) -> None:
            self._loop(until=lambda: not waiting[done.step], on_end=lambda t: waiting[step_of[t]].discard(t))

        for s in range(steps):
            g = build(spec, s)
            if s >= in_flight:
                self.now += self.sync  # the trainer's host turn between steps
            graphs.append(g)
            waiting[s] = set(g.nodes)
            step_of.update((t, s) for t in g)
            self.add(g, stream.push(s, g))
            for done in stream.due():
                finish(done)
        for done in stream.drain():
            finish(done)
        return [sorted((self.records[t] for t in g), key=lambda r: (r.start, r.end)) for g in graphs]

    def _loop(self, until: Callable[[], bool] | None = None, on_end: Callable[[Task], None] | None = None) -> None:
        sched = self.scheduler
        assert sched is not None
        while True:
            for launch in sched.poll():
                self.lanes[launch.task.lane].queue.append(launch)
                self.launch_time[launch.task] = self.now
            self._dispatch()
            if until is not None and until():
                return
            self._drop_stale_ends()
            if not self._events:
                if until is None:
                    return
                raise AssertionError("the simulation ran dry before the step finished")  # a scheduler bug
            t, _, kind, item = heapq.heappop(self._events)
            self.now = max(self.now, t)
            if kind == _END:
                task, worker = item[0], item[1]
                if self._copies.pop(task, None) is not None:
                    self._reshare()
                lane = self.lanes[task.lane]
                lane.running[worker] = None
                lane.free_at[worker] = self.now
                self.end[task] = self.now
                self.records[task].end = self.now
                if on_end is not None:
                    on_end(task)
                if sched.needs_completion(task):
                    self._push(self.now + self.sync, _REPORT, task)
            elif kind == _REPORT:
                self.reported[item] = self.now
                sched.complete(item)

    def _drop_stale_ends(self) -> None:
        """Drop the copies' ends at the head of the queue that were scheduled before their rate
        last changed (:meth:`_reshare` scheduled another)."""
        while self._events:
            _, _, kind, item = self._events[0]
            if kind != _END or not item[2]:
                return
            c = self._copies.get(item[0])
            if c is not None and c.token == item[2]:
                return
            heapq.heappop(self._events)

    def _push(self, t: float, kind: int, item: Any) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, item))

    def _dispatch(self) -> None:
        for lane in self.lanes.values():
            while lane.queue:
                launch = lane.queue[0]
                if any(w not in self.end for w in launch.waits):
                    break  # a fence not yet ended: a stream (or a worker thread) waits here
                worker = next((i for i, r in enumerate(lane.running) if r is None), None)
                if worker is None:
                    break
                lane.queue.popleft()
                self._start(lane, worker, launch)

    def _reshare(self) -> None:
        """Set every copy in flight to the rate the link gives it now (its duplex share while
        the other direction copies too) and move its end to match."""
        lanes = {t.lane for t in self._copies}
        for task, c in self._copies.items():
            c.advance(self.now)
            seconds = c.shared if len(lanes) > 1 else c.alone
            if seconds == c.seconds and c.token:
                continue
            c.seconds, c.token = seconds, c.token + 1
            end = self.now + c.left * seconds
            self.records[task].end = end
            self._push(end, _END, (task, c.worker, c.token))

    def _start(self, lane: _Lane, worker: int, launch: Launch) -> None:
        task = launch.task
        copy = self._copy is not None and task.lane in ("h2d", "d2h")
        dur = self._copy(task, False) if copy else self._seconds(task)  # type: ignore[misc]
        lane.running[worker] = task
        # What this start waited for last: the lane (its previous task), a fence, or (host
        # work) the completion report of a dependency, or the launch itself.
        candidates: list[tuple[float, Task | None]] = [(self.end[w], w) for w in launch.waits]
        if lane.last[worker] is not None:
            candidates.append((lane.free_at[worker], lane.last[worker]))
        candidates += [(self.reported.get(p, self.end.get(p, 0.0)), p) for p in self.preds.get(task, ())]
        self.cause[task] = max(candidates, key=lambda c: c[0])[1] if candidates else None
        lane.last[worker] = task
        self.records[task] = TaskRecord(task=task, lane=task.lane, worker=worker, start=self.now, end=self.now + dur,
                                        slot=launch.slot, reads=launch.reads, bytes=int(self._bytes(task)),
                                        deps=list(self.preds.get(task, ())))
        if copy:  # its end is scheduled by the link's share
            assert self._copy is not None
            self._copies[task] = _Copy(worker, dur, self._copy(task, True), self.now)
            self._reshare()
        else:
            self._push(self.now + dur, _END, (task, worker, 0))
