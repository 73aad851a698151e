"""One host copy of the model state for all the processes of a node.

Data parallel, every process streams the same weights and, without sharing, would keep its own
fp32 master, Adam moments (and ``stream-bf16`` copy): 12-14 bytes per parameter *per process*.
Here the node's first process creates two files in ``/dev/shm`` (shared memory; another
temporary folder where there is none), sized for every streamed unit's state, and hands their
names to the others; each process maps them (``torch.from_file(..., shared=True)``), so the
pages exist once in the node's memory, and pins the part that ``fetch`` copies to the GPU.

The files never outlive the run. They are unlinked as soon as every process has mapped them (a
barrier), or as soon as handing them round failed (a process died:
:class:`~flowtrain.train.distributed.PeerLost`), so a process killed later leaves nothing. For
the moments before that, each file is named ``flowtrain-NAME-PID-XXXXXXXX`` and its creator
holds an exclusive ``flock`` on it for as long as it has a name (taken before the name appears,
under a hidden temporary one): a file whose lock anyone can take belongs to a process that died,
``kill -9`` included, and :func:`remove_stale` deletes it. The node's first process does so
before it creates its own, and every process of the node when opening fails and when its run
ends (:func:`flowtrain.train.run.train`), so a creator killed between creating and
unlinking is cleaned up by the survivors::

    arena = SharedArena.open(world, {"pinned": pinned_bytes, "plain": plain_bytes}, pin=True)
    master = arena.take("pinned", numel, torch.float32)   # a view into the mapped file
    ...
    unpin_all()                                            # flowtrain.train.pinning, after the run

Each unit's Adam then runs in one process only (its owner, ``StepSpec.owner``); the
``sync_step`` barrier tells the others when the owners' updates are in. Resident units and the
per-process buffers (gradient staging, a ``full`` layout's host gradient) are not shared.
"""

from __future__ import annotations

import fcntl
import os
import re
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


#: The names of the state's files (``flowtrain-pinned-1234-k3j_x9ab``), and of those earlier
#: versions of flowtrain made without the creator's pid (and without a lock).
_NAME = re.compile(r"flowtrain-[a-z]+-(\d+-)?[a-z0-9_]{8}")


def create_locked(directory: str, name: str, nbytes: int) -> tuple[str, int]:
    """A new file of ``nbytes`` (at least 1) in ``directory``, named after ``name`` and this
    process, and an open descriptor holding an exclusive lock on it: the file gets its name
    only once locked, so :func:`remove_stale` never takes a live creator's file for a dead one.
    Close the descriptor after unlinking the file."""
    fd, tmp = tempfile.mkstemp(prefix=f".flowtrain-{name}-", dir=directory)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, max(nbytes, 1))
        path = os.path.join(directory, f"flowtrain-{name}-{os.getpid()}-{tmp.rsplit('-', 1)[1]}")
        os.link(tmp, path)  # fails rather than replace a file of that name
    except BaseException:
        os.close(fd)
        raise
    finally:
        os.unlink(tmp)
    return path, fd


def remove_stale(directory: str) -> list[str]:
    """Delete the state files in ``directory`` whose creator is gone (nobody holds their lock);
    returns their names. Files of live runs, of other users and anything not named like a state
    file are left alone."""
    removed = []
    for entry in os.scandir(directory):
        if not _NAME.fullmatch(entry.name) or not entry.is_file(follow_symlinks=False):
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(entry.path)
            removed.append(entry.name)
        except OSError:  # locked: its creator is alive; or gone already, or not ours to delete
            continue
        finally:
            os.close(fd)
    return removed


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
        the node calls this at the same point. However it ends, the files have no name any more
        when it returns or raises (:class:`~flowtrain.train.distributed.PeerLost` where another
        process died or stopped answering)."""
        directory = shared_dir()
        paths: dict[str, str] = {}
        held: list[int] = []  # the creator's locks, kept until the names are gone
        try:
            if world.local_rank == 0:
                remove_stale(directory)  # left by a run whose first process was killed
                for name, nbytes in sizes.items():
                    paths[name], fd = create_locked(directory, name, nbytes)
                    held.append(fd)
            paths = node_broadcast(paths, world)
            try:
                buffers = {name: torch.from_file(paths[name], shared=True, size=max(nbytes, 1), dtype=torch.uint8)
                           for name, nbytes in sizes.items()}
            finally:
                node_barrier()  # every process has mapped them (or failed): the names can go
        except BaseException:
            remove_stale(directory)  # the creator may be the process that died: its files go too
            raise
        finally:
            if world.local_rank == 0:
                for path in paths.values():
                    Path(path).unlink(missing_ok=True)
            for fd in held:
                os.close(fd)
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
