"""Steps whose loss or gradients are not finite: found on the device, kept off the weights.

A step whose loss or any gradient holds a NaN or an infinity is **skipped**: no master weight,
Adam moment or Adam step count changes, bit for bit (its batch is consumed all the same). The
step program (:mod:`flowtrain.train.program`) asks this module three questions, none of which
costs a host synchronisation per layer on a GPU:

- *Is this piece finite?* :func:`nonfinite` flags a gradient piece on the device from the
  squared norm that ``offload_grad`` takes anyway. Every ``loss`` task copies the step's loss
  sum, and every ``offload_grad`` its flags, into pinned host memory on its own lane.
- *May this* ``cpu_adam`` *update?* It runs once its own offload has finished; the d2h lane runs
  in order and every loss precedes every offload, so the loss and every flag copied up to its
  own are on the host. :meth:`StepCheck.admit` reads those it has not seen yet (each once per
  step) and says: skip (something is known bad), update, or update after copying the range
  into the step's undo record (the step is not verified yet: a lower layer may still turn out
  bad). Once every piece has been seen finite, nothing more is recorded.
- *Was the step finite after all?* ``verify_step``, once every check is on the host, settles it
  (:meth:`StepCheck.settle`, after any update admitted before it has finished) and puts back
  every recorded range if not; the ``cpu_adam`` tasks after it skip, or update with no record.
  The next step's fetches wait for it. The undo record is bounded by :class:`UndoBudget`: past it, Adam
  runs without a record and a late non-finite gradient ends the run with
  :class:`~flowtrain.errors.NonFiniteError` (resume from the last checkpoint).

Resident units are never put back: their ``gpu_adam`` waits for ``found_inf``, which ORs the
loss and every flag on the device, and hands it to torch's fused AdamW, which then leaves
master, m and v untouched (the step count is taken back by the same flag). With
``--grad-clip`` every gradient is in before any Adam: ``grad_norm`` settles the step first.

For tests, ``FLOWTRAIN_INJECT_NAN="step=2,where=layer.0"`` writes a NaN into one gradient
(``where``: ``loss``, ``head``, ``embed`` or ``layer.<i>``; ``value=inf`` or any number instead
of NaN) of micro-batch 0 of step 2 (0-based)::

    FLOWTRAIN_INJECT_NAN="step=1,where=loss" flowtrain train --steps 3 ...   # step 2 is skipped
"""

from __future__ import annotations

import math
import os
import threading

import msgspec
import torch

from ..errors import ConfigError
from ..plan.buffer_sizes import chunk_range, undo_arena_bytes, undo_record_numel  # noqa: F401 - re-exported

#: The environment variable :func:`injection_from_env` reads.
INJECT_ENV = "FLOWTRAIN_INJECT_NAN"

#: What :meth:`StepCheck.admit` answers (or a buffer for the undo record).
SKIP, UPDATE = "skip", "update"


def nonfinite(piece: torch.Tensor, sq_norm: torch.Tensor | None = None) -> torch.Tensor:
    """``()`` bool on ``piece``'s device: whether ``piece`` holds a NaN or an infinity.

    ``sq_norm`` (``piece``'s squared norm, fp32) decides in almost every case: NaN means a NaN,
    finite means every element is finite. Infinite is ambiguous: an infinity, or finite
    elements whose squares sum past fp32's range (3.4e38: one element beyond 1.8e19 is enough),
    which is a finite step and must not be skipped. Only then does the piece itself have to be read. On the host that read
    happens only in that case; on a GPU, deciding would need a host sync, so the largest
    ``|element|`` (a reduction that propagates NaN, with no temporary: one more read of the
    piece in device memory, against its copy over PCIe) is always taken. Without ``sq_norm``
    the piece is read."""
    if sq_norm is None:
        return ~torch.isfinite(torch.linalg.vector_norm(piece, math.inf))
    bad = ~torch.isfinite(sq_norm)
    if piece.device.type == "cpu" and not bool(torch.isinf(sq_norm)):
        return bad
    return bad & ~torch.isfinite(torch.linalg.vector_norm(piece, math.inf))


# ---- injection (tests) --------------------------------------------------------------------
class Injection(msgspec.Struct, frozen=True):
    """Write ``value`` into one place of micro-batch 0 of step ``step``: the loss, or the first
    element of the gradient of ``head``, ``embed`` or ``layer.<i>``."""

    step: int
    where: str
    value: float = math.nan

    @classmethod
    def parse(cls, text: str, layers: int) -> "Injection":
        """``"step=2,where=layer.0"`` or ``"step=0,where=loss,value=inf"``."""
        wheres = {"loss", "head", "embed", *(f"layer.{i}" for i in range(layers))}
        try:
            fields = dict(part.split("=", 1) for part in text.split(","))
            inj = cls(step=int(fields.pop("step")), where=fields.pop("where"), value=float(fields.pop("value", "nan")))
            if fields or inj.step < 0 or inj.where not in wheres:
                raise ValueError
        except (ValueError, KeyError):
            raise ConfigError(
                f"{INJECT_ENV}={text!r} is not step=N,where=W[,value=X] with N >= 0 and W one of "
                f"loss, head, embed, layer.0..layer.{layers - 1}"
            ) from None
        return inj

    def hits(self, step: int, where: str, micro_batch: int) -> bool:
        return step == self.step and where == self.where and micro_batch == 0

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        t.view(-1)[0] = self.value
        return t


def injection_from_env(layers: int) -> Injection | None:
    text = os.environ.get(INJECT_ENV)
    return Injection.parse(text, layers) if text else None


# ---- the undo record ----------------------------------------------------------------------
class UndoBudget:
    """Host memory for undo records: one fp32 arena of at most ``limit`` bytes (``most``: what a
    step could ever record, if smaller), allocated at the first record and reused by every step,
    so a record costs copies, not fresh pages. One step records at a time (the next step's
    ``cpu_adam`` tasks all come after this step's ``verify_step``); :meth:`release` empties it.
    ``used`` is the bytes held now, ``recorded`` every byte ever recorded."""

    def __init__(self, limit: int, most: int | None = None) -> None:
        self.limit = limit
        self._numel = max(0, min(limit, most if most is not None else limit)) // 4
        self._arena: torch.Tensor | None = None
        self._top = 0
        self._owner: int | None = None
        self.recorded = 0
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        return 4 * self._top

    def take(self, step: int, numel: int) -> torch.Tensor | None:
        """``numel`` fp32 elements for a record of step ``step``, or None past the budget."""
        with self._lock:
            if self._top + numel > self._numel or self._owner not in (None, step):
                return None
            if self._arena is None:
                self._arena = torch.empty(self._numel, dtype=torch.float32)
            view = self._arena[self._top : self._top + numel]
            self._top += numel
            self._owner = step
            self.recorded += 4 * numel
            return view

    def release(self, step: int) -> None:
        with self._lock:
            if self._owner == step:
                self._top, self._owner = 0, None

    def __repr__(self) -> str:
        return f"<UndoBudget {self.used}/{self.limit} bytes>"


class Saved:
    """``[lo, hi)`` of one unit's master, m and v and the step count of its chunk, as they were
    before this step's update, copied into ``buf`` (``numel(hi - lo)`` fp32 elements); and a
    sparse layer's per-expert step counts, where it keeps them (a few floats, copied aside).
    Where the unit's state is on disk, ``pieces`` are the master, m and v of the range where the
    update reads them (a staging slot, the master perhaps in memory) and ``put_back`` puts the
    record back (:meth:`flowtrain.train.program.disk.DiskPart.restore`)."""

    __slots__ = ("unit", "lo", "hi", "chunk", "buf", "expert_steps", "put_back")

    def __init__(self, unit, lo: int, hi: int, chunk: int, buf: torch.Tensor,  # unit: host_state.UnitState
                 pieces: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, put_back=None) -> None:
        self.unit, self.lo, self.hi, self.chunk, self.buf = unit, lo, hi, chunk, buf
        self.put_back = put_back
        self.expert_steps = None if unit.expert_steps is None else unit.expert_steps.clone()
        n = hi - lo
        if pieces is None:
            pieces = (unit.master[lo:hi], unit.exp_avg[lo:hi], unit.exp_avg_sq[lo:hi])
        for i, src in enumerate(pieces):
            buf[i * n : (i + 1) * n].copy_(src)
        buf[3 * n :].copy_(unit.steps[chunk].view(1))

    @staticmethod
    def numel(n: int) -> int:
        return undo_record_numel(n)

    def fields(self) -> dict[str, torch.Tensor]:
        """The recorded master, m and v of the range, by name."""
        n = self.hi - self.lo
        return {name: self.buf[i * n : (i + 1) * n] for i, name in enumerate(("master", "exp_avg", "exp_avg_sq"))}

    def restore(self) -> None:
        u, lo, hi, buf = self.unit, self.lo, self.hi, self.buf
        n = hi - lo
        if self.put_back is not None:  # state on disk: wherever it is now, the slot or the file
            self.put_back(self)
        else:
            for i, dst in enumerate((u.master, u.exp_avg, u.exp_avg_sq)):
                dst[lo:hi].copy_(buf[i * n : (i + 1) * n])
            u.refresh_copies(lo, hi)
        u.steps[self.chunk].view(1).copy_(buf[3 * n :])
        if self.expert_steps is not None:
            u.expert_steps.copy_(self.expert_steps)


# ---- one step's bookkeeping ---------------------------------------------------------------
class StepCheck:
    """What one step knows about its finiteness; every method takes the step's own lock.

    ``pieces`` are the flags of the offloaded gradient pieces in d2h order (unit key, device
    flag, host copy); ``checks`` is how many host checks verify the step (each piece, plus each
    host-only check such as a tied embedding's summed gradient). ``bad`` names what was found
    not finite (``"the loss"``, ``"layer.3"``), ``verified`` says everything was seen finite,
    ``moved`` lists what was updated without an undo record before that."""

    def __init__(self, step: int, checks: int, resident: bool, budget: UndoBudget) -> None:
        self.step = step
        self.budget = budget
        self.loss_host: torch.Tensor | None = None
        self.pieces: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        self.index: dict[tuple[str, int | None], int] = {}  # (unit key, chunk) -> its last piece
        self.resident: list[tuple[str, torch.Tensor]] = []  # (unit key, device flag)
        self.found_inf: torch.Tensor | None = None  # () fp32 on the device, 1.0 if anything is bad
        self.found_inf_host: torch.Tensor | None = None
        self.gpu_updated: list[str] = []  # resident units whose gpu_adam ran with found_inf
        self.bad: str | None = None
        self.verified = False
        self.settled = False
        self.moved: list[str] = []
        self.error: str | None = None
        self._undo: list[Saved] = []
        self._unchecked = checks
        self._resident_units = resident
        self._seen = 0
        self._loss_seen = False
        self._lock = threading.Lock()
        self._updating = 0  # admitted Adam tasks not yet finished (see settle)
        self._release_pending = False  # give the undo arena back once they have
        self._idle = threading.Condition(self._lock)

    # -- called by the tasks that find things out
    def add_pieces(self, key: tuple[str, int | None], flags: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        with self._lock:
            self.pieces += flags
            self.index[key] = len(self.pieces) - 1

    def host_checked(self, name: str, bad: bool) -> None:
        """A check done on the host (a tied embedding's summed gradient)."""
        with self._lock:
            self._unchecked -= 1
            if bad and self.bad is None:
                self.bad = name
            self._maybe_verified()

    # -- called by cpu_adam
    def admit(self, key: tuple[str, int | None], label: str, n: int) -> torch.Tensor | str:
        """Before ``cpu_adam`` updates ``n`` elements of piece ``key``: :data:`SKIP`,
        :data:`UPDATE`, or a buffer to record the range into (then :meth:`keep` the record).
        Unless it says skip, call :meth:`updated` once the update is done (also if it fails)."""
        with self._lock:
            self._scan(self.index[key])
            if self.bad is not None:
                return SKIP
            self._updating += 1
            if self.verified:
                return UPDATE
            buf = None if self.moved else self.budget.take(self.step, Saved.numel(n))
            if buf is not None:
                return buf
            self.moved.append(label)  # one range without a record: the rest need none either
            return UPDATE

    def updated(self) -> None:
        """An admitted update is finished (its record kept, its range written)."""
        with self._lock:
            self._updating -= 1
            if not self._updating:
                if self._release_pending:
                    self._release_pending = False
                    self.budget.release(self.step)
                self._idle.notify_all()

    def keep(self, saved: Saved) -> None:
        with self._lock:
            if not self.verified:  # else the arena was already released
                self._undo.append(saved)

    # -- called by verify_step (grad_norm with clipping, end_step otherwise)
    def settle(self) -> list[Saved]:
        """The verdict, once every flag is on the host. Returns the records to put back (none
        if the step was finite); sets ``error`` if something changed that cannot be put back."""
        with self._lock:
            if self.settled:
                return []
            self.settled = True
            self._scan(len(self.pieces) - 1)
            device_bad = self.found_inf_host is None or bool(self.found_inf_host)
            if self.bad is None and device_bad:
                self.bad = next((name for name, flag in self.resident if bool(flag)), None)
            if self.bad is None:
                self.verified = True
                self._undo = []
                self._release_undo()
                return []
            while self._updating:  # updates admitted before the verdict, running on the CPU now
                self._idle.wait()
            lost = list(self.moved)
            if self.found_inf_host is not None and not bool(self.found_inf_host):
                lost += self.gpu_updated  # only a host-only check can disagree with found_inf
            undo, self._undo = self._undo, []
            if lost:
                self.error = self._lost_message(lost)
            return undo  # the caller puts them back, then calls release()

    def release(self) -> None:
        """Give the undo record's memory back (after putting it back)."""
        self.budget.release(self.step)

    @property
    def skipped(self) -> bool:
        return self.bad is not None

    # -- internals (under the lock)
    def _lost_message(self, lost: list[str]) -> str:
        what = "the loss" if self.bad == "the loss" else f"the gradient of {self.bad}"
        why = (f"without an undo record (it would not fit in --undo-mem {self.budget.limit / 2**30:g} GiB)" if self.moved
               else "on the device before the host found it (a tied embedding's summed gradient overflowed)")
        return (f"step {self.step + 1}: {what} was not finite, but {', '.join(dict.fromkeys(lost))} had already "
                f"been updated {why} and could not be put back; resume from the last checkpoint (a larger "
                f"--undo-mem, or --grad-clip, which checks every gradient before any update, avoids this)")

    def _scan(self, upto: int) -> None:
        """Look at the loss and at the flags up to ``upto`` not seen yet."""
        if not self._loss_seen and self.loss_host is not None:
            self._loss_seen = True
            if not bool(torch.isfinite(self.loss_host)) and self.bad is None:
                self.bad = "the loss"
        for name, _, host in self.pieces[self._seen : upto + 1]:
            self._unchecked -= 1
            if self.bad is None and bool(host):
                self.bad = name
        self._seen = max(self._seen, upto + 1)
        self._maybe_verified()

    def _maybe_verified(self) -> None:
        if self.bad is None and self._loss_seen and self._unchecked == 0 and not self._resident_units:
            self.verified = True
            self._undo = []
            self._release_undo()

    def _release_undo(self) -> None:
        """Give the undo arena back now, or once the updates admitted before are finished (one
        may still be copying its record into it)."""
        if self._updating:
            self._release_pending = True
        else:
            self.budget.release(self.step)
