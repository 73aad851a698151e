"""The ``flowtrain`` command line: one subcommand per module, imported where it runs.

Subcommands: ``train`` (the product), ``graph`` (compile a step DAG to JSON), ``plan`` (memory
plan), ``viz`` (HTML report of graphs and traces), ``bench`` (benchmarks), ``simulate``
(predicted speed on a machine), ``probe`` (measure this machine for ``simulate``) and ``cache``
(list and trim the token cache of ``--data`` files).

A failure ends the command with one line on stderr, never a traceback, and an exit status
that says whose it is:

- 2: the input. A :class:`~flowtrain.errors.FlowtrainError` (bad flag, model, data, plan) or a
  ``ValueError`` (a bad value found deeper down); argparse's own errors exit 2 as well.
- 1: the system. An ``OSError``: a file that cannot be read or written, a full disk.
- 130 / 143: ended by SIGINT (Ctrl-C) / SIGTERM; the line says what was saved.

Set ``FLOWTRAIN_DEBUG=1`` to let the exception through with its traceback instead. Any other
exception is a bug in flowtrain and keeps its traceback.

Starting is cheap: ``flowtrain --help`` lists the commands from :data:`COMMANDS` without
importing them, and ``flowtrain train ...`` imports ``train``'s module alone, whose
``add_arguments`` imports no torch; torch, the trainer, the planner and matplotlib are imported
where a command runs (tests/cli/test_cli_startup.py holds every ``--help`` to that).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable

from ..errors import ConfigError, FlowtrainError, Interrupted

#: what ``flowtrain --help`` opens with: for users
DESCRIPTION = """\
Train large language models in full precision on one GPU far too small for them: the weights,
fp32 master copy and Adam state live in host memory and stream through the GPU layer by layer.

  flowtrain train                       a tiny model on the bundled corpus, on the CPU (a first look)
  flowtrain train --model DIR --data chats.jsonl --out tuned/   fine-tune a Hugging Face model folder
  flowtrain plan --model DIR --seq-len 4096 --batch-size 16      will it fit? where every byte goes

`flowtrain COMMAND --help` lists a command's flags."""

#: subcommand -> module with ``add_arguments(parser)`` and ``run(args) -> int``
COMMANDS = {
    "train": ("flowtrain.cli.train", "train a model (with no arguments: a tiny model on the bundled corpus)"),
    "graph": ("flowtrain.cli.graph", "compile one training step into a task DAG and write it as JSON"),
    "plan": ("flowtrain.cli.plan", "estimate host and GPU memory for a training run"),
    "viz": ("flowtrain.cli.viz", "draw graphs and traces as a self-contained HTML report"),
    "bench": ("flowtrain.bench", "benchmark the scheduler or a training configuration"),
    "simulate": ("flowtrain.cli.simulate", "predict a training run's speed on a machine, without running it"),
    "probe": ("flowtrain.sim.probe", "measure this machine's copy, compute and CPU Adam rates into a machine file"),
    "cache": ("flowtrain.cli.cache", "list the data cache's entries with their sizes; --clean [--max-gb G] removes them"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``flowtrain`` parser, with the arguments of ``command`` alone.

    Every subcommand is listed (its help comes from :data:`COMMANDS`), but only ``command``'s
    module is imported to add its arguments and its ``run``: the others stay bare, since
    importing all of them would cost the seconds that torch takes to import.
    """
    parser = argparse.ArgumentParser(prog="flowtrain", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=_ShowDefaults)
        if name == command:
            _add_command(p, module)
    return parser


class _ShowDefaults(argparse.HelpFormatter):
    """``--help`` shows every option's default that its text does not already state (none for
    options off unless given, or decided by the run where their text says how, nor for a switch
    such as ``--no-shuffle``, whose default is not giving it: "(default: True)" there reads as
    "no shuffling by default")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        switch = isinstance(action, argparse._StoreConstAction)
        if "default" in text or default in (None, False, argparse.SUPPRESS) or not action.option_strings or switch:
            return text
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        return f"{text} (default: {shown})".strip()


def _add_command(p: argparse.ArgumentParser, module: str) -> None:
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        p.set_defaults(_unavailable=module)
        return
    mod.add_arguments(p)
    p.set_defaults(_run=mod.run, _flag_of=getattr(mod, "flag_of", None))


def _command(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names: its first argument that is not an option (the top-level
    parser has no option that takes a value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_command(argv))
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "_unavailable", None):
        print(f"flowtrain: error: '{args.command}' is not available in this build", file=sys.stderr)
        return 2
    try:
        return int(args._run(args) or 0)
    except BrokenPipeError:
        if args.command == "train":  # a run whose output went nowhere: say so, as any other failure
            print("flowtrain: error: standard output was closed (broken pipe)", file=sys.stderr)
            return 1
        _quiet_stdout()  # `flowtrain simulate ... | head -1`: the reader has what it wanted
        return 0
    except Interrupted as exc:
        if os.environ.get("RANK", "0") == "0":  # data parallel: rank 0 says it for all
            print(f"flowtrain: {exc}", file=sys.stderr)
        return exc.exit_status
    except (FlowtrainError, ValueError, OSError, KeyboardInterrupt) as exc:
        if os.environ.get("FLOWTRAIN_DEBUG") == "1":
            raise
        print(f"flowtrain: {_one_line(exc, getattr(args, '_flag_of', None))}", file=sys.stderr)
        if isinstance(exc, ConnectionError):  # a lost data-parallel peer: no teardown that could abort
            from ..train.distributed import PeerLost, exit_after_peer_lost

            if isinstance(exc, PeerLost):
                exit_after_peer_lost(_exit_status(exc))
        return _exit_status(exc)


def _quiet_stdout() -> None:
    """Point standard output at /dev/null: what is still buffered for a reader that has gone
    would fail again at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _exit_status(exc: BaseException) -> int:
    if isinstance(exc, KeyboardInterrupt):
        return 130
    if isinstance(exc, OSError):
        return 1
    return 2


def _one_line(exc: BaseException, flag_of: Callable[[str], str | None] | None = None) -> str:
    """The message of ``exc`` as one line, the settings it names spelled as the command's flags
    (``flag_of``: the command module's, else train's); errors from outside flowtrain
    name their type and how to see where they came from."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    if isinstance(exc, ConfigError):
        if flag_of is None:  # a command without its own: train's spelling, where it has one
            from .train import flag_of as train_flag_of

            flag_of = train_flag_of
        text = exc.spelled(flag_of)
    elif isinstance(exc, FlowtrainError):
        text = str(exc)
    elif isinstance(exc, OSError) and exc.strerror:
        names = [str(f) for f in (exc.filename, exc.filename2) if f is not None]
        text = exc.strerror + (f": {' -> '.join(names)}" if names else "")
    else:
        text = f"{type(exc).__name__}: {exc}"
    text = " ".join(line.strip() for line in text.splitlines() if line.strip()) or type(exc).__name__
    if not isinstance(exc, FlowtrainError):
        text += " (set FLOWTRAIN_DEBUG=1 to see the traceback)"
    return f"error: {text}"


if __name__ == "__main__":
    sys.exit(main())
