"""The rates a run's copies reached, read from its trace: what a machine file's link rates rest on.

Each copy task of at least ``--min-mb`` megabytes (``fetch``, ``offload_grad``, ``offload_act``,
``fetch_act``) in the steps after the first is classed by how much of its time a copy the other
way overlapped: ``alone`` (under a tenth), ``shared`` (over nine tenths) or ``part``; its rate is
its bytes over its time. Per trace the median of each kind and class is printed, then, per kind
and class, the median of those medians over the traces given::

    python -m flowtrain.sim.link_rates docs/bench/2026-12-0[234]/*-trace.json   # the H200's traces
    python -m flowtrain.sim.link_rates docs/bench/2026-12-06/*-trace.json       # the H100s'

A copy's time in a trace runs from its start on its stream to its end, so a fetch's includes its
cast to bf16 on the device; the lone gradient offloads (``offload_grad alone``) are the cleanest
measure of the device-to-host rate, and ``d2h_gbps`` in the shipped H200 and H100 files is their
median over the traces above.

Last, what each direction keeps of its lone rate while the other copies too: per trace, the median
``shared`` rate over the median ``alone`` rate of the gradient offloads (device to host) and of the
layer fetches (host to device), and the median of those ratios over the traces that have both.
A machine file's ``duplex_gbps`` (both directions together) is its ``d2h_gbps`` and ``h2d_gbps``
times these shares, over the kept traces of both cards (the same PCIe 5 link)::

    python -m flowtrain.sim.link_rates docs/bench/2026-12-0[2-7]/*-trace.json
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from pathlib import Path

from .task_times import steady_tasks

COPIES = ("fetch", "offload_grad", "offload_act", "fetch_act")
DIRECTIONS = {"d2h": "offload_grad", "h2d": "fetch"}  # the copy kind that measures each direction
Key = tuple[str, str]  # (kind, "alone" | "part" | "shared")


def _overlap(start: float, end: float, spans: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in spans)


def copy_rates(trace: Path, min_bytes: float = 50e6) -> dict[Key, list[float]]:
    """``(kind, class) -> [GB/s, ...]`` of a trace's copies of at least ``min_bytes`` in the
    steps after the first (see the module's docstring for the classes)."""
    events = [e for e in steady_tasks(trace) if e["args"].get("lane") in ("h2d", "d2h")]
    spans: dict[str, list[tuple[float, float]]] = {"h2d": [], "d2h": []}
    for e in events:
        spans[e["args"]["lane"]].append((e["ts"], e["ts"] + e["dur"]))
    rates: dict[Key, list[float]] = defaultdict(list)
    for e in events:
        a = e["args"]
        nbytes, dur = a.get("bytes") or 0, e["dur"]  # the trace's clock is microseconds
        if a.get("kind") not in COPIES or nbytes < min_bytes or dur <= 0:
            continue
        other = spans["d2h" if a["lane"] == "h2d" else "h2d"]
        share = _overlap(e["ts"], e["ts"] + dur, other) / dur
        cls = "alone" if share < 0.1 else "shared" if share > 0.9 else "part"
        rates[(a["kind"], cls)].append(nbytes / dur / 1e3)
    return dict(rates)


def medians(traces: list[Path], min_bytes: float = 50e6) -> tuple[dict[Path, dict[Key, tuple[float, int]]], dict[Key, float]]:
    """Each trace's ``(kind, class) -> (median GB/s, count)``, and per ``(kind, class)`` the
    median of those medians over the traces that have it."""
    per = {t: {k: (statistics.median(v), len(v)) for k, v in copy_rates(t, min_bytes).items()} for t in traces}
    keys = {k for m in per.values() for k in m}
    over = {k: statistics.median(m[k][0] for m in per.values() if k in m) for k in keys}
    return per, over


def kept_shares(per: dict[Path, dict[Key, tuple[float, int]]]) -> dict[str, tuple[float, int]]:
    """Per direction (``"d2h"``, ``"h2d"``): the median over the traces of its copies' ``shared``
    rate over their ``alone`` rate (the kind of :data:`DIRECTIONS`), and how many traces had both."""
    out = {}
    for lane, kind in DIRECTIONS.items():
        ratios = [m[(kind, "shared")][0] / m[(kind, "alone")][0] for m in per.values()
                  if (kind, "shared") in m and (kind, "alone") in m]
        if ratios:
            out[lane] = (statistics.median(ratios), len(ratios))
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m flowtrain.sim.link_rates", description=__doc__.split("\n")[0])
    p.add_argument("traces", nargs="+", type=Path, help="trace files that flowtrain bench --trace or train --trace wrote")
    p.add_argument("--min-mb", type=float, default=50.0, help="leave out copies smaller than this (MB; default 50)")
    args = p.parse_args(argv)
    missing = [str(t) for t in args.traces if not t.is_file()]
    if missing:
        print(f"python -m flowtrain.sim.link_rates: error: no such trace: {', '.join(missing)}", file=sys.stderr)
        return 2
    try:
        per, over = medians(args.traces, args.min_mb * 1e6)
    except (ValueError, KeyError) as e:
        print(f"python -m flowtrain.sim.link_rates: error: not a flowtrain trace ({e})", file=sys.stderr)
        return 2
    order = sorted(over)
    print("| trace | " + " | ".join(f"{k} {c}" for k, c in order) + " |")
    print("| --- |" + " --- |" * len(order))
    for t, m in per.items():
        cells = [f"{m[k][0]:.1f} ({m[k][1]})" if k in m else "-" for k in order]
        print(f"| {t.name} | " + " | ".join(cells) + " |")
    print("| median of the traces | " + " | ".join(f"{over[k]:.1f}" for k in order) + " |")
    print("\nGB/s (copies counted); alone / part / shared: a copy the other way overlapped under a tenth, "
          "between, over nine tenths of it")
    kept = kept_shares(per)
    if kept:
        print("kept of the lone rate while the other direction copies: " + ", ".join(
            f"{lane} ({DIRECTIONS[lane]}) {share:.2f} over {n} traces" for lane, (share, n) in kept.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
