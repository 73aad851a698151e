"""``flowtrain viz``: draw graphs and traces as one self-contained HTML report (and a PNG).

    flowtrain viz sequential.json double_buffer.json --out report.html --png report.png
    flowtrain viz step.json --policy lookahead --out graph.html

Each INPUT is a trace (Chrome trace JSON from ``write_chrome_trace`` or ``flowtrain train
--trace``) or a graph (``flowtrain graph`` JSON); the kind is read from the file. Traces share
one time scale; graphs show the planned order of ``--policy``.
"""

from __future__ import annotations

import argparse

from ..errors import ConfigError
from .html import write_report
from .load import GraphInput, Trace, load_input


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="trace or graph JSON files (traces share a time scale)")
    p.add_argument("--out", default="report.html", help="HTML report to write (default: report.html)")
    p.add_argument("--png", metavar="FILE", help="also write a PNG picture (the traces, or the first graph)")
    p.add_argument("--policy", default=None, help="policy whose planned order graphs show (default: double_buffer)")
    p.add_argument("--title", default="flowtrain schedule report", help="report title")
    p.add_argument("--min-gap-ms", type=float, default=None,
                   help="mark compute gaps longer than this (default: 5%% of the median compute task)")


def run(args: argparse.Namespace) -> int:
    if args.min_gap_ms is not None and args.min_gap_ms < 0:
        raise ConfigError(f"--min-gap-ms must be at least 0 (got {args.min_gap_ms})")
    if args.png:  # matplotlib is optional and slow to import: only for --png, and checked before writing
        from .png import require_matplotlib

        require_matplotlib()
    inputs = [load_input(path) for path in args.inputs]
    traces = [x for x in inputs if isinstance(x, Trace)]
    graphs = [x for x in inputs if isinstance(x, GraphInput)]
    if args.policy is not None and not graphs:
        raise ConfigError("--policy applies to graph inputs, and none of the inputs is a graph "
                          "(write one with 'flowtrain graph --out FILE.json')")
    min_gap = None if args.min_gap_ms is None else args.min_gap_ms * 1e-3
    out = write_report(args.out, inputs, policy=args.policy or "double_buffer", title=args.title, min_gap=min_gap)
    what = ", ".join(f"{n} {k}{'s' if n != 1 else ''}" for n, k in ((len(traces), "trace"), (len(graphs), "graph")) if n)
    print(f"wrote {out} ({what})")
    if args.png:
        from .png import write_png

        print(f"wrote {write_png(args.png, inputs, min_gap=min_gap)}")
    return 0
