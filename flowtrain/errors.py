"""The errors flowtrain raises, in one place.

Every error a user can cause derives from :class:`FlowtrainError`; the command line prints
its message as one line and exits non-zero, so messages say what is wrong *and* how to fix
it ("--micro-batch-size 3 does not divide --batch-size 8"). ``assert`` is kept for internal
invariants only.
"""

from __future__ import annotations

import re
from collections.abc import Callable


class FlowtrainError(Exception):
    """Base class: a problem the user can act on."""


class ConfigError(FlowtrainError):
    """A flag, preset or config value is invalid or unsupported.

    A message about a setting names it by its field, in braces, and is raised with
    ``named=True``: ``ConfigError("{steps} must be at least 1 (got 0)", named=True)``. Its text
    (``str``) spells the field as the Python API takes it (``steps must be at least 1``); each
    command spells it as its own flag (:meth:`spelled`: ``--steps must be at least 1``), so a
    check written once speaks to both, and ``flowtrain graph`` names ``graph``'s flags, not
    ``train``'s. A doubled brace stands for a brace; any other text is left as it is (a path
    with braces in it, put in by an f-string, cannot break the message).
    """

    def __init__(self, message: str = "", *, named: bool = False) -> None:
        self.template = message if named else None
        super().__init__(_spell(message, lambda field: field) if named else message)

    def spelled(self, spell: Callable[[str], str | None]) -> str:
        """The message with each named field spelled by ``spell`` (a field -> its flag; None:
        not a setting of that command, left as written)."""
        return str(self) if self.template is None else _spell(self.template, spell)


_NAMED = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _spell(template: str, spell: Callable[[str], str | None]) -> str:
    def one(m: re.Match[str]) -> str:
        if m.group(1) is None:
            return m.group(0)[0]  # {{ -> {, }} -> }
        return spell(m.group(1)) or m.group(0)

    return _NAMED.sub(one, template)


class ScheduleError(FlowtrainError):
    """A graph or a policy's proposal cannot be scheduled (bad order, unknown task, ...)."""


class CycleError(ScheduleError):
    """The task graph has a cycle, so no order can satisfy its dependencies."""


class SlotError(ScheduleError):
    """A slot budget is missing, too small, or was violated."""


class DeadlockError(ScheduleError):
    """Nothing can run, nothing is running, and tasks remain: the slot budget is too small
    for the proposed order."""


class StepFailed(FlowtrainError):
    """A task failed during a step; the step was cancelled.

    ``task`` is the task that failed and ``__cause__`` the original exception.
    """

    def __init__(self, task: object, cause: BaseException) -> None:
        self.task = task
        super().__init__(f"task {task} failed: {type(cause).__name__}: {cause}")


class CheckpointError(FlowtrainError):
    """A model directory or checkpoint file is missing, corrupt or inconsistent."""


class DataError(FlowtrainError):
    """Training data is missing, empty or malformed."""


class PlanError(FlowtrainError):
    """The requested run does not fit in host or GPU memory."""


class GpuOutOfMemory(PlanError):
    """The run ran out of GPU memory, in a step or setting up its buffers: it did not fit the GPU
    as planned. The message names where, what was asked and held, the plan's count, and what to
    change."""


class NonFiniteError(FlowtrainError):
    """Training stopped because loss or gradients were not finite: too many steps in a row were
    skipped, or a step could not be undone. The message names the steps and what to resume from."""


class Interrupted(FlowtrainError):
    """The run was ended by a signal (SIGINT, SIGTERM); the message says what was saved. The
    command line exits with ``128 + signum`` (130, 143)."""

    def __init__(self, signum: int, message: str) -> None:
        self.signum = signum
        super().__init__(message)

    @property
    def exit_status(self) -> int:
        return 128 + self.signum
