"""Which tasks of a run make torch's pinned host allocator grow.

    python3 docs/bench/pinned_by_task.py BENCH_ARGS...

runs ``flowtrain bench BENCH_ARGS`` (on a GPU) with every task's handler wrapped: the bytes torch's
CUDA pinned allocator holds (``torch.cuda.host_memory_stats()``, the result line's
``host_pinned_by_torch_gib``) are read before and after each task, and a task during which they
grew is charged with the growth. After the bench's own result line it prints, to stderr, what the
allocator holds at the end and the growth by task kind, with the first task of each kind that
grew. Tasks run concurrently on their lanes, so growth inside a long task (a first forward that
compiles the layer) is charged to it even where another thread allocated; ``pin_memory()`` calls
of over 1 MiB are printed with their stack as they happen, and so is every copy Inductor's
autotuner saves in host memory (``CachingAutotuner.copy_args_to_cpu_if_needed``: an argument the
kernel writes in place, kept from the trials of its configurations), with its kernel and size.
flowtrain pins its own buffers in place (``cudaHostRegister``), outside that allocator: what
shows here is torch's.
"""

import collections
import sys
import threading
import traceback

import torch

from task_wrap import bench_with_tasks_wrapped


def held() -> int:
    return torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)


growth: collections.Counter = collections.Counter()
first: dict[str, tuple[str, int]] = {}
lock = threading.Lock()


def charged(task, call):
    """Charge the allocator's growth during the task's handler to the task."""
    before = held()
    out = call()
    grew = held() - before
    if grew > 0:
        with lock:
            growth[type(task).__name__] += grew
            first.setdefault(type(task).__name__, (str(task), grew))
    return out


def pin_memory_traced(pin_memory):
    def traced(self, *args, **kwargs):
        nbytes = self.numel() * self.element_size()
        if nbytes > 2**20:
            print(f"pin_memory {nbytes / 2**20:.1f} MiB", "".join(traceback.format_stack(limit=6)), file=sys.stderr)
        return pin_memory(self, *args, **kwargs)

    return traced


def autotuner_copies_traced(copy_args_to_cpu_if_needed):
    def traced(self, *args, **kwargs):
        copies = copy_args_to_cpu_if_needed(self, *args, **kwargs)
        for name, (_, host) in copies.items():
            kernel = self.inductor_meta.get("kernel_name", "?")
            print(f"autotuner host copy {host.numel() * host.element_size() / 2**20:.1f} MiB: {kernel} argument {name}",
                  file=sys.stderr)
        return copies

    return traced


def trace_autotuner_copies() -> None:
    """Wrap the autotuner's host copies where this torch has them (its name is torch's own)."""
    try:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    except ImportError:
        return
    if hasattr(CachingAutotuner, "copy_args_to_cpu_if_needed"):
        CachingAutotuner.copy_args_to_cpu_if_needed = autotuner_copies_traced(
            CachingAutotuner.copy_args_to_cpu_if_needed)


if __name__ == "__main__":
    trace_autotuner_copies()
    torch.Tensor.pin_memory = pin_memory_traced(torch.Tensor.pin_memory)
    rc = bench_with_tasks_wrapped(charged, sys.argv[1:])
    print("before-exit pinned by torch:", held() / 2**30, "GiB", file=sys.stderr)
    for kind, nbytes in growth.most_common():  # the first task of the kind to grow it, and by how many bytes
        print(f"growth {kind}: {nbytes / 2**20:.1f} MiB, first {first[kind]}", file=sys.stderr)
    sys.exit(rc)
