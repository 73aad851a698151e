"""Memory over time: slots in use against each pool's budget, and bytes held on the GPU and in
pinned host memory.

A slot holds its bytes from the start of the task that took it until its last reader is done
(:func:`~flowtrain.viz.analysis.slot_uses`). How many bytes a slot of a pool holds, and where
the pool lives, come from the trace's metadata when the producer wrote them::

    "otherData": {"flowtrain": {"budgets": {"weights": 2, "grads": 2, "host_grads": 3},
                                "slot_bytes": {"weights": 181760, "grads": 727040, ...},
                                "pool_memory": {"host_grads": "pinned"},
                                "capacities": {"gpu": 80e9, "pinned": 20e9}}}

Without ``slot_bytes`` a pool's slot size is the most bytes a task that took one moved (a fetch
moves a whole slot); a pool whose takers move nothing (``zero_grad``) has no known size and is
left out of the byte totals, by name. Without ``pool_memory`` a pool named ``host*`` is pinned
host memory and any other is on the GPU.

The slots are only part of a run's memory: activations, resident weights, the allocator's cache
and the CUDA context are not in any slot, so a run can peak at 73.7 GiB on the GPU while its
slots hold 2.3 GiB. What the producer recorded about the whole run is kept beside the slot
bytes and said apart from them (:func:`caption`)::

    "planned": {"gpu": 82443000000, "host": 28451000000},       # the memory plan's peaks
    "measured": {"gpu_peak": 79110000000, "gpu_reserved_peak": ...}   # torch's, after the run
"""

from __future__ import annotations

from typing import Sequence

import msgspec

from .analysis import SlotUse
from .load import Trace
from .steps import fmt_bytes

GPU, PINNED = "gpu", "pinned"


class Memory(msgspec.Struct, frozen=True):
    """Bytes held over time per place (``gpu``, ``pinned``), as step functions
    ``[(time, bytes from then on), ...]``, and what they could not count."""

    held: dict[str, list[tuple[float, int]]]
    slot_bytes: dict[str, int]  # per pool, where known
    place: dict[str, str]  # per pool
    unknown: tuple[str, ...]  # pools whose slot size the trace does not say
    capacities: dict[str, int]  # per place, where the trace says
    planned: dict[str, int] = {}  # the memory plan's peak bytes of the whole run, per place ("gpu", "host")
    measured: dict[str, int] = {}  # measured peaks of the whole run ("gpu_peak": allocated, "gpu_reserved_peak")

    def peak(self, place: str) -> int:
        return max((b for _, b in self.held.get(place, [])), default=0)


def _meta_ints(trace: Trace, key: str) -> dict[str, int]:
    """``meta[key]`` as ``{name: int}``, leaving out what is not a number (``null`` limits)."""
    value = trace.meta.get(key)
    if not isinstance(value, dict):
        return {}
    return {str(k): int(v) for k, v in value.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def pool_place(trace: Trace, pool: str) -> str:
    given = trace.meta.get("pool_memory")
    if isinstance(given, dict) and given.get(pool) in (GPU, PINNED):
        return str(given[pool])
    return PINNED if pool.startswith("host") else GPU


def memory(trace: Trace, uses: Sequence[SlotUse]) -> Memory:
    """Bytes held in taken slots over time, per place."""
    given = _meta_ints(trace, "slot_bytes")
    sizes = dict(given)
    for u in uses:
        if u.pool not in given:
            sizes[u.pool] = max(sizes.get(u.pool, 0), trace.tasks[u.holder].bytes)
    pools = sorted({u.pool for u in uses})
    unknown = tuple(p for p in pools if not sizes.get(p))
    place = {p: pool_place(trace, p) for p in pools}
    changes: dict[str, list[tuple[float, int]]] = {}
    for u in uses:
        if sizes.get(u.pool):
            changes.setdefault(place[u.pool], []).extend([(u.start, sizes[u.pool]), (u.end, -sizes[u.pool])])
    held = {where: _steps(cs) for where, cs in sorted(changes.items())}
    return Memory(held, {p: sizes[p] for p in pools if sizes.get(p)}, place, unknown, _meta_ints(trace, "capacities"),
                  _meta_ints(trace, "planned"), _meta_ints(trace, "measured"))


def caption(m: Memory) -> str:
    """What the bytes row shows, in words: the slots' peaks, named as the slots' (never as the
    run's memory), then the run's own GPU numbers where the trace records them, else that it
    does not. For example ``slots hold at most 2.3 GiB on the GPU, 4.5 GiB pinned (slot
    buffers only) · the run on the GPU: 73.7 GiB measured peak (allocated), 76.8 GiB planned,
    limit 80.0 GiB``."""
    names = {GPU: "on the GPU", PINNED: "pinned"}
    held = [f"{fmt_bytes(m.peak(w))} {names.get(w, w)}" for w in (GPU, PINNED) if w in m.held]
    parts = [f"slots hold at most {', '.join(held)} (slot buffers only)" if held else "no slot bytes known"]
    if m.unknown:
        parts.append(f"not counted (slot size unknown): {', '.join(m.unknown)}")
    run = []
    if "gpu_peak" in m.measured:
        run.append(f"{fmt_bytes(m.measured['gpu_peak'])} measured peak (allocated)")
    if "gpu_reserved_peak" in m.measured:
        run.append(f"{fmt_bytes(m.measured['gpu_reserved_peak'])} reserved")
    if "gpu" in m.planned:
        run.append(f"{fmt_bytes(m.planned['gpu'])} planned")
    if GPU in m.capacities:
        run.append(f"limit {fmt_bytes(m.capacities[GPU])}")
    parts.append(f"the run on the GPU: {', '.join(run)}" if run else "the trace records no peak for the run's GPU memory")
    return " \u00b7 ".join(parts)


def _steps(changes: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """A running total of ``(time, change)`` as ``[(time, total from then on), ...]`` from 0,
    releases before takes at the same instant, one point per instant."""
    out: list[tuple[float, int]] = [(0.0, 0)]
    total = 0
    for t, d in sorted(changes, key=lambda c: (c[0], c[1])):
        total += d
        if out[-1][0] == t:
            out[-1] = (t, total)
        else:
            out.append((t, total))
    return [p for n, p in enumerate(out) if n == 0 or p[1] != out[n - 1][1]]
