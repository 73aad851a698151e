"""Transitional: the old name of :mod:`flowtrain.runtime.engine`, kept only for the one module
that still imports ``TaskContext`` from here (``flowtrain/train/program.py``); remove this file
once that import reads ``from ..runtime.engine import TaskContext``."""

from .engine import TaskContext

__all__ = ["TaskContext"]
