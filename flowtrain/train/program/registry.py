"""Which function runs each task kind: the program's :class:`~flowtrain.graph.registry.KindTable`.

Each handler module registers its functions here, by kind::

    @HANDLERS.register("fetch")
    def run_fetch(program: StepProgram, task: Fetch, ctx: TaskContext) -> int: ...

A handler returns the bytes it moved (copies and saves, for the trace) or None.
:class:`~flowtrain.train.program.StepProgram` calls ``HANDLERS[task.kind](self, task, ctx)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...graph.registry import KindTable

#: ``handler(program, task, ctx) -> bytes moved or None``
Handler = Callable[..., Any]

HANDLERS: KindTable[Handler] = KindTable("the training program")
