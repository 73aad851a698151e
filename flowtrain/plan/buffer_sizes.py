"""Sizes of the host and device buffers, as plain arithmetic on the units' flat maps (no torch):
weight and gradient slots, host staging slots and the chunks a gradient passes them in, the undo
arena; and the host state layouts (``--layout``) they are sized for.

The planner (:mod:`flowtrain.plan.planner`), the simulator and the state itself
(:mod:`flowtrain.train.host_state`, :mod:`flowtrain.train.program`) size their buffers with
these functions, so the plan counts exactly what the run allocates; keeping them free of torch
lets ``flowtrain plan`` and ``flowtrain simulate`` answer without importing it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Iterable

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..model.config import ModelConfig
    from ..model.flat_map import FlatMap

#: Host state layouts: fp32 master and Adam m, v always; gradients through a staging ring
#: (``staged``), a per-unit host gradient (``full``), or staged plus a bf16 streaming copy.
LAYOUTS = ("staged", "full", "stream-bf16")

#: Bytes of training state per parameter that no layout goes below: the fp32 master weight and
#: Adam's two fp32 moments (where the unit is streamed or resident).
STATE_BYTES_PER_PARAM = 12
#: The one "bytes per parameter" figure flowtrain states (the README, ``flowtrain plan``'s header
#: and hints, ``--layout``'s help): host bytes of training state per streamed parameter in each
#: layout, and what they are. The rest of a run's host memory (staging, checkpoints waiting for
#: their backward, the process) does not grow with the model and is counted on its own lines.
LAYOUT_STATE_BYTES = {"staged": STATE_BYTES_PER_PARAM, "full": STATE_BYTES_PER_PARAM + 4,
                      "stream-bf16": STATE_BYTES_PER_PARAM + 2}
LAYOUT_STATE_WHAT = {"staged": "fp32 master weight, Adam m and v",
                     "full": "fp32 master weight, Adam m and v, fp32 gradient",
                     "stream-bf16": "fp32 master weight, Adam m and v, bf16 streaming copy"}


def state_bytes_text(layout: str) -> str:
    """``"12 host bytes per parameter: fp32 master weight, Adam m and v"``: how the figure is said."""
    return f"{LAYOUT_STATE_BYTES[layout]} host bytes per parameter: {LAYOUT_STATE_WHAT[layout]}"


def units_by_size(cfg: "ModelConfig") -> list[tuple[int, str]]:
    """``(parameters, what sizes them)`` of the embedding, one decoder layer and the head, largest
    first: integer arithmetic on the config alone, before any layout is built."""
    vh = f"vocab_size {cfg.vocab_size:,} x hidden_size {cfg.hidden_size:,}"
    units = [(cfg.vocab_size * cfg.hidden_size, f"{vh}: an embedding of"),
             (cfg.layer_parameters(), f"hidden_size {cfg.hidden_size:,} and intermediate_size "
                                      f"{cfg.intermediate_size:,}: one decoder layer of")]
    if not cfg.tie_word_embeddings:
        units.append((cfg.vocab_size * cfg.hidden_size + cfg.hidden_size, f"{vh}: an output head of"))
    return sorted(units, key=lambda u: -u[0])


def host_memory_total() -> int | None:
    """Bytes of this machine's memory (all of it, not what is free), or None where unknown."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_units_fit(cfg: "ModelConfig", host_mem: float | None, gpu_bytes: int | None = None) -> None:
    """Refuse, in one line naming the config.json fields, a model whose largest unit's training
    state alone (:data:`STATE_BYTES_PER_PARAM` per parameter) is more than the machine could hold
    in one place: the host's memory (``host_mem`` GiB, ``--host-mem``, else all of this
    machine's) or, where larger, the GPU's (``gpu_bytes``). A unit's state lives whole in one of
    them, so no plan could fit such a model, and sizing one would allocate without end (its
    gradient passes the staging slots in millions of chunks, each a task of the step's graph).
    Integer arithmetic only, before anything is sized from the config."""
    host = int(host_mem * 2**30) if host_mem is not None else host_memory_total()
    if host is None:
        return
    holds = max(host, gpu_bytes or 0)
    params, what = units_by_size(cfg)[0]
    need = params * STATE_BYTES_PER_PARAM
    if need <= holds:
        return
    source = " planned for (--host-mem, or the machine's)" if host_mem is not None else ", all of this machine's memory"
    gpu = f" or the GPU ({gpu_bytes / 2**30:,.1f} GiB)" if gpu_bytes else ""
    raise ConfigError(
        f"model config: {what} {params:,} parameters, whose training state alone ({STATE_BYTES_PER_PARAM} bytes each: "
        f"{need / 2**30:,.0f} GiB) is more than the host could hold ({host / 2**30:,.1f} GiB{source}){gpu}; "
        f"no plan can fit this model"
    )


#: Elements of the fp32 landing buffer that fetches of fp32 masters pass through on their way
#: to a bf16 slot (64 MiB): large enough that each piece's copy runs at full PCIe speed.
LANDING_NUMEL = 16 << 20


def slot_numel(layouts: list[FlatMap], resident: Iterable[str], tied: bool) -> int:
    """Elements of one device weight or gradient slot: the largest streamed unit; a streamed
    tied head's slot also carries the embedding matrix after the final norm."""
    res = set(resident)
    n = max((lay.numel for lay in layouts if lay.key not in res), default=0)
    if tied and "head" not in res:
        n = max(n, layouts[-1].numel + layouts[0].numel)
    return n


def staging_numel(layouts: Iterable[FlatMap], resident: Iterable[str] = ()) -> int:
    """Elements of one host staging slot: the largest streamed decoder layer (or, with no
    streamed layer, the largest streamed unit). Bigger units pass through it in chunks."""
    res = set(resident)
    streamed = [lay for lay in layouts if lay.key not in res]
    layers = [lay.numel for lay in streamed if lay.unit == "layer"]
    return max(layers or [lay.numel for lay in streamed] or [0])


#: The most staging chunks one unit's gradient may pass through: each is an ``offload_grad`` and a
#: ``cpu_adam`` task of every step's graph. Published models need a few dozen at most (an
#: embedding a few dozen times the largest decoder layer).
MAX_GRAD_CHUNKS = 1 << 14


def grad_chunks(layouts: Iterable[FlatMap], resident: Iterable[str], stage_n: int) -> dict[str, int]:
    """Staging chunks of every streamed unit larger than one staging slot. A unit that would
    need more than :data:`MAX_GRAD_CHUNKS` is refused in one line, before any task is built."""
    res = set(resident)
    big = [lay for lay in layouts if lay.key not in res and stage_n and lay.numel > stage_n]
    chunks = {lay.key: -(-lay.numel // stage_n) for lay in big}
    for lay in big:
        if chunks[lay.key] > MAX_GRAD_CHUNKS:
            name = {"embed": "the embedding", "head": "the output head"}.get(lay.key, lay.key)
            raise ConfigError(
                f"model config: vocab_size and hidden_size make {name} ({lay.numel:,} parameters) {chunks[lay.key]:,} "
                f"times the largest decoder layer ({stage_n:,}): its gradient would pass the host staging slots in as "
                f"many chunks, each a task of every step, more than the {MAX_GRAD_CHUNKS:,} a step may hold"
            )
    return chunks


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
