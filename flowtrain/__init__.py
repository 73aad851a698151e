"""flowtrain: train large language models in full precision on one GPU far too small for them.

A training step is a DAG of typed tasks (:mod:`flowtrain.graph`), scheduled under a swappable
policy (:mod:`flowtrain.policy`) by an asyncio engine over CUDA streams or threads
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

__all__ = [
    "CheckpointError", "ConfigError", "CycleError", "DataError", "DeadlockError", "FlowtrainError",
    "GpuOutOfMemory", "NonFiniteError", "PlanError", "ScheduleError", "SlotError", "StepFailed", "StepSpec",
    "compile_step", "compile_steps", "cross_step_edges", "Policy", "Proposal", "natural_order", "register_policy",
    "resolve_policy", "Engine", "Instrument", "TaskRecord", "TraceRecorder", "run_graph", "run_reference",
]
