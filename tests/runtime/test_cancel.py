"""Stopping the engine: cancel, failure, Ctrl-C, a hung job, the watchdog, and the lanes' part.

What must hold whenever the engine stops (see :mod:`flowtrain.runtime.engine`):

- no task is launched after the stop (an instrument counts launches at the stop) and no job
  *starts* after it (lanes stamp ``fence.began`` under the gate that ``abort()`` takes, so
  ``began`` later than the moment ``cancel()`` returned would be a job started after it);
- jobs that had not started are skipped: their fences set and failed;
- every fence ever made is set once the ``async with`` block is left (:class:`FenceLog`);
- a job that never returns delays the exit by the grace period only, and is named in
  ``engine.stuck``: the block is left while the job still runs.

No test asserts how long anything took: each waits on events, and a timeout (``HANG_GUARD_S``)
only turns a hang into a failure. That a running job is waited for within the grace period is
asserted by jobs released after the stop, which finish and are not stuck; that a job that never
returns is given up, by the block being left while the job is still held.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import networkx as nx
import pytest
import torch
from runtime_helpers import HANG_GUARD_S, Budget, FenceLog, Hold, Recorder, guarded, join_lane_threads, lane_threads

from flowtrain.errors import ConfigError, ScheduleError, StepFailed
from flowtrain.graph import (
    WEIGHTS,
    Backward,
    CpuAdam,
    Fetch,
    Forward,
    OffloadGrad,
    StepSpec,
    compile_step,
    compile_steps,
)
from flowtrain.runtime import Engine, FaultInjector, Instrument
from flowtrain.runtime.lanes import Fence, ThreadLane, _Clock

GRACE = 0.3  # for tests where a job hangs: what the engine gives it before it leaves it behind


class Launches(Instrument):
    """Launches in order; ``at_error`` is how many there were when the engine failed."""

    def __init__(self) -> None:
        self.launched: list = []
        self.at_error: int | None = None

    def on_launch(self, task, lane):
        self.launched.append(task)

    def on_error(self, task, error):
        self.at_error = len(self.launched)


def others_end(hung_thread: str) -> list[str]:
    """Names of lane threads other than ``hung_thread`` still alive once they were given time to
    end (``HANG_GUARD_S``, only ever reached if one hangs)."""
    for t in lane_threads():
        if t.name != hung_thread:
            t.join(HANG_GUARD_S)
    return [t.name for t in lane_threads() if t.name != hung_thread]


# ---- cancel ----------------------------------------------------------------------------------

A = Forward(unit="layer", layer=0, micro_batch=0)
B = Forward(unit="layer", layer=1, micro_batch=0)
C = CpuAdam(unit="layer", layer=0)
D = OffloadGrad(unit="layer", layer=0)
E = Fetch(unit="layer", layer=1, phase="forward")


def fan_out() -> nx.DiGraph:
    """Everything waits for A::

                         forward L0 (held)
            /             |            \\                \\
        fetch L1      forward L1     offload_grad L0    cpu_adam L0
         (h2d)        (compute)        (d2h)            (cpu: needs A *finished*)

    While A is held, the three device-lane tasks are launched and wait on their lanes for A's
    fence; cpu_adam is not launched at all. Nothing else can start, so what ran is exact.
    """
    g = nx.DiGraph()
    g.add_edges_from([(A, E), (A, B), (A, D), (A, C)], reads=False)
    return g


async def test_cancel_launches_nothing_more_skips_queued_jobs_and_sets_every_fence(monkeypatch):
    log, hold, launches = FenceLog(monkeypatch), Hold(), Launches()
    rec = Recorder({A: hold})
    graph = fan_out()
    async with Engine(rec, Budget(**{WEIGHTS: 1}), instruments=[launches], grace=HANG_GUARD_S) as engine:
        engine.add(graph)
        await hold.began()
        assert set(launches.launched) == {A, B, D, E}
        engine.cancel()
        cancelled_at = time.perf_counter()
        engine.cancel()  # idempotent
        hold.release()  # A finishes after the cancel: its completion must not launch cpu_adam
        with pytest.raises(asyncio.CancelledError, match="the engine was cancelled"):
            await guarded(engine.wait(graph))
        with pytest.raises(asyncio.CancelledError):
            engine.add(compile_step(StepSpec(layers=1), step=1))
    assert rec.ran == {A} and set(launches.launched) == {A, B, D, E}
    assert not log.unset and not log.started_after(cancelled_at)
    assert [f.failed for f in log.fences].count(False) == 1  # A's; B, D and E were skipped
    assert engine.stuck == [] and not lane_threads()


@pytest.mark.parametrize("after_s", [0.0, 0.005, 0.02, 0.05])
async def test_cancel_at_a_random_moment_of_a_busy_run(monkeypatch, after_s):
    """Two overlapping steps whose tasks sleep up to 2 ms (a fault of mode ``delay``),
    cancelled part-way: whatever ran was launched before the cancel, and started before it."""
    log, launches = FenceLog(monkeypatch), Launches()
    rec = Recorder()
    graph = compile_steps(StepSpec(layers=4, micro_batches=2), 2)
    program = FaultInjector(rec, f"*:delay=0.002;seed={int(after_s * 1000)}")
    async with Engine(program, "lookahead", instruments=[launches], grace=HANG_GUARD_S) as engine:
        engine.add(graph)
        await asyncio.sleep(after_s)
        engine.cancel()
        cancelled_at, launched = time.perf_counter(), list(launches.launched)
    assert launches.launched == launched
    assert rec.ran <= set(launched) and rec.active == 0
    assert not log.unset and not log.started_after(cancelled_at)
    assert engine.stuck == [] and not lane_threads()


async def test_leaving_the_block_with_an_error_cancels(monkeypatch):
    log, hold, launches = FenceLog(monkeypatch), Hold(), Launches()
    rec = Recorder({A: hold})
    engine = Engine(rec, Budget(**{WEIGHTS: 1}), instruments=[launches], grace=HANG_GUARD_S)
    with pytest.raises(KeyError):
        async with engine:
            engine.add(fan_out())
            await hold.began()
            asyncio.get_running_loop().call_later(0.02, hold.release)
            raise KeyError("the caller's own error")
    assert rec.ran == {A} and C not in launches.launched
    assert not log.unset and engine.stuck == [] and not lane_threads()


async def test_leaving_the_block_normally_launches_nothing_more(monkeypatch):
    """Work added but not waited for is cancelled, not run, when the block ends."""
    log, hold = FenceLog(monkeypatch), Hold()
    rec = Recorder({A: hold})
    async with Engine(rec, Budget(**{WEIGHTS: 1}), grace=HANG_GUARD_S) as engine:
        engine.add(fan_out())
        await hold.began()
        asyncio.get_running_loop().call_later(0.02, hold.release)
    assert rec.ran == {A} and not log.unset and not lane_threads()
    with pytest.raises(ScheduleError, match="the engine has closed"):
        engine.add(fan_out())


# ---- a job that never returns ------------------------------------------------------------------


async def test_a_hung_job_delays_the_exit_by_the_grace_period_only_and_is_reported(monkeypatch):
    log, hold = FenceLog(monkeypatch), Hold()
    graph = compile_step(StepSpec(layers=3, micro_batches=2))
    hung = Backward(unit="layer", layer=1, micro_batch=0)
    rec = Recorder({hung: hold})
    engine = Engine(rec, "double_buffer", grace=GRACE)

    async def run():
        async with engine:
            engine.add(graph)
            await hold.began()
            engine.cancel()

    try:
        await guarded(run())
        assert hung in rec.ran and hung not in rec.end  # left while the job still runs
        assert engine.stuck == [hung]
        assert not log.unset  # the hung job's fence too: abandoned, set as failed
        assert others_end("flowtrain-compute-0") == []
    finally:
        hold.release()
    assert not join_lane_threads()  # the worker got its stop sentinel back, and ended
    assert rec.end.keys() == rec.ran  # the late job finished; its report went nowhere


@pytest.mark.parametrize("hangs", [False, True], ids=["returns", "hangs"])
async def test_cancelling_the_task_that_waits_ends_the_run(monkeypatch, hangs):
    """What Ctrl-C does under ``asyncio.run``: the main task is cancelled while it awaits
    ``engine.wait``. The block is left at once if the running job returns soon, after the
    grace period if it never does."""
    log, hold, launches = FenceLog(monkeypatch), Hold(), Launches()
    graph = compile_step(StepSpec(layers=3, micro_batches=2))
    held = Forward(unit="layer", layer=1, micro_batch=1)
    rec = Recorder({held: hold})
    grace = GRACE if hangs else HANG_GUARD_S
    engine = Engine(rec, "double_buffer", instruments=[launches], grace=grace)

    async def main():
        async with engine:
            engine.add(graph)
            await engine.wait(graph)

    runner = asyncio.create_task(main())
    try:
        await hold.began()
        launched = len(launches.launched)
        runner.cancel()
        if not hangs:
            asyncio.get_running_loop().call_later(0.05, hold.release)
        with pytest.raises(asyncio.CancelledError):
            await guarded(runner)
        assert len(launches.launched) == launched
        assert not log.unset
        if hangs:
            assert engine.stuck == [held] and held not in rec.end  # left while the job still runs
        else:
            assert engine.stuck == [] and held in rec.end and not lane_threads()
    finally:
        hold.release()
    assert not join_lane_threads()


def test_sigint_under_asyncio_run_ends_the_process_within_the_grace_period(tmp_path):
    """The real thing: a process whose task hangs gets SIGINT; asyncio.run cancels the main
    task, the engine gives the hung job its grace period, and the process exits."""
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent("""
        import asyncio, signal, sys
        from flowtrain.graph import StepSpec, compile_step
        from flowtrain.runtime import Engine, FaultInjector

        # started from a background job, the test runner may ignore SIGINT, and its children
        # inherit that: this process answers it as any Python process started from a terminal
        signal.signal(signal.SIGINT, signal.default_int_handler)

        faults = FaultInjector(lambda task, ctx: None, "backward@layer=1,micro_batch=0:hang")

        def program(task, ctx):
            if task.kind == "backward" and task.layer == 1 and task.micro_batch == 0:
                print("hanging", flush=True)
            return faults(task, ctx)

        engine = Engine(program, "double_buffer", grace=0.5)

        async def main():
            graph = compile_step(StepSpec(layers=3, micro_batches=2))
            async with engine:
                engine.add(graph)
                await engine.wait(graph)

        try:
            asyncio.run(main())
        except KeyboardInterrupt:
            print("interrupted; stuck:", ", ".join(map(str, engine.stuck)), flush=True)
            sys.exit(130)
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        assert proc.stdout.readline() == "hanging\n"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=HANG_GUARD_S)  # the job never returns: only the grace period ends it
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert out == "interrupted; stuck: backward L1 m0\n"


# ---- failure -----------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["sequential", "double_buffer", "lookahead"])
async def test_a_failure_launches_nothing_more(monkeypatch, policy):
    log, launches = FenceLog(monkeypatch), Launches()
    graph = compile_step(StepSpec(layers=4, micro_batches=2))
    failing = Forward(unit="layer", layer=2, micro_batch=1)

    def boom(task, ctx):
        raise ValueError("bad weights")

    rec = Recorder({failing: boom})
    with pytest.raises(StepFailed, match="forward L2 m1 failed: ValueError: bad weights"):
        async with Engine(rec, policy, instruments=[launches], grace=HANG_GUARD_S) as engine:
            await guarded(engine.run(graph))
    assert launches.at_error == len(launches.launched)
    assert not rec.ran & nx.descendants(graph, failing)
    assert not log.unset and rec.active == 0 and engine.stuck == [] and not lane_threads()


# ---- the watchdog ------------------------------------------------------------------------------


async def test_the_watchdog_fails_the_run_naming_the_hung_task(monkeypatch):
    """The hung job exceeds any timeout; 1 s leaves every other (instant) job far within it,
    however loaded the machine."""
    log, launches = FenceLog(monkeypatch), Launches()
    graph = compile_step(StepSpec(layers=3, micro_batches=2))
    hung = Backward(unit="layer", layer=1, micro_batch=1)
    faults = FaultInjector(Recorder(), "backward@layer=1,micro_batch=1:hang")
    engine = Engine(faults, "double_buffer", instruments=[launches], task_timeout=1.0, grace=GRACE)

    async def run():
        async with engine:
            await engine.run(graph)

    try:
        with pytest.raises(StepFailed) as err:
            await guarded(run())  # the job never returns: only the watchdog and the grace period end the run
        assert err.value.task == hung and isinstance(err.value.__cause__, TimeoutError)
        assert str(err.value) == "task backward L1 m1 failed: TimeoutError: did not finish within 1 s"
        assert faults.fired == [(hung, faults.spec.faults[0])]
        assert engine.stuck == [hung] and launches.at_error == len(launches.launched)
        assert not log.unset
    finally:
        faults.release()
    assert not join_lane_threads()


async def test_the_watchdog_counts_only_the_time_a_job_runs():
    """::

        compute:  forward L0 -> L1 -> L2 -> L3 (0.25 s each) --fence--> d2h: offload_grad L0 (0.25 s)

    The copy is launched at once and waits on its lane for the last forward's fence: more than
    the 0.8 s timeout passes between its launch and its end (it was launched before forward L1
    ended, and three forwards and the copy each sleep 0.25 s at least), but no job runs longer
    than 0.25 s plus what a loaded machine adds, far within the timeout."""
    forwards = [Forward(unit="layer", layer=i, micro_batch=0) for i in range(4)]
    graph = nx.DiGraph(list(zip(forwards, [*forwards[1:], D])), reads=False)
    rec = Recorder({t: lambda t, c: time.sleep(0.25) for t in graph})

    class EndedAtLaunch(Instrument):
        def __init__(self) -> None:
            self.ended: dict = {}

        def on_launch(self, task, lane):
            self.ended[task] = set(rec.end)

    launches = EndedAtLaunch()
    async with Engine(rec, Budget(), instruments=[launches], task_timeout=0.8) as engine:
        await guarded(engine.run(graph))
    assert rec.ran == set(graph)
    assert not launches.ended[D] & set(forwards[1:])  # so its launch-to-end took over 0.75 + 0.25 s


def test_the_grace_period_and_the_timeout_are_checked():
    with pytest.raises(ConfigError, match="grace period must be >= 0"):
        Engine(Recorder(), grace=-1)
    with pytest.raises(ConfigError, match="task_timeout must be > 0"):
        Engine(Recorder(), task_timeout=0)


async def test_a_lane_that_fails_to_start_leaves_no_threads(monkeypatch):
    from flowtrain.runtime import engine as engine_module

    def lane(name, *args, **kwargs):
        if name == "cpu":
            raise OSError("no more threads")
        return ThreadLane(name, *args, **kwargs)

    monkeypatch.setattr(engine_module, "ThreadLane", lane)
    with pytest.raises(OSError, match="no more threads"):
        async with Engine(Recorder()):
            pass
    assert not lane_threads()


# ---- lanes and fences ------------------------------------------------------------------------------


def _lane(name="test", workers=1):
    errors: list = []
    return ThreadLane(name, _Clock(), lambda tag, f: None, lambda tag, exc: errors.append((tag, exc)), workers), errors


def test_submitting_to_a_closed_or_aborted_lane_gives_a_failed_fence_at_once():
    ran = []
    lane, _ = _lane()
    lane.abort()
    f = lane.submit(lambda: ran.append(1), [], "late", True)
    assert f.is_set() and f.failed
    assert lane.close(HANG_GUARD_S) == []
    f = lane.submit(lambda: ran.append(1), [], "later", True)
    assert f.is_set() and f.failed and not ran and not lane_threads()


def test_close_gives_up_on_a_hung_job_after_its_timeout_and_skips_the_queue():
    go = threading.Event()
    lane, errors = _lane()
    hung = lane.submit(go.wait, [], "hung", False)
    queued = lane.submit(lambda: None, [], "queued", False)
    while not hung.began:
        time.sleep(0.001)
    running = lane.close(GRACE)  # returns although the job never does
    assert [tag for tag, _ in running] == ["hung"] and running[0][1] is hung
    assert queued.is_set() and queued.failed and not hung.is_set()
    go.set()
    assert hung.wait(HANG_GUARD_S) and not hung.failed and not errors
    assert not join_lane_threads()


def test_a_job_waiting_for_a_hung_producer_is_skipped_on_abort():
    go = threading.Event()
    producer_lane, _ = _lane("producer")
    consumer_lane, _ = _lane("consumer")
    hung = producer_lane.submit(go.wait, [], "hung", False)
    waiting = consumer_lane.submit(lambda: None, [hung], "waiting", False)
    assert not waiting.wait(0.05)
    consumer_lane.abort()
    assert waiting.wait(HANG_GUARD_S) and waiting.failed and not hung.is_set()
    go.set()
    for lane in (producer_lane, consumer_lane):
        assert lane.close(HANG_GUARD_S) == []
    assert not lane_threads()


def test_fence_callbacks_run_once_whoever_sets_the_fence():
    calls: list = []
    f = Fence()
    f.add_done_callback(calls.append)
    threads = [threading.Thread(target=f.skip) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    f.set()
    assert calls == [f] and f.is_set() and f.failed
    f.add_done_callback(calls.append)  # already set: at once
    assert calls == [f, f]


# ---- CUDA lanes --------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_cuda_lanes_cancel_with_a_hung_launch_and_report_it(monkeypatch):
    log, hold, launches = FenceLog(monkeypatch), Hold(), Launches()
    graph = compile_step(StepSpec(layers=3, micro_batches=2))
    hung = Backward(unit="layer", layer=1, micro_batch=0)
    x = torch.ones(1024, device="cuda")
    entered: list[float] = []  # when each job's Python began (perf_counter)

    def program(task, ctx):
        entered.append(time.perf_counter())
        if task == hung:
            hold(task, ctx)
        x.mul_(1.0)

    engine = Engine(program, "double_buffer", device="cuda", instruments=[launches], grace=GRACE)
    seen = {}

    async def run():
        async with engine:
            engine.add(graph)
            await hold.began()
            seen["launched"] = len(launches.launched)
            engine.cancel()
            seen["cancelled_at"] = time.perf_counter()

    try:
        await guarded(run())  # left while the hung launch is still held
        launched, cancelled_at = seen["launched"], seen["cancelled_at"]
        assert engine.stuck == [hung] and len(launches.launched) == launched
        # no job's Python began after the cancel (a fence's ``began`` is no test of that here:
        # the waiter marks jobs launched before the cancel as running again when it reaches them)
        assert not log.unset and max(entered) < cancelled_at
    finally:
        hold.release()
    assert not join_lane_threads()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_cuda_watchdog_and_closed_lane(monkeypatch):
    from flowtrain.runtime.lanes import CudaLane

    log = FenceLog(monkeypatch)
    graph = compile_step(StepSpec(layers=2, micro_batches=2))
    faults = FaultInjector(lambda t, c: None, "forward@layer=1,micro_batch=0:hang")
    engine = Engine(faults, "double_buffer", device="cuda", task_timeout=1.0, grace=GRACE)
    try:
        with pytest.raises(StepFailed, match="forward L1 m0 failed: TimeoutError"):
            async with engine:
                await guarded(engine.run(graph))
        assert engine.stuck == [Forward(unit="layer", layer=1, micro_batch=0)] and not log.unset
    finally:
        faults.release()
    assert not join_lane_threads()

    clock = _Clock()
    clock.cuda_base = torch.cuda.Event(enable_timing=True)
    clock.cuda_base.record()
    lane = CudaLane("test", clock, lambda *a: None, lambda *a: None, torch.device("cuda"))
    assert lane.close(HANG_GUARD_S) == []
    f = lane.submit(lambda: None, [], "late", True)
    assert f.is_set() and f.failed and f.launched.is_set()
