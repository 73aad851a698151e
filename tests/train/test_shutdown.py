"""The signal handling of one process, in-process: a real signal to this process, its handler
on a running event loop, and what the loop's main task then sees. Nothing is timed: the test
waits on what the handler does (it says so, or it cancels the task)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from flowtrain.train.shutdown import Shutdown

GUARD_S = 60.0  # only ever reached if a handler never runs


def _signal_self(said: asyncio.Event) -> None:
    said.clear()
    os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.parametrize("peer_first", [True, False], ids=["after-a-peers-request", "alone"])
def test_the_first_own_signal_finishes_the_steps_in_flight_and_the_second_cancels(peer_first):
    """Data parallel: a process hears at a step boundary that another was signalled
    (``request_from_peer``) and torchrun's signal to it may come after. That is still its first
    signal: it finishes the steps in flight as its peers do. Counted as a second one it cancelled
    the process at once, and the others waited in a gradient all-reduce it never joined."""
    messages: list[str] = []
    seen: dict[str, object] = {}

    async def main() -> None:
        said = asyncio.Event()
        shutdown = Shutdown(graceful=True, saves=False, say=lambda m: (messages.append(m), said.set()))
        shutdown.attach(asyncio.get_running_loop(), asyncio.current_task())  # type: ignore[arg-type]
        try:
            if peer_first:
                shutdown.request_from_peer()
                assert shutdown.requested and shutdown.signum == signal.SIGTERM and not shutdown.cancelled
            _signal_self(said)
            await asyncio.wait_for(said.wait(), GUARD_S)  # the first: said, not cancelled
            seen["first"] = (shutdown.requested, shutdown.cancelled, shutdown.signum)
            os.kill(os.getpid(), signal.SIGINT)
            try:
                await asyncio.sleep(GUARD_S)  # the second cancels this task
            except asyncio.CancelledError:
                seen["second"] = shutdown.cancelled
        finally:
            shutdown.detach()

    asyncio.run(main())
    assert seen["first"] == (True, False, signal.SIGINT)
    assert messages == ["SIGINT: finishing the steps in flight (send it again to stop at once)"]
    assert seen["second"] is True
