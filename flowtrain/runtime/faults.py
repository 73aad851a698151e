"""Fault injection: make chosen tasks raise, hang or dawdle, to test how a run fails.

A :class:`FaultInjector` wraps a program; it looks each task up in a list of faults before
running it. Tests build one directly; the command line gets one from the environment through
:func:`from_env`, so a subprocess test of the real CLI can break a real run::

    program = FaultInjector(program, "backward@step=2,layer=1:hang")
    FLOWTRAIN_FAULT='cpu_adam:raise' flowtrain train ...     # the trainer calls from_env(program)

Spec grammar (whitespace around items is ignored, empty items too)::

    spec   := item (";" item)*
    item   := "seed=" INT | fault
    fault  := KIND ["@" KEY "=" VALUE ("," KEY "=" VALUE)*] ":" MODE ("," OPTION)*
    KIND   := a task kind such as cpu_adam, backward, save (matched as a string, so kinds the
              graph does not have yet are fine), or "*" for every task
    KEY    := step | layer | micro_batch | chunk (integers) | unit | phase | activations
              (words); a task matches when each given key equals its field (a field that is
              unset never matches)
    MODE   := raise                raise InjectedFault (a RuntimeError naming the task)
            | hang                 block the task until the process exits
            | delay=SECONDS        sleep a random 0..SECONDS before the task runs
    OPTION := count=N              fire for the first N matching tasks
            | always               fire for every matching task

``raise`` and ``hang`` fire once (the first matching task to run), ``delay`` always, unless an
option says otherwise. ``seed=N`` seeds the delays (default 0). Examples::

    cpu_adam:raise                             the first cpu_adam raises
    backward@step=2,layer=1:hang               backward of layer 1 in step 2 never returns
    fetch@step=1:raise,count=2                 two fetches of step 1 raise
    *:delay=0.002;seed=7                       every task sleeps up to 2 ms (a soak test)

A fault fires *before* the wrapped program runs, so a task that raises has done nothing.
An invalid spec raises :class:`~flowtrain.errors.ConfigError` saying what is wrong.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import re
import threading
import time
from typing import TYPE_CHECKING, Mapping

from ..errors import ConfigError
from ..graph.tasks import Task

if TYPE_CHECKING:
    from .engine import Program, TaskContext

ENV = "FLOWTRAIN_FAULT"
INT_KEYS = ("step", "layer", "micro_batch", "chunk")
STR_KEYS = ("unit", "phase", "activations")
MODES = ("raise", "hang", "delay")
_NAME = re.compile(r"\*|[A-Za-z_][A-Za-z0-9_]*")
_USAGE = "expected KIND[@key=value,...]:MODE, e.g. cpu_adam:raise or backward@step=2,layer=1:hang"


class InjectedFault(RuntimeError):
    """What a ``raise`` fault raises; the message names the task."""


@dataclasses.dataclass(frozen=True)
class Fault:
    """One parsed fault. ``where`` holds ``(key, value)`` pairs; ``count`` ``None`` is always."""

    kind: str
    where: tuple[tuple[str, int | str], ...]
    mode: str
    seconds: float = 0.0
    count: int | None = 1
    text: str = ""

    def matches(self, task: Task) -> bool:
        if self.kind != "*" and task.kind != self.kind:
            return False
        return all(getattr(task, key, None) == value for key, value in self.where)


@dataclasses.dataclass(frozen=True)
class FaultSpec:
    """A parsed spec string: the faults, in order, and the seed of the delays."""

    faults: tuple[Fault, ...]
    seed: int = 0

    @classmethod
    def parse(cls, spec: str) -> "FaultSpec":
        faults: list[Fault] = []
        seed: int | None = None
        for item in (part.strip() for part in spec.split(";")):
            if not item:
                continue
            if item.startswith("seed="):
                if seed is not None:
                    raise ConfigError(f"fault spec {spec!r}: seed is given twice")
                seed = _int(item, "seed", item[len("seed="):])
                continue
            faults.append(_parse_fault(item))
        return cls(tuple(faults), seed or 0)


def _int(item: str, key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"fault {item!r}: {key}={value} is not an integer") from None


def _parse_fault(item: str) -> Fault:
    head, colon, tail = item.partition(":")
    if not colon or not tail.strip():
        raise ConfigError(f"fault {item!r}: {_USAGE}")
    kind, at, where_text = head.partition("@")
    kind = kind.strip()
    if not _NAME.fullmatch(kind):
        raise ConfigError(f"fault {item!r}: {kind!r} is not a task kind or '*'; {_USAGE}")
    where: dict[str, int | str] = {}
    for pair in where_text.split(",") if at else ():
        key, eq, value = (s.strip() for s in pair.partition("="))
        if key not in INT_KEYS + STR_KEYS:
            raise ConfigError(f"fault {item!r}: unknown key {key!r} (keys: {', '.join(INT_KEYS + STR_KEYS)})")
        if not eq or not value:
            raise ConfigError(f"fault {item!r}: key {key} needs a value, as in {key}=1")
        if key in where:
            raise ConfigError(f"fault {item!r}: key {key} is given twice")
        where[key] = _int(item, key, value) if key in INT_KEYS else value
    mode_text, *options = (s.strip() for s in tail.split(","))
    mode, eq, arg = mode_text.partition("=")
    if mode == "delay" and not eq:
        raise ConfigError(f"fault {item!r}: delay needs a number of seconds, as in delay=0.01")
    if mode not in MODES or bool(eq) != (mode == "delay"):
        raise ConfigError(f"fault {item!r}: unknown mode {mode_text!r} (modes: raise, hang, delay=SECONDS)")
    seconds = 0.0
    if mode == "delay":
        try:
            seconds = float(arg)
        except ValueError:
            seconds = math.nan
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ConfigError(f"fault {item!r}: delay={arg} is not a number of seconds >= 0")
    count: int | None = None if mode == "delay" else 1
    for option in options:
        if option == "always":
            count = None
        elif option.startswith("count="):
            count = _int(item, "count", option[len("count="):])
            if count < 1:
                raise ConfigError(f"fault {item!r}: count must be at least 1 (got {count})")
        else:
            raise ConfigError(f"fault {item!r}: unknown option {option!r} (options: count=N, always)")
    return Fault(kind, tuple(where.items()), mode, seconds, count, item)


class FaultInjector:
    """A program that runs ``program`` after applying ``faults`` (a spec string or a parsed
    :class:`FaultSpec`) to each task. Thread-safe: lanes call it from their threads.

    ``fired`` lists ``(task, fault)`` for each ``raise`` or ``hang`` that fired, in order.
    :meth:`release` lets hung tasks go on (tests use it to end their threads).
    """

    def __init__(self, program: Program, faults: "str | FaultSpec") -> None:
        self.program = program
        self.spec = faults if isinstance(faults, FaultSpec) else FaultSpec.parse(faults)
        self.fired: list[tuple[Task, Fault]] = []
        self._left = [f.count for f in self.spec.faults]
        self._lock = threading.Lock()
        self._rng = random.Random(self.spec.seed)
        self._never = threading.Event()  # hung tasks wait on it; only release() sets it

    def __call__(self, task: Task, ctx: TaskContext) -> int | None:
        for i, fault in enumerate(self.spec.faults):
            if not fault.matches(task):
                continue
            with self._lock:
                left = self._left[i]
                if left == 0:
                    continue
                if left is not None:
                    self._left[i] = left - 1
                if fault.mode == "delay":
                    pause = self._rng.uniform(0.0, fault.seconds)
                else:
                    self.fired.append((task, fault))
            if fault.mode == "delay":
                time.sleep(pause)
            elif fault.mode == "raise":
                raise InjectedFault(f"injected fault in {task} ({fault.text})")
            else:
                self._never.wait()
        return self.program(task, ctx)

    def release(self) -> None:
        """Let every hung task (and every later one) go on: for tests, never for real runs."""
        self._never.set()

    def __repr__(self) -> str:
        return f"<FaultInjector {'; '.join(f.text for f in self.spec.faults)!r} around {self.program!r}>"


def from_env(program: Program, environ: Mapping[str, str] | None = None) -> Program:
    """``program`` wrapped in the faults of ``$FLOWTRAIN_FAULT``, or ``program`` itself when the
    variable is unset or empty."""
    spec = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not spec:
        return program
    try:
        return FaultInjector(program, spec)
    except ConfigError as exc:
        raise ConfigError(f"{ENV}: {exc}") from None
