"""What a run's first step leaves behind that later steps need not carry.

The first step is where the compiled layer is built: torch.compile traces it, Inductor writes and
loads its kernels and times each kernel's candidate configurations on the real arguments. Two
things outlive that work:

- **Long-lived Python objects.** The compiled graphs, their guards and kernel wrappers are made
  then and kept to the end of the run. The run froze what existed once it was set up
  (:func:`flowtrain.train.run.open_run`); what the first step made is not frozen, so every later
  full garbage collection walks it while holding the GIL, and the lane launchers wait: on an H100
  a full collection inside a measured llama-3b step took 31 to 68 ms (``flowtrain bench``'s
  ``gc_full_by_step``). Freezing again once the first step is over moves these objects out of
  the collector's sight too; a later full collection walks only what the steps themselves leave.
- **Pinned host blocks.** To keep its trials from changing an argument a kernel writes in place,
  Inductor's autotuner copies that argument first, to pinned host memory where the GPU has no
  room for the copy below the run's peak so far. torch's pinned allocator rounds the block up to a
  power of two and keeps it cached after the copy is dropped: 1 GiB for Qwen2.5-7B at 79 x 1,024
  tokens a micro-batch. The plan counts it (``autotune_copy`` in
  :mod:`flowtrain.plan.memory`); giving the unused cached blocks back after the first step returns
  that memory to the machine for the rest of the run. Blocks still in use stay.
"""

from __future__ import annotations

import gc

import torch


def settle_after_first_step(device_type: str) -> None:
    """Freeze the objects alive now out of full collections and, on CUDA, give torch's unused
    cached pinned host blocks back. Call once, after the run's first step has finished."""
    gc.freeze()
    if device_type == "cuda":
        empty_pinned_cache()


def empty_pinned_cache() -> None:
    """Give the unused blocks of torch's pinned host allocator back to the system (blocks in use,
    or whose copies have not finished, stay): ``torch.accelerator.empty_host_cache`` where torch
    has it, else the internal call that torch's CUDA graph capture makes. It only returns memory,
    so where torch cannot (no accelerator initialised) the run goes on holding it."""
    accelerator = getattr(torch, "accelerator", None)
    release = getattr(accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if release is None:
        return
    try:
        release()
    except RuntimeError:  # "Cannot access accelerator device when none is available"
        return
