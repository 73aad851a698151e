"""Optimizer state on disk (``--state-dir``): the files, their reads and writes, and the slots.

Host memory decides how large a model trains: 12 bytes per streamed parameter (fp32 master,
Adam m and v). With a state folder, the units the plan names (``StepSpec.disk``) keep their Adam
moments, and where the plan says so their fp32 master too, in one file per unit (per staging
chunk where the unit's Adam runs in chunks) instead. A unit whose master is on disk keeps a
copy in the compute dtype in host memory (what ``fetch`` copies; in bf16, 2 bytes per
parameter), which its ``cpu_adam`` refreshes as ever::

    store = StateStore(Path("/nvme/state"), units, queue_depth=4)   # files made, space reserved
    store.read(key, chunk, buf)        # read_state: the file into a host_state staging slot
    store.write(key, chunk, buf)       # write_state: the slot back into the file
    store.read_field(key, chunk, "master", buf)   # one field alone: a checkpoint's, the final model's
    store.write_field(key, chunk, "exp_avg", buf)  # one field alone: a resumed run's, from its checkpoint
    store.close()                      # the files removed

A file holds the unit's fields one after another (``master`` where it is on disk, then
``exp_avg``, ``exp_avg_sq``), each padded to 4 KiB, so that every read and write is one large
aligned transfer. They go through ``O_DIRECT`` where the filesystem allows it, which keeps the
state out of the page cache (it would otherwise take the memory the tier frees); elsewhere
through ordinary reads and writes followed by ``posix_fadvise(DONTNEED)``. Each transfer is cut
into pieces of :data:`PIECE` bytes, ``queue_depth`` of them in flight at once (an NVMe drive
reaches its rate only with several requests outstanding).

The space is reserved when the files are made (``posix_fallocate``), so a disk too small for
the state stops the run before it trains; a read or write that fails later fails its task,
which ends the run in one line, the last checkpoint untouched. The folder is locked like
``--out`` (:class:`~flowtrain.ckpt.out_lock.OutLock`): two runs never share one. The files are
removed when the run ends, however it ends: a checkpoint holds the whole state
(:mod:`flowtrain.ckpt.checkpoints`), and a resumed run writes its files afresh from it.
"""

from __future__ import annotations

import errno
import os
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable

import torch

from ..errors import FlowtrainError
from ..graph.tasks import STATE_PIECE, STATE_QUEUE_DEPTH

#: alignment of every transfer, offset and buffer (O_DIRECT asks for the logical block size)
ALIGN = 4096
#: bytes of one request; a transfer keeps ``queue_depth`` of them in flight (the simulator's too)
PIECE = STATE_PIECE
#: the fields a unit may keep on disk, in file order
FIELDS = ("master", "exp_avg", "exp_avg_sq")


class DiskStateError(FlowtrainError):
    """The state folder cannot hold, give back or take the state (full, failing, gone)."""


def field_numel(n: int) -> int:
    """Elements of one field of ``n`` elements in a file and a slot: padded to :data:`ALIGN`."""
    per = ALIGN // 4
    return -(-n // per) * per


def aligned_empty(numel: int) -> torch.Tensor:
    """An fp32 host tensor of ``numel`` elements whose first byte is :data:`ALIGN`-aligned."""
    raw = torch.empty(numel + ALIGN // 4, dtype=torch.float32)
    skip = (-raw.data_ptr() % ALIGN) // 4
    return raw[skip: skip + numel]


class StateFile:
    """One unit's (or one chunk's) file: ``n`` elements of each of ``fields``."""

    __slots__ = ("key", "chunk", "n", "fields", "path", "fd", "direct")

    def __init__(self, key: str, chunk: int | None, n: int, fields: tuple[str, ...], path: Path) -> None:
        self.key, self.chunk, self.n, self.fields, self.path = key, chunk, n, fields, path
        self.fd = -1
        self.direct = False

    @property
    def numel(self) -> int:
        """Elements of the file (and of the slot it is read into): every field, padded."""
        return len(self.fields) * field_numel(self.n)

    @property
    def name(self) -> str:
        return self.key if self.chunk is None else f"{self.key} c{self.chunk}"

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each field's ``n`` elements in ``buf`` (a slot this file was read into)."""
        f = field_numel(self.n)
        return {name: buf[i * f: i * f + self.n] for i, name in enumerate(self.fields)}


class StateStore:
    """The state folder's files of one run (see the module docstring). ``units`` lists
    ``(key, chunk, numel, fields)`` for every file; :meth:`bind` and :meth:`unbind` keep track of
    which chunk's state sits in which staging slot between its read and its write."""

    def __init__(self, root: Path, units: Iterable[tuple[str, int | None, int, tuple[str, ...]]], *,
                 queue_depth: int = STATE_QUEUE_DEPTH, direct: bool = True) -> None:
        self.root = Path(root)
        self.queue_depth = max(1, queue_depth)
        self.run_dir = self.root / f"flowtrain-state-{os.getpid()}-{secrets.token_hex(3)}"
        self.files: dict[tuple[str, int | None], StateFile] = {}
        self._pool = ThreadPoolExecutor(self.queue_depth, thread_name_prefix="state-io") if self.queue_depth > 1 else None
        #: (key, chunk) -> the slot views its state is in now (between read_state and write_state)
        self.bound: dict[tuple[str, int | None], dict[str, torch.Tensor]] = {}
        self.lock = threading.Lock()
        #: bytes read and written so far
        self.read_bytes = self.written_bytes = 0
        try:
            self.run_dir.mkdir(parents=True)
            for key, chunk, n, fields in units:
                name = key if chunk is None else f"{key}.c{chunk}"
                sf = StateFile(key, chunk, n, fields, self.run_dir / f"{name}.state")
                self._open(sf, direct)
                self.files[(key, chunk)] = sf
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        return f"<StateStore {self.run_dir} {len(self.files)} files, {self.total_bytes / 2**30:.2f} GiB>"

    @property
    def total_bytes(self) -> int:
        return sum(4 * f.numel for f in self.files.values())

    @property
    def slot_numel(self) -> int:
        """Elements of one ``host_state`` staging slot: the largest file."""
        return max((f.numel for f in self.files.values()), default=0)

    def _open(self, sf: StateFile, direct: bool) -> None:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
        try:
            if direct and hasattr(os, "O_DIRECT"):
                try:
                    sf.fd, sf.direct = os.open(sf.path, flags | os.O_DIRECT, 0o600), True
                except OSError as e:
                    if e.errno != errno.EINVAL:  # the filesystem takes no direct I/O: page cache, dropped after
                        raise
            if sf.fd < 0:
                sf.fd = os.open(sf.path, flags, 0o600)
            size = 4 * sf.numel
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(sf.fd, 0, size)  # the space now: a disk too small fails here
            else:  # pragma: no cover - every Linux has it
                os.ftruncate(sf.fd, size)
        except OSError as e:
            raise DiskStateError(self._why(f"cannot make the state file of {sf.name} ({4 * sf.numel / 2**30:.2f} GiB) "
                                           f"in {self.root}", e)) from e

    def _why(self, what: str, e: OSError) -> str:
        if e.errno == errno.ENOSPC:
            return (f"{what}: the disk is full ({self.total_bytes / 2**30:.2f} GiB of state placed so far); give "
                    f"--state-dir a disk with more room, or --disk-state moments")
        return f"{what}: {e.strerror or e}"

    # ---- transfers -----------------------------------------------------------------------
    def _pieces(self, sf: StateFile, buf: torch.Tensor, write: bool, start: int = 0, numel: int | None = None) -> None:
        """Transfer ``numel`` elements (by default the whole file) between ``buf`` and the file
        from its byte ``start`` (a multiple of :data:`ALIGN`)."""
        numel = sf.numel if numel is None else numel
        nbytes = 4 * numel
        if buf.numel() < numel or buf.dtype != torch.float32:
            raise ValueError(f"a slot of {buf.numel()} fp32 elements cannot hold {sf.name}'s {numel}")
        mem = memoryview(buf[:numel].numpy()).cast("B")  # type: ignore[arg-type]  # an ndarray is a buffer

        def one(lo: int) -> None:
            view = mem[lo: min(nbytes, lo + PIECE)]
            done = 0
            while done < len(view):
                part = view[done:]
                at = start + lo + done
                k = os.pwritev(sf.fd, [part], at) if write else os.preadv(sf.fd, [part], at)
                if k <= 0:
                    raise OSError(errno.EIO, f"{'wrote' if write else 'read'} {done} of {len(view)} bytes at {start + lo}")
                done += k

        starts = range(0, nbytes, PIECE)
        if self._pool is None or nbytes <= PIECE:
            for lo in starts:
                one(lo)
        else:
            for f in [self._pool.submit(one, lo) for lo in starts]:
                f.result()
        if not sf.direct:  # through the page cache: written out, then dropped from it
            if write:
                os.fdatasync(sf.fd)
            os.posix_fadvise(sf.fd, start, nbytes, os.POSIX_FADV_DONTNEED)

    def read(self, key: str, chunk: int | None, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Read the file of ``(key, chunk)`` into ``buf`` (an aligned slot); returns each field's
        view in it."""
        sf = self.files[(key, chunk)]
        try:
            self._pieces(sf, buf, write=False)
        except OSError as e:
            raise DiskStateError(self._why(f"cannot read the optimizer state of {sf.name} from {sf.path}", e)) from e
        self.read_bytes += 4 * sf.numel
        return sf.views(buf)

    def write(self, key: str, chunk: int | None, buf: torch.Tensor) -> None:
        """Write ``buf`` (the slot the file was read into, updated) back into the file."""
        sf = self.files[(key, chunk)]
        try:
            self._pieces(sf, buf, write=True)
        except OSError as e:
            raise DiskStateError(self._why(f"cannot write the optimizer state of {sf.name} to {sf.path}", e)) from e
        self.written_bytes += 4 * sf.numel

    def fill(self, key: str, chunk: int | None, fields: dict[str, torch.Tensor], scratch: torch.Tensor) -> None:
        """Write a chunk's state from tensors in memory (``fields`` by name, each ``n``
        elements; a missing one is zeros) through ``scratch`` (an aligned buffer of at least
        the file's size): how the state is first placed, and put back by an undo."""
        sf = self.files[(key, chunk)]
        buf = scratch[: sf.numel]
        buf.zero_()
        for name, view in sf.views(buf).items():
            if name in fields:
                view.copy_(fields[name])
        self.write(key, chunk, buf)

    def read_field(self, key: str, chunk: int | None, field: str, buf: torch.Tensor) -> torch.Tensor:
        """Read one field of the file of ``(key, chunk)``, and nothing else of it, into ``buf``
        (aligned, at least :func:`field_numel` of the chunk's elements); returns its elements
        there. How a checkpoint or the final model takes a unit's state back, a field at a time."""
        sf = self.files[(key, chunk)]
        self.read_bytes += self._field(sf, field, buf, write=False)
        return buf[: sf.n]

    def write_field(self, key: str, chunk: int | None, field: str, buf: torch.Tensor) -> None:
        """Write one field of the file of ``(key, chunk)``, and nothing else of it, from ``buf``
        (aligned, at least :func:`field_numel` of the chunk's elements: those past the chunk's
        go into the field's padding). How a resumed run puts a checkpoint's state back, a field
        at a time (:meth:`read_field`'s counterpart)."""
        self.written_bytes += self._field(self.files[(key, chunk)], field, buf, write=True)

    def _field(self, sf: StateFile, field: str, buf: torch.Tensor, write: bool) -> int:
        """Transfer one field of ``sf`` (its padded elements) between ``buf`` and the file;
        returns the bytes moved."""
        f = field_numel(sf.n)
        try:
            self._pieces(sf, buf, write=write, start=4 * f * sf.fields.index(field), numel=f)
        except OSError as e:
            what = f"write the {field} of {sf.name} to" if write else f"read the {field} of {sf.name} from"
            raise DiskStateError(self._why(f"cannot {what} {sf.path}", e)) from e
        return 4 * f

    def close(self) -> None:
        """Close and remove every file and the run's folder. Safe to call twice."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for sf in self.files.values():
            if sf.fd >= 0:
                os.close(sf.fd)
                sf.fd = -1
            sf.path.unlink(missing_ok=True)
        self.bound.clear()
        try:
            self.run_dir.rmdir()
        except OSError:
            pass
