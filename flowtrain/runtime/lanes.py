"""Lanes: where tasks run. One interface, two implementations.

A lane accepts jobs in order and runs them in order, each after the *fences* it was given:

- :class:`CudaLane` is a CUDA stream. Its launcher thread runs each job's Python (which only
  enqueues kernels) inside ``torch.cuda.stream(...)``, after ``stream.wait_event`` on each
  fence, and records an event after the job's kernels. GPU-to-GPU dependencies never touch the
  host. A per-lane waiter thread reports completions the host asked for, in stream order.
- :class:`ThreadLane` gives a machine without a GPU the same semantics with threads: each job
  waits for its fences (thread events) in the lane's worker thread, then runs there. With
  several workers (the CPU pool) jobs start in order but may run concurrently.

Both record start and end times per job and report failures to the engine, which then
aborts the lanes: queued jobs are skipped, their fences marked failed, so nothing runs on.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Sequence

Job = Callable[[], "int | None"]


class Fence:
    """Set when a job has finished (``failed`` if it raised or was skipped).

    One fence is made per task, so it is built on a bare lock (held until :meth:`set`)
    rather than a ``threading.Event``, whose condition variable costs several times more to
    create. Only the lane that owns the job sets it; any number of threads may wait.
    """

    __slots__ = ("_lock", "_set", "launched", "failed", "start", "end", "bytes", "worker", "cuda_start", "cuda_end")

    def __init__(self) -> None:
        # Host lanes: launched means finished. CUDA lanes give each fence a separate
        # ``launched`` fence, set once the job's kernels are enqueued and its event recorded.
        self.launched: Fence = self
        self._lock = threading.Lock()
        self._lock.acquire()
        self._set = False
        self.failed = False
        self.start = 0.0
        self.end = 0.0
        self.bytes = 0
        self.worker = 0
        self.cuda_start: Any = None
        self.cuda_end: Any = None

    def set(self) -> None:
        if not self._set:
            self._set = True
            self._lock.release()

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

    def now(self) -> float:
        return time.perf_counter() - self.zero


class ThreadLane:
    """A lane run by ``workers`` threads pulling jobs from one FIFO queue."""

    def __init__(self, name: str, clock: _Clock, on_done: Callable, on_error: Callable, workers: int = 1) -> None:
        self.name = name
        self.clock = clock
        self.on_done = on_done  # (tag, fence) -> None, called from the worker thread
        self.on_error = on_error  # (tag, exc) -> None, called from the worker thread
        self.aborted = False
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, args=(i,), name=f"flowtrain-{name}-{i}", daemon=True)
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    def submit(self, job: Job, fences: Sequence[Fence], tag: Any, notify: bool) -> Fence:
        fence = Fence()
        self._queue.put((job, fences, fence, tag, notify))
        return fence

    def _work(self, worker: int) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, fences, fence, tag, notify = item
            fence.worker = worker
            for f in fences:
                f.wait()
                if f.failed:
                    fence.failed = True
            if self.aborted or fence.failed:
                fence.failed = True
                fence.set()
                continue
            fence.start = self.clock.now()
            try:
                fence.bytes = job() or 0
            except BaseException as exc:  # noqa: BLE001 - reported to the engine
                fence.end = self.clock.now()
                fence.failed = True
                fence.set()
                self.on_error(tag, exc)
                continue
            fence.end = self.clock.now()
            fence.set()
            if notify:
                self.on_done(tag, fence)

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join()


class CudaLane:
    """A CUDA stream fed by its own launcher thread.

    The launcher thread waits until each fence's producer has been *launched* (its CUDA event
    recorded), makes the stream wait on those events, runs the job's Python (which only
    enqueues kernels) inside ``torch.cuda.stream``, and records an end event. Launching off the
    event loop keeps the loop free to react to completions (e.g. to start ``cpu_adam``) even
    when the launcher blocks on a full CUDA launch queue far ahead of the GPU. A waiter thread
    synchronizes end events in stream order and reports the completions the host asked for.
    """

    def __init__(self, name: str, clock: _Clock, on_done: Callable, on_error: Callable, device: Any) -> None:
        import torch

        self.name = name
        self.torch = torch
        index = device.index if getattr(device, "index", None) is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self.stream = torch.cuda.Stream(device=device)
        self.on_done = on_done
        self.on_error = on_error
        self.aborted = False
        self.base = clock.cuda_base  # type: ignore[attr-defined]
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._launcher = threading.Thread(target=self._launch_loop, name=f"flowtrain-{name}-launcher", daemon=True)
        self._waiter = threading.Thread(target=self._wait_loop, name=f"flowtrain-{name}-waiter", daemon=True)
        self._launcher.start()
        self._waiter.start()

    def submit(self, job: Job, fences: Sequence[Fence], tag: Any, notify: bool) -> Fence:
        fence = Fence()
        fence.launched = Fence()
        self._jobs.put((job, fences, fence, tag, notify))
        return fence

    def _launch_loop(self) -> None:
        try:
            self.torch.cuda.set_device(self.device)
            self.torch.cuda.synchronize(self.device)  # make the primary context current here (cuBLAS)
        except BaseException as exc:  # noqa: BLE001 - never die silently: the engine would hang
            self.aborted = True
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
            for f in fences:
                f.launched.wait()
                if f.failed and f.cuda_end is None:
                    fence.failed = True
            if self.aborted or fence.failed or any(f.failed for f in fences):
                fence.failed = True
                fence.launched.set()
                fence.set()
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
            except BaseException as exc:  # noqa: BLE001 - reported to the engine
                fence.failed = True
                fence.launched.set()
                fence.set()
                self.on_error(tag, exc)
                continue
            fence.launched.set()
            self._queue.put((fence, tag, notify))

    def _wait_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fence, tag, notify = item
            try:
                fence.cuda_end.synchronize()
                fence.start = self.base.elapsed_time(fence.cuda_start) / 1e3
                fence.end = self.base.elapsed_time(fence.cuda_end) / 1e3
            except BaseException as exc:  # noqa: BLE001
                fence.failed = True
                fence.set()
                self.on_error(tag, exc)
                continue
            fence.set()
            if notify:
                self.on_done(tag, fence)

    def close(self) -> None:
        self._jobs.put(None)
        self._launcher.join()
        self._waiter.join()
