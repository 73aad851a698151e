"""A setting declared once: what a config field means, what it accepts, how it is spelled.

The machinery under :mod:`flowtrain.train.config`'s declaration:
:class:`~flowtrain.train.config.run_config.TrainConfig` annotates each field with a :class:`Setting`::

    steps: Annotated[int, Setting("optimizer steps", ge=1)] = 200

From that one line come the ``--steps`` flag with its help and type (``flowtrain.cli.flags``),
the check that refuses ``steps=0`` (:func:`check_values`), and the spelling of the field in an
error: ``steps`` for the Python API, ``--steps`` on the command line (a
:class:`~flowtrain.errors.ConfigError` raised with ``named=True`` names fields in braces).

What a field accepts follows from its type and bounds: an ``int`` field takes integers (never a
``bool``) of at least ``ge``; a ``float`` field finite numbers of at least ``ge`` or above
``gt``; a ``Literal`` field one of its values; a type with ``None`` in it also takes ``None``.
Other types (``bool``, ``str``, tuples, unions of kinds) are checked where they are used.
msgspec ignores the annotation, so the struct itself is unchanged.
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin

import msgspec

from ...errors import ConfigError


@dataclass(frozen=True)
class Setting:
    """What a config field means (``help``, shown by ``--help``), the bounds of a number
    (``ge``: at least; ``gt``: above), and how a command line spells it: ``flag`` (default
    ``--field-name``), ``aliases`` (older names), ``metavar``, ``group`` (a section of
    ``--help``), ``const`` (the flag takes no value and sets the field to this: ``--no-shuffle``
    sets ``shuffle`` to False), and ``parse`` (text -> value, for types argparse cannot read)."""

    help: str
    ge: float | None = None
    gt: float | None = None
    flag: str | None = None
    aliases: tuple[str, ...] = ()
    metavar: str | None = None
    group: str | None = None
    const: Any = None
    parse: Callable[[str], Any] | None = None


@dataclass(frozen=True)
class Field:
    """One field of a config struct: its name, its type without ``None``, whether ``None`` is
    accepted, its default and its :class:`Setting`."""

    name: str
    kind: Any
    optional: bool
    default: Any
    setting: Setting

    @property
    def flag(self) -> str:
        return self.setting.flag or flag_name(self.name)

    @property
    def choices(self) -> tuple[Any, ...] | None:
        """The values of a ``Literal`` field, else None."""
        return get_args(self.kind) if get_origin(self.kind) is Literal else None


def flag_name(field: str) -> str:
    """A field's flag by the usual rule: ``micro_batch_size`` -> ``--micro-batch-size``."""
    return "--" + field.replace("_", "-")


def fields_of(struct: type[msgspec.Struct]) -> Iterator[Field]:
    """The fields of ``struct`` that carry a :class:`Setting`, in declaration order."""
    hints = typing.get_type_hints(struct, include_extras=True)
    for info in msgspec.structs.fields(struct):
        hint = hints[info.name]
        if get_origin(hint) is not typing.Annotated:
            continue
        kind, *meta = get_args(hint)
        setting = next((m for m in meta if isinstance(m, Setting)), None)
        if setting is None:
            continue
        kind, optional = _without_none(kind)
        yield Field(info.name, kind, optional, info.default, setting)


def _without_none(kind: Any) -> tuple[Any, bool]:
    if get_origin(kind) in (typing.Union, types.UnionType):
        rest = tuple(a for a in get_args(kind) if a is not type(None))
        if len(rest) < len(get_args(kind)):
            return (rest[0] if len(rest) == 1 else typing.Union[rest]), True  # noqa: UP007 - a runtime union
    return kind, False


def flag_map(struct: type[msgspec.Struct]) -> dict[str, str]:
    """field -> flag for every field of ``struct``: how a command spells them in errors."""
    return {f.name: f.flag for f in fields_of(struct)}


def check_values(config: msgspec.Struct) -> None:
    """Refuse the first field of ``config`` whose value its type and bounds do not accept, with a
    :class:`ConfigError` that names the field: ``{lr} must be a finite number >= 0 (got nan)``."""
    for f in fields_of(type(config)):
        value = getattr(config, f.name)
        if value is None and f.optional:
            continue
        problem = _problem(f, value)
        if problem:
            raise ConfigError(f"{{{f.name}}} must be {problem} (got {_shown(value)})", named=True)


def _problem(f: Field, value: Any) -> str | None:
    """What ``value`` should have been, or None if ``f`` accepts it."""
    s = f.setting
    if f.choices is not None:
        return None if value in f.choices else _one_of(f.choices)
    if f.kind is int:
        if not (isinstance(value, int) and not isinstance(value, bool)):
            return f"an integer >= {_num(s.ge)}" if s.ge is not None else "an integer"
        return f"at least {_num(s.ge)}" if s.ge is not None and value < s.ge else None
    if f.kind is float:
        op, low = (">=", s.ge) if s.ge is not None else (">", s.gt)
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        ok = number and (low is None or (value >= low if op == ">=" else value > low))
        return None if ok else "a finite number" + (f" {op} {_num(low)}" if low is not None else "")
    return None


def _one_of(choices: tuple[Any, ...]) -> str:
    names = [str(c) for c in choices]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _num(x: float | None) -> str:
    return f"{x:g}"


def _shown(value: Any) -> str:
    """``value`` as the message shows it, its braces doubled for :meth:`str.format_map`."""
    text = repr(value) if isinstance(value, str) else str(value)
    return text.replace("{", "{{").replace("}", "}}")
