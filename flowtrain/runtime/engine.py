"""The engine: the asyncio shell around the pure :class:`Scheduler`, which runs task graphs.

It turns the scheduler's launch instructions into lane jobs and lane completions back into
scheduler events. Nothing here decides *what* runs next. Usage::

    engine = Engine(program, "double_buffer", device="cpu")
    async with engine:
        records = await engine.run(graph)          # one step

    # or overlap steps: add the next step before waiting for this one
    async with engine:
        engine.add(step0)
        engine.add(step1, after=step0_adam_edges)
        await engine.wait(step0)

A *program* is any callable ``program(task, ctx) -> bytes moved | None`` that does the work of
one task (see :class:`TaskContext`); on CUDA it runs on the lane's launcher thread inside the task's
stream and only enqueues kernels; without CUDA it runs in the lane's worker thread.

Stopping. The engine *stops* when a task fails (:class:`~flowtrain.errors.StepFailed` naming
it), when :meth:`Engine.cancel` is called, when the ``async with`` block is left with an
exception (a ``CancelledError`` from Ctrl-C included), or when it is left at all. From that
moment, in this order:

1. no task is launched any more (completions still arriving are ignored);
2. every lane is aborted: jobs that have not started are skipped, their fences set and failed;
3. the engine waits for the jobs still running, at most ``grace`` seconds after the stop,
   without blocking the event loop: fences wake the loop through done callbacks, so no thread
   of asyncio's default executor is ever parked on a job that may never finish;
4. the lanes' daemon threads are joined within what is left of the grace period. Jobs still
   running then are *abandoned*: listed in :attr:`Engine.stuck` (host state they touch may be
   half-updated) and their fences set as failed, so that every fence ever made ends up set.

A watchdog (``task_timeout``) fails the engine with ``StepFailed(task, TimeoutError(...))`` when
one job has run longer than that, and the engine then stops as above. It ticks at most once a
second; a tick that comes late by more than its period finds a process that did not run (stopped
by SIGSTOP or a suspended machine): that time is no job's, and running jobs are credited with it. What a caller sees::

    engine = Engine(program, policy, grace=5.0, task_timeout=600.0)
    try:
        async with engine:                   # Ctrl-C under asyncio.run cancels the task
            engine.add(step)                 # awaiting here: CancelledError leaves the block,
            await engine.wait(step)          # which cancels the engine (or call engine.cancel())
    finally:
        if engine.stuck:                     # still running after the grace period
            print(f"task {engine.stuck[0]} was still running; host state may be half-updated")
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from typing import Any, Callable, Iterable, Sequence, TypeVarTuple, Unpack

import networkx as nx

from ..errors import ConfigError, ScheduleError, StepFailed
from ..graph.tasks import DEVICE_LANES, LANES, Task
from ..policy import Policy, resolve_policy
from .lanes import CudaLane, Fence, ThreadLane, _Clock
from .scheduler import Launch, Scheduler
from .trace import Instrument, TaskRecord

_JOIN_MIN_S = 0.1  # lanes that are done but for their threads' exit get at least this long
_Ts = TypeVarTuple("_Ts")


class TaskContext:
    """What a program gets for one task: the slot it took and the slots it reads."""

    __slots__ = ("task", "slot", "reads", "lane")

    def __init__(self, launch: Launch, lane: Any) -> None:
        self.task = launch.task
        self.slot = launch.slot
        self.reads = launch.reads
        self.lane = lane

    def read(self, pool: str) -> int:
        """The one slot of ``pool`` this task reads."""
        slots = self.reads.get(pool, [])
        if len(slots) != 1:
            raise ScheduleError(f"{self.task} reads {len(slots)} slots of {pool!r}, expected one")
        return slots[0]


Program = Callable[[Task, TaskContext], "int | None"]


def use_uvloop() -> None:
    """Install uvloop's event loop policy where uvloop is importable (a no-op otherwise)."""
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


class _Countdown:
    """Calls ``wake()`` once, from whichever thread sets the last of ``fences``: one loop
    wake-up per waited step rather than one per task. ``done`` may be read from any thread."""

    __slots__ = ("_lock", "_left", "_wake", "done")

    def __init__(self, fences: Sequence[Fence], wake: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self._left = len(fences)
        self._wake = wake
        self.done = not fences
        for f in fences:
            f.add_done_callback(self._one)

    def _one(self, fence: Fence) -> None:
        with self._lock:
            self._left -= 1
            if self._left:
                return
        self.done = True
        self._wake()


class Engine:
    """Runs task graphs on lanes under a policy; see the module docstring.

    ``grace``: seconds that running jobs get to finish once the engine stops (default 5).
    ``task_timeout``: fail the run when a job has been running longer than this (``None``:
    never). After the ``async with`` block, :attr:`stuck` lists the tasks that were still
    running when the grace period ended (empty if everything finished or was skipped).
    """

    def __init__(
        self,
        program: Program,
        policy: "str | Policy" = "double_buffer",
        *,
        device: str = "cpu",
        cpu_workers: int = 1,
        instruments: Sequence[Instrument] = (),
        grace: float = 5.0,
        task_timeout: float | None = None,
    ) -> None:
        if not grace >= 0:
            raise ConfigError(f"the engine's grace period must be >= 0 seconds (got {grace})")
        if task_timeout is not None and not task_timeout > 0:
            raise ConfigError(f"task_timeout must be > 0 seconds or None (got {task_timeout})")
        self.program = program
        self.policy = resolve_policy(policy)
        self.device = device
        self.cpu_workers = cpu_workers
        self.instruments = list(instruments)
        self.grace = grace
        self.task_timeout = task_timeout
        self.stuck: list[Task] = []
        self.scheduler: Scheduler | None = None
        self.budgets: dict[str, int] | None = None
        self._fences: dict[Task, Fence] = {}
        self._launches: dict[Task, Launch] = {}
        self._graph_preds: dict[Task, list[Task]] = {}
        self._error: BaseException | None = None
        self._stopped = False  # failing, cancelled or closing: nothing is launched any more
        self._deadline = 0.0  # monotonic time at which the grace period ends (once stopped)
        self._attached = False  # lane threads may call into the loop (cleared at close)
        self._lanes: dict[str, ThreadLane[Task] | CudaLane[Task]] = {}
        self._lane_list: tuple[ThreadLane[Task] | CudaLane[Task], ...] = ()  # the same, for lane threads (never mutated)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._watchdog_due = (0.0, 0.0)  # when the next tick is due, and its period

    # ---- lifecycle ----------------------------------------------------------------------
    async def __aenter__(self) -> "Engine":
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._attached = True  # before any lane thread starts: a lane may fail at once
        try:
            self._open_lanes(_Clock())
        except BaseException:
            self._lane_list = tuple(self._lanes.values())  # those made before the failure
            self._abort_lanes()
            self._close(_JOIN_MIN_S)
            raise
        self._lane_list = tuple(self._lanes.values())
        self._arm_watchdog()
        return self

    # ---- what exists only while a run is open (made by start) ----------------------------
    @property
    def _running_scheduler(self) -> Scheduler:
        assert self.scheduler is not None, "no run is open: the engine's scheduler is made by run()"
        return self.scheduler

    @property
    def _event(self) -> asyncio.Event:
        assert self._wake is not None, "no run is open: the engine's wake-up event is made by start()"
        return self._wake

    @property
    def _event_loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "no run is open: the engine's event loop is taken by start()"
        return self._loop

    def _open_lanes(self, clock: _Clock) -> None:
        done, err = self._done_threadsafe, self._error_threadsafe
        if self.device.startswith("cuda"):
            import torch

            clock.cuda_base = torch.cuda.Event(enable_timing=True)
            clock.cuda_base.record()
            clock.cuda_base.synchronize()
            clock.zero = time.perf_counter()
            for lane in DEVICE_LANES:
                self._lanes[lane] = CudaLane(lane, clock, done, err, torch.device(self.device))
        else:
            for lane in DEVICE_LANES:
                self._lanes[lane] = ThreadLane(lane, clock, done, err)
        for lane in LANES:  # host lanes: the CPU pool, and one thread for each other (e.g. io)
            if lane not in DEVICE_LANES:
                workers = self.cpu_workers if lane == "cpu" else 1
                self._lanes[lane] = ThreadLane(lane, clock, done, err, workers=workers)

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            self.cancel()
        else:
            self._stop()
        try:
            await self._settle()
        except BaseException:
            self._close(0.0)  # interrupted again: do not wait any more
            raise
        self._close(max(self._deadline - time.monotonic(), _JOIN_MIN_S))

    def cancel(self, msg: str = "the engine was cancelled") -> None:
        """Stop: launch nothing more, skip every job that has not started, and make waits raise
        ``asyncio.CancelledError(msg)`` (unless a task failed first: then its StepFailed).
        Idempotent. Call it from the loop's thread (e.g. a ``loop.add_signal_handler`` callback);
        from another thread, use ``loop.call_soon_threadsafe(engine.cancel)``. Leaving the
        ``async with`` block then waits at most ``grace`` seconds for jobs still running."""
        if self._error is None:
            self._error = asyncio.CancelledError(msg)
        self._stop()

    async def drain(self) -> None:
        """Cancel (if nothing failed yet) and wait, at most until the grace period ends, until
        no job runs. For callers that want the lanes quiet before they handle an error."""
        self.cancel()
        await self._settle()

    def _stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._deadline = time.monotonic() + self.grace
        self._abort_lanes()
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._wake is not None:
            self._wake.set()

    def _abort_lanes(self) -> None:
        """Safe from any thread: lanes take their own gate lock."""
        for lane in self._lane_list:
            lane.abort()

    async def _settle(self) -> None:
        """Wait until every job launched has finished or been skipped, or the grace period
        has ended, whichever comes first; the loop keeps running meanwhile."""
        pending = [f for f in self._fences.values() if not f.is_set()]
        if not pending or self._loop is None:
            return
        settled = self._loop.create_future()
        _Countdown(pending, lambda: self._call_soon(_resolve, settled))
        await asyncio.wait([settled], timeout=max(self._deadline - time.monotonic(), 0.0))

    def _close(self, timeout: float) -> None:
        """Join the lanes within ``timeout`` seconds; abandon what still runs (see module doc)."""
        if not self._lane_list:
            return
        deadline = time.monotonic() + timeout
        running: list[tuple[Task, Fence]] = []
        for lane in self._lane_list:  # every lane's threads start ending now, then one deadline
            lane.finish()
        for lane in self._lane_list:
            running += lane.close(max(deadline - time.monotonic(), 0.0))
        self.stuck = [tag for tag, f in running if tag is not None and not f.is_set()]
        self._attached = False  # a job that returns later must not call into a closed loop
        for f in self._fences.values():
            if not f.is_set():
                f.skip()  # abandoned: nothing may wait for it for ever
        self._lanes.clear()
        self._lane_list = ()

    # ---- adding work --------------------------------------------------------------------
    def add(self, graph: nx.DiGraph, after: Iterable[tuple[Task, Task]] = ()) -> None:
        """Add a graph (e.g. one step) under the policy's proposal; ``after`` are edges from
        tasks added earlier into this graph. Launching starts at once."""
        self._raise_if_stopped()
        if self._loop is None:
            raise ScheduleError("add graphs to the engine inside 'async with engine'")
        proposal = self.policy.propose(graph)
        if self.scheduler is None:
            self.scheduler = Scheduler(dict(proposal.budgets), workers={"cpu": self.cpu_workers})
            self.budgets = dict(proposal.budgets)
            for ins in self.instruments:  # the trace records what the run was given
                on_budgets = getattr(ins, "on_budgets", None)
                if on_budgets is not None:
                    on_budgets(self.budgets)
        elif dict(proposal.budgets) != self.budgets:
            raise ScheduleError(f"slot budgets changed between graphs: {self.budgets} then {proposal.budgets}")
        after = list(after)
        self.scheduler.add(proposal.order, graph, after, urgency=proposal.urgency)
        for t in graph:
            self._graph_preds[t] = list(graph.predecessors(t))
        for u, v in after:
            self._graph_preds[v].append(u)
        self._pump()

    async def run(self, graph: nx.DiGraph) -> list[TaskRecord]:
        """Add ``graph`` and wait for it; returns its task records in launch order."""
        self.add(graph)
        return await self.wait(graph)

    def finished(self, graph: nx.DiGraph | Iterable[Task]) -> bool:
        """Whether every task of ``graph`` ran to its end without failing; also after the engine
        stopped, where a failure elsewhere makes :meth:`wait` raise instead. (A graph already
        waited for has given its tasks' fences up: False.)"""
        return all((f := self._fences.get(t)) is not None and f.is_set() and not f.failed for t in graph)

    async def wait(self, graph: nx.DiGraph | Iterable[Task]) -> list[TaskRecord]:
        """Wait until every task of ``graph`` has finished; return their records.

        Raises as soon as the engine fails (StepFailed) or is cancelled (CancelledError),
        while other jobs may still run: leave the ``async with`` block to wait for those."""
        tasks = list(graph)
        assert self._wake is not None, "use the engine inside 'async with'"
        launched = 0  # tasks[:launched] have been launched (checked once each, not per wake-up)
        while True:
            self._raise_if_stopped()
            while launched < len(tasks) and tasks[launched] in self._fences:
                launched += 1
            if launched == len(tasks):
                break
            await self._changed()
        fences = [self._fences[t] for t in tasks]
        finished = _Countdown([f for f in fences if not f.is_set()], self._wake_threadsafe)
        while not finished.done:
            self._raise_if_stopped()
            await self._changed()
        while self._error is None and any(f.failed for f in fences):
            # A lane reports a failure before it sets the fence, but the report may still be
            # on its way to the loop: wait for it, or this step would look finished.
            await self._changed()
        self._raise_if_stopped()
        records = [self._record(t) for t in tasks]
        for r in records:
            for ins in self.instruments:
                ins.on_record(r)
        self._running_scheduler.forget(tasks)
        for t in tasks:
            self._launches.pop(t, None)
            del self._fences[t]  # finished: keeps a long run's memory (and CUDA events) flat
        return records

    async def _changed(self) -> None:
        """Sleep until something happened: a launch, a completion, a failure or a stop."""
        self._event.clear()
        await self._event.wait()

    def _record(self, task: Task) -> TaskRecord:
        f = self._fences[task]
        launch = self._launches[task]
        return TaskRecord(
            task=task,
            lane=task.lane,
            worker=f.worker,
            start=f.start,
            end=f.end,
            slot=launch.slot,
            reads=launch.reads,
            bytes=int(f.bytes),
            deps=self._graph_preds.pop(task, []),
        )

    # ---- the pump -----------------------------------------------------------------------
    def _pump(self) -> None:
        """Launch everything the scheduler allows now (nothing once stopped)."""
        if self._stopped:
            return
        try:
            launches = self._running_scheduler.poll()
        except ScheduleError as exc:
            self._fail(None, exc)
            return
        for launch in launches:
            task = launch.task
            lane = self._lanes[task.lane]
            ctx = TaskContext(launch, lane)
            # A producer missing here was waited for already (its fence set, then dropped by
            # ``wait``): it is finished, so there is nothing to wait for.
            fences = [self._fences[w] for w in launch.waits if w in self._fences]
            notify = self._running_scheduler.needs_completion(task)
            for ins in self.instruments:
                ins.on_launch(task, task.lane)
            try:
                fence = lane.submit(functools.partial(self.program, task, ctx), fences, task, notify)
            except BaseException as exc:  # a CUDA-lane job raised while launching
                self._launches[task] = launch
                self._fail(task, exc)
                return
            self._fences[task] = fence
            self._launches[task] = launch
        if launches:
            self._event.set()

    # ---- events from lane threads ---------------------------------------------------------
    def _call_soon(self, fn: Callable[[Unpack[_Ts]], object], *args: Unpack[_Ts]) -> None:
        """Run ``fn(*args)`` on the loop, from any thread; dropped once the engine closed."""
        if not self._attached:
            return
        try:
            self._event_loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed meanwhile: nobody is listening any more
            pass

    def _wake_threadsafe(self) -> None:
        self._call_soon(self._event.set)

    def _done_threadsafe(self, task: Task, fence: Fence) -> None:
        self._call_soon(self._on_done, task)

    def _error_threadsafe(self, task: Task | None, exc: BaseException) -> None:
        self._abort_lanes()  # at once, from the failing thread: no other job starts from now on
        self._call_soon(self._fail, task, exc)

    def _on_done(self, task: Task) -> None:
        if self._stopped:
            return
        self._running_scheduler.complete(task)
        self._pump()
        self._event.set()

    def _fail(self, task: Task | None, exc: BaseException) -> None:
        """The first failure (or cancel) wins; later ones are consequences and are dropped."""
        if self._error is None:
            if task is None:
                self._error = exc
            else:
                self._error = StepFailed(task, exc)
                self._error.__cause__ = exc
            for ins in self.instruments:
                ins.on_error(task, exc)
        self._stop()
        self._event.set()

    def _raise_if_stopped(self) -> None:
        err = self._error
        if isinstance(err, asyncio.CancelledError):
            raise asyncio.CancelledError(*err.args)
        if err is not None:
            raise err
        if self._stopped:
            raise ScheduleError("the engine has closed: add and wait for graphs inside 'async with engine'")

    # ---- the watchdog -------------------------------------------------------------------
    def _arm_watchdog(self) -> None:
        if self.task_timeout is None or self._stopped:
            return
        period = min(max(self.task_timeout / 4, 0.01), 1.0)
        self._watchdog_due = (time.perf_counter() + period, period)
        self._watchdog = self._event_loop.call_later(period, self._check_timeouts)

    def _check_timeouts(self) -> None:
        """One timer on the loop for every lane: fail on the first job running too long."""
        self._watchdog = None
        now = time.perf_counter()
        limit = self.task_timeout
        assert limit is not None, "the watchdog runs only with a task_timeout (_arm_watchdog)"
        due, period = self._watchdog_due
        late = now - due if now - due > period else 0.0  # the process was stopped: no job ran
        for lane in self._lane_list:
            for task, fence in lane.running():
                if late and fence.began and fence.began < due:
                    fence.began += late
                began = fence.began
                if task is not None and began and now - began > limit and not fence.is_set():
                    self._abort_lanes()
                    self._fail(task, TimeoutError(f"did not finish within {limit:g} s"))
                    return
        self._arm_watchdog()


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def run_graph(
    graph: nx.DiGraph,
    program: Program,
    policy: "str | Policy" = "double_buffer",
    *,
    device: str = "cpu",
    cpu_workers: int = 1,
    instruments: Sequence[Instrument] = (),
    grace: float = 5.0,
    task_timeout: float | None = None,
) -> list[TaskRecord]:
    """Run one graph to completion. On failure, waits (at most ``grace`` seconds) until
    nothing runs, then raises."""
    engine = Engine(program, policy, device=device, cpu_workers=cpu_workers, instruments=instruments,
                    grace=grace, task_timeout=task_timeout)
    async with engine:
        return await engine.run(graph)
