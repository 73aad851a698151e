"""The steps of a run as they enter an executor: a few in flight, each linked to the one before.

The training loop (:mod:`flowtrain.train.loop`) feeds steps to the engine and the simulator
(:meth:`flowtrain.sim.clock.VirtualClock.run_steps`) to its virtual clock in the same way, and
this is that way, written once::

    stream = StepStream(spec, in_flight=2)
    for s in range(steps):
        graph = compile_step(spec, step=s)
        engine.add(graph, stream.push(s, graph))    # with the edges that let it overlap step s - 1
        for done in stream.due():                   # the oldest, once `in_flight` are open
            await engine.wait(done.graph)
    for done in stream.drain():                     # the rest, oldest first
        await engine.wait(done.graph)

A step's edges from the one before are :func:`~flowtrain.graph.cross_step.cross_step_edges`
(its fetches wait for the previous step's Adam of their unit), plus what ``link`` adds (the
loop's checkpoint saves: :func:`~flowtrain.graph.saving.save_edges`). After :meth:`drain`
nothing is in flight, so the next step needs no edges.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import networkx as nx

from .cross_step import cross_step_edges
from .spec import StepSpec
from .tasks import Task

Edges = list[tuple[Task, Task]]


@dataclass(frozen=True)
class OpenStep:
    """A step added and not yet finished: its number, its graph and what its adder keeps with it."""

    step: int
    graph: nx.DiGraph
    data: Any = None


class StepStream:
    """Steps in flight, at most ``in_flight`` of them. ``link(previous, graph)`` gives edges of
    the caller's own from the previous :class:`OpenStep` to a new step's graph."""

    def __init__(self, spec: StepSpec, in_flight: int = 2,
                 link: Callable[[OpenStep, nx.DiGraph], Edges] | None = None) -> None:
        if in_flight < 1:
            raise ValueError(f"in_flight must be at least 1 (got {in_flight})")
        self.spec, self.in_flight, self.link = spec, in_flight, link
        self.open: deque[OpenStep] = deque()
        self._last: OpenStep | None = None  # the step the next one follows; None: nothing to wait for

    def push(self, step: int, graph: nx.DiGraph, data: Any = None) -> Edges:
        """Record ``step`` as in flight; the edges it must be added with."""
        edges: Edges = []
        if self._last is not None:
            edges = cross_step_edges(self._last.graph, graph, self.spec)
            if self.link is not None:
                edges += self.link(self._last, graph)
        self._last = OpenStep(step, graph, data)
        self.open.append(self._last)
        return edges

    def due(self) -> Iterator[OpenStep]:
        """The steps to finish now, oldest first: while ``in_flight`` are open, the oldest."""
        while len(self.open) >= self.in_flight:
            yield self.open.popleft()

    def drain(self) -> Iterator[OpenStep]:
        """Every open step, oldest first; the next step then follows none."""
        while self.open:
            yield self.open.popleft()
        self._last = None
