"""The head as the program sees it: its own matrix, or the embedding's (tied weights).

A part the step program is composed with, chosen once per run (:func:`head_part`), so that no
task body asks whether the embeddings are tied:

- :class:`UntiedHead`: the head's slot holds the final norm and the output matrix; nothing
  else changes.
- :class:`TiedHead`: the output matrix *is* the embedding matrix. Streamed, the head's slot
  holds the final norm followed by the embedding matrix (fetched with it), and its gradient
  slot likewise; the head's part of the tied gradient goes to a pinned host buffer on the
  head's offload, and the embedding's Adam adds it before stepping (whole, or chunk by chunk
  in the staged layouts), checking the sum's finiteness on the host. Resident, the head reads
  the embedding's own copy and adds into the embedding's own gradient.
"""

from __future__ import annotations

import threading

import torch

from ...graph.tasks import Task
from ...model import bind
from ...runtime.engine import TaskContext
from ..host_state import HostState, UnitState, pinned_zeros
from ..nonfinite import nonfinite
from .slots import Slots
from .step_data import StepData

#: a device flag to check: (what it names, the flag)
Flag = tuple[str, torch.Tensor]


class UntiedHead:
    """The head's own norm and matrix; every tied hook is a no-op."""

    def __init__(self, state: HostState, slots: Slots) -> None:
        self.state = state
        self.slots = slots

    def weights(self, ctx: TaskContext) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm_w, head_w)``: the final norm and output matrix a loss reads."""
        head = self.state.head
        views = bind(self.slots.weights(head, ctx), head.flat_map)
        return views["norm"], views["lm_head"]

    def grads(self, ctx: TaskContext) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm_grad, head_grad)``: the views a loss adds the head's gradient into, laid out
        as :meth:`weights` reads the weights."""
        head = self.state.head
        views = bind(self.slots.grads(head, ctx), head.flat_map)
        return views["norm"], views["lm_head"]

    def slot_extra(self, task: Task) -> int:
        """Elements behind ``task``'s unit in its slot (the tied embedding matrix behind the head)."""
        return 0

    def fetched_with(self, task: Task) -> list[UnitState]:
        """Units a fetch copies into the slot after ``task``'s own."""
        return []

    def host_checks(self) -> int:
        """Host checks of the tied gradient's finiteness a step waits for."""
        return 0

    def norm_waits(self, task: Task) -> bool:
        """Whether the squared norm of ``task``'s offloaded piece waits for a host sum."""
        return False

    def offload_extra(self, task: Task, unit: UnitState, src: torch.Tensor) -> int:
        """Copy the head's part of a tied gradient to the host; returns the bytes moved."""
        return 0

    def extra_flags(self, task: Task, unit: UnitState, src: torch.Tensor) -> list[Flag]:
        """Finiteness flags of what :meth:`offload_extra` copied."""
        return []

    def sum_whole(self, data: StepData) -> None:
        """Full layout: add the head's part into the embedding's host gradient, once a step."""

    def add_to_chunk(self, data: StepData, task: Task, grad: torch.Tensor, lo: int, hi: int) -> None:
        """Staged layouts: add the head's part into one chunk of the embedding's gradient."""


class TiedHead(UntiedHead):
    """The embedding matrix serves as the head's output matrix (``tie_word_embeddings``)."""

    def __init__(self, state: HostState, slots: Slots, *, trains: bool) -> None:
        super().__init__(state, slots)
        self.embed = state.embed
        self.head_n = state.head.flat_map.numel
        #: the head streams and its gradient is taken: the head's part of the tied gradient
        #: waits here, on the host, for the embedding's Adam
        self.streamed = trains and not state.head.resident
        self.host_grad = pinned_zeros(self.embed.flat_map.numel, slots.pin) if self.streamed else None
        self._checks = 1 + len(self.embed.steps) if trains and not self.embed.resident else 0
        self._lock = threading.Lock()

    def _matrix(self, buf: torch.Tensor) -> torch.Tensor:
        e = self.embed.flat_map.entries[0]
        return buf[self.head_n + e.offset : self.head_n + e.offset + e.numel].view(e.shape)

    def weights(self, ctx: TaskContext) -> tuple[torch.Tensor, torch.Tensor]:
        head = self.state.head
        wbuf = self.slots.weights(head, ctx)
        norm_w = bind(wbuf, head.flat_map)["norm"]
        if head.resident:  # the embedding is resident too: its own copy
            emb = self.embed
            return norm_w, bind(emb.compute, emb.flat_map)[emb.flat_map.entries[0].key]  # type: ignore[arg-type]
        return norm_w, self._matrix(wbuf)

    def grads(self, ctx: TaskContext) -> tuple[torch.Tensor, torch.Tensor]:
        head = self.state.head
        gbuf = self.slots.grads(head, ctx)
        norm_g = bind(gbuf, head.flat_map)["norm"]
        if head.resident:  # the embedding is resident too: its own gradient
            emb = self.embed
            return norm_g, bind(emb.own_grad(), emb.flat_map)[emb.flat_map.entries[0].key]
        return norm_g, self._matrix(gbuf)

    def slot_extra(self, task: Task) -> int:
        return self.embed.flat_map.numel if task.unit == "head" else 0

    def fetched_with(self, task: Task) -> list[UnitState]:
        return [self.embed] if task.unit == "head" else []

    def host_checks(self) -> int:
        return self._checks

    def norm_waits(self, task: Task) -> bool:
        return task.unit == "embed"

    def _carries_part(self, task: Task) -> bool:
        return task.unit == "head" and task.chunk in (None, 0)

    def offload_extra(self, task: Task, unit: UnitState, src: torch.Tensor) -> int:
        if not self._carries_part(task):
            return 0
        n, m = unit.flat_map.numel, self.embed.flat_map.numel
        assert self.host_grad is not None
        self.host_grad.copy_(src[n : n + m], non_blocking=self.slots.non_blocking)
        return 4 * m

    def extra_flags(self, task: Task, unit: UnitState, src: torch.Tensor) -> list[Flag]:
        if not self._carries_part(task):
            return []
        n, m = unit.flat_map.numel, self.embed.flat_map.numel
        return [(self.embed.flat_map.key, nonfinite(src[n : n + m]))]

    def sum_whole(self, data: StepData) -> None:
        with self._lock:
            emb = self.embed
            if self.host_grad is not None and not emb.resident and emb.grad is not None and not data.tied_summed:
                emb.grad.add_(self.host_grad)
                sq = data.sq_norms[(emb.flat_map.key, None)] = torch.dot(emb.grad, emb.grad)
                data.check.host_checked(emb.flat_map.key, bool(nonfinite(emb.grad, sq)))
                data.tied_summed = True

    def add_to_chunk(self, data: StepData, task: Task, grad: torch.Tensor, lo: int, hi: int) -> None:
        if task.unit != "embed":
            return
        assert self.host_grad is not None
        grad.add_(self.host_grad[lo:hi])
        sq = data.sq_norms[(self.embed.flat_map.key, task.chunk)] = torch.dot(grad, grad)
        data.check.host_checked(self.embed.flat_map.key, bool(nonfinite(grad, sq)))


def head_part(state: HostState, slots: Slots, *, trains: bool) -> UntiedHead:
    """The head part for this model: tied or not (``trains``: the head takes a gradient)."""
    if state.cfg.tie_word_embeddings:
        return TiedHead(state, slots, trains=trains)
    return UntiedHead(state, slots)
