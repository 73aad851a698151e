"""Lanes: where tasks run. One interface, two implementations.

A lane accepts jobs in order and runs them in order, each after the *fences* it was given:

- :class:`CudaLane` is a CUDA stream. Its launcher thread runs each job's Python (which only
  enqueues kernels) inside ``torch.cuda.stream(...)``, after ``stream.wait_event`` on each
  fence, and records an event after the job's kernels. GPU-to-GPU dependencies never touch the
  host. A per-lane waiter thread reports completions the host asked for, in stream order.
- :class:`ThreadLane` gives a machine without a GPU the same semantics with threads: each job
  waits for its fences (thread events) in the lane's worker thread, then runs there. With
  several workers (the CPU pool) jobs start in order but may run concurrently.

Both record start and end times per job and report failures to the engine.

Stopping is part of the interface, because a run must end within seconds of a Ctrl-C even
when a job never returns:

- :meth:`abort` skips every job that has not started: its fence is set and ``failed``. A job
  starts under the lane's gate lock, so once ``abort()`` returns no job of the lane starts.
- :meth:`submit` on an aborted or closed lane returns a fence that is already set and failed
  (never a job queued behind the workers' stop sentinel, whose fence nobody would set).
- :meth:`finish` accepts no more jobs and lets the threads end once the queue is done;
  :meth:`close` does that and joins the (daemon) threads for at most ``timeout`` seconds; if one
  is still busy then, the lane aborts, skips what is still queued and returns the jobs still
  running (a hung job: the caller reports it and leaves its thread behind).
- :meth:`running` lists the jobs running now with ``fence.began`` (a ``perf_counter`` time),
  which the engine's watchdog compares with its ``task_timeout``.

A thread waiting for another lane's fence checks ``aborted`` every ``_POLL_S`` seconds, so a
hung producer cannot pin its consumers' threads as well.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Generic, Sequence, TypeVar

if TYPE_CHECKING:
    import torch

Job = Callable[[], "int | None"]
#: A job's tag: the lane never looks at it, only hands it back (to ``on_done`` and ``on_error``,
#: and from ``running()``); the engine tags each job with its task.
Tag = TypeVar("Tag")
_Item = TypeVar("_Item")
#: A job in a lane's queue: the job, the fences it waits for, its own fence, its tag, and
#: whether ``on_done`` is to hear of its completion.
_Queued = tuple[Job, Sequence["Fence"], "Fence", Tag, bool]
#: A CUDA job launched and waiting for its end event: its fence, tag and ``notify``.
_Launched = tuple["Fence", Tag, bool]

_POLL_S = 0.05  # how often a thread blocked on a fence looks at ``aborted``
_SETTING = threading.Lock()  # makes Fence.set atomic against a second set and new callbacks


class Fence:
    """Set when a job has finished (``failed`` if it raised or was skipped).

    One fence is made per task, so it is built on a bare lock (held until :meth:`set`)
    rather than a ``threading.Event``, whose condition variable costs several times more to
    create. Normally only the lane that owns the job sets it; the engine also sets (as failed)
    the fence of a job it abandoned, so :meth:`set` is idempotent. Any number of threads may
    wait, and :meth:`add_done_callback` turns completion into a call instead of a blocked thread.
    """

    __slots__ = ("_lock", "_set", "_callbacks", "launched", "failed", "start", "end", "began", "bytes",
                 "worker", "cuda_start", "cuda_end")

    def __init__(self) -> None:
        # Host lanes: launched means finished. CUDA lanes give each fence a separate
        # ``launched`` fence, set once the job's kernels are enqueued and its event recorded.
        self.launched: Fence = self
        self._lock = threading.Lock()
        self._lock.acquire()
        self._set = False
        self._callbacks: list[Callable[[Fence], None]] | None = None
        self.failed = False
        self.start = 0.0
        self.end = 0.0
        self.began = 0.0  # perf_counter() when the job began running; 0.0 while it is not
        self.bytes = 0
        self.worker = 0
        self.cuda_start: Any = None
        self.cuda_end: Any = None

    def set(self) -> None:
        """Mark finished (a second call does nothing) and run the done callbacks, here."""
        with _SETTING:
            if self._set:
                return
            self._set = True
            callbacks, self._callbacks = self._callbacks, None
        self._lock.release()
        for fn in callbacks or ():
            fn(self)

    def skip(self) -> None:
        """Finish without running: failed, and launched (CUDA) as well as set."""
        self.failed = True
        if self.launched is not self:
            self.launched.set()
        self.set()

    def add_done_callback(self, fn: Callable[["Fence"], None]) -> None:
        """Call ``fn(fence)`` once the fence is set: at once if it is, else in the thread that
        sets it (so ``fn`` must be quick and must not raise; typically it wakes an event loop)."""
        with _SETTING:
            if not self._set:
                if self._callbacks is None:
                    self._callbacks = [fn]
                else:
                    self._callbacks.append(fn)
                return
        fn(self)

    def wait(self, timeout: float | None = None) -> bool:
        if self._set:
            return True
        # Each waiter takes the lock and hands it straight on, so all of them wake.
        if self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            self._lock.release()
            return True
        return self._set

    def is_set(self) -> bool:
        return self._set


class _Clock:
    """Seconds since the engine started (a shared zero for all lanes)."""

    def __init__(self) -> None:
        self.zero = time.perf_counter()
        #: on CUDA, the event the device lanes time their tasks from (recorded at ``zero``)
        self.cuda_base: Any = None

    def now(self) -> float:
        return time.perf_counter() - self.zero


def _skip_queued(q: queue.SimpleQueue[_Item | None], fence_of: Callable[[_Item], Fence]) -> None:
    """Skip every job still in ``q``; stop sentinels (``None``) are put back for late workers."""
    sentinels = 0
    while True:
        try:
            item = q.get_nowait()
        except queue.Empty:
            break
        if item is None:
            sentinels += 1
        else:
            fence_of(item).skip()
    for _ in range(sentinels):
        q.put(None)


def _join(threads: Sequence[threading.Thread], timeout: float | None) -> bool:
    """Join ``threads`` within ``timeout`` seconds in all; whether they all ended."""
    deadline = None if timeout is None else time.perf_counter() + timeout
    for t in threads:
        t.join(None if deadline is None else max(0.0, deadline - time.perf_counter()))
    return not any(t.is_alive() for t in threads)


class _Lane(Generic[Tag]):
    """What both lanes share: the gate that orders job starts against abort and close."""

    def __init__(self, name: str, on_done: Callable[[Tag, Fence], None],
                 on_error: Callable[[Tag | None, BaseException], None]) -> None:
        self.name = name
        self.on_done = on_done  # (tag, fence) -> None, called from a lane thread
        self.on_error = on_error  # (tag, exc) -> None, called from a lane thread (tag None: the lane failed)
        self.aborted = False
        self.closed = False
        self._gate = threading.Lock()

    def abort(self) -> None:
        """Skip every job that has not started; once this returns, none of this lane starts."""
        with self._gate:
            self.aborted = True

    def _admit(self, item: _Item, q: queue.SimpleQueue[_Item | None]) -> bool:
        """Queue ``item`` unless the lane is aborted or closed (then the caller skips it)."""
        with self._gate:
            if self.aborted or self.closed:
                return False
            q.put(item)
            return True

    def _start(self, fence: Fence, tag: Tag, fences: Sequence[Fence], mark: Callable[[tuple[Tag, Fence]], None],
               launched: bool = False) -> bool:
        """Wait for the job's fences, then start it, or not at all once abort() has returned:
        ``mark`` records ``(tag, fence)`` as running, under the same gate. False (the fence
        skipped) when the job must not run."""
        if self._await_fences(fences, launched):
            with self._gate:
                if not self.aborted:
                    fence.began = time.perf_counter()
                    mark((tag, fence))
                    return True
        fence.skip()
        return False

    def _await_fences(self, fences: Sequence[Fence], launched: bool = False) -> bool:
        """Block until every fence is set (``launched`` for CUDA producers); False if one
        failed or the lane was aborted meanwhile."""
        for f in fences:
            g = f.launched if launched else f
            while not g.wait(_POLL_S):
                if self.aborted:
                    return False
            if f.failed:
                return False
        return not self.aborted


class ThreadLane(_Lane[Tag]):
    """A lane run by ``workers`` daemon threads pulling jobs from one FIFO queue."""

    def __init__(self, name: str, clock: _Clock, on_done: Callable[[Tag, Fence], None],
                 on_error: Callable[[Tag | None, BaseException], None], workers: int = 1) -> None:
        super().__init__(name, on_done, on_error)
        self.clock = clock
        self._queue: queue.SimpleQueue[_Queued[Tag] | None] = queue.SimpleQueue()
        self._running: list[tuple[Tag, Fence] | None] = [None] * workers
        self._threads = [
            threading.Thread(target=self._work, args=(i,), name=f"flowtrain-{name}-{i}", daemon=True)
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    def submit(self, job: Job, fences: Sequence[Fence], tag: Tag, notify: bool) -> Fence:
        fence = Fence()
        if not self._admit((job, fences, fence, tag, notify), self._queue):
            fence.skip()
        return fence

    def running(self) -> list[tuple[Tag, Fence]]:
        """``(tag, fence)`` of the jobs running now (a snapshot)."""
        return [r for r in self._running if r is not None]

    def _work(self, worker: int) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, fences, fence, tag, notify = item
            fence.worker = worker
            if not self._start(fence, tag, fences, lambda r: self._running.__setitem__(worker, r)):
                continue
            fence.start = self.clock.now()
            try:
                fence.bytes = job() or 0
            except BaseException as exc:  # reported to the engine
                fence.end = self.clock.now()
                self._running[worker] = None
                fence.failed = True
                self.on_error(tag, exc)  # before set: the engine aborts before dependents see it
                fence.set()
                continue
            fence.end = self.clock.now()
            self._running[worker] = None
            fence.set()
            if notify:
                self.on_done(tag, fence)

    def finish(self) -> None:
        """Accept no more jobs; the workers end once the queue is done. Does not wait."""
        with self._gate:
            if not self.closed:
                self.closed = True
                for _ in self._threads:
                    self._queue.put(None)

    def close(self, timeout: float | None = None) -> list[tuple[Tag, Fence]]:
        """Accept no more jobs and end the workers once the queue is done, waiting at most
        ``timeout`` seconds (``None``: for ever). Workers still busy then are left behind (they
        are daemon threads): the lane aborts, skips what is queued, and returns the jobs still
        running."""
        self.finish()
        if _join(self._threads, timeout):
            return []
        self.abort()
        _skip_queued(self._queue, lambda item: item[2])
        return self.running()


class CudaLane(_Lane[Tag]):
    """A CUDA stream fed by its own launcher thread.

    The launcher thread waits until each fence's producer has been *launched* (its CUDA event
    recorded), makes the stream wait on those events, runs the job's Python (which only
    enqueues kernels) inside ``torch.cuda.stream``, and records an end event. Launching off the
    event loop keeps the loop free to react to completions (e.g. to start ``cpu_adam``) even
    when the launcher blocks on a full CUDA launch queue far ahead of the GPU. A waiter thread
    synchronizes end events in stream order and reports the completions the host asked for.

    A job counts as running (:meth:`running`, ``fence.began``) while its Python runs on the
    launcher, and again from when the waiter starts waiting for its end event (everything
    before it on the stream has finished) until the event is reached.
    """

    def __init__(self, name: str, clock: _Clock, on_done: Callable[[Tag, Fence], None],
                 on_error: Callable[[Tag | None, BaseException], None], device: torch.device) -> None:
        import torch

        super().__init__(name, on_done, on_error)
        self.torch = torch
        index = device.index if getattr(device, "index", None) is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self.stream = torch.cuda.Stream(device=device)
        self.base = clock.cuda_base
        self._jobs: queue.SimpleQueue[_Queued[Tag] | None] = queue.SimpleQueue()
        self._queue: queue.SimpleQueue[_Launched[Tag] | None] = queue.SimpleQueue()
        self._launching: tuple[Tag, Fence] | None = None
        self._syncing: tuple[Tag, Fence] | None = None
        self._launcher = threading.Thread(target=self._launch_loop, name=f"flowtrain-{name}-launcher", daemon=True)
        self._waiter = threading.Thread(target=self._wait_loop, name=f"flowtrain-{name}-waiter", daemon=True)
        self._launcher.start()
        self._waiter.start()

    def submit(self, job: Job, fences: Sequence[Fence], tag: Tag, notify: bool) -> Fence:
        fence = Fence()
        fence.launched = Fence()
        if not self._admit((job, fences, fence, tag, notify), self._jobs):
            fence.skip()
        return fence

    def running(self) -> list[tuple[Tag, Fence]]:
        return [r for r in (self._launching, self._syncing) if r is not None]

    def _launch_loop(self) -> None:
        try:
            self.torch.cuda.set_device(self.device)
            self.torch.cuda.synchronize(self.device)  # make the primary context current here (cuBLAS)
        except BaseException as exc:  # never die silently: the engine would hang
            self.abort()
            self.on_error(None, exc)
        self._launch_jobs()

    def _launch_jobs(self) -> None:
        torch = self.torch
        while True:
            item = self._jobs.get()
            if item is None:
                self._queue.put(None)
                return
            job, fences, fence, tag, notify = item
            if not self._start(fence, tag, fences, lambda r: setattr(self, "_launching", r), launched=True):
                continue
            try:
                with torch.cuda.stream(self.stream):
                    for f in fences:
                        if f.cuda_end is not None:
                            self.stream.wait_event(f.cuda_end)
                    fence.cuda_start = torch.cuda.Event(enable_timing=True)
                    fence.cuda_end = torch.cuda.Event(enable_timing=True)
                    fence.cuda_start.record(self.stream)
                    fence.bytes = job() or 0
                    fence.cuda_end.record(self.stream)
            except BaseException as exc:  # reported to the engine
                self._launching = None
                fence.failed = True
                self.on_error(tag, exc)
                fence.launched.set()
                fence.set()
                continue
            fence.began = 0.0  # queued on the stream: running again once the waiter reaches it
            self._launching = None
            fence.launched.set()
            self._queue.put((fence, tag, notify))

    def _wait_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fence, tag, notify = item
            fence.began = time.perf_counter()
            self._syncing = (tag, fence)
            try:
                fence.cuda_end.synchronize()
                fence.start = self.base.elapsed_time(fence.cuda_start) / 1e3
                fence.end = self.base.elapsed_time(fence.cuda_end) / 1e3
            except BaseException as exc:
                self._syncing = None
                fence.failed = True
                self.on_error(tag, exc)
                fence.set()
                continue
            self._syncing = None
            fence.set()
            if notify:
                self.on_done(tag, fence)

    def finish(self) -> None:
        """Accept no more jobs; the threads end once the stream's work is done. Does not wait."""
        with self._gate:
            if not self.closed:
                self.closed = True
                self._jobs.put(None)

    def close(self, timeout: float | None = None) -> list[tuple[Tag, Fence]]:
        """As :meth:`ThreadLane.close`: at most ``timeout`` seconds, then abort and skip what is
        queued (jobs not launched, and launched jobs the waiter has not reached)."""
        self.finish()
        if _join([self._launcher, self._waiter], timeout):
            return []
        self.abort()
        if self._launcher.is_alive():  # stuck in a job's Python: let the waiter end anyway
            _skip_queued(self._jobs, lambda item: item[2])
            self._queue.put(None)
        if self._waiter.is_alive():
            _skip_queued(self._queue, lambda item: item[0])
        return self.running()
