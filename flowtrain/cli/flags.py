"""Command-line flags generated from :class:`~flowtrain.train.config.run_config.TrainConfig`.

A field of ``TrainConfig`` is declared once, with its :class:`~flowtrain.train.config.settings.Setting`;
``train`` takes every field as a flag, ``plan``, ``simulate`` and ``bench --model`` the fields
they need, each with the same name, type, choices and help::

    add_config_flags(parser, ["seq_len", "batch_size"], defaults={"seq_len": 4096})
    TrainConfig(**config_values(args, ["seq_len", "batch_size"]))

The flag's type comes from the field's (``int``, ``float``, ``str``; a ``Literal`` gives the
choices), a ``bool`` field off by default is a switch (``--overwrite``), and a setting with a
``const`` is a switch that sets it (``--no-shuffle`` sets ``shuffle`` to False). The values are
checked by the config's own checks (``flowtrain.train.config.checks.check_fields``), not by argparse:
the Python API and the command line accept and refuse the same things.

This module is the last stop of a run's settings: the declaration, defaults and checks are
the package :mod:`flowtrain.train.config` (its docstring maps the whole path); only turning
them into argparse flags is the command line's.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from typing import Any

from ..train.config.run_config import TrainConfig
from ..train.config.settings import Field, fields_of


def config_fields(names: Iterable[str] | None = None) -> list[Field]:
    """``TrainConfig``'s fields named in ``names`` (all of them if None), in declaration order."""
    fields = list(fields_of(TrainConfig))
    if names is None:
        return fields
    wanted = set(names)
    unknown = wanted - {f.name for f in fields}
    if unknown:
        raise KeyError(f"not fields of TrainConfig: {sorted(unknown)}")
    return [f for f in fields if f.name in wanted]


def add_config_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, names: Iterable[str] | None = None, *,
                     defaults: Mapping[str, Any] | None = None, helps: Mapping[str, str] | None = None,
                     required: Iterable[str] = (), grouped: bool = True) -> None:
    """Add a flag for each field in ``names`` (every field if None). ``defaults`` and ``helps``
    replace a field's default and help for this command (``bench`` measures 4096-token
    sequences by default); ``required`` fields must be given. ``grouped``: one section of
    ``--help`` per setting's group, else all under the parser's own."""
    defaults, helps, required = dict(defaults or {}), dict(helps or {}), set(required)
    sections: dict[str | None, Any] = {}
    for f in config_fields(names):
        group = f.setting.group if grouped else None
        if group not in sections:
            sections[group] = parser if group is None else parser.add_argument_group(group)  # type: ignore[union-attr]
        _add_flag(sections[group], f, defaults.get(f.name, f.default), helps.get(f.name, f.setting.help),
                  f.name in required)


def _add_flag(section: Any, f: Field, default: Any, help_text: str, required: bool) -> None:
    s = f.setting
    names = [f.flag, *s.aliases]
    if s.const is not None:
        section.add_argument(*names, dest=f.name, action="store_const", const=s.const, default=default, help=help_text)
        return
    if f.kind is bool:
        section.add_argument(*names, dest=f.name, action="store_true", default=default, help=help_text)
        return
    kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": help_text, "required": required}
    if s.metavar:
        kwargs["metavar"] = s.metavar
    if f.choices is not None:
        kwargs["choices"] = list(f.choices)
    elif s.parse is not None:
        kwargs["type"] = _argparse_type(s.parse)
    elif f.kind in (int, float):
        kwargs["type"] = f.kind
    section.add_argument(*names, **kwargs)


def _argparse_type(parse: Any) -> Any:
    """``parse`` with its ``ValueError`` made argparse's own error (one line, exit 2)."""
    def parsed(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parsed.__name__ = getattr(parse, "__name__", "value").lstrip("_")
    return parsed


def config_values(args: argparse.Namespace, names: Iterable[str] | None = None) -> dict[str, Any]:
    """The fields in ``names`` (every field if None) as ``args`` holds them, for ``TrainConfig(**...)``."""
    return {f.name: getattr(args, f.name) for f in config_fields(names)}


def flag_of(field: str) -> str | None:
    """How ``train`` spells ``field`` (``checkpoint_every`` -> ``--activation-checkpoint-every``);
    None for a name that is no field of ``TrainConfig``."""
    return next((f.flag for f in fields_of(TrainConfig) if f.name == field), None)
