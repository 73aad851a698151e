"""``flowtrain viz``: draw graphs and traces as one self-contained HTML report (and a PNG).

    flowtrain viz sequential.json double_buffer.json --out report.html --png report.png
    flowtrain viz trace.json --png trace.png      # the PNG alone: no report.html
    flowtrain viz trace.json --steps 2:5          # summaries over training steps 2 to 5
    flowtrain viz step.json --policy lookahead --out graph.html

For each trace it prints the window's step time, how busy compute was and how much copying
was hidden, then what the schedule does not explain: tasks that started well after all they
waited for had finished (ready work nobody dispatched), and tasks far past their kind's median
(:mod:`flowtrain.viz.outliers`).

Each INPUT is a trace (Chrome trace JSON from ``write_chrome_trace`` or ``flowtrain train
--trace``) or a graph (``flowtrain graph`` JSON); the kind is read from the file. Traces share
one time scale; graphs show the planned order of ``--policy``. Summaries cover a window of
steps: ``--steps A:B``, or by default all but the first step and any warm-up after it.

This module imports neither torch nor the runtime: ``flowtrain viz`` starts in well under a
second, and the HTML needs nothing from the machine that trained.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import ConfigError
from ..viz.html import trace_views, write_report
from ..viz.load import GraphInput, Trace, load_input
from ..viz.outliers import outlier_lines
from ..viz.steps import fmt_time, parse_steps


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="trace or graph JSON files (traces share a time scale)")
    p.add_argument("--out", default=None,
                   help="HTML report to write (default: report.html, unless --png alone asks for a picture)")
    p.add_argument("--png", metavar="FILE", help="write a PNG picture (the traces, or the first graph); "
                                                 "with --out too, both")
    p.add_argument("--policy", default=None, help="policy whose planned order graphs show (default: double_buffer)")
    p.add_argument("--title", default="flowtrain schedule report", help="report title")
    p.add_argument("--steps", metavar="A:B", default=None,
                   help="window the summaries cover, steps counted from 1 as training counts them: '2:5' steps "
                        "2 to 5, '2:' from step 2, '3' step 3 (default: leave out the first step and warm-up)")
    p.add_argument("--min-gap-ms", type=float, default=None,
                   help="mark compute gaps longer than this (default: 5%% of the median compute task)")


def run(args: argparse.Namespace) -> int:
    if args.min_gap_ms is not None and args.min_gap_ms < 0:
        raise ConfigError(f"--min-gap-ms must be at least 0 (got {args.min_gap_ms})")
    for flag, path in (("--out", args.out), ("--png", args.png)):  # nothing is written unless everything can be
        if path and not Path(path).absolute().parent.is_dir():
            raise ConfigError(f"{flag} {path}: the folder {Path(path).parent} does not exist; create it first")
    if args.png:  # matplotlib is optional and slow to import: only for --png, and checked before writing
        from ..viz.png import require_matplotlib

        require_matplotlib()
    inputs = [load_input(path) for path in args.inputs]
    traces = [x for x in inputs if isinstance(x, Trace)]
    graphs = [x for x in inputs if isinstance(x, GraphInput)]
    if args.policy is not None and not graphs:
        raise ConfigError("--policy applies to graph inputs, and none of the inputs is a graph "
                          "(write one with 'flowtrain graph --out FILE.json')")
    if args.steps is not None:
        parse_steps(args.steps)  # a malformed window fails before anything is read
    min_gap = None if args.min_gap_ms is None else args.min_gap_ms * 1e-3
    views = trace_views(traces, min_gap, args.steps)  # each trace that has the --steps on them
    counts = ((len(traces), "trace"), (len(graphs), "graph"))
    what = ", ".join(f"{n} {k}{'s' if n != 1 else ''}" for n, k in counts if n)
    html = args.out or (None if args.png else "report.html")  # write only what was asked for
    if html is not None:
        out = write_report(html, inputs, policy=args.policy or "double_buffer", title=args.title,
                           min_gap=min_gap, steps=args.steps, views=views)
        print(f"wrote {out} ({what})")
    for v in views:
        s = v.summary
        print(f"  {v.trace.label}: {v.window.label}: step time {fmt_time(s.step_time)}, "
              f"compute busy {100 * s.compute_busy:.1f}% of busy + idle, "
              f"copy hidden {100 * s.overlap.copy_hidden:.1f}%" + (f" ({v.window.why})" if v.missed else ""))
        for line in outlier_lines(v.trace, v.late, v.long, v.window):
            print(f"    {line}")
    if args.png:
        from ..viz.png import write_png

        print(f"wrote {write_png(args.png, inputs, min_gap=min_gap, views=views)}")
    return 0
