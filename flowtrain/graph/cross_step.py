"""How consecutive steps overlap: the edges from one step's graph into a later one's.

Each step is compiled alone (:func:`~flowtrain.graph.compiler.compile_step`). What ties step s+1
to step s is that it reads the weights step s wrote: the next step's ``fetch`` of a unit waits
for this step's Adam of that unit and for the step's ``verify_step`` (which may still put a
streamed unit back), not for every Adam of the step, so the forward of step s+1 can start on
the units already updated while the CPU still updates the rest::

    cpu_adam L0 s0 -> fetch L0 (forward) s1         cpu_adam L1 s0 -> fetch L1 (forward) s1
    verify_step s0 -> every fetch of step 1

A resident unit has no fetch: the tasks of step s+1 that read its weights wait for its
``gpu_adam``, on the device. :func:`cross_step_edges` lists these edges;
:func:`~flowtrain.graph.compiler.compile_steps` joins steps into one graph with them, and
:class:`~flowtrain.graph.stream.StepStream`, which hands an engine one step at a time, adds
them as each step comes.
"""

from __future__ import annotations

from typing import Iterable

from .spec import StepSpec
from .tasks import WEIGHT_READERS, CpuAdam, Fetch, GpuAdam, ReadState, SyncStep, Task, VerifyStep, WriteState


def cross_step_edges(earlier: Iterable[Task], later: Iterable[Task], spec: StepSpec) -> list[tuple[Task, Task]]:
    """The edges from one step's Adam of each unit (every chunk's ``cpu_adam``, or its
    ``gpu_adam``) to what reads that unit's weights in a later step: every ``fetch`` of a
    streamed unit, every weight-reading task of a resident one. With tied embeddings the head
    also reads the embedding matrix, so it waits for both. Every ``fetch`` also waits for the
    step's ``verify_step``, which may put streamed units back, and its ``sync_step`` where the
    processes share the state (another process may have updated the unit). A unit's state on
    disk is read again (``read_state``, each chunk's) only once the earlier step's
    ``write_state`` of it has put it back. Executors that
    receive steps one at a time add these themselves. With LoRA, every task that runs layer i
    also reads its adapters: it waits for their ``gpu_adam``."""
    adams: dict[tuple[str | None, int | None], list[Task]] = {}
    verify = []
    writes: dict[tuple[str | None, int | None, int | None], Task] = {}
    for t in earlier:
        if isinstance(t, WriteState):
            writes[(t.unit, t.layer, t.chunk)] = t
        elif isinstance(t, (CpuAdam, GpuAdam)):
            adams.setdefault((t.unit, t.layer), []).append(t)
        elif isinstance(t, (VerifyStep, SyncStep)):
            verify.append(t)
    edges = []
    for t in later:
        reads_resident = isinstance(t, WEIGHT_READERS) and t.unit is not None and spec.is_resident(t.unit, t.layer)
        if isinstance(t, Fetch) or reads_resident:  # a frozen unit has no Adam
            edges += [(a, t) for a in adams.get((t.unit, t.layer), [])]
            if spec.tied and t.unit == "head":
                edges += [(a, t) for a in adams.get(("embed", None), [])]
        if spec.lora and isinstance(t, WEIGHT_READERS + (Fetch,)) and t.unit == "layer":  # its adapters too
            edges += [(a, t) for a in adams.get(("adapter", t.layer), [])]
        if isinstance(t, Fetch):
            edges += [(v, t) for v in verify]
        if isinstance(t, ReadState):  # after the earlier write, and any undo the step's verdict made
            edges += [(v, t) for v in verify]
            if (w := writes.get((t.unit, t.layer, t.chunk))) is not None:
                edges.append((w, t))
    return edges
