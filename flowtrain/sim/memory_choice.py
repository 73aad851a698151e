"""``--activations auto`` and ``--layout auto``, checked against predicted step time.

The planner picks where activations wait and the host layout by rules: what each choice saves
per GPU byte (:func:`~flowtrain.plan.planner.plan_activations`, :mod:`flowtrain.plan.attention`), and the
staged layout (12 bytes per parameter) unless ``--grad-clip`` needs the full one. The rules
follow what the H200 measured; another machine may want otherwise (a slow link wants the
stream-bf16 layout, which halves the bytes of every fetch for 2 more host bytes per parameter).
So where a machine model of the run's GPU is known (the one ``--order auto`` predicts with,
:mod:`.order_choice`), the plan the rules make is compared with the plan of each alternative of
a setting left on ``auto``, one change at a time::

    req, plan, why = choose_memory(cfg, req, plan, plan_one, machine=machine)

and the fastest predicted is taken where it fits and is at least 2% faster than the rules'
plan (closer than the model can tell apart otherwise); ``why`` says so, and the plan and the run
summary show it.

``--resident auto`` is checked the same way: the rules stop at a third of the layers (past it,
on a dense model, a resident layer saves less than its GPU bytes buy as slots and kept
activations), but where CPU Adam is what the step waits for (a mixture of experts, whose layers
hold many parameters for little compute) each further resident layer takes its update off the
CPU. So more layers are tried, 1, 2, 4, ... beyond the rules' count and the most that fit;
where the fastest is one of them, the fewest layers predicted within the margin of it (and
still the margin faster than the rules' plan) are taken: the rest of the GPU stays with kept
activations and slots. Without a GPU, with several processes, or on a GPU no shipped machine
describes, the rules' plan stands and nothing is simulated.
"""

from __future__ import annotations

from typing import Any, Callable

import msgspec

from ..plan.planner import never_resident
from .order_choice import MARGIN, Predictions, this_gpu_machine

__all__ = ["alternatives", "choose_memory", "more_resident"]


def alternatives(req: Any) -> list[tuple[str, str]]:
    """``(setting, value)`` pairs to compare with the rules' plan: the explicit values of each
    setting the request leaves on ``auto``, where the rules may be wrong: keeping layers or not,
    and the layout. Not the ``--activations`` the rules turn to only for memory: ``offload`` (the rules
    offload what the GPU cannot hold; offloading more only adds copies) and ``attention`` (the
    rules save attention outputs wherever their FLOPs pay for their bytes; on every layer they
    take memory that checkpoints or kept layers use better). Both stay in ``flowtrain plan
    --machine``'s wider search (:mod:`flowtrain.sim.choose`)."""
    out: list[tuple[str, str]] = []
    if req.activations == "auto":
        out += [("activations", a) for a in ("recompute", *(("keep",) if req.checkpoint_every == 1 else ()))]
    if req.layout == "auto" and not req.grad_clip:
        out.append(("layout", "stream-bf16"))
    return out


def more_resident(cfg: Any, req: Any, plan: Any, fits: Callable[[str], bool]) -> list[str]:
    """``--resident`` values to compare with the rules' plan where the request leaves it on
    ``auto``: the plan's resident units with 1, 2, 4, ... more layers, bottom-up (the order the
    rules add them), and with the most layers that fit (found by bisection; ``fits(value)``
    says whether that residency's plan fits). Never a layer the run must stream
    (:func:`~flowtrain.plan.planner.never_resident`: adapters in host memory)."""
    if req.resident != "auto":
        return []
    resident, never = tuple(plan.spec.resident), never_resident(cfg, req)
    layers = [f"layer.{i}" for i in range(cfg.num_layers) if f"layer.{i}" not in (*resident, *never)]

    def value(more: int) -> str:
        return ",".join(resident + tuple(layers[:more]))

    lo, hi = 0, len(layers)  # the most that fit lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(value(mid)) else (lo, mid - 1)
    counts = {lo} if lo else set()
    more = 1
    while more < lo:
        counts.add(more)
        more *= 2
    return [value(n) for n in sorted(counts)]


def choose_memory(cfg: Any, req: Any, plan: Any, plan_one: Callable[[Any], Any], *, policy: Any,
                     machine: Any = None, local_gpu: bool = True,
                     predictions: Predictions | None = None) -> tuple[Any, Any, str | None]:
    """``(req, plan, why)``: the rules' request and plan, or an alternative's predicted at least
    2% faster on ``machine`` (a :class:`~flowtrain.sim.machine.Machine`; by default, with
    ``local_gpu``, the one describing this GPU); ``why`` names the change and both predictions
    where one was taken. ``plan_one(req)`` plans one request; ``predictions`` may hold what the
    order choice simulated already.

    The layout alternative is tried only where the link shows on the rules' plan's critical
    chain (at least the margin of it on ``h2d``): stream-bf16 only halves the fetches' bytes, so
    it cannot gain more than the time the chain spends copying them. Likewise more resident
    layers only where the chain spends at least the margin of it off the GPU's compute (CPU
    Adam, copies): residency cannot gain more than that."""
    options = alternatives(req)
    if not plan.fits or plan.device != "cuda" or req.processes > 1 or not (options or req.resident == "auto"):
        return req, plan, None
    machine = machine or (this_gpu_machine() if local_gpu else None)
    if machine is None:
        return req, plan, None
    predictions = predictions or Predictions(cfg, policy)
    plans: dict[Any, Any] = {}

    def plan_of(r: Any) -> Any:
        key = msgspec.json.encode(r)
        if key not in plans:
            plans[key] = plan_one(r)
        return plans[key]

    def same(p: Any) -> bool:  # an alternative the rules' plan already is
        return (p.layout, p.spec, p.budgets, p.chunk_tokens) == (plan.layout, plan.spec, plan.budgets, plan.chunk_tokens)

    summary = predictions(req, plan, machine)
    base = summary.tokens_per_s
    chain = summary.critical_by_lane
    on_link = chain.get("h2d", 0.0) / (sum(chain.values()) or 1.0)
    if 1 - chain.get("compute", 0.0) / (sum(chain.values()) or 1.0) >= MARGIN - 1:
        options += [("resident", v) for v in more_resident(
            cfg, req, plan, lambda v: plan_of(msgspec.structs.replace(req, resident=v)).fits)]
    best = (base, req, plan, "")
    residencies: list[tuple[float, Any, Any, str]] = []  # fewest layers first
    for setting, value in options:
        if setting == "layout" and on_link < MARGIN - 1:
            continue
        r = msgspec.structs.replace(req, **{setting: value})
        p = plan_of(r)
        if p.fits and not same(p):
            t = predictions(r, p, machine).tokens_per_s
            if setting == "resident":
                residencies.append((t, r, p, f"--{setting} {value}"))
            if t > best[0]:
                best = (t, r, p, f"--{setting} {value}")
    if best[3].startswith("--resident") and best[0] >= MARGIN * base:
        # the fewest layers within the margin of the fastest that still clear the rules' plan by it
        floor = max(best[0] / MARGIN, MARGIN * base)
        best = next(c for c in residencies if c[0] >= floor)
    t, r, p, change = best
    if t < MARGIN * base:
        return req, plan, None
    return r, p, f"auto: {change}, predicted on {machine.name} {t:,.0f} tok/s against {base:,.0f} for the rules' plan"
