"""How long Python's full garbage collections stop a run, step by step.

A full collection (generation 2) walks every object the interpreter tracks while holding the
GIL, so the lane launchers stop with it: where the GPU runs only a few tasks ahead of them,
the GPU waits too. ``flowtrain bench`` reports them beside each step::

    with FullCollections() as full:
        ...                       # a step
        full.mark()               # its collections: full.by_step[-1] == (count, seconds, longest)
"""

from __future__ import annotations

import gc
import time


class FullCollections:
    """Times every full collection while entered; :meth:`mark` closes a step's share."""

    def __init__(self) -> None:
        #: ``(collections, seconds in all, longest one's seconds)`` of each step closed by :meth:`mark`
        self.by_step: list[tuple[int, float, float]] = []
        self._count = 0
        self._seconds = 0.0
        self._longest = 0.0
        self._began: float | None = None

    def __enter__(self) -> FullCollections:
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        # called by the collecting thread, which holds the GIL from start to stop
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            took = time.perf_counter() - self._began
            self._began = None
            self._count += 1
            self._seconds += took
            self._longest = max(self._longest, took)

    def mark(self) -> None:
        """Close the current step: what was collected since the last mark."""
        self.by_step.append((self._count, self._seconds, self._longest))
        self._count, self._seconds, self._longest = 0, 0.0, 0.0
