"""How every graph of tasks is built: :class:`GraphBuilder` makes each task, checks it, and adds
it and its edges to a ``networkx.DiGraph``.

The nodes are the tasks themselves (frozen, hashable structs), inserted in the order one thread
would run them: networkx keeps insertion order, and policies start from it. An edge says that
the consumer waits for the producer; ``reads=True`` says, moreover, that it reads the slot the
producer took, which then stays taken until every reader has been launched::

    b = GraphBuilder(spec, step=0)
    f = b.node(Fetch, unit="layer", layer=0, phase="forward")
    t = b.node(Forward, layer=0, micro_batch=0)
    b.dep(f, t, reads=True)          # forward L0 m0 reads the weight slot fetch L0 filled
    b.g                              # the graph: two tasks, one edge

Every task is stamped with the builder's step and checked as it is made: its fields against
their types (:class:`~flowtrain.graph.tasks.TaskFields`, for mypy), its kind's shape
(:func:`~flowtrain.graph.tasks.check_shape`: a ``forward`` names a layer and a micro-batch and
nothing else), and a task made twice is a bug of the builder, caught at once. The training
step (:mod:`flowtrain.graph.step_builder`) and the held-out evaluation
(:mod:`flowtrain.graph.evaluation`) are both built through it.
"""

from __future__ import annotations

from typing import Unpack

import msgspec
import networkx as nx

from .spec import StepSpec
from .tasks import Task, TaskFields, check_shape


class GraphBuilder:
    """Adds nodes in serial order and edges with a ``reads`` flag; ``g`` is the graph."""

    def __init__(self, spec: StepSpec, step: int) -> None:
        data = msgspec.to_builtins(spec)
        if not spec.disk:  # a graph without a disk tier reads as it did before the tier existed
            del data["disk"], data["disk_ahead"]
        self.g = nx.DiGraph(spec=data)
        self.step = step

    def node(self, cls: type[Task], **fields: Unpack[TaskFields]) -> Task:
        task = cls(step=self.step, **fields)
        check_shape(task)  # each kind names what it should, nothing else
        assert task not in self.g, f"duplicate task {task}"
        self.g.add_node(task)
        return task

    def dep(self, producer: Task, consumer: Task, *, reads: bool = False) -> None:
        if self.g.has_edge(producer, consumer):
            self.g.edges[producer, consumer]["reads"] |= reads
        else:
            self.g.add_edge(producer, consumer, reads=reads)
