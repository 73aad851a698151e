"""Sizes of the host and device buffers, as plain arithmetic on unit layouts (no torch).

The planner (:mod:`flowtrain.plan.memory`), the simulator and the state itself
(:mod:`flowtrain.train.host_state`, :mod:`flowtrain.train.program`) size their buffers with
these functions, so the plan counts exactly what the run allocates; keeping them free of torch
lets ``flowtrain plan`` and ``flowtrain simulate`` answer without importing it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from ..model.layout import UnitLayout

#: Host state layouts: fp32 master and Adam m, v always; gradients through a staging ring
#: (``staged``), a per-unit host gradient (``full``), or staged plus a bf16 streaming copy.
LAYOUTS = ("staged", "full", "stream-bf16")

#: Elements of the fp32 landing buffer that fetches of fp32 masters pass through on their way
#: to a bf16 slot (64 MiB): large enough that each piece's copy runs at full PCIe speed.
LANDING_NUMEL = 16 << 20


def slot_numel(layouts: list[UnitLayout], resident: Iterable[str], tied: bool) -> int:
    """Elements of one device weight or gradient slot: the largest streamed unit; a streamed
    tied head's slot also carries the embedding matrix after the final norm."""
    res = set(resident)
    n = max((lay.numel for lay in layouts if lay.key not in res), default=0)
    if tied and "head" not in res:
        n = max(n, layouts[-1].numel + layouts[0].numel)
    return n


def staging_numel(layouts: Iterable[UnitLayout], resident: Iterable[str] = ()) -> int:
    """Elements of one host staging slot: the largest streamed decoder layer (or, with no
    streamed layer, the largest streamed unit). Bigger units pass through it in chunks."""
    res = set(resident)
    streamed = [lay for lay in layouts if lay.key not in res]
    layers = [lay.numel for lay in streamed if lay.unit == "layer"]
    return max(layers or [lay.numel for lay in streamed] or [0])


def grad_chunks(layouts: Iterable[UnitLayout], resident: Iterable[str], stage_n: int) -> dict[str, int]:
    """Staging chunks of every streamed unit larger than one staging slot."""
    res = set(resident)
    return {lay.key: math.ceil(lay.numel / stage_n) for lay in layouts
            if lay.key not in res and stage_n and lay.numel > stage_n}


def chunk_range(numel: int, stage_n: int, chunk: int | None) -> tuple[int, int]:
    """``[lo, hi)`` of chunk ``chunk`` of a unit of ``numel`` elements (all of it for ``None``)."""
    if chunk is None:
        return 0, numel
    lo = chunk * stage_n
    return lo, min(numel, lo + stage_n)


def undo_record_numel(n: int) -> int:
    """fp32 elements of the undo record of a range of ``n`` elements: its master, m and v, and
    the chunk's step count (:class:`flowtrain.train.nonfinite.Saved`)."""
    return 3 * n + 1


def undo_arena_bytes(units: list[tuple[int, int]], stage_n: int, limit: int, *, touched: bool = False) -> int:
    """Host bytes of the undo arena: ``limit``, or less where a whole step's records need less
    (master, m, v and step count of every range a ``cpu_adam`` updates; ``units`` gives each
    streamed unit's elements and staging chunks, bottom unit first). The program sizes the arena
    with it (pages are touched only when written). ``touched``: what the planner counts, with
    nothing resident: the bottom unit's last chunk is offloaded last, so its ``cpu_adam`` finds
    the step verified and records nothing. A range whose record alone exceeds ``limit`` is never
    recorded, so it takes no room (a model whose every layer does gets no arena at all)."""
    ranges = [hi - lo for n, k in units for c in range(k) for lo, hi in [chunk_range(n, stage_n, c if k > 1 else None)]]
    if touched and ranges:
        ranges.pop(units[0][1] - 1)
    fitting = [r for r in ranges if 4 * undo_record_numel(r) <= limit]  # a larger range is never recorded
    return 4 * (min(limit, 4 * sum(undo_record_numel(r) for r in fitting)) // 4)
