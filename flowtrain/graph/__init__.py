"""Task kinds and the compiler that turns a training step into a DAG of them (no torch here)."""

from .compiler import StepSpec, compile_step, compile_steps, cross_step_edges, units
from .evaluation import compile_eval
from .export import graph_from_json, graph_to_json
from .saving import add_saves, save_edges
from .tasks import (
    ACTS,
    DEVICE_LANES,
    GRADS,
    HOST_GRADS,
    KINDS,
    LANES,
    WEIGHTS,
    AnyTask,
    Backward,
    CpuAdam,
    Embed,
    EmbedBackward,
    EvalLoss,
    Fetch,
    FetchAct,
    Forward,
    FoundInf,
    GpuAdam,
    GradNorm,
    GradSqNorm,
    Loss,
    OffloadAct,
    OffloadGrad,
    Recompute,
    ReduceGrad,
    SaveUnit,
    Task,
    VerifyStep,
    ZeroGrad,
)

__all__ = [
    "StepSpec", "compile_eval", "compile_step", "compile_steps", "cross_step_edges", "units",
    "graph_from_json", "graph_to_json", "add_saves", "save_edges", "ACTS", "DEVICE_LANES", "GRADS",
    "HOST_GRADS", "KINDS", "LANES", "WEIGHTS", "AnyTask", "Backward", "CpuAdam", "Embed", "EmbedBackward",
    "EvalLoss", "Fetch", "FetchAct", "Forward", "FoundInf", "GpuAdam", "GradNorm", "GradSqNorm", "Loss",
    "OffloadAct", "OffloadGrad", "Recompute", "ReduceGrad", "SaveUnit", "Task", "VerifyStep", "ZeroGrad",
]
