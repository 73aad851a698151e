"""The scheduler's pure core: which task may be launched next, and with which slot.

This is a synchronous state machine. It imports neither torch nor asyncio: the executor feeds
it events (``launched`` is implied by :meth:`Scheduler.poll` returning a task, completions come
through :meth:`Scheduler.complete`) and launches the instructions it returns. Tests drive it
directly and assert the exact instructions::

    sched = Scheduler({"weights": 1, "grads": 1})
    sched.add(order, graph)
    launches = sched.poll()        # tasks that may start now, in plan order, with slots
    sched.complete(task)           # a task the host needed to see finish has finished

Rules the engine enforces, whatever the policy proposed:

- **Lanes issue in plan order.** Each lane (``h2d``, ``compute``, ``d2h``, ``cpu``) launches its
  tasks in the order of the plan, like a CUDA stream.
- **Except for urgent host work.** A policy may give host tasks an *urgency* (lower runs sooner).
  On a host lane with a known number of ``workers``, a run of consecutive urgent tasks is a pool,
  not a queue: whenever a worker is free (fewer of the lane's tasks launched and not yet
  completed than it has workers), the ready task of the run with the lowest urgency is launched,
  ahead of earlier ones still waiting for their inputs. A task without an urgency is a barrier:
  nothing overtakes it and it overtakes nothing. So the CPU can update the unit the next step
  needs first rather than the one whose gradient came first.
- **Dependencies.** An edge between two device lanes is satisfied once the producer is
  *launched*: the consumer's lane waits for the producer's fence, not the host. Any edge that
  touches the ``cpu`` lane needs the producer *completed* (the host needs the data).
- **Slots.** A task whose kind ``takes`` a pool gets a slot index from it, in plan order among
  that pool's takers (FIFO). The slot is released once every task that reads it (edges marked
  ``reads``) has been launched; the next taker of that slot waits for their fences on its lane.
- **Deadlock.** If nothing can be launched, no completion is outstanding and tasks remain,
  :class:`~flowtrain.errors.DeadlockError` names the stuck lane heads.

Memory. A run adds a graph per step for days, so nothing here may grow with the number of steps.
Each node drops its links to other nodes as soon as they have served (its successors once it
launched or completed, its slot's readers once the slot is released), so a finished node never
keeps a later step's nodes alive; and :meth:`Scheduler.forget` drops a node from :attr:`nodes`
when its completion arrives if that is after the caller forgot it (the executor's ``wait`` sees
a fence set before the completion reaches the loop).
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Mapping, NamedTuple

import networkx as nx

from ..errors import DeadlockError, ScheduleError, SlotError
from ..graph.tasks import DEVICE_LANES, LANES, Task, pool_of


class Launch(NamedTuple):
    """An instruction: start ``task`` on its lane.

    ``slot`` is the slot it takes (``None`` if its kind takes none); ``reads`` maps each pool
    whose slot it reads to the slot index; ``waits`` are the tasks whose fences its lane must
    wait for first (device-lane producers and the previous readers of the taken slot).
    """

    task: Task
    slot: int | None
    reads: dict[str, list[int]]
    waits: tuple[Task, ...]


class _Node:
    """One task's scheduling state. The lists of other nodes are emptied once they have served
    (see the module docstring, "Memory"): a node's links then never pin another step's nodes."""

    __slots__ = ("task", "waiting", "succ_launch", "succ_done", "holders", "readers", "readers_left",
                 "launched", "done", "notify", "slot", "fence_preds", "urgency", "forgotten")

    def __init__(self, task: Task, urgency: float | None = None) -> None:
        self.task = task
        self.urgency = urgency  # None: issued in plan order (see the module docstring)
        self.waiting = 0  # dependencies not yet satisfied
        self.succ_launch: list[_Node] = []  # successors satisfied by our launch
        self.succ_done: list[_Node] = []  # successors satisfied by our completion
        self.holders: list[_Node] = []  # slot takers whose slots we read
        self.readers: list[_Node] = []  # for a taker: the tasks that read its slot
        self.readers_left = 0  # for a taker: readers not yet launched
        self.launched = False
        self.done = False
        self.notify = False  # the host must be told when we complete
        self.slot: int | None = None
        self.fence_preds: list[Task] = []
        self.forgotten = False  # forget() asked before the completion arrived: drop it then


class PoolState:
    """Free slots of one pool and the fences each carries from its last holder's readers."""

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        self.free: deque[int] = deque(range(capacity))
        self.fences: dict[int, tuple[Task, ...]] = {i: () for i in range(capacity)}
        self.takers: deque[_Node] = deque()  # plan order
        self.held: dict[int, Task] = {}

    def __repr__(self) -> str:
        waiting = sum(1 for n in self.takers if not n.launched)
        return f"<Slots {self.name} {len(self.held)}/{self.capacity}, {waiting} waiting>"


class Scheduler:
    """Decides launches for one or more graphs added in plan order (see module docstring)."""

    def __init__(self, budgets: dict[str, int], workers: Mapping[str, int] | None = None) -> None:
        for pool, n in budgets.items():
            if n < 1:
                raise SlotError(f"slot budget for {pool!r} must be at least 1 (got {n})")
        self.workers = {lane: n for lane, n in (workers or {}).items() if lane not in DEVICE_LANES}
        self.running = {lane: 0 for lane in self.workers}  # launched, completion not yet seen
        self.pools = {name: PoolState(name, n) for name, n in budgets.items()}
        self.nodes: dict[Task, _Node] = {}
        self.lanes: dict[str, deque[_Node]] = {lane: deque() for lane in LANES}
        self.outstanding = 0  # launched tasks whose completion the host awaits
        self.unlaunched = 0
        self.undone = 0

    # ---- building -------------------------------------------------------------------
    def add(self, order: Iterable[Task], graph: nx.DiGraph, extra_edges: Iterable[tuple[Task, Task]] = (),
            urgency: Mapping[Task, float] | None = None) -> None:
        """Add ``graph``'s tasks in the proposed ``order`` (which must list each task of the
        graph once, in an order consistent with its edges). ``extra_edges`` may point from
        tasks added earlier (e.g. the previous step's ``cpu_adam``) into this graph.
        ``urgency`` ranks host tasks that may overtake each other on a lane with ``workers``
        (module docstring); it is ignored elsewhere."""
        order = list(order)
        if len(order) != graph.number_of_nodes() or set(order) != set(graph.nodes):
            missing = set(graph.nodes) - set(order)
            extra = set(order) - set(graph.nodes)
            raise ScheduleError(
                f"the proposed order must list every task of the graph exactly once "
                f"(missing {len(missing)}, unknown {len(extra)}, {len(order)} listed for {graph.number_of_nodes()})"
            )
        position = {t: i for i, t in enumerate(order)}
        for u, v in graph.edges:
            if position[u] >= position[v]:
                raise ScheduleError(f"the proposed order runs {v} before its dependency {u}")
        for t in order:
            if t in self.nodes:
                raise ScheduleError(f"task {t} was already added")
            if t.takes is not None and t.takes not in self.pools:
                raise SlotError(f"task {t} takes a slot from pool {t.takes!r}, which has no budget")
        urgency = urgency or {}
        new = {t: _Node(t, urgency.get(t) if t.lane in self.workers else None) for t in order}
        for n in new.values():
            n.notify = n.task.lane not in DEVICE_LANES  # host work always reports completion
        self.nodes.update(new)
        edges = [(u, v, d.get("reads", False)) for u, v, d in graph.edges(data=True)]
        edges += [(u, v, False) for u, v in extra_edges]
        for u, v, reads in edges:
            pu, nv = self.nodes.get(u), self.nodes.get(v)
            if pu is None or nv is None:
                raise ScheduleError(f"edge {u} -> {v} names a task that was never added")
            if reads:
                if u.takes is None:
                    raise SlotError(f"{v} reads a slot of {u}, whose kind takes none")
                if pu.launched:
                    raise ScheduleError(f"{v} reads the slot of {u}, which was already released")
                nv.holders.append(pu)
                pu.readers.append(nv)
                pu.readers_left += 1
            fenced = u.lane in DEVICE_LANES and v.lane in DEVICE_LANES
            if fenced:
                if not pu.launched:
                    pu.succ_launch.append(nv)
                    nv.waiting += 1
                nv.fence_preds.append(u)
            else:
                if pu.launched and not pu.notify:
                    raise ScheduleError(f"{u} was launched without completion tracking; {v} cannot wait for it")
                pu.notify = True
                if not pu.done:
                    pu.succ_done.append(nv)
                    nv.waiting += 1
        for t in order:
            n = new[t]
            self.lanes[t.lane].append(n)
            if t.takes is not None:
                self.pools[t.takes].takers.append(n)
        self.unlaunched += len(order)
        self.undone += len(order)

    # ---- events -----------------------------------------------------------------------
    def poll(self) -> list[Launch]:
        """Launch everything that may start now; raise DeadlockError if nothing ever can."""
        out: list[Launch] = []
        progress = True
        while progress:
            progress = False
            for lane, queue in self.lanes.items():
                while queue:
                    node = queue[0] if queue[0].urgency is None else self._most_urgent(lane, queue)
                    launch = None if node is None else self._try_launch(node)
                    if launch is None or node is None:
                        break
                    if node is queue[0]:
                        queue.popleft()
                    else:
                        queue.remove(node)
                    out.append(launch)
                    progress = True
        # Only a completion can unblock a lane head now; with none to come, tasks left over
        # can never start (checked even when this poll launched some: no later event would).
        if self.unlaunched and not self.outstanding:
            heads = [q[0].task for q in self.lanes.values() if q]
            stuck = ", ".join(f"{t} ({self._why(self.nodes[t])})" for t in heads)
            raise DeadlockError(f"no task can start and none is running; waiting: {stuck}. "
                                f"Slots: {', '.join(map(repr, self.pools.values()))}")
        return out

    def complete(self, task: Task) -> None:
        """The host has seen ``task`` finish (only needed for tasks with ``needs_completion``)."""
        node = self.nodes[task]
        if not node.launched or node.done:
            raise ScheduleError(f"completion of {task}, which is not running")
        node.done = True
        self.undone -= 1
        if node.notify:
            self.outstanding -= 1
        if task.lane in self.running:
            self.running[task.lane] -= 1
        for s in node.succ_done:
            s.waiting -= 1
        node.succ_done = []  # served; add() appends to a done node's list no more
        if node.forgotten:
            del self.nodes[task]

    def needs_completion(self, task: Task) -> bool:
        """Whether the executor must report this task's completion through :meth:`complete`."""
        return self.nodes[task].notify

    @property
    def finished_launching(self) -> bool:
        return self.unlaunched == 0

    def forget(self, tasks: Iterable[Task]) -> None:
        """Drop tasks' bookkeeping (for long runs that add graph after graph): at once for a
        finished task, at its :meth:`complete` for one whose completion is still on its way.
        Later graphs may no longer name forgotten tasks in their edges."""
        for t in tasks:
            n = self.nodes.get(t)
            if n is None:
                continue
            if n.done:
                del self.nodes[t]
            else:
                n.forgotten = True

    # ---- internals --------------------------------------------------------------------
    def _most_urgent(self, lane: str, queue: deque[_Node]) -> _Node | None:
        """The ready task of the run of urgent tasks at the head of ``lane`` with the lowest
        urgency (the earliest in plan order among equals), or None: no worker is free, or none of
        them can start yet. A slot taker stays in plan order among its pool's takers."""
        if self.running[lane] >= self.workers[lane]:
            return None
        best: _Node | None = None
        best_urgency = 0.0
        for node in queue:
            if node.urgency is None:
                break  # a barrier
            if node.waiting or (node.task.takes is not None and self.pools[node.task.takes].takers[0] is not node):
                continue
            if best is None or node.urgency < best_urgency:
                best, best_urgency = node, node.urgency
        return best

    def _why(self, node: _Node) -> str:
        if node.waiting:
            return f"{node.waiting} dependencies unmet"
        pool = self.pools[pool_of(node.task)]
        return f"needs a {pool.name} slot"

    def _try_launch(self, node: _Node) -> Launch | None:
        if node.waiting:
            return None
        task = node.task
        waits = list(node.fence_preds)
        slot = None
        if task.takes is not None:
            pool = self.pools[task.takes]
            if pool.takers[0] is not node or not pool.free:
                return None
            pool.takers.popleft()
            slot = pool.free.popleft()
            waits.extend(pool.fences[slot])
            pool.held[slot] = task
            node.slot = slot
        reads: dict[str, list[int]] = {}
        for h in node.holders:
            held = h.slot
            assert held is not None  # a holder was granted its slot at its launch
            reads.setdefault(pool_of(h.task), []).append(held)
        node.launched = True
        self.unlaunched -= 1
        if task.lane in self.running:
            self.running[task.lane] += 1
        if node.notify:
            self.outstanding += 1
        elif task.lane in DEVICE_LANES:
            # Completion is never reported for it: count it done for bookkeeping.
            node.done = True
            self.undone -= 1
        for s in node.succ_launch:
            s.waiting -= 1
        for h in node.holders:
            h.readers_left -= 1
            if h.readers_left == 0:
                self._release(h)
        if task.takes is not None and node.readers_left == 0:
            self._release(node)  # a slot nobody reads is free at once
        # Served: add() links to a launched node's succ_launch no more, and holders and fences
        # are in the Launch now. Emptying them keeps this step's nodes from pinning others.
        node.succ_launch, node.holders, node.fence_preds = [], [], []
        return Launch(task, slot, reads, tuple(waits))

    def _release(self, holder: _Node) -> None:
        pool = self.pools[pool_of(holder.task)]
        slot = holder.slot
        assert slot is not None and pool.held.get(slot) is holder.task
        del pool.held[slot]
        readers = tuple(n.task for n in holder.readers)
        holder.readers = []  # released: add() refuses new readers of a launched taker
        pool.fences[slot] = readers or (holder.task,)
        pool.free.append(slot)
