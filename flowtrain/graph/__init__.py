"""Task kinds and the compiler that turns a training step into a DAG of them (no torch here)."""

from .compiler import StepSpec, compile_step, compile_steps, cross_step_edges, units
from .export import graph_from_json, graph_to_json
from .tasks import (
    DEVICE_LANES, GRADS, HOST_GRADS, KINDS, LANES, WEIGHTS, AnyTask, Backward, CpuAdam, Embed,
    EmbedBackward, Fetch, Forward, GpuAdam, GradNorm, GradSqNorm, Loss, OffloadGrad, Recompute, Task,
    ZeroGrad,
)

__all__ = [
    "StepSpec", "compile_step", "compile_steps", "cross_step_edges", "units", "graph_from_json",
    "graph_to_json", "DEVICE_LANES", "GRADS", "HOST_GRADS", "KINDS", "LANES", "WEIGHTS", "AnyTask", "Backward",
    "CpuAdam", "Embed", "EmbedBackward", "Fetch", "Forward", "GpuAdam", "GradNorm", "GradSqNorm", "Loss", "OffloadGrad",
    "Recompute", "Task", "ZeroGrad",
]
