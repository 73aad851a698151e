"""A training configuration's speed (``flowtrain bench --model``): tokens/s, model TFLOP/s, memory, busy lanes.

Trains ``--steps`` steps of a preset (or model directory) on random tokens (or on ``--data``,
read as ``flowtrain train`` reads it: packed, with document masking, unless ``--no-packing``) and
reports the steps after ``--warmup`` (excluded: compilation, allocator growth, first fetches)::

    flowtrain bench --model llama-3b --seq-len 4096 --batch-size 4 --micro-batch-size 4 --steps 8

Model FLOPs per token are :func:`flowtrain.model.counts.model_flops_per_token`'s, as MFU
counts them: 6 per weight a token multiplies by (the input embedding left out; of a mixture of
experts the router and the top-k experts of each sparse layer) and ``6 L (heads x head_dim) S``
for causal attention, recompute not counted; with ``--lora-rank`` the frozen base counts 4 a
weight and the adapters 6.
Busy fractions come from the executed trace: for each lane, the union of its tasks' intervals
over the measured window, so they say where the time went. Beside the measured peaks (host RSS,
GPU ``max_memory_allocated``, and the whole process's device memory as ``nvidia-smi`` would
show it: :func:`gpu_memory`) the result carries the memory plan the run followed (layout,
resident units, slot budgets, planned host and GPU bytes), so every benchmark also checks the
planner.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from ..cli.flags import add_config_flags, config_values
from ..cli.train import KERNEL_FIELDS, MEMORY_FIELDS
from ..errors import ConfigError
from ..train.config.checks import check_output_file
from ..runtime.trace import TraceRecorder, lane_busy, write_chrome_trace
from .collections_timer import FullCollections

# numpy, torch, the model and the trainer are imported where a benchmark runs, so that
# ``flowtrain bench --help`` (which adds these options) stays instant.
if TYPE_CHECKING:
    from ..plan.memory import Plan
    from ..train.config.run_config import TrainConfig


#: the fields of ``TrainConfig`` that ``bench --model`` takes, with train's flags and checks
#: (its defaults below: a benchmark measures long sequences, a few steps)
BENCH_FIELDS = ("data", "packing", "seq_len", "batch_size", "micro_batch_size", "steps", "precision", "device",
                "adam_workers", "order", *MEMORY_FIELDS, *KERNEL_FIELDS, "lora_rank", "lora_alpha", "lora_targets",
                "lora_state", "skip_idle_experts", "state_dir", "disk_state", "disk_gbs")


def add_model_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Options of ``--model`` mode (``--model`` itself and ``--policy`` belong to the caller)."""
    add_config_flags(p, BENCH_FIELDS, grouped=False,
                     defaults={"seq_len": 4096, "batch_size": 4, "micro_batch_size": 4, "steps": 8},
                     helps={"steps": "steps in all, warm-up included",
                            "seq_len": "tokens per sequence",
                            "data": "train on this data file instead of random tokens (token ids: .npy or input_ids rows)",
                            "packing": "with --data: one example per sequence, padded (default: packed, documents "
                                       "masked)"})
    a = p.add_argument
    a("--warmup", type=int, default=2, help="first steps excluded from the numbers")
    a("--trace", default=None, help="also write the executed trace (Chrome JSON)")
    a("--gpu-peak-report", metavar="FILE", default=None,
      help="record the CUDA allocator's history and write what was alive at the GPU peak, grouped by "
           "where it was allocated, beside the plan's items (JSON; slows the run: its speed is no measurement)")
    a("--walk-memory-map-each-step", action="store_true",
      help="also read the resident memory by kind (/proc/self/smaps_rollup, a walk over every resident page) "
           "at the end of every step, on the event loop while the next step runs, as the bench once did: "
           "to measure what that walk costs a run (host_rss_parts_by_step_gib)")


def model_flops_per_token(model: str, seq_len: int, adapter_params: float | None = None) -> float:
    from ..model.counts import model_flops_per_token as per_token
    from ..train.config.run_config import load_model_config

    cfg, _ = load_model_config(model)
    return per_token(cfg, seq_len, adapter_params)


def run_model(args: argparse.Namespace) -> dict:
    """Train ``args``' benchmark run and measure it: the result line (see the module docstring)."""
    import torch

    from ..plan.adapters import adapter_active_numel, adapter_numel
    from ..plan.request import run_request
    from ..train.config.run_config import load_model_config

    _check_model_args(args)
    cfg_m, _ = load_model_config(args.model, args.layer_path)
    cfg, metrics, recorder, plans, peak, host_marks = _train(args, cfg_m.vocab_size)
    adapters = adapter_numel(cfg_m, run_request(cfg)) if cfg.lora else None
    active = adapter_active_numel(cfg_m, run_request(cfg)) if cfg.lora else None
    result = {
        "model": args.model, "seq_len": args.seq_len, "batch_size": args.batch_size,
        "micro_batch_size": args.micro_batch_size, "policy": args.policy,
        "order": plans[-1].spec.order if plans else args.order,
        **_speed(args, metrics, recorder.records, active),
        "host_peak_gib": _peak_rss_gib(),
        # when host memory grew: the peak when the plan was made (before any state), the peak and
        # the resident memory at the end of each step (warm-up included)
        "host_peak_at_plan_gib": host_marks["at_plan"][0] if host_marks["at_plan"] else None,
        "host_peak_by_step_gib": host_marks["peak_by_step"],
        "host_resident_by_step_gib": host_marks["resident_by_step"],
        # what the resident memory is, when the plan was made and at the end of the last step:
        # the process's own allocations (anon, and of those in huge pages anon_huge), mapped
        # files (file: its libraries, the data), shared memory (shmem); the machine's THP mode
        "host_rss_parts_at_plan_gib": host_marks["parts_at_plan"][0] if host_marks["parts_at_plan"] else None,
        "host_rss_parts_gib": host_marks["parts_last"][0] if host_marks["parts_last"] else None,
        # with --walk-memory-map-each-step: the same at the end of every step (else None)
        "host_rss_parts_by_step_gib": host_marks["parts_by_step"] if args.walk_memory_map_each_step else None,
        # the named mappings (files, shared memory, devices) holding the most of it then
        "host_mapped_gib": host_marks["mapped_last"][0] if host_marks["mapped_last"] else None,
        "transparent_hugepages": _transparent_hugepages(),
        # Python's full garbage collections in each step (warm-up included), which stop the
        # lane launchers while they run: how many, how long in all, and the longest one
        "gc_full_by_step": [{"count": n, "ms": round(1e3 * t, 1), "longest_ms": round(1e3 * most, 1)}
                            for n, t, most in host_marks["gc_by_step"]],
        "compile": args.compile, "data": args.data, "packing": args.packing,
    }
    if adapters is not None:
        result.update(lora_rank=cfg.lora_rank, adapter_params=adapters)
    if cfg.skip_idle_experts:  # per step, the share of expert weights left in host memory
        result["experts_unfetched"] = [m.experts_unfetched for m in metrics]
    if plans:
        result.update(_plan_fields(plans[0], result["host_peak_gib"], lora=adapters is not None))
    if torch.cuda.is_available() and cfg.device != "cpu":
        result.update(gpu_memory(torch))
        result["gpu"] = torch.cuda.get_device_name()
    if peak is not None:
        result.update(gpu_peak_report=str(args.gpu_peak_report), gpu_peak_replayed_gib=peak["peak_gib"])
    if args.trace:
        write_chrome_trace(args.trace, recorder.records, meta=bench_trace_meta(args, cfg, plans, recorder.records))
    return result


def _check_model_args(args: argparse.Namespace) -> None:
    """What ``--model`` mode refuses before it trains: too few steps, and a file it could not
    write at the end (a minute of training later)."""
    args.policy = args.policy[0] if isinstance(args.policy, list) else (args.policy or "double_buffer")
    if args.steps <= args.warmup:
        raise ConfigError(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    if args.trace:
        check_output_file("--trace", args.trace)
    if args.gpu_peak_report is not None:
        _check_peak_report(args.gpu_peak_report, args.device)


def _train(args: argparse.Namespace, vocab_size: int) -> tuple:
    """The run: ``(its TrainConfig, per-step metrics, the trace recorder, the plans it followed,
    the GPU peak report or None, the host memory marks)``. Without ``--data`` it trains on
    random tokens, written to a temporary file for the run's length."""
    import numpy as np
    import torch

    from ..train.run import TrainConfig, train
    from ..train.prepare import prefer_expandable_segments

    with tempfile.TemporaryDirectory() as tmp:
        data = args.data
        if data is None:
            data = str(Path(tmp) / "tokens.npy")
            tokens = args.seq_len * args.batch_size * args.steps
            np.save(data, np.random.default_rng(0).integers(0, vocab_size, size=tokens, dtype=np.int64))
        recorder = TraceRecorder()
        cfg = TrainConfig(**{**config_values(args, BENCH_FIELDS), "data": data}, model=args.model, lr=1e-5,
                          policy=args.policy, progress=False)
        prefer_expandable_segments(cfg)  # as train() would, before the line below starts the allocator
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        plans: list = []
        host_marks: dict[str, list] = {"at_plan": [], "peak_by_step": [], "resident_by_step": [],
                                       "parts_at_plan": [], "parts_by_step": [], "parts_last": [],
                                       "mapped_last": []}

        def planned(plan) -> None:
            plans.append(plan)
            host_marks["at_plan"].append(_peak_rss_gib())
            host_marks["parts_at_plan"].append(_rss_parts_gib())

        def stepped(_metrics) -> None:  # on the event loop, while the next step's tasks run
            full.mark()
            host_marks["peak_by_step"].append(_peak_rss_gib())
            host_marks["resident_by_step"].append(_rss_gib())
            if args.walk_memory_map_each_step:  # asked for: what the walk below costs when it runs every step
                host_marks["parts_by_step"].append(_rss_parts_gib())
            if len(host_marks["peak_by_step"]) == args.steps:  # the last step: by kind, and the mappings
                # Only now: reading smaps walks the page table entry of every resident page
                # (8 to 18 ms per GiB of 4 KiB pages on a 2-core test machine), and this runs on
                # the event loop, which dispatches nothing meanwhile: once a step, in a run
                # holding tens of GiB, that held back the tasks that became ready.
                last = host_marks["parts_by_step"][-1] if args.walk_memory_map_each_step else _rss_parts_gib()
                host_marks["parts_last"].append(last)
                host_marks["mapped_last"].append(_largest_mappings_gib())

        def run() -> list:
            return train(cfg, on_step=stepped, instruments=[recorder], on_plan=planned)

        with FullCollections() as full:
            if args.gpu_peak_report is None:
                metrics, peak = run(), None
            else:
                metrics, peak = _recorded(args.gpu_peak_report, run, plans)
        host_marks["gc_by_step"] = full.by_step
        return cfg, metrics, recorder, plans, peak, host_marks


def _peak_rss_gib() -> float:
    """The process's peak resident memory so far, GiB (what ``host_peak_gib`` reports at the end)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)


def _rss_gib() -> float | None:
    """The process's resident memory now, GiB (Linux; None elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return round(pages * resource.getpagesize() / 2**30, 2)


def _rss_parts_gib() -> dict[str, float] | None:
    """The process's resident memory now by kind, GiB: ``anon`` (its own allocations: the state,
    buffers, the interpreter's heap), ``file`` (mapped files: the CUDA and torch libraries, a
    memory-mapped data set) and ``shmem`` (shared memory); and ``anon_huge``, the part of ``anon``
    in transparent huge pages (2 MiB each, resident whole once any byte of one is touched).
    Linux; None elsewhere. ``smaps_rollup`` walks every resident page: read it outside the
    measured steps."""
    names = {"RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem", "AnonHugePages:": "anon_huge"}
    parts: dict[str, float] = {}
    try:
        for path in ("/proc/self/status", "/proc/self/smaps_rollup"):
            for line in Path(path).read_text().splitlines():
                field = line.split()
                if field and field[0] in names:
                    parts[names[field[0]]] = round(int(field[1]) / 2**20, 2)  # kB
    except (OSError, ValueError, IndexError):
        return None
    return parts if len(parts) == len(names) else None


def _largest_mappings_gib(count: int = 4, least: float = 0.01) -> dict[str, float] | None:
    """The ``count`` named mappings of the process holding the most resident memory now, GiB
    (each at least ``least``), by name: a library, a data file, ``/dev/shm/...`` or a driver's
    device file. Anonymous memory (the heap, torch's tensors) is left out: ``anon`` counts it.
    Linux; None elsewhere."""
    rss: dict[str, int] = {}
    name = ""
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                field = line.split()
                if not field:
                    continue
                if "-" in field[0] and not field[0].endswith(":"):  # a mapping's header line
                    name = " ".join(field[5:])
                elif field[0] == "Rss:" and name and not name.startswith("["):
                    rss[name] = rss.get(name, 0) + int(field[1])
    except (OSError, ValueError, IndexError):
        return None
    top = sorted(rss.items(), key=lambda kv: -kv[1])[:count]
    return {path: round(kb / 2**20, 2) for path, kb in top if kb / 2**20 >= least}


def _transparent_hugepages() -> str | None:
    """This machine's transparent huge page mode (``always``, ``madvise``, ``never``): under
    ``always`` large allocations are backed by 2 MiB pages. Linux; None elsewhere."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    chosen = [w.strip("[]") for w in text.split() if w.startswith("[")]
    return chosen[0] if chosen else None


def _speed(args: argparse.Namespace, metrics: list, records: list, adapter_active: float | None) -> dict:
    """Tokens/s and model TFLOP/s over the steps after ``--warmup``, and each lane's busy
    fraction over their window in the executed trace."""
    measured = metrics[args.warmup:]
    tok_s = sum(m.tokens for m in measured) / sum(m.seconds for m in measured)
    window = [r for r in records if r.task.step >= args.warmup]
    t0, t1 = min(r.start for r in window), max(r.end for r in window)
    return {
        "steps_measured": len(measured),
        "tokens_per_s": round(tok_s, 1),
        "model_tflops": round(tok_s * model_flops_per_token(args.model, args.seq_len, adapter_active) / 1e12, 1),
        "step_seconds": [round(m.seconds, 4) for m in measured],
        "loss": [round(m.loss, 4) for m in metrics],
        "busy_fraction": {lane: round(b / (t1 - t0), 4) for lane, b in lane_busy(window).items()},
        "steps_traced": len({r.task.step for r in records}),
    }


def _plan_fields(p: Plan, host_peak_gib: float, lora: bool) -> dict:
    """The plan the run followed, beside what was measured: layout, resident units, budgets,
    planned peaks, and host bytes per parameter as planned and as measured."""
    out = dict(layout=p.layout, resident=list(p.spec.resident), budgets=p.budgets,
               planned_host_gib=round(p.host_total / 2**30, 2), planned_gpu_gib=round(p.gpu_total / 2**30, 2),
               planned_host_state_bytes_per_param=round(p.host_state_bytes_per_param, 3),
               # peak RSS per parameter: of the whole process, and less the planner's
               # allowance for the process itself (interpreter, torch, CUDA libraries)
               host_bytes_per_param=round(host_peak_gib * 2**30 / p.params, 3),
               measured_host_bytes_per_param=round((host_peak_gib * 2**30 - p.host.get("runtime", 0)) / p.params, 3))
    if lora:  # where the adapters and their AdamW lived (--lora-state auto decides)
        out["lora_state"] = "host" if p.spec.host_adapters else "gpu"
    return out


def _check_peak_report(path: str, device: str | None) -> None:
    """``--gpu-peak-report`` needs a CUDA device and a file it can write at the run's end."""
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        raise ConfigError("--gpu-peak-report records the CUDA allocator: it needs a run on a CUDA GPU"
                          + (" (this one runs on the CPU)" if device == "cpu" else " (none is available here)"))
    check_output_file("--gpu-peak-report", path)


def _recorded(path: str, run, plans: list) -> tuple:  # run: () -> train()'s metrics
    """``run()`` under the allocator's record, then its report written to ``path``, also where
    ``run`` fails (out of memory above all: what was alive then is what the report is for; a
    report that cannot be written then does not hide the failure). Returns ``(run()'s result,
    the report)``."""
    import torch

    from . import gpu_peak

    base = gpu_peak.start(torch)
    try:
        result = run()
    except BaseException:
        try:
            _report_peak(path, base, plans)
        except Exception as e:  # the run's own failure is the one to raise
            print(f"the GPU peak report could not be written: {e}", file=sys.stderr)
        raise
    return result, _report_peak(path, base, plans)


def _report_peak(path: str, base: int, plans: list) -> dict:
    import torch

    from . import gpu_peak

    events, counters = gpu_peak.stop(torch)
    rep = gpu_peak.report(events, base, counters, plans[0].gpu if plans else None)
    gpu_peak.write_report(path, rep)
    print(gpu_peak.format_report(rep) + f"\nwrote {path}", file=sys.stderr)
    return rep


def bench_trace_meta(args: argparse.Namespace, cfg: TrainConfig, plans: list, records: list) -> dict:
    """What ``flowtrain bench --trace`` records about its run: what a ``flowtrain train
    --trace`` file does (:func:`flowtrain.train.run.trace_meta`: budgets, slot sizes, where
    each pool lives, limits, planned and measured peaks), and the steps the benchmark left out
    as warm-up."""
    import torch

    from ..train.config.run_config import load_model_config
    from ..train.run import trace_meta
    from ..train.prepare import resolve_dtype

    if not plans:  # the run stopped before it was planned: what is known
        return {"policy": args.policy, "model": args.model, "warmup": args.warmup}
    device = torch.device(plans[-1].device)
    mcfg, _ = load_model_config(args.model, cfg.layer_path)
    meta = trace_meta(cfg, plans[-1], device, resolve_dtype(args.precision, device), records, mcfg)
    return {**meta, "warmup": args.warmup}


def gpu_memory(torch) -> dict:  # torch: the module, imported by the caller
    """The run's device memory, as PyTorch sees it and as the card does (GiB):
    ``gpu_peak_gib`` (most allocated), ``gpu_reserved_peak_gib`` (most the caching allocator
    held), ``gpu_outside_allocator_gib`` (in use on the device now but not the allocator's: the
    CUDA context, loaded kernels, library workspaces) and ``gpu_process_peak_gib``, the sum of
    the last two: what ``nvidia-smi`` shows the process at its peak. What lies outside the
    allocator only grows (kernels load, nothing unloads), so that sum is the peak's upper
    bound. The device is taken to hold no other process, as on a benchmark machine.
    ``gpu_alloc_retries``: how often the allocator, short of room under its cap, released its
    cached memory (a device synchronize each time) and tried again; ``gpu_device_frees``: how
    often it gave memory back to the driver. Both stay near zero unless the plan runs the
    allocator at its cap. ``host_pinned_by_torch_gib`` and ``host_pinned_by_torch_blocks``: the
    host memory torch's own pinned allocator holds (``pin_memory()`` and what falls back to it;
    each block rounded up to a power of two), which the process's ``shmem`` shows, and how many
    blocks it asked CUDA for; ``host_pin_in_place_failed``, the host buffers flowtrain could not
    page-lock in place (ranges, GiB), which is what sends them to torch's allocator."""
    free, total = torch.cuda.mem_get_info()
    outside = (total - free) - torch.cuda.memory_reserved()
    reserved_peak = torch.cuda.max_memory_reserved()
    stats = torch.cuda.memory_stats()
    return {"gpu_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "gpu_reserved_peak_gib": round(reserved_peak / 2**30, 2),
            "gpu_outside_allocator_gib": round(outside / 2**30, 2),
            "gpu_process_peak_gib": round((outside + reserved_peak) / 2**30, 2),
            "gpu_alloc_retries": stats.get("num_alloc_retries", 0),
            "gpu_device_frees": stats.get("num_device_free", 0),
            **_pinned_by_torch(torch)}


def _pinned_by_torch(torch) -> dict:
    """Host memory held by torch's CUDA pinned allocator now, where this torch reports it."""
    try:
        host = torch.cuda.host_memory_stats()
    except (AttributeError, RuntimeError):
        return {}
    from ..train.pinning import failures

    ranges, nbytes = failures()
    return {"host_pinned_by_torch_gib": round(host.get("allocated_bytes.current", 0) / 2**30, 2),
            "host_pinned_by_torch_blocks": host.get("num_host_alloc", 0),
            "host_pin_in_place_failed": {"ranges": ranges, "gib": round(nbytes / 2**30, 2)}}


def print_result(result: dict, json_path: str | None) -> None:
    print(json.dumps(result))
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1) + "\n")
