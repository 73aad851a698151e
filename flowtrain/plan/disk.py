"""The disk tier's plan: which units keep their optimizer state in the state folder.

With ``--state-dir``, ``--disk-state`` says what goes there: ``moments`` (every streamed unit's
Adam m and v, 8 bytes per parameter), ``all`` (their fp32 master too: 12, a compute-dtype copy
staying in host memory for the fetches), ``none``, or ``auto`` (the default): only what host
memory cannot hold, unit by unit in the order the step's Adam reaches them (the head, the layers
from the top, the embedding), each unit's moments first, then, where that still does not fit
and it frees memory (a compute copy smaller than the fp32 master), masters in the same order.

The plan then counts the host staging slots the reads fill (``disk_staging``: ``disk_ahead``
slots of the largest unit's, or staging chunk's, state), the field a save reads back
(``disk_readback``: a checkpoint writes a unit on disk one field at a time, master, ``exp_avg``,
``exp_avg_sq``, each read back whole just before it is written and let go after, and the final
model its master the same way; so 4 bytes per parameter of the largest unit with any field on
disk, padded as its files are; the saves run one at a time, on the one ``io`` lane, so one such
field at once), and the bytes the disk holds, reads and writes each step (:func:`disk_traffic`).
``auto`` counts both in the total it compares with the host limit::

    plan = place_on_disk(plan, cfg, req, compute_bytes=2)
    plan.disk            # {"head": ("exp_avg", "exp_avg_sq"), "layer.31": (...), ...}
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..graph.tasks import HOST_STATE
from ..model import ModelConfig, model_flat_maps
from .buffer_sizes import chunk_range, staging_numel

MOMENTS = ("exp_avg", "exp_avg_sq")
ALL = ("master", "exp_avg", "exp_avg_sq")
_PAD = 1024  # elements a file pads each field to (4 KiB)


def _padded(n: int) -> int:
    return -(-n // _PAD) * _PAD


def adam_order(keys: list[str]) -> list[str]:
    """Unit keys in the order a step's Adam reaches them: head, layers from the top, embed."""
    layers = sorted((k for k in keys if k.startswith("layer.")), key=lambda k: -int(k.split(".")[1]))
    return [k for k in ("head",) if k in keys] + layers + [k for k in ("embed",) if k in keys]


def place_on_disk(plan: Any, cfg: ModelConfig, req: Any, compute_bytes: int) -> Any:  # Plan -> Plan
    """``plan`` with its units' state placed as ``req.disk_state`` asks (module docstring)."""
    mode = getattr(req, "disk_state", "none")
    if mode == "none":
        return plan
    if req.lora_rank or req.share > 1:  # a state folder given, unused: the plan says so
        return msgspec.structs.replace(plan, disk_tier=True)
    spec = plan.spec
    maps = {lay.key: lay for lay in model_flat_maps(cfg) if lay.key not in spec.resident}
    order = adam_order(list(maps))
    stage_n = staging_numel(list(maps.values()), ())
    copy_kept = plan.layout == "stream-bf16" and compute_bytes < 4
    host = dict(plan.host)
    disk: dict[str, tuple[str, ...]] = {}
    ahead = max(1, getattr(req, "disk_ahead", 2))

    def chunks(key: str) -> list[int | None]:
        return [None] if plan.layout == "full" else list(range(spec.grad_chunks.get(key, 1)))

    def staging(d: dict[str, tuple[str, ...]]) -> int:
        most = 0
        for key, fields in d.items():
            n = maps[key].numel
            for c in chunks(key):
                lo, hi = chunk_range(n, stage_n, c)
                most = max(most, len(fields) * _padded(hi - lo) * 4)
        return ahead * most

    def readback(d: dict[str, tuple[str, ...]]) -> int:
        return max((4 * _padded(maps[key].numel) for key in d), default=0)

    def total(h: dict[str, int], d: dict[str, tuple[str, ...]]) -> int:
        h = {**h, "disk_staging": staging(d), "disk_readback": readback(d)}
        return msgspec.structs.replace(plan, host=h).host_node_total

    def move(key: str, fields: tuple[str, ...]) -> None:
        n = maps[key].numel
        had = disk.get(key, ())
        if "exp_avg" not in had:
            host["adam"] -= 8 * n
        if "master" in fields and "master" not in had:
            host["master"] -= 4 * n
            if not copy_kept:
                host["streaming_copy"] = host.get("streaming_copy", 0) + compute_bytes * n
        disk[key] = fields

    limit = plan.host_limit
    if mode in ("moments", "all"):
        for key in order:
            move(key, ALL if mode == "all" else MOMENTS)
    else:  # auto: only what does not fit
        for fields in (MOMENTS, ALL):
            if fields is ALL and not copy_kept and compute_bytes >= 4:
                break  # an fp32 compute copy is as large as the master: moving it frees nothing
            for key in order:
                if limit is None or total(host, disk) <= limit:
                    break
                move(key, fields)
    note = _note(disk, order, mode, masters_free=copy_kept or compute_bytes < 4)
    if not disk:
        return msgspec.structs.replace(plan, disk_tier=True, disk_note=note)
    host["disk_staging"] = staging(disk)
    host["disk_readback"] = readback(disk)
    spec = msgspec.structs.replace(spec, disk=tuple(k for k in order if k in disk), disk_ahead=ahead)
    budgets = {**plan.budgets, HOST_STATE: ahead}
    return msgspec.structs.replace(plan, host=host, spec=spec, budgets=budgets, disk=disk, disk_tier=True,
                                   disk_note=note)


def _note(disk: dict[str, tuple[str, ...]], order: list[str], mode: str, masters_free: bool) -> str:
    """What the state folder holds, in words, and what more ``--disk-state`` could put there."""
    moments = sum(1 for f in disk.values() if "exp_avg" in f)
    masters = sum(1 for f in disk.values() if "master" in f)
    held = (f"the state folder holding the Adam moments of {moments} of {len(order)} streamed units"
            + (f" and the fp32 masters of {masters}" if masters else ""))
    if mode == "moments":
        return held + " (--disk-state all or auto puts the masters there too)"
    if masters == len(order) or (moments == len(order) and not masters_free):
        return held + " (all the optimizer state there is to move)"
    return held


def disk_bytes(cfg: ModelConfig, disk: dict[str, tuple[str, ...]]) -> int:
    """Bytes the state folder holds for ``disk`` (each unit's fields, fp32)."""
    maps = {lay.key: lay for lay in model_flat_maps(cfg)}
    return sum(4 * len(fields) * maps[key].numel for key, fields in disk.items())


class DiskTraffic(msgspec.Struct, frozen=True, kw_only=True):
    """What the state folder holds and moves each step under a plan (:func:`disk_traffic`)."""

    #: bytes the folder holds (every disk-resident field, fp32)
    held: int
    #: bytes read and written each step: every unit's state is read before its Adam and written after
    read: int
    written: int
    #: units whose moments, and whose fp32 masters, are on disk, in the order the step's Adam reaches them
    moments: tuple[str, ...]
    masters: tuple[str, ...]

    def seconds(self, read_gbps: float, write_gbps: float) -> float:
        """Seconds the disk is busy each step at these rates (reads and writes share one drive)."""
        return self.read / (read_gbps * 1e9) + self.written / (write_gbps * 1e9)

    def needs_gbps(self, step_s: float) -> float:
        """GB/s, reads and writes together, that a step of ``step_s`` seconds needs of the disk."""
        return (self.read + self.written) / step_s / 1e9


def disk_traffic(cfg: ModelConfig, plan: Any) -> DiskTraffic:  # plan: a Plan
    """:class:`DiskTraffic` of ``plan``'s state folder (nothing where it has none)."""
    held = disk_bytes(cfg, plan.disk)
    keys = adam_order(list(plan.disk))
    return DiskTraffic(held=held, read=held, written=held,
                       moments=tuple(k for k in keys if "exp_avg" in plan.disk[k]),
                       masters=tuple(k for k in keys if "master" in plan.disk[k]))


def unit_ranges(keys: tuple[str, ...] | list[str]) -> str:
    """Unit keys in a short form: ``head, layer.31-0, embed`` (runs of layers as ranges)."""
    out: list[str] = []
    run: list[int] = []

    def flush() -> None:
        if run:
            out.append(f"layer.{run[0]}" if len(run) == 1 else f"layer.{run[0]}-{run[-1]}")
            run.clear()

    for k in keys:
        if k.startswith("layer.") and (not run or abs(int(k.split(".")[1]) - run[-1]) == 1
                                       and (len(run) < 2 or int(k.split(".")[1]) - run[-1] == run[-1] - run[-2])):
            run.append(int(k.split(".")[1]))
            continue
        flush()
        if k.startswith("layer."):
            run.append(int(k.split(".")[1]))
        else:
            out.append(k)
    flush()
    return ", ".join(out) if out else "none"
