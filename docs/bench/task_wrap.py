"""``flowtrain bench`` with every task's handler wrapped: the part the task probes share.

    rc = bench_with_tasks_wrapped(around, sys.argv[1:])

``around(task, call)`` runs in the task's lane thread and must return ``call()``, the task's own
handler's result; what it reads before and after is the probe's (``pinned_by_task.py``,
``stalls_by_task.py``). Lanes run concurrently, so what changes during one call may have changed
in another thread.
"""

from collections.abc import Callable
from typing import Any

import flowtrain.train.loop as loop
from flowtrain.cli import main
from flowtrain.runtime.engine import Engine


def bench_with_tasks_wrapped(around: Callable[[Any, Callable[[], Any]], Any], argv: list[str]) -> int:
    class Wrapped(Engine):
        def __init__(self, program, *args, **kwargs):
            super().__init__(lambda task, ctx: around(task, lambda: program(task, ctx)), *args, **kwargs)

    loop.Engine = Wrapped  # the training loop builds its engine from this name
    return main(["bench", *argv])
