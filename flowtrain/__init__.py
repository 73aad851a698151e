"""flowtrain: train large language models in full precision on one GPU far too small for them.

Train from Python with a :class:`TrainConfig` (the same settings as ``flowtrain train``'s flags,
by their field names) and :func:`train`, which returns one :class:`StepMetrics` per step::

    from flowtrain import TrainConfig, train

    metrics = train(TrainConfig(model="path/to/hf-model", data="chats.jsonl", steps=100,
                                batch_size=16, micro_batch_size=2, seq_len=2048, out="tuned/"))
    print(metrics[-1].loss)

or from the command line: ``flowtrain train --help``, ``flowtrain plan --help`` (will it fit?).
The guides are in the repository's docs/ folder (docs/api.md for the Python API).

Underneath, a training step is a DAG of typed tasks (:mod:`flowtrain.graph`), scheduled under
a swappable policy (:mod:`flowtrain.policy`) by an asyncio engine over CUDA streams or threads
(:mod:`flowtrain.runtime`); :mod:`flowtrain.train` supplies the model, state and optimizer.
"""

from .errors import (
    CheckpointError,
    ConfigError,
    CycleError,
    DataError,
    DeadlockError,
    FlowtrainError,
    GpuOutOfMemory,
    NonFiniteError,
    PlanError,
    ScheduleError,
    SlotError,
    StepFailed,
)
from .graph import StepSpec, compile_step, compile_steps, cross_step_edges
from .policy import Policy, Proposal, natural_order, register_policy, resolve_policy
from .runtime import Engine, Instrument, TaskRecord, TraceRecorder, run_graph, run_reference

__version__ = "0.1.0"

#: names imported on first use (they import torch and the trainer: ``import flowtrain`` and
#: ``flowtrain --help`` stay quick)
_LAZY = {"TrainConfig": "flowtrain.train.config.run_config", "StepMetrics": "flowtrain.train.reporting",
         "PolicyTrainer": "flowtrain.train.policy_session"}


def __getattr__(name: str) -> object:
    import importlib

    if name == "train":  # the subpackage, which calls flowtrain.train.run.train (see its _Callable)
        return importlib.import_module("flowtrain.train")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'flowtrain' has no attribute {name!r}")

__all__ = [
    "TrainConfig", "train", "StepMetrics", "PolicyTrainer",
    "CheckpointError", "ConfigError", "CycleError", "DataError", "DeadlockError", "FlowtrainError",
    "GpuOutOfMemory", "NonFiniteError", "PlanError", "ScheduleError", "SlotError", "StepFailed", "StepSpec",
    "compile_step", "compile_steps", "cross_step_edges", "Policy", "Proposal", "natural_order", "register_policy",
    "resolve_policy", "Engine", "Instrument", "TaskRecord", "TraceRecorder", "run_graph", "run_reference",
]
