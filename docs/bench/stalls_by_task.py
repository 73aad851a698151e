"""Which tasks of a run take long in their own thread, and what torch's GPU allocator did meanwhile.

    python3 docs/bench/stalls_by_task.py BENCH_ARGS...

runs ``flowtrain bench BENCH_ARGS`` (on a GPU) with every task's handler wrapped: the wall time of
the call (on a CUDA lane the launch, which returns before the GPU has run it, unless something in
it waits) and the caching allocator's counts before and after it (``torch.cuda.memory_stats()``:
``num_alloc_retries``, a request that did not fit, after which the allocator waits for the GPU,
returns its free cached memory to the driver and asks again; ``num_device_free`` and
``num_device_alloc``, the driver calls), and what the host did to the calling thread meanwhile:
its CPU seconds, page faults (minor, major) and context switches (voluntary: it waited;
involuntary: it was preempted), from ``getrusage(RUSAGE_THREAD)``, and the whole host's direct
reclaims and compactions (``allocstall_*``, ``compact_stall`` in ``/proc/vmstat``: an allocation
that had to free or move pages first). After the bench's own result line it prints, to stderr,
each call of over 50 ms with its counts' growth, then the growth by task kind. Lanes run
concurrently, so a GPU or host-wide count that grew during a long call may have grown in another
thread; a long launch with a retry in it is the allocator's wait, one spent on the CPU with faults
in it the kernel's.
"""

import collections
import resource
import sys
import threading
import time

import torch

from task_wrap import bench_with_tasks_wrapped

GPU_COUNTS = ("num_alloc_retries", "num_device_free", "num_device_alloc")
THREAD_COUNTS = ("cpu_ms", "minflt", "majflt", "nvcsw", "nivcsw")
HOST_COUNTS = ("allocstall", "compact_stall")
COUNTS = GPU_COUNTS + THREAD_COUNTS + HOST_COUNTS
LONG_S = 0.05


def host_counts() -> tuple[int, ...]:
    """The host's direct reclaims (every ``allocstall_*`` zone summed) and compaction stalls."""
    stall = compact = 0
    try:
        for line in open("/proc/vmstat"):
            name, value = line.split()
            if name.startswith("allocstall"):
                stall += int(value)
            elif name == "compact_stall":
                compact = int(value)
    except OSError:
        pass
    return stall, compact


def counts() -> tuple[int, ...]:
    stats = torch.cuda.memory_stats()
    me = resource.getrusage(resource.RUSAGE_THREAD)
    cpu_ms = round((me.ru_utime + me.ru_stime) * 1e3)
    return (tuple(stats.get(name, 0) for name in GPU_COUNTS)
            + (cpu_ms, me.ru_minflt, me.ru_majflt, me.ru_nvcsw, me.ru_nivcsw) + host_counts())


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
