"""``flowtrain bench``: benchmarks, one mode per flag.

``--scheduler`` measures what the engine itself costs per task: a compiled training step whose
tasks do nothing runs through the asyncio :class:`~flowtrain.runtime.Engine` on CPU lanes (uvloop
where installed) under each built-in policy, and the wall time of ``engine.run`` divided by the
number of tasks is the scheduling overhead per task::

    flowtrain bench --scheduler                       # about 10,000 tasks, every built-in policy
    flowtrain bench --scheduler --tasks 2000 --policy sequential --json sched.json

The DAG comes from the real compiler (8 micro-batches, as many layers as give about ``--tasks``
tasks), so its shape, lanes, slot traffic and host round trips are those of a training step.
A 100-layer, 8-micro-batch step is timed as well, since that is the size the target is about.

Each mode is a flag in the ``mode`` group of :func:`add_arguments`, with its own argument group
and its own section below; :func:`run` dispatches on it and writes the optional ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from ..cli.train import flag_of  # noqa: F401 - how bench's errors spell the settings they name
from ..errors import ConfigError
from ..train.config.checks import check_output_file
from ..graph import StepSpec, compile_step
from ..runtime import Engine, use_uvloop
from .training_speed import add_model_arguments, run_model

BUILTIN_POLICIES = ("sequential", "double_buffer", "lookahead")


def add_arguments(p: argparse.ArgumentParser) -> None:
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--scheduler", action="store_true", help="scheduling overhead per task on a DAG of no-op tasks")
    mode.add_argument("--model", metavar="PRESET|DIR",
                      help="train a model on random tokens: tokens/s, TFLOP/s, memory, lane busy fractions")
    add_model_arguments(p.add_argument_group("--model options"))

    sched = p.add_argument_group("--scheduler options")
    sched.add_argument("--tasks", type=int, default=10_000, help="about how many tasks in the DAG (default 10000)")
    sched.add_argument("--micro-batches", type=int, default=8, help="micro-batches of the compiled step (default 8)")
    sched.add_argument("--policy", action="append", metavar="NAME",
                       help="policy to measure (repeatable; default: every built-in policy)")
    sched.add_argument("--repeat", type=int, default=5, help="timed runs per policy, after one warm-up (default 5)")
    sched.add_argument("--gc-freeze", action="store_true",
                       help="gc.freeze() once set up, so full collections skip the heap found at start (torch's)")

    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")


def run(args: argparse.Namespace) -> int:
    if args.json:  # refused before the benchmark runs, not after it
        check_output_file("--json", args.json)
    if args.scheduler:
        _import_torch()
        result = scheduler_benchmark(
            tasks=args.tasks,
            micro_batches=args.micro_batches,
            policies=tuple(args.policy or BUILTIN_POLICIES),
            repeat=args.repeat,
            gc_freeze=args.gc_freeze,
        )
        print(format_scheduler(result))
    elif args.model:
        result = run_model(args)
        print(json.dumps(result))
    else:  # argparse requires one mode
        raise ConfigError("choose what to benchmark, e.g. --scheduler")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


def machine() -> dict[str, Any]:
    """Where a number was measured."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return {
        "cpus": cpus,
        "processor": _cpu_model() or platform.processor() or platform.machine(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
    }


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


# ---- --scheduler -------------------------------------------------------------------------------

STEP_LAYERS = 100  # the reference size: a 100-layer step


def _noop(task, ctx) -> None:
    return None


def spec_for(tasks: int, micro_batches: int) -> StepSpec:
    """A layer-major step with about ``tasks`` tasks. Per layer the compiler emits two fetches,
    a forward and a backward per micro-batch, a zero_grad, an offload_grad and a cpu_adam; the
    embedding and head add about three tasks per micro-batch and eight more."""
    if tasks < 1:
        raise ConfigError(f"--tasks must be at least 1 (got {tasks})")
    if micro_batches < 1:
        raise ConfigError(f"--micro-batches must be at least 1 (got {micro_batches})")
    per_layer, fixed = 2 * micro_batches + 5, 3 * micro_batches + 8
    return StepSpec(layers=max(1, round((tasks - fixed) / per_layer)), micro_batches=micro_batches)


async def _time_runs(graph, policy: str, runs: int) -> list[float]:
    """Seconds of ``engine.run(graph)`` for ``runs`` runs, each on a fresh engine."""
    seconds = []
    for _ in range(runs):
        async with Engine(_noop, policy, device="cpu") as engine:
            start = time.perf_counter()
            await engine.run(graph)
            seconds.append(time.perf_counter() - start)
    return seconds


async def _measure(graphs: dict[str, Any], policies: tuple[str, ...], repeat: int) -> tuple[str, dict]:
    loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
    out: dict[str, dict] = {}
    for policy in policies:
        out[policy] = {}
        for name, graph in graphs.items():
            await _time_runs(graph, policy, 1)  # warm-up: first-use costs are not scheduling
            out[policy][name] = await _time_runs(graph, policy, repeat)
    return loop, out


def _import_torch() -> None:
    """Measure the scheduler in the heap of a training process: with torch imported, whose few
    hundred thousand objects every full garbage collection walks. The command line imports torch
    only where a command needs it, so ``bench --scheduler`` does it here (where it is installed)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        pass


def scheduler_benchmark(tasks: int = 10_000, micro_batches: int = 8, policies: tuple[str, ...] = BUILTIN_POLICIES,
                        repeat: int = 5, gc_freeze: bool = False) -> dict[str, Any]:
    """Run the benchmark; returns plain data (see :func:`format_scheduler` for the table).

    Much of the cost in a process that has imported torch (as a trainer has, and as ``flowtrain
    bench --scheduler`` does before measuring) is the garbage collector: the engine's per-task
    objects trigger full collections, and each one walks torch's few hundred thousand objects too.
    ``gc_freeze`` moves everything alive after set-up out of the collector's sight, as a
    long-running trainer may do after loading.
    """
    if repeat < 1:
        raise ConfigError(f"--repeat must be at least 1 (got {repeat})")
    spec = spec_for(tasks, micro_batches)
    step_spec = StepSpec(layers=STEP_LAYERS, micro_batches=micro_batches)
    graphs = {"dag": compile_step(spec), "step": compile_step(step_spec)}

    previous = asyncio.get_event_loop_policy()
    use_uvloop()
    if gc_freeze:
        gc.collect()
        gc.freeze()
    try:
        loop, seconds = asyncio.run(_measure(graphs, policies, repeat))
    finally:
        asyncio.set_event_loop_policy(previous)
        if gc_freeze:
            gc.unfreeze()

    def shape(s: StepSpec, g) -> dict:
        return {"layers": s.layers, "micro_batches": s.micro_batches, "tasks": g.number_of_nodes(),
                "edges": g.number_of_edges()}

    n = graphs["dag"].number_of_nodes()
    results = {}
    for policy, runs in seconds.items():
        results[policy] = {
            "us_per_task": statistics.median(runs["dag"]) / n * 1e6,
            "us_per_task_min": min(runs["dag"]) / n * 1e6,
            "runs_s": runs["dag"],
            "step_ms": statistics.median(runs["step"]) * 1e3,
            "step_runs_s": runs["step"],
        }
    return {
        "benchmark": "scheduler",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "loop": loop,
        "gc_freeze": gc_freeze,
        "torch_imported": "torch" in sys.modules,
        "repeat": repeat,
        "graph": shape(spec, graphs["dag"]),
        "step_graph": shape(step_spec, graphs["step"]),
        "results": results,
    }


def format_scheduler(result: dict[str, Any]) -> str:
    g, s, m = result["graph"], result["step_graph"], result["machine"]
    lines = [
        f"scheduler overhead: {g['tasks']:,} no-op tasks ({g['layers']} layers x {g['micro_batches']} micro-batches, "
        f"{g['edges']:,} edges), {result['loop']} loop, {m['cpus']} CPUs, median of {result['repeat']} runs"
        + (", gc frozen after set-up" if result["gc_freeze"] else ""),
        f"{'policy':<16}{'us/task':>10}{'best':>10}   {s['layers']}x{s['micro_batches']} step ({s['tasks']:,} tasks)",
    ]
    for policy, r in result["results"].items():
        lines.append(f"{policy:<16}{r['us_per_task']:>10.1f}{r['us_per_task_min']:>10.1f}   {r['step_ms']:>8.1f} ms")
    return "\n".join(lines)
