"""Helpers shared by the runtime tests.

- :class:`Recorder`: a program that stamps every task with a global sequence number when it
  starts and when it ends (and keeps the slot it took and the slots it read), so tests can
  assert the *real* execution order on thread lanes without timing bounds.
- :func:`check_topological` / :func:`check_slots`: the engine's two promises, checked on a
  recorder after a run.
- :func:`slots_suffice`: an oracle that says whether a plan can finish under a slot budget.
- :class:`ToyModel`: a numeric program for compiled graphs (float64 arithmetic on buffers keyed
  by slot) and :meth:`ToyModel.expected`, the same model computed by plain loops.
- :class:`FenceLog`: every fence the lanes make during a test, to check that all were set.
- :class:`Hold`: a hook that blocks a task until the test lets it go, and tells the loop it began.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections import defaultdict
from typing import Callable

import networkx as nx
import torch
from hypothesis import strategies as st

from flowtrain.graph import (
    GRADS,
    WEIGHTS,
    Backward,
    CpuAdam,
    Embed,
    EmbedBackward,
    Fetch,
    Forward,
    FoundInf,
    GradNorm,
    Loss,
    OffloadGrad,
    Recompute,
    StepSpec,
    Task,
    VerifyStep,
    ZeroGrad,
)
from flowtrain.graph.tasks import DEVICE_LANES
from flowtrain.runtime import run_graph

HANG_GUARD_S = 60.0  # only ever reached when something hangs


class Recorder:
    """A program that records what ran, in which order, with which slots.

    ``hooks`` maps a task to a callable ``hook(task, ctx)`` run inside the task (to block it on
    an event, or make it fail). ``active`` counts jobs running right now.
    """

    def __init__(self, hooks: dict[Task, Callable] | None = None) -> None:
        self.hooks = hooks or {}
        self._lock = threading.Lock()
        self._seq = 0
        self.start: dict[Task, int] = {}
        self.end: dict[Task, int] = {}
        self.slot: dict[Task, int | None] = {}
        self.reads: dict[Task, dict[str, list[int]]] = {}
        self.runs: defaultdict[Task, int] = defaultdict(int)
        self.active = 0

    def _tick(self) -> int:
        with self._lock:
            self._seq += 1
            return self._seq

    def __call__(self, task: Task, ctx) -> int:
        with self._lock:
            self._seq += 1
            self.start[task] = self._seq
            self.active += 1
            self.runs[task] += 1
        self.slot[task] = ctx.slot
        self.reads[task] = {pool: list(slots) for pool, slots in ctx.reads.items()}
        try:
            hook = self.hooks.get(task)
            if hook is not None:
                hook(task, ctx)
        finally:
            with self._lock:
                self._seq += 1
                self.end[task] = self._seq
                self.active -= 1
        return 0

    @property
    def ran(self) -> set[Task]:
        return set(self.start)


def check_topological(graph: nx.DiGraph, rec: Recorder, extra_edges=()) -> None:
    """Every task ran once, and after every one of its dependencies had finished."""
    assert set(rec.start) == set(graph.nodes), "every task runs"
    assert all(n == 1 for n in rec.runs.values()), "no task runs twice"
    for u, v in [*graph.edges, *extra_edges]:
        assert rec.start[v] > rec.end[u], f"{v} started before its dependency {u} finished"


def readers(graph: nx.DiGraph, holder: Task) -> list[Task]:
    return [v for _, v, r in graph.out_edges(holder, data="reads") if r]


def check_slots(graph: nx.DiGraph, rec: Recorder, budgets: dict[str, int]) -> None:
    """Slot budgets hold in real execution order.

    A slot is in use from its holder's start until the last of its readers ends. Per pool, the
    slot indices stay below the budget, two uses of one index never overlap, and every reader
    was handed the slot its holder took.
    """
    uses: defaultdict[tuple[str, int], list[tuple[int, int, Task]]] = defaultdict(list)
    for t in graph:
        if t.takes is None:
            assert rec.slot[t] is None
            continue
        s = rec.slot[t]
        assert s is not None and 0 <= s < budgets[t.takes], f"{t} got slot {s} of a {budgets[t.takes]}-slot pool"
        rs = readers(graph, t)
        for r in rs:
            assert s in rec.reads[r].get(t.takes, []), f"{r} reads {rec.reads[r]}, not {t}'s slot {s}"
        last = max([rec.end[t], *(rec.end[r] for r in rs)])
        uses[(t.takes, s)].append((rec.start[t], last, t))
    for (pool, s), spans in uses.items():
        spans.sort(key=lambda x: x[0])
        for (_, end_a, a), (start_b, _, b) in zip(spans, spans[1:]):
            assert start_b > end_a, f"{pool} slot {s}: {b} filled it while {a}'s readers still used it"


def slots_suffice(order: list[Task], graph: nx.DiGraph, budgets: dict[str, int]) -> bool:
    """Whether the scheduler's rules let ``order`` finish under ``budgets``.

    Completion is instantaneous here: whether a plan deadlocks depends only on the order in
    which slots are taken and released, never on timing. Rules: each lane issues in plan order,
    a pool hands out slots to its takers in plan order, a slot is free again once every task
    reading it has been issued.
    """
    lanes: dict[str, list[Task]] = defaultdict(list)
    takers: dict[str, list[Task]] = defaultdict(list)
    for t in order:
        lanes[t.lane].append(t)
        if t.takes is not None:
            takers[t.takes].append(t)
    left = {t: len(readers(graph, t)) for t in graph if t.takes is not None}
    in_use = dict.fromkeys(budgets, 0)
    issued: set[Task] = set()
    progress = True
    while progress:
        progress = False
        for queue in lanes.values():
            while queue:
                t = queue[0]
                if any(p not in issued for p in graph.predecessors(t)):
                    break
                if t.takes is not None:
                    if takers[t.takes][0] is not t or in_use[t.takes] >= budgets[t.takes]:
                        break
                    takers[t.takes].pop(0)
                    in_use[t.takes] += 1
                queue.pop(0)
                issued.add(t)
                progress = True
                for h in graph.predecessors(t):
                    if graph.edges[h, t]["reads"]:
                        left[h] -= 1
                        if left[h] == 0:
                            in_use[h.takes] -= 1
                if t.takes is not None and left[t] == 0:
                    in_use[t.takes] -= 1
    return len(issued) == graph.number_of_nodes()


def lane_order_ok(records, order) -> None:
    """Each device lane runs one job at a time, in plan order (thread lanes on CPU)."""
    position = {t: i for i, t in enumerate(order)}
    for lane in DEVICE_LANES:
        mine = sorted((r for r in records if r.lane == lane), key=lambda r: position[r.task])
        for a, b in zip(mine, mine[1:]):
            assert b.start >= a.end, f"{lane}: {b.task} started before {a.task} ended"


# ---- a numeric toy model ---------------------------------------------------------------------

D = 4  # width of every activation and of every unit's weight vector


class ToyModel:
    """A model with the shape of the real one, small enough to compute by hand.

    Units: the embedding ``e`` (D), layer i ``w_i`` (D), the head ``[n, H]`` (2D) whose output
    matrix is ``e`` when tied. Micro-batch m has input ``x_m`` (D)::

        a_0 = x_m * e        a_{i+1} = tanh(a_i * w_i)        loss_m = sum(n * a_L * H)

    The program keeps device state in buffers keyed by slot: ``fetch`` copies a unit's host
    weights into its weight slot, readers take weights only from there; ``zero_grad`` zeroes a
    gradient slot with one row per micro-batch, backward work adds into its row, ``offload_grad``
    sums the rows into the host gradient, and ``cpu_adam`` takes an SGD step (after ``grad_norm``
    has computed the clip factor when clipping). Forward activations are dropped unless they are
    checkpoints, so backward only works if recompute ran first. Any ordering or slot mistake
    changes the numbers (or raises).
    """

    LR = 0.25

    def __init__(self, spec: StepSpec, seed: int = 0) -> None:
        self.spec = spec
        gen = torch.Generator().manual_seed(seed)

        def rand(n):
            return torch.rand(n, generator=gen, dtype=torch.float64) + 0.5

        self.x = [rand(D) for _ in range(spec.micro_batches)]
        self.W: dict[tuple[str, int | None], torch.Tensor] = {("embed", None): rand(D)}
        for i in range(spec.layers):
            self.W[("layer", i)] = rand(D)
        self.W[("head", None)] = rand(2 * D)
        self._lock = threading.Lock()
        self.weight_slots: dict[int, torch.Tensor] = {}
        self.grad_slots: dict[int, torch.Tensor] = {}
        self.acts: dict[tuple, torch.Tensor] = {}
        self.dacts: dict[tuple, torch.Tensor] = {}
        self.G: dict[tuple, torch.Tensor] = {}
        self.scale: dict[int, float] = {}
        self.losses: dict[tuple[int, int], float] = {}

    # ---- host side ---------------------------------------------------------------------
    def fetched(self, unit: str, layer: int | None) -> torch.Tensor:
        w = self.W[(unit, layer)]
        if unit == "head" and self.spec.tied:
            return torch.cat([w[:D], self.W[("embed", None)]])
        return w

    def _buf(self, table: dict, slot: int, shape) -> torch.Tensor:
        with self._lock:
            if slot not in table:
                table[slot] = torch.full(shape, math.nan, dtype=torch.float64)
            return table[slot]

    def state(self) -> dict:
        return {"W": {k: v.clone() for k, v in self.W.items()}, "losses": dict(self.losses)}

    # ---- the program -------------------------------------------------------------------
    def __call__(self, task: Task, ctx) -> int:
        s, m, i, k = task.step, task.micro_batch, task.layer, self.spec.checkpoint_every
        key = (task.unit, task.layer)
        match task:
            case Fetch():
                w = self.fetched(task.unit, task.layer)
                self._buf(self.weight_slots, ctx.slot, (2 * D,))[: len(w)] = w
                return 8 * len(w)
            case ZeroGrad():
                self._buf(self.grad_slots, ctx.slot, (self.spec.micro_batches, 2 * D)).zero_()
            case Embed():
                e = self.weight_slots[ctx.read(WEIGHTS)][:D]
                self.acts[("fwd", s, 0, m)] = self.x[m] * e
            case Forward():
                w = self.weight_slots[ctx.read(WEIGHTS)][:D]
                a = self.acts[("fwd", s, i, m)] if i % k == 0 else self.acts.pop(("fwd", s, i, m))
                self.acts[("fwd", s, i + 1, m)] = torch.tanh(a * w)
            case Loss():
                head = self.weight_slots[ctx.read(WEIGHTS)]
                n, out = head[:D], head[D:]
                L = self.spec.layers
                y = self.acts[("fwd", s, L, m)] if L % k == 0 else self.acts.pop(("fwd", s, L, m))
                self.losses[(s, m)] = float((n * y * out).sum())
                self.grad_slots[ctx.read(GRADS)][m] += torch.cat([y * out, n * y])
                self.dacts[(s, L - 1, m)] = n * out
            case Recompute():
                w = self.weight_slots[ctx.read(WEIGHTS)][:D]
                a = self._bwd_input(s, i, m)
                self.acts[("rec", s, i + 1, m)] = torch.tanh(a * w)
            case Backward():
                w = self.weight_slots[ctx.read(WEIGHTS)][:D]
                a = self._bwd_input(s, i, m)
                dw, da = layer_backward(a, w, self.dacts.pop((s, i, m)))
                self.grad_slots[ctx.read(GRADS)][m, :D] += dw
                self.dacts[(s, i - 1, m)] = da
            case EmbedBackward():
                self.grad_slots[ctx.read(GRADS)][m, :D] += self.dacts.pop((s, -1, m)) * self.x[m]
            case OffloadGrad():
                size = 2 * D if task.unit == "head" else D
                self.G[(s, *key)] = self.grad_slots[ctx.read(GRADS)][:, :size].sum(0)
                return 8 * size
            case GradNorm():
                self.scale[s] = clip_scale([self.G[(s, *u)] for u in self.W])
            case CpuAdam():
                self._sgd(s, key)
            case FoundInf() | VerifyStep():
                pass  # the toy's numbers are always finite
            case _:
                raise AssertionError(f"unknown task {task}")
        return 0

    def _bwd_input(self, s: int, i: int, m: int) -> torch.Tensor:
        if i % self.spec.checkpoint_every == 0:
            return self.acts[("fwd", s, i, m)]
        return self.acts[("rec", s, i, m)]

    def _sgd(self, s: int, key) -> None:
        scale = self.scale[s] if self.spec.grad_clip else 1.0
        g = self.G[(s, *key)]
        if key[0] == "embed" and self.spec.tied:
            g = g + self.G[(s, "head", None)][D:]
        if key[0] == "head" and self.spec.tied:
            self.W[key][:D] -= self.LR * scale * g[:D]
        else:
            self.W[key] -= self.LR * scale * g

    # ---- the same model by plain loops ---------------------------------------------------
    def expected(self, steps: int) -> dict:
        """Losses and final weights after ``steps`` SGD steps, computed without any graph."""
        spec, L, M = self.spec, self.spec.layers, self.spec.micro_batches
        W = {k: v.clone() for k, v in self.W.items()}
        losses = {}
        for s in range(steps):
            e = W[("embed", None)]
            head = torch.cat([W[("head", None)][:D], e]) if spec.tied else W[("head", None)]
            n, out = head[:D], head[D:]
            rows = {u: torch.zeros(M, 2 * D, dtype=torch.float64) for u in W}
            for m in range(M):
                acts = [self.x[m] * e]
                for i in range(L):
                    acts.append(torch.tanh(acts[i] * W[("layer", i)]))
                y = acts[L]
                losses[(s, m)] = float((n * y * out).sum())
                rows[("head", None)][m] += torch.cat([y * out, n * y])
                g = n * out
                for i in reversed(range(L)):
                    dw, g = layer_backward(acts[i], W[("layer", i)], g)
                    rows[("layer", i)][m, :D] += dw
                rows[("embed", None)][m, :D] += g * self.x[m]
            G = {u: rows[u][:, : (2 * D if u[0] == "head" else D)].sum(0) for u in W}
            scale = clip_scale([G[u] for u in W]) if spec.grad_clip else 1.0
            for u in W:
                g = G[u]
                if u[0] == "embed" and spec.tied:
                    g = g + G[("head", None)][D:]
                if u[0] == "head" and spec.tied:
                    W[u][:D] -= self.LR * scale * g[:D]
                else:
                    W[u] -= self.LR * scale * g
        return {"W": W, "losses": losses}


def layer_backward(a: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``tanh(a * w)`` w.r.t. ``w`` and ``a``, given the output gradient ``g``."""
    y = torch.tanh(a * w)
    d = g * (1 - y * y)
    return d * a, d * w


def clip_scale(grads: list[torch.Tensor]) -> float:
    """Clip to a global norm of 1, summing squared norms in a fixed order."""
    total = 0.0
    for g in grads:
        total += float((g * g).sum())
    return 1.0 / max(1.0, math.sqrt(total))


def same_state(a: dict, b: dict) -> None:
    """Bit-for-bit equal losses and weights."""
    assert a["losses"] == b["losses"]
    assert a["W"].keys() == b["W"].keys()
    for k in a["W"]:
        assert torch.equal(a["W"][k], b["W"][k]), f"{k}: {a['W'][k]} != {b['W'][k]}"


#: Random step shapes for hypothesis: every compiler option.
specs = st.builds(
    StepSpec,
    layers=st.integers(1, 5),
    micro_batches=st.integers(1, 3),
    checkpoint_every=st.integers(1, 3),
    order=st.sampled_from(["layer", "micro"]),
    tied=st.booleans(),
    grad_clip=st.booleans(),
)


def run_async(graph, program, policy):
    """``run_graph`` on a fresh event loop, with a guard that only trips on a hang."""

    async def main():
        return await asyncio.wait_for(run_graph(graph, program, policy), HANG_GUARD_S)

    return asyncio.run(main())


# ---- cancellation and faults ------------------------------------------------------------------


def lane_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("flowtrain-")]


def join_lane_threads(timeout: float = HANG_GUARD_S) -> list[threading.Thread]:
    """Wait for lane threads left behind (e.g. by a job that hung, now released) to end;
    returns those still alive."""
    for t in lane_threads():
        t.join(timeout)
    return lane_threads()


class FenceLog:
    """Every :class:`~flowtrain.runtime.lanes.Fence` the lanes create while installed (it
    patches the class the lanes instantiate), so a test can check that each one ended up set."""

    def __init__(self, monkeypatch) -> None:
        from flowtrain.runtime import lanes

        self.fences: list = []
        log = self.fences

        class Logged(lanes.Fence):
            def __init__(self) -> None:
                super().__init__()
                log.append(self)

        monkeypatch.setattr(lanes, "Fence", Logged)

    @property
    def unset(self) -> list:
        return [f for f in self.fences if not f.is_set()]

    def started_after(self, t: float) -> list:
        """Fences of jobs that began running (``perf_counter``) after ``t``: on a thread lane
        when the job's Python began; on a CUDA lane also when its waiter reached a job launched
        earlier, so there it is no test of what started after ``t``."""
        return [f for f in self.fences if f.began > t]


class Hold:
    """A hook that blocks its task until :meth:`release` (or for ever), after telling the
    test it began: ``await hold.began()`` returns once the task runs, without blocking the loop."""

    def __init__(self) -> None:
        self._began = threading.Event()
        self._go = threading.Event()
        self.tasks: list[Task] = []

    def __call__(self, task: Task, ctx) -> None:
        self.tasks.append(task)
        self._began.set()
        self._go.wait()

    async def began(self, timeout: float = HANG_GUARD_S) -> None:
        async def poll():
            while not self._began.is_set():
                await asyncio.sleep(0.002)

        await asyncio.wait_for(poll(), timeout)

    def release(self) -> None:
        self._go.set()


async def guarded(coro):
    """Await ``coro``, failing the test instead of hanging it."""
    return await asyncio.wait_for(coro, HANG_GUARD_S)


class Budget:
    """A user policy: the natural order with fixed budgets."""

    def __init__(self, **budgets: int) -> None:
        self.budgets = budgets

    def propose(self, graph):
        from flowtrain.policy import Proposal, natural_order

        return Proposal(natural_order(graph), dict(self.budgets))
