"""The ``flowtrain`` command line: a thin dispatcher over the package.

Subcommands: ``train`` (the product), ``graph`` (compile a step DAG to JSON), ``plan`` (memory
plan), ``viz`` (HTML report of graphs and traces), ``bench`` (benchmarks). Any
:class:`~flowtrain.errors.FlowtrainError` ends the command with one line on stderr and exit
status 2: no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import FlowtrainError

#: subcommand -> module with ``add_arguments(parser)`` and ``run(args) -> int``
COMMANDS = {
    "train": ("flowtrain.train.cli", "train a model (with no arguments: a tiny model on the bundled corpus)"),
    "graph": ("flowtrain.graph.cli", "compile one training step into a task DAG and write it as JSON"),
    "plan": ("flowtrain.train.plan_cli", "estimate host and GPU memory for a training run"),
    "viz": ("flowtrain.viz.cli", "draw graphs and traces as a self-contained HTML report"),
    "bench": ("flowtrain.bench", "benchmark the scheduler or a training configuration"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flowtrain", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            p.set_defaults(_unavailable=module)
            continue
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "_unavailable", None):
        print(f"flowtrain: error: '{args.command}' is not available in this build", file=sys.stderr)
        return 2
    try:
        return int(args._run(args) or 0)
    except FlowtrainError as exc:
        print(f"flowtrain: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("flowtrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
