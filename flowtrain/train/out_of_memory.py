"""Running out of GPU memory, said in one line a user can act on.

The allocator's own message is a paragraph about PyTorch's internals; what a user needs is where
the run failed, how far it was from its plan, and what to change. :func:`gpu_out_of_memory` turns
the allocator's refusal, in a task (the cause of its :class:`~flowtrain.errors.StepFailed`) or
while the run sets up its GPU buffers (where the card holds less than ``--gpu-mem`` says,
another process using part of it), into a :class:`~flowtrain.errors.GpuOutOfMemory` with those:
the request the allocator could not meet, what it held then (read from its message, where it
says), the plan's count and budget, and the flags that leave more room. A step that fails so is
cancelled as any failed step is: no final model is written, and every checkpoint already written
stays whole.
"""

from __future__ import annotations

import re

from ..errors import GpuOutOfMemory
from ..plan.memory import GiB, Plan

#: what the CUDA caching allocator's message says of a failed request (PyTorch 2.x)
_ASKED = re.compile(r"Tried to allocate ([\d.]+ [KMGT]?i?B)")
_ALLOCATED = re.compile(r"([\d.]+ [KMGT]?i?B) is allocated by PyTorch")
_UNUSED = re.compile(r"([\d.]+ [KMGT]?i?B) is reserved by PyTorch but unallocated")


def gpu_out_of_memory(where: str, cause: BaseException, plan: Plan) -> GpuOutOfMemory:
    """The one-line error for ``where`` (a task, or the run's set-up) running out of GPU memory
    with the allocator's ``cause``."""
    said = str(cause)
    asked, allocated, unused = (m.group(1) if (m := p.search(said)) else None for p in (_ASKED, _ALLOCATED, _UNUSED))
    held = ""
    if allocated is not None:
        held = f" with {allocated} allocated" + (f" and {unused} reserved but unused" if unused is not None else "")
    budget = f" of {plan.gpu_limit / GiB:.2f} usable" if plan.gpu_limit is not None else ""
    return GpuOutOfMemory(
        f"{where} ran out of GPU memory: {asked or 'a request'} could not be allocated{held}, where "
        f"the plan counted a peak of {plan.gpu_total / GiB:.2f} GiB{budget}. A smaller --micro-batch-size or "
        f"--gpu-mem leaves the allocator more room; `flowtrain bench` with the same settings and "
        f"--gpu-peak-report FILE records what was alive at the peak")
