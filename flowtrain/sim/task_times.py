"""Task times predicted against a kept trace: what each of the simulator's costs rests on.

A measured run whose entry in ``docs/bench/measured_runs.json`` names its trace (``trace``, a
file under docs/bench/ that ``flowtrain bench --trace`` wrote) is simulated as
:mod:`flowtrain.sim.validate` simulates it, and the median time of each task kind and unit in
the steps after the first is set beside the trace's::

    python -m flowtrain.sim.task_times "gate on an H100: llama-3b W1"   # one run's table
    python -m flowtrain.sim.task_times --machine h100-sxm "RUN"         # on another machine file
    python -m flowtrain.sim.task_times                                  # the runs with a trace

    for r in compare_tasks("gate on an H100: llama-3b W1"):
        r["kind"], r["unit"], r["predicted_ms"], r["measured_ms"], r["ratio"]   # measured / predicted

A copy's measured time includes any wait for the other direction's copies and the link; a
``cpu_adam`` task's is the run's host, which differs between hosts of one machine kind: a run
simulated on its own host's machine file is set beside the shipped one with ``--machine``.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from ..errors import ConfigError
from .validate import BENCH, measured_runs, simulate_run

Key = tuple[str, str | None]


def steady_tasks(trace: Path) -> list[dict]:
    """A trace's task events (``args`` naming their ``kind``) in the steps after the first, whose
    times the first step's start-up does not stretch; ``ts`` and ``dur`` in microseconds."""
    return [e for e in json.loads(trace.read_text())["traceEvents"]
            if e.get("ph") == "X" and e.get("args", {}).get("kind") and e["args"].get("step", 0) > 0]


def measured_medians(trace: Path) -> dict[Key, tuple[float, int]]:
    """``(kind, unit) -> (median seconds, count)`` of a trace's tasks in the steps after the first."""
    times: dict[Key, list[float]] = defaultdict(list)
    for e in steady_tasks(trace):
        times[(e["args"]["kind"], e["args"].get("unit"))].append(e["dur"] / 1e6)
    return {k: (statistics.median(v), len(v)) for k, v in times.items()}


def predicted_medians(records: list[list]) -> dict[Key, tuple[float, int]]:
    """The same of a prediction's task records (one list per simulated step)."""
    times: dict[Key, list[float]] = defaultdict(list)
    for step in records[1:]:
        for r in step:
            times[(r.task.kind, r.task.unit)].append(r.duration)
    return {k: (statistics.median(v), len(v)) for k, v in times.items()}


def compare_tasks(name: str, bench: Path = BENCH, machine: str | None = None) -> list[dict]:
    """Each task kind and unit both the run's trace and its prediction hold: predicted (on the
    run's own machine file, or on ``machine``) and measured median milliseconds and their ratio,
    measured over predicted."""
    found = {n: (row, extra) for n, row, extra in measured_runs(bench)}
    if name not in found:
        raise KeyError(f"no measured run named {name!r} (python -m flowtrain.sim.validate lists them)")
    row, extra = found[name]
    if "trace" not in extra:
        raise KeyError(f"the run {name!r} keeps no trace")
    measured = measured_medians(bench / extra["trace"])
    predicted = predicted_medians(simulate_run(row, extra, machine).records)
    return [{"kind": k[0], "unit": k[1], "predicted_ms": round(predicted[k][0] * 1e3, 3),
             "measured_ms": round(measured[k][0] * 1e3, 3), "count": measured[k][1],
             "ratio": measured[k][0] / predicted[k][0]}
            for k in sorted(set(measured) & set(predicted), key=lambda k: (k[0], k[1] or ""))]


def traced_runs(bench: Path = BENCH) -> list[str]:
    """The names of the measured runs whose trace is kept."""
    return [n for n, _, extra in measured_runs(bench) if "trace" in extra and (bench / extra["trace"]).exists()]


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m flowtrain.sim.task_times", description=__doc__.split("\n")[0])
    p.add_argument("run", nargs="?", help="a measured run's name (default: list the runs with a trace)")
    p.add_argument("--machine", metavar="NAME|FILE",
                   help="predict on this machine file instead of the run's own (e.g. h100-sxm)")
    args = p.parse_args(argv)
    if args.run is None:
        print("\n".join(traced_runs()))
        return 0
    try:
        rows = compare_tasks(args.run, machine=args.machine)
    except (KeyError, ConfigError) as e:
        print(f"python -m flowtrain.sim.task_times: error: {e.args[0]}", file=sys.stderr)
        return 2
    print("| task | unit | predicted ms | measured ms | measured / predicted | tasks measured |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['kind']} | {r['unit'] or '-'} | {r['predicted_ms']:,.2f} | {r['measured_ms']:,.2f} | "
              f"{r['ratio']:.3f} | {r['count']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
