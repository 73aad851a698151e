"""The device and pinned host buffers behind the engine's slot pools, made once per run.

- ``weights``: ``budgets["weights"]`` flat compute-dtype device buffers, each as large as the
  largest streamed unit (with a tied head, the head and the embedding matrix behind it; with
  LoRA's adapters in host memory, a layer and its adapters). A ``fetch`` fills one from the
  unit's host copy (:meth:`Slots.stream_in`): the pinned bf16 streaming copy where the layout
  keeps one, otherwise the pinned fp32 master, piece by piece through a small fp32 landing
  buffer and cast on the device, on the fetch's own lane (so a slot costs 2 bytes per
  parameter in bf16, not 6).
- ``grads``: ``budgets["grads"]`` flat fp32 gradient accumulators (with LoRA, the adapters'
  only).
- ``host_grads``: in the staged layouts, pinned host staging slots the size of the largest
  streamed layer; ``offload_grad`` of chunk ``c`` copies that piece of a unit's gradient into
  one, and the ``cpu_adam`` of the same chunk updates the matching piece of the master from it.

- ``acts``: where checkpoints are offloaded, the device buffers ``fetch_act`` copies them back
  into, one per slot, beside their pinned host buffers (:class:`OffloadedActivations`).

A resident unit (``unit.resident``) takes no slot: :meth:`Slots.weights` and
:meth:`Slots.grads` answer its own device copies instead.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from ...graph.tasks import GRADS, HOST_GRADS, WEIGHTS
from ...plan.buffer_sizes import LANDING_NUMEL, slot_numel, staging_numel
from ...runtime.engine import TaskContext
from ..host_state import HostState, UnitState, pinned_zeros


class Slots:
    """The buffers the slot budgets allow, and the copy that streams a unit into one."""

    def __init__(self, state: HostState, budgets: dict[str, int], *, device: torch.device, dtype: torch.dtype,
                 lora: bool) -> None:
        self.device = device
        self.pin = device.type == "cuda"
        self.non_blocking = device.type == "cuda"
        tied = state.cfg.tie_word_embeddings
        adapter_n = max((a.flat_map.numel for a in state.adapters if not a.resident), default=0)
        slot_n = slot_numel(state.flat_maps, state.resident, tied) + adapter_n
        grad_n = adapter_n if lora else slot_n
        self.weight_c = [torch.empty(slot_n, dtype=dtype, device=device) for _ in range(budgets[WEIGHTS])]
        needs_landing = any(u.stream is None and u.master.dtype != dtype
                            for u in state.units + state.adapters if not u.resident)
        self.landing = torch.empty(min(slot_n, LANDING_NUMEL) if needs_landing else 0, dtype=torch.float32,
                                   device=device)
        self.grad_slots = [torch.empty(grad_n, dtype=torch.float32, device=device) for _ in range(budgets[GRADS])]
        #: elements of one staging slot (a chunk of a streamed unit's gradient)
        self.stage_n = staging_numel(state.flat_maps, state.resident)
        self.staging = [pinned_zeros(self.stage_n, self.pin) for _ in range(budgets.get(HOST_GRADS, 0))]

    def weights(self, unit: UnitState, ctx: TaskContext) -> torch.Tensor:
        """The flat compute-dtype weights a task reads: the unit's own copy if resident, else
        the weight slot it was given."""
        return unit.compute if unit.resident else self.weight_c[ctx.read(WEIGHTS)]  # type: ignore[return-value]

    def grads(self, unit: UnitState, ctx: TaskContext) -> torch.Tensor:
        """The flat fp32 gradient accumulator a task adds into (own if resident, else its slot)."""
        return unit.own_grad() if unit.resident else self.grad_slots[ctx.read(GRADS)]

    def stream_in(self, unit: UnitState, dst: torch.Tensor, ranges: list[tuple[int, int]]) -> int:
        """Copy ``ranges`` of a streamed unit's weights from host memory into the same places of
        ``dst`` (compute dtype, on the device); returns the bytes that crossed PCIe."""
        nb = self.non_blocking
        moved = 0
        for lo, hi in ranges:
            if unit.stream is not None:
                dst[lo:hi].copy_(unit.stream[lo:hi], non_blocking=nb)
                moved += (hi - lo) * unit.stream.element_size()
            elif dst.dtype == unit.master.dtype:  # an fp32 run's master, or a frozen LoRA base
                dst[lo:hi].copy_(unit.master[lo:hi], non_blocking=nb)
                moved += (hi - lo) * dst.element_size()
            else:  # fp32 pieces through the landing buffer, cast on the device, all on this lane
                piece = self.landing.numel()
                for a in range(lo, hi, piece):
                    b = min(hi, a + piece)
                    land = self.landing[: b - a]
                    land.copy_(unit.master[a:b], non_blocking=nb)
                    dst[a:b].copy_(land)
                moved += 4 * (hi - lo)
        return moved

    def host_copy(self, t: torch.Tensor) -> torch.Tensor:
        """A device scalar as host memory the CPU may read once the work so far on this lane is
        done: a pinned copy queued on the lane's stream (no sync); on the CPU, ``t`` itself."""
        if self.device.type != "cuda":
            return t
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t, non_blocking=True)
        return out


class OffloadedActivations:
    """The pinned host buffers of offloaded checkpoints and the device buffers they come back to."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pin = device.type == "cuda"
        #: offloaded checkpoints' pinned host buffers by (layer, micro_batch), reused every step
        self.host: dict[tuple[int, int], torch.Tensor] = {}
        #: device buffers that fetch_act copies checkpoints back into, by acts slot, made at
        #: the first copy into each, once the checkpoint's shape is known
        self.slots: dict[int, torch.Tensor] = {}

    def reserve(self, layers: Iterable[int], micro_batches: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Allocate the host buffer of every checkpoint the step graph offloads (layer ``i``'s
        input of each micro-batch, of ``shape``)."""
        for i in layers:
            for m in range(micro_batches):
                if (i, m) not in self.host:
                    self.host[(i, m)] = self.buffer(shape, dtype)

    def buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # page-locked in place: torch's pinned allocator would round a 3 GiB checkpoint up to
        # 4 GiB (a power of two), host memory the plan does not have
        return pinned_zeros(math.prod(shape), self.pin, dtype).view(shape)
