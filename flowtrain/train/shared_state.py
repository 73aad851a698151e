"""One host copy of the model state for all the processes of a node.

Data parallel, every process streams the same weights and, without sharing, would keep its own
fp32 master, Adam moments (and ``stream-bf16`` copy): 12-14 bytes per parameter *per process*.
Here the node's first process creates two files in ``/dev/shm`` (shared memory; another
temporary folder where there is none), sized for every streamed unit's state, and hands their
names to the others; each process maps them (``torch.from_file(..., shared=True)``), so the
pages exist once in the node's memory, and pins the part that ``fetch`` copies to the GPU. The
files are unlinked once every process has mapped them: nothing is left behind, even if a
process is killed later::

    arena = SharedArena.open(world, {"pinned": pinned_bytes, "plain": plain_bytes}, pin=True)
    master = arena.take("pinned", numel, torch.float32)   # a view into the mapped file
    ...
    unpin_all()                                            # flowtrain.train.pinning, after the run

Each unit's Adam then runs in one process only (its owner, ``StepSpec.owner``); the
``sync_step`` barrier tells the others when the owners' updates are in. Resident units and the
per-process buffers (gradient staging, a ``full`` layout's host gradient) are not shared.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from .distributed import World, node_barrier, node_broadcast
from .pinning import pin

#: Where the state's files go: shared memory where the machine has it.
SHM_DIR = "/dev/shm"
#: Each tensor starts on its own 4 KiB page boundary, so pinning never splits a page.
ALIGN = 4096


def shared_dir() -> str:
    return SHM_DIR if os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK) else tempfile.gettempdir()


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class SharedArena:
    """Mapped files holding the node's shared state, handed out as tensors by :meth:`take`.
    ``sizes`` names each file and its bytes (the sum of :func:`aligned` sizes of what will be
    taken from it); the files named in ``pinned`` are page-locked for copies to the GPU."""

    def __init__(self, buffers: dict[str, torch.Tensor], pinned: list[str]) -> None:
        self._buffers = buffers
        self._used = dict.fromkeys(buffers, 0)
        for name in pinned:  # until the run's unpin_all; where it fails, copies are only slower
            if buffers[name].numel():
                pin(buffers[name])

    @classmethod
    def open(cls, world: World, sizes: dict[str, int], *, pin: bool) -> "SharedArena":
        """Create (the node's first process) or map (the others) the files; every process of
        the node calls this at the same point."""
        paths: dict[str, str] = {}
        if world.local_rank == 0:
            for name, nbytes in sizes.items():
                fd, path = tempfile.mkstemp(prefix=f"flowtrain-{name}-", dir=shared_dir())
                try:
                    os.ftruncate(fd, max(nbytes, 1))
                finally:
                    os.close(fd)
                paths[name] = path
        paths = node_broadcast(paths, world)
        try:
            buffers = {name: torch.from_file(paths[name], shared=True, size=max(nbytes, 1), dtype=torch.uint8)
                       for name, nbytes in sizes.items()}
        finally:
            node_barrier()  # every process has mapped them (or failed): the names can go
            if world.local_rank == 0:
                for path in paths.values():
                    Path(path).unlink(missing_ok=True)
        return cls(buffers, [n for n in sizes if pin and n == "pinned"])

    def take(self, file: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The next ``numel`` elements of ``file`` as a ``dtype`` tensor. Every process takes
        the same tensors in the same order, so each gets the same bytes of the file."""
        nbytes = numel * dtype.itemsize
        lo = self._used[file]
        hi = lo + aligned(nbytes)
        buf = self._buffers[file]
        if hi > buf.numel():
            raise RuntimeError(f"shared state file {file!r} is {buf.numel()} bytes, {hi} taken")
        self._used[file] = hi
        return buf[lo : lo + nbytes].view(dtype)
