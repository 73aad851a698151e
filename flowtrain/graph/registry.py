"""What each part of flowtrain does for each task kind, one table per part.

A task kind (:mod:`flowtrain.graph.tasks`) means something to three parts beside the graph:
the training program runs it (:mod:`flowtrain.train.program`), the simulator prices it
(:mod:`flowtrain.sim.costs`) and the visualizer colours it (:mod:`flowtrain.viz.graphview`).
Each keeps a :class:`KindTable` keyed by the kind's string, filled where the code lives::

    HANDLERS = KindTable("the training program")

    @HANDLERS.register("fetch")
    def fetch(program, task, ctx): ...

    HANDLERS["fetch"]          # which code runs a fetch: one lookup
    HANDLERS.missing()         # kinds it has no entry for (a test asks every table)

A new kind is one class in ``tasks.py`` and one entry in each table (docs/concepts.md,
"Adding a task kind"); :func:`register_kind` adds a kind from outside the package (a test's
toy kind, a user's own). Pure data: no torch, no asyncio.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar, cast

from .tasks import KINDS, Task

V = TypeVar("V")

#: every table made, by name: the test that no kind lacks an entry walks them all
TABLES: dict[str, KindTable[object]] = {}


class KindTable(dict[str, V]):
    """A mapping from task kind to what one part does for it (a handler, a cost, a colour)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        TABLES[name] = cast("KindTable[object]", self)

    def register(self, *kinds: str) -> Callable[[V], V]:
        """A decorator that enters its function (or value) for each of ``kinds``."""

        def enter(value: V) -> V:
            for kind in kinds:
                self.add(kind, value)
            return value

        return enter

    def add(self, kind: str, value: V) -> None:
        """Enter ``value`` for ``kind``; a kind the graph does not know, or entered twice, is a
        mistake in the code and raises ``ValueError``."""
        if kind not in KINDS:
            raise ValueError(f"{self.name}: no task kind {kind!r} (known: {', '.join(sorted(KINDS))})")
        if kind in self:
            raise ValueError(f"{self.name}: task kind {kind!r} is entered twice")
        self[kind] = value

    def __missing__(self, kind: str) -> V:
        raise KeyError(f"{self.name} has no entry for task kind {kind!r}: docs/concepts.md, 'Adding a task kind'")

    def missing(self) -> list[str]:
        """The kinds the graph knows that this table has no entry for."""
        return sorted(k for k in KINDS if k not in self)


def register_kind(cls: type[Task]) -> type[Task]:
    """Make a task class known to the graph by its tag, as the built-in kinds are (its JSON
    decodes, every :class:`KindTable` expects an entry for it)."""
    kind = cls.__struct_config__.tag
    if not isinstance(kind, str) or kind in KINDS:
        raise ValueError(f"task class {cls.__name__} needs a tag of its own (got {kind!r})")
    KINDS[kind] = cls
    return cls


def unregister_kind(kind: str) -> None:
    """Forget a kind added by :func:`register_kind`, and every table's entry for it."""
    KINDS.pop(kind, None)
    for table in TABLES.values():
        table.pop(kind, None)


def kinds_missing(tables: Iterable[KindTable[object]] | None = None) -> dict[str, list[str]]:
    """For each table that lacks some kind, the kinds it lacks (empty: every table is whole)."""
    found = {t.name: t.missing() for t in (tables if tables is not None else TABLES.values())}
    return {name: kinds for name, kinds in found.items() if kinds}
