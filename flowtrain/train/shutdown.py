"""Ending a run on SIGINT (Ctrl-C) or SIGTERM, within seconds, with nothing half-written.

While the training loop runs, :class:`Shutdown` turns the first signal into a *request*:

- with ``--save-every``, the loop adds no new step, lets the steps in flight finish, writes a
  checkpoint of the last finished step and ends;
- without it (nothing to save), or on a second signal, the engine is cancelled at once: no task
  starts after the cancel, the lanes drain, temporary folders are removed.

Either way the run ends with :class:`Interrupted`, which the command line prints as one line
(what was saved, where to resume from) and turns into exit status 128 + the signal number
(130 for SIGINT, 143 for SIGTERM). Outside the loop (loading, the final save) a signal raises
:class:`Interrupted` straight away in the main thread, so ``finally`` blocks clean up::

    with Shutdown(graceful=cfg.save_every is not None) as shutdown:
        ...                                  # load: a signal raises Interrupted here
        shutdown.attach(loop, main_task)     # inside the loop: request, then cancel
        ...
        if shutdown.requested: ...           # stop adding steps
"""

from __future__ import annotations

import asyncio
import signal
import threading

from ..errors import Interrupted

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class Shutdown:
    """Signal handling for one run; see the module docstring."""

    def __init__(self, graceful: bool, say=print, saves: bool | None = None) -> None:
        self.graceful = graceful
        #: a graceful stop ends in a checkpoint (else it only finishes the steps in flight:
        #: data-parallel processes, which must stop at the same step)
        self.saves = graceful if saves is None else saves
        self.say = say
        self.signum: int | None = None
        #: signals this process received
        self.count = 0
        #: another data-parallel process was signalled (:meth:`request_from_peer`)
        self.peer = False
        #: what a signal outside the loop interrupts, for its one line
        self.phase = "before training started; nothing was written"
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._old: dict[int, object] = {}
        self._active = threading.current_thread() is threading.main_thread()

    # ---- outside the loop: raise at once --------------------------------------------------
    def __enter__(self) -> "Shutdown":
        if self._active:
            for s in SIGNALS:
                self._old[s] = signal.signal(s, self._raise)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)  # type: ignore[arg-type]

    def _received(self, signum: int) -> None:
        """Count a signal to this process; its first names the stop (over a peer's stand-in)."""
        if self.count == 0:
            self.signum = signum
        self.count += 1

    def _raise(self, signum: int, frame: object) -> None:
        self._received(signum)
        raise Interrupted(signum, f"stopped by {signal_name(signum)} {self.phase}")

    def restore_sync_handlers(self) -> None:
        """After the event loop closed (asyncio resets the handlers it owned)."""
        if self._active:
            for s in SIGNALS:
                signal.signal(s, self._raise)

    # ---- inside the loop: request, then cancel -------------------------------------------
    def attach(self, loop: asyncio.AbstractEventLoop, task: asyncio.Task) -> None:
        self._loop, self._task = loop, task
        if self._active:
            for s in SIGNALS:
                loop.add_signal_handler(s, self._on_signal, s)

    def detach(self) -> None:
        if self._active and self._loop is not None:
            for s in SIGNALS:
                self._loop.remove_signal_handler(s)
        self._loop = self._task = None

    @property
    def requested(self) -> bool:
        return self.count > 0 or self.peer

    def request_from_peer(self) -> None:
        """Another data-parallel process was signalled: stop as if this one had been (named
        SIGTERM until its own signal comes). torchrun signals every process, so this one's own
        usually follows the vote that told it; that is still its first signal, not a second
        one that would cancel it while its peers finish the steps in flight."""
        if self.count == 0 and not self.peer:
            self.peer, self.signum = True, signal.SIGTERM

    @property
    def cancelled(self) -> bool:
        """The loop was (or will be) cancelled by a signal rather than allowed to finish."""
        return self.count > 1 or (self.count == 1 and not self.graceful)

    def _on_signal(self, signum: int) -> None:
        self._received(signum)
        if self.count == 1 and self.graceful:
            self.say(f"{signal_name(signum)}: finishing the steps in flight"
                     + (" and saving a checkpoint" if self.saves else "")
                     + " (send it again to stop at once" + (", without saving)" if self.saves else ")"))
            return
        if self._task is not None:
            self._task.cancel()
