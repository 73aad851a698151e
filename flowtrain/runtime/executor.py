"""The asyncio executor: the shell around the pure :class:`Scheduler`.

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

One failing task fails the run: the lanes are aborted (queued jobs are skipped), the engine
waits until nothing is running, and raises :class:`~flowtrain.errors.StepFailed` naming the task.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Iterable, Sequence

import networkx as nx

from ..errors import ScheduleError, StepFailed
from ..graph.tasks import DEVICE_LANES, Task
from ..policy import Policy, resolve_policy
from .lanes import CudaLane, Fence, ThreadLane, _Clock
from .scheduler import Launch, Scheduler
from .trace import Instrument, TaskRecord


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


class Engine:
    """Runs task graphs on lanes under a policy; see the module docstring."""

    def __init__(
        self,
        program: Program,
        policy: "str | Policy" = "double_buffer",
        *,
        device: str = "cpu",
        cpu_workers: int = 1,
        instruments: Sequence[Instrument] = (),
    ) -> None:
        self.program = program
        self.policy = resolve_policy(policy)
        self.device = device
        self.cpu_workers = cpu_workers
        self.instruments = list(instruments)
        self.scheduler: Scheduler | None = None
        self.budgets: dict[str, int] | None = None
        self._fences: dict[Task, Fence] = {}
        self._launches: dict[Task, Launch] = {}
        self._graph_preds: dict[Task, list[Task]] = {}
        self._error: StepFailed | None = None
        self._lanes: dict[str, Any] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._cpu_lane_name = "cpu"

    # ---- lifecycle ----------------------------------------------------------------------
    async def __aenter__(self) -> "Engine":
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        clock = _Clock()
        done, err = self._done_threadsafe, self._error_threadsafe
        if self.device.startswith("cuda"):
            import torch

            clock.cuda_base = torch.cuda.Event(enable_timing=True)  # type: ignore[attr-defined]
            clock.cuda_base.record()  # type: ignore[attr-defined]
            clock.cuda_base.synchronize()  # type: ignore[attr-defined]
            clock.zero = __import__("time").perf_counter()
            for lane in DEVICE_LANES:
                self._lanes[lane] = CudaLane(lane, clock, done, err, torch.device(self.device))
        else:
            for lane in DEVICE_LANES:
                self._lanes[lane] = ThreadLane(lane, clock, done, err)
        self._lanes["cpu"] = ThreadLane("cpu", clock, done, err, workers=self.cpu_workers)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for lane in self._lanes.values():
            lane.aborted = exc[0] is not None or lane.aborted
        await asyncio.to_thread(self._close_lanes)

    def _close_lanes(self) -> None:
        for lane in self._lanes.values():
            lane.close()
        self._lanes.clear()

    # ---- adding work --------------------------------------------------------------------
    def add(self, graph: nx.DiGraph, after: Iterable[tuple[Task, Task]] = ()) -> None:
        """Add a graph (e.g. one step) under the policy's proposal; ``after`` are edges from
        tasks added earlier into this graph. Launching starts at once."""
        self._raise_if_failed()
        proposal = self.policy.propose(graph)
        if self.scheduler is None:
            self.scheduler = Scheduler(dict(proposal.budgets))
            self.budgets = dict(proposal.budgets)
        elif dict(proposal.budgets) != self.budgets:
            raise ScheduleError(f"slot budgets changed between graphs: {self.budgets} then {proposal.budgets}")
        after = list(after)
        self.scheduler.add(proposal.order, graph, after)
        for t in graph:
            self._graph_preds[t] = list(graph.predecessors(t))
        for u, v in after:
            self._graph_preds[v].append(u)
        self._pump()

    async def run(self, graph: nx.DiGraph) -> list[TaskRecord]:
        """Add ``graph`` and wait for it; returns its task records in launch order."""
        self.add(graph)
        return await self.wait(graph)

    async def wait(self, graph: nx.DiGraph | Iterable[Task]) -> list[TaskRecord]:
        """Wait until every task of ``graph`` has finished; return their records."""
        tasks = list(graph)
        assert self._wake is not None, "use the engine inside 'async with'"
        launched = 0  # tasks[:launched] have been launched (checked once each, not per wake-up)
        while True:
            self._raise_if_failed()
            while launched < len(tasks) and tasks[launched] in self._fences:
                launched += 1
            if launched == len(tasks):
                break
            self._wake.clear()
            await self._wake.wait()
        fences = [self._fences[t] for t in tasks]
        pending = [f for f in fences if not f.is_set()]
        if pending:
            await asyncio.to_thread(self._wait_fences, pending)
        while self._error is None and any(f.failed for f in fences):
            # A lane sets a failed job's fence before its report reaches the loop: wait for the
            # report, or this step would look finished.
            self._wake.clear()
            await self._wake.wait()
        self._raise_if_failed()
        records = [self._record(t) for t in tasks]
        for r in records:
            for ins in self.instruments:
                ins.on_record(r)
        self.scheduler.forget(tasks)  # type: ignore[union-attr]
        for t in tasks:
            self._launches.pop(t, None)
            del self._fences[t]  # finished: keeps a long run's memory (and CUDA events) flat
        return records

    @staticmethod
    def _wait_fences(fences: list[Fence]) -> None:
        for f in fences:
            f.wait()

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
        """Launch everything the scheduler allows now."""
        if self._error is not None:
            return
        try:
            launches = self.scheduler.poll()  # type: ignore[union-attr]
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
            notify = self.scheduler.needs_completion(task)  # type: ignore[union-attr]
            for ins in self.instruments:
                ins.on_launch(task, task.lane)
            program = self.program
            try:
                fence = lane.submit(lambda t=task, c=ctx: program(t, c), fences, task, notify)
            except BaseException as exc:  # noqa: BLE001 - a CUDA-lane job raised while launching
                self._launches[task] = launch
                self._fail(task, exc)
                return
            self._fences[task] = fence
            self._launches[task] = launch
        if launches:
            self._wake.set()  # type: ignore[union-attr]

    def _done_threadsafe(self, task: Task, fence: Fence) -> None:
        self._loop.call_soon_threadsafe(self._on_done, task)  # type: ignore[union-attr]

    def _error_threadsafe(self, task: Task, exc: BaseException) -> None:
        self._loop.call_soon_threadsafe(self._fail, task, exc)  # type: ignore[union-attr]

    def _on_done(self, task: Task) -> None:
        if self._error is not None:
            return
        self.scheduler.complete(task)  # type: ignore[union-attr]
        self._pump()
        self._wake.set()  # type: ignore[union-attr]

    def _fail(self, task: Task | None, exc: BaseException) -> None:
        if self._error is None:
            if task is None:
                self._error = exc  # type: ignore[assignment]
            else:
                self._error = StepFailed(task, exc)
                self._error.__cause__ = exc
            for lane in self._lanes.values():
                lane.aborted = True
            for ins in self.instruments:
                ins.on_error(task, exc)  # type: ignore[arg-type]
        self._wake.set()  # type: ignore[union-attr]

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    async def drain(self) -> None:
        """Wait until every launched job has finished or been skipped (after a failure)."""
        fences = list(self._fences.values())
        await asyncio.to_thread(self._wait_fences, fences)


async def run_graph(
    graph: nx.DiGraph,
    program: Program,
    policy: "str | Policy" = "double_buffer",
    *,
    device: str = "cpu",
    cpu_workers: int = 1,
    instruments: Sequence[Instrument] = (),
) -> list[TaskRecord]:
    """Run one graph to completion. On failure, waits until nothing runs, then raises."""
    engine = Engine(program, policy, device=device, cpu_workers=cpu_workers, instruments=instruments)
    async with engine:
        try:
            return await engine.run(graph)
        except BaseException:
            await engine.drain()
            raise
