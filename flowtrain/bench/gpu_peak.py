"""What was alive on the GPU at its peak, and who asked for it: ``flowtrain bench --gpu-peak-report``.

Every benchmark line puts the measured GPU peak (``gpu_peak_gib``, PyTorch's
``max_memory_allocated``) beside the plan's (``planned_gpu_gib``). When the two differ, the
numbers alone do not say which of the plan's items is wrong. This report does: it records the
CUDA caching allocator's history for the whole run, every allocation with the Python stack
that asked for it (``torch.cuda.memory._record_memory_history``), replays the allocations and
frees to the moment the most bytes were allocated, and groups the blocks alive at that moment
by where they were allocated::

    flowtrain bench --model qwen3-moe-12l --seq-len 4096 --batch-size 16 --micro-batch-size 2 \\
        --steps 2 --warmup 1 --gpu-mem 10 --gpu-peak-report moe10-peak.json

A group is named by the innermost flowtrain frame of its blocks' stacks (``site``) and the
step program's frame that called it (``via``: which task body it was in), e.g. a weight slot
made in ``Slots.__init__`` or the MLP's intermediate made under ``run_forward``. Two kinds
of allocation have no flowtrain frame:

* autograd runs a CUDA backward on its own thread, which has no Python caller: its eager
  operators' outputs (saved-tensor gradients, weight gradients) are ``no Python stack``;
* a compiled layer's buffers are allocated by inductor's generated code. Where this torch can
  map generated code back to its graph (``augment_with_fx_traces``), the group is named by the
  source line the buffer's node came from, else by the generated function.

The report (JSON) carries the replayed peak beside the allocator's own peak counters (a check
on the replay: the trace records requested sizes, the counters rounded ones, so the replay sits
a little below ``max_memory_allocated``), the plan's GPU items, the groups largest first and
the allocation that reached the peak; a run that ran out of memory writes its report too, with
the request that failed. Recording stacks slows a run, so a recorded run's
throughput is not a measurement. The replay (:func:`peak_of`) and the grouping
(:func:`alive_at_peak`) read plain dicts in the snapshot's format and need no GPU.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import msgspec

__all__ = ["Peak", "alive_at_peak", "format_report", "peak_of", "report", "start", "stop", "write_report"]

GiB = 2**30
MiB = 2**20

#: names of groups without a flowtrain frame
BEFORE = "allocated before recording began"
NO_STACK = "no Python stack (autograd's backward thread, or C++)"


def start(torch: Any) -> int:
    """Record from now on every allocation on the current CUDA device, with its Python stack.
    Returns the bytes already allocated (requested sizes, as the trace counts them): they were
    allocated before the record and are reported as :data:`BEFORE`."""
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python")
    return int(torch.cuda.memory_stats().get("requested_bytes.all.current", torch.cuda.memory_allocated()))


def stop(torch: Any) -> tuple[list[dict], dict[str, int]]:
    """End the record: the current device's trace events and the allocator's peak counters."""
    try:
        try:  # maps inductor's generated code back to the graph node and source line
            snap = torch.cuda.memory._snapshot(augment_with_fx_traces=True)
        except TypeError:  # an older torch
            snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    stats = torch.cuda.memory_stats()
    events = snap["device_traces"][torch.cuda.current_device()]
    return events, {"allocated_peak": int(stats.get("allocated_bytes.all.peak", 0)),
                    "requested_peak": int(stats.get("requested_bytes.all.peak", 0))}


class Peak(msgspec.Struct, frozen=True):
    """The peak of a replayed trace: its bytes, the index of the event that reached it (-1: the
    bytes allocated before the record were the peak) and how many of those were still
    allocated then."""

    bytes: int
    at: int
    before: int


def _replay(events: list[dict]):  # yields (index, event, its freed alloc, the blocks allocated)
    """Each event, the ``alloc`` event of the block it frees (None: none the trace saw
    allocated, or not a free) and the ``alloc`` events of the blocks allocated just after it (by
    address, one dict updated in place). A block counts from its ``alloc`` to its
    ``free_requested`` (as ``max_memory_allocated`` counts it; a block another stream still
    uses is reused only after ``free_completed``, but it is no longer allocated)."""
    live: dict[int, dict] = {}
    for i, e in enumerate(events):
        freed = None
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_requested":
            freed = live.pop(e["addr"], None)
        yield i, e, freed, live


def peak_of(events: list[dict], base: int = 0) -> Peak:
    """The peak of an allocator trace (a block counted as :func:`_replay` counts it), ``base``
    bytes allocated before its first event. A free of a block the trace did not see allocated
    takes its bytes off ``base``."""
    total = before = base
    peak = Peak(base, -1, base)
    for i, e, freed, _ in _replay(events):
        if e["action"] == "alloc":
            total += e["size"]
            if total > peak.bytes:
                peak = Peak(total, i, before)
        elif e["action"] == "free_requested":
            if freed is None:  # allocated before the record
                before = max(before - e["size"], 0)
            total -= e["size"] if freed is None else freed["size"]
    return peak


def alive_at_peak(events: list[dict], at: int) -> list[dict]:
    """The ``alloc`` events whose blocks are still allocated just after event ``at``."""
    for i, _, _, live in _replay(events):
        if i == at:
            return list(live.values())
    return []


def _package_path(filename: str) -> str | None:
    """``flowtrain/...`` for a frame in flowtrain's package, else None."""
    i = filename.replace("\\", "/").rfind("/flowtrain/")
    return filename[i + 1:] if i >= 0 else None


def _frame(f: dict, path: str) -> str:
    return f"{path}:{f['line']} {f['name']}"


#: a line of a Python traceback, as an FX node's original trace holds them
_TRACE_LINE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>\S+)')


def _compiled_origin(frames: list[dict]) -> str | None:
    """Where a compiled graph's buffer came from: the innermost flowtrain line of its graph
    node's original trace (else the node's name), or the generated function that allocated it;
    None for an allocation outside any compiled graph."""
    for f in frames:
        ours = [(m, p) for m in _TRACE_LINE.finditer(str(f.get("fx_original_trace") or ""))
                if (p := _package_path(m["file"])) is not None]
        if ours:
            m, path = ours[-1]
            return f"compiled: {path}:{m['line']} {m['name']}"
        if f.get("fx_node_name"):
            return f"compiled: graph node {f['fx_node_name']}"
    for f in frames:
        if "torchinductor" in f["filename"]:
            return f"compiled: {Path(f['filename']).name}:{f['line']} {f['name']}"
    return None


#: the package of the step program's task bodies (fetch, forward, backward, ...)
PROGRAM = "flowtrain/train/program/"


def site_of(frames: list[dict]) -> tuple[str, str | None]:
    """``(site, via)`` of an allocation's stack (innermost frame first): ``site`` the innermost
    flowtrain frame (or the compiled graph's source line), ``via`` the step program's frame
    that called it (its task body), where that is another frame."""
    ours = [(f, p) for f in frames if (p := _package_path(f["filename"])) is not None]
    compiled = _compiled_origin(frames)
    if not ours:
        if compiled is not None:
            return compiled, None
        torch_frames = [f for f in frames if "/torch/" in f["filename"]]
        if torch_frames:
            f = torch_frames[0]
            return f"torch: {_frame(f, f['filename'][f['filename'].rfind('/torch/') + 1:])}", None
        return NO_STACK, None
    callers = ours if compiled is not None else ours[1:]
    via = next((_frame(f, p) for f, p in callers if p.startswith(PROGRAM)), None)
    return (compiled if compiled is not None else _frame(*ours[0])), via


#: block sizes a group lists, the most bytes first
SIZES_LISTED = 6


class Group(msgspec.Struct):
    """Blocks alive at the peak that were allocated at one place. ``sizes``: ``[MiB, blocks]``
    of the block sizes holding most of its bytes, which tell apart what a place without a
    Python stack allocated (a weight's gradient from a batch of activations, say)."""

    site: str
    via: str | None
    bytes: int = 0
    blocks: int = 0
    largest: int = 0
    sizes: list[list[float]] = msgspec.field(default_factory=list)


def _groups(alive: list[dict], before: int) -> list[Group]:
    groups: dict[tuple[str, str | None], Group] = {}
    counts: dict[tuple[str, str | None], dict[int, int]] = {}
    for e in alive:
        key = site_of(e.get("frames") or [])
        g = groups.setdefault(key, Group(*key))
        g.bytes += e["size"]
        g.blocks += 1
        g.largest = max(g.largest, e["size"])
        by_size = counts.setdefault(key, {})
        by_size[e["size"]] = by_size.get(e["size"], 0) + 1
    for key, g in groups.items():
        most = sorted(counts[key].items(), key=lambda kv: -kv[0] * kv[1])[:SIZES_LISTED]
        g.sizes = [[round(size / MiB, 1), n] for size, n in most]
    out = sorted(groups.values(), key=lambda g: -g.bytes)
    if before > 0:
        out.append(Group(BEFORE, None, before, 0, 0))
    return out


def report(events: list[dict], base: int, counters: dict[str, int], planned_gpu: dict[str, int] | None) -> dict:
    """The report of one recorded run (see the module docstring)."""
    peak = peak_of(events, base)
    at = peak.at
    alive = alive_at_peak(events, at) if at >= 0 else []
    top = events[at] if at >= 0 else None
    out: dict[str, Any] = {
        "peak_gib": round(peak.bytes / GiB, 3),
        "allocator_peak_gib": round(counters.get("allocated_peak", 0) / GiB, 3),
        "allocator_requested_peak_gib": round(counters.get("requested_peak", 0) / GiB, 3),
        "peak_bytes": peak.bytes,
        "allocator_peak_bytes": counters.get("allocated_peak", 0),
        "allocator_requested_peak_bytes": counters.get("requested_peak", 0),
        "events": len(events),
        "peak_event": at,
        "alive": [{**msgspec.structs.asdict(g), "gib": round(g.bytes / GiB, 3)} for g in _groups(alive, peak.before)],
    }
    if top is not None:
        site, via = site_of(top.get("frames") or [])
        out["peak_allocation"] = {"site": site, "via": via, "mib": round(top["size"] / MiB, 1)}
    oom = next((e for e in events if e["action"] == "oom"), None)
    if oom is not None:  # the request the allocator could not meet
        out["out_of_memory"] = {"mib": round(oom["size"] / MiB, 1),
                                "device_free_mib": round(oom.get("device_free", 0) / MiB, 1)}
    if planned_gpu is not None:
        from ..plan.memory import gpu_peak

        out["planned_gpu_gib"] = round(gpu_peak(planned_gpu) / GiB, 3)
        out["planned_gpu_items_gib"] = {k: round(v / GiB, 3) for k, v in planned_gpu.items()}
    return out


def format_report(rep: dict, most: int = 12) -> str:
    """A few lines for a terminal: the peaks, then the largest groups alive at the peak."""
    lines = [f"GPU peak replayed {rep['peak_gib']:.2f} GiB (allocator: {rep['allocator_peak_gib']:.2f} "
             f"allocated, {rep['allocator_requested_peak_gib']:.2f} requested"
             + (f"; planned {rep['planned_gpu_gib']:.2f}" if "planned_gpu_gib" in rep else "") + ")"]
    for g in rep["alive"][:most]:
        via = f"  [via {g['via']}]" if g["via"] else ""
        sizes = ", ".join(f"{n} x {mib:g} MiB" for mib, n in g["sizes"][:3])
        lines.append(f"  {g['gib']:8.3f} GiB  {g['blocks']:5d} blocks  {g['site']}{via}" + (f"  ({sizes})" if sizes else ""))
    if len(rep["alive"]) > most:
        rest = sum(g["gib"] for g in rep["alive"][most:])
        lines.append(f"  {rest:8.3f} GiB  in {len(rep['alive']) - most} more groups")
    if "peak_allocation" in rep:
        p = rep["peak_allocation"]
        lines.append(f"  reached by {p['mib']:.1f} MiB at {p['site']}" + (f" [via {p['via']}]" if p["via"] else ""))
    if "out_of_memory" in rep:
        o = rep["out_of_memory"]
        lines.append(f"  out of memory: {o['mib']:.1f} MiB asked for, {o['device_free_mib']:.1f} MiB free on the device")
    return "\n".join(lines)


def write_report(path: str | os.PathLike[str], rep: dict) -> None:
    """Write ``rep`` as JSON at ``path`` whole or not at all (a temporary file renamed in)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.absolute().parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(msgspec.json.format(msgspec.json.encode(rep), indent=1) + b"\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
