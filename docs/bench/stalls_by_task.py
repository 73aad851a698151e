"""Which tasks of a run take long in their own thread, and what torch's GPU allocator did meanwhile.

    python3 docs/bench/stalls_by_task.py BENCH_ARGS...

runs ``flowtrain bench BENCH_ARGS`` (on a GPU) with every task's handler wrapped: the wall time of
the call (on a CUDA lane the launch, which returns before the GPU has run it, unless something in
it waits) and the caching allocator's counts before and after it (``torch.cuda.memory_stats()``:
``num_alloc_retries``, a request that did not fit, after which the allocator waits for the GPU,
returns its free cached memory to the driver and asks again; ``num_device_free`` and
``num_device_alloc``, the driver calls). After the bench's own result line it prints, to stderr,
each call of over 50 ms with its counts' growth, then the growth by task kind. Lanes run
concurrently, so a count that grew during a long call may have grown in another thread; a long
launch with a retry in it is the allocator's wait.
"""

import collections
import sys
import threading
import time

import torch

from task_wrap import bench_with_tasks_wrapped

COUNTS = ("num_alloc_retries", "num_device_free", "num_device_alloc")
LONG_S = 0.05


def counts() -> tuple[int, ...]:
    stats = torch.cuda.memory_stats()
    return tuple(stats.get(name, 0) for name in COUNTS)


long_calls: list[tuple[str, float, tuple[int, ...]]] = []
by_kind: dict[str, list[int]] = collections.defaultdict(lambda: [0] * len(COUNTS))
lock = threading.Lock()


def timed(task, call):
    """Time the task's handler and count what the allocator did meanwhile."""
    before, start = counts(), time.perf_counter()
    out = call()
    seconds = time.perf_counter() - start
    grew = tuple(a - b for a, b in zip(counts(), before))
    with lock:
        kind = by_kind[type(task).__name__]
        for i, n in enumerate(grew):
            kind[i] += n
        if seconds > LONG_S:
            long_calls.append((str(task), seconds, grew))
    return out


if __name__ == "__main__":
    rc = bench_with_tasks_wrapped(timed, sys.argv[1:])
    for name, seconds, grew in long_calls:
        print(f"long {name}: {seconds * 1e3:.1f} ms, " + ", ".join(f"{c} +{n}" for c, n in zip(COUNTS, grew)),
              file=sys.stderr)
    for kind, grew in sorted(by_kind.items()):
        print(f"kind {kind}: " + ", ".join(f"{c} +{n}" for c, n in zip(COUNTS, grew)), file=sys.stderr)
    sys.exit(rc)
