"""Idle experts (``--skip-idle-experts``): what a step's routing says each sparse layer may skip.

An expert that no real token of a step is routed to gets no gradient and no update, as
``torch.optim.AdamW`` skips a parameter whose gradient is None. The training program asks
:class:`IdleExperts` at each point of the step where that matters::

    idle = IdleExperts(state, device)             # the layers whose state counts expert steps
    tap = idle.tap(step, layer, mb, targets)      # a forward's router tap: real tokens per expert
    idle.fetch_ranges(step, layer, phase, mbs)    # what a fetch copies (all of it in the forward)
    idle.trained_ranges(step, layer, n, lo, hi)   # what an offload copies back (n micro-batches)
    idle.adam_pieces(step, layer, n, unit, chunk) # what CPU Adam updates, and on which step count
    idle.idle_on_device(step, layer, n)           # a resident layer's idle experts, for its gpu_adam
    idle.set_summed(step, layer, counts)          # data parallel: every process's counts
    idle.end_step(step)                           # the fraction of expert weights left unfetched

Routing is counted on the device by each forward (the recompute's and the backward's rebuilds
route alike and are not counted again) and read on the host by the first task that needs it:
the fetch before the layer's recompute or backward, which the step graph puts after the layer's
forwards (``StepSpec.skip_idle_experts``), so on a GPU the read waits only for work long queued. Padding is
routed too, but an expert that only padding reaches has nothing to learn from (a zero
gradient), so it counts as idle; real tokens are those the load-balancing loss counts
(:func:`~flowtrain.train.load_balance.real_tokens`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

from ..model.expert_slices import ExpertSlices
from ..model.moe import RouterTap
from .host_state import HostState, UnitState
from .load_balance import real_tokens

__all__ = ["IdleExperts"]

Range = tuple[int, int]


class IdleExperts:
    """Per step: each sparse layer's tokens per expert, and what follows from them."""

    def __init__(self, state: HostState, device: torch.device) -> None:
        self.device = device
        self.num_experts = state.cfg.num_experts
        #: the layers that skip idle experts (their state counts each expert's steps), and
        #: where each expert's weights sit in them
        self.slices: dict[int, ExpertSlices] = {}
        for i, unit in enumerate(state.units[1:-1]):
            sl = ExpertSlices.of(unit.flat_map)
            if unit.expert_steps is not None and sl is not None:
                self.slices[i] = sl
        self._counts: dict[tuple[int, int, int], torch.Tensor] = {}  # (step, layer, mb) -> (experts,) fp32
        self._real: dict[tuple[int, int], torch.Tensor] = {}  # (step, mb) -> (tokens,) 1.0 / 0.0
        self._used: dict[tuple[int, int], list[bool]] = {}  # (step, layer) -> the step's union
        #: (step, layer) -> real tokens per expert over every process's micro-batches (data parallel)
        self._summed: dict[tuple[int, int], torch.Tensor] = {}
        self._fetched: dict[int, list[int]] = {}  # step -> [expert elements copied, and in all]
        self._lock = threading.Lock()

    def __contains__(self, layer: object) -> bool:
        return layer in self.slices

    def __bool__(self) -> bool:
        return bool(self.slices)

    def tap(self, s: int, i: int, m: int, targets: torch.Tensor) -> RouterTap:
        """The router tap of layer ``i``'s forward of micro-batch ``m`` (whose ``targets`` say
        which tokens are real): counts the real tokens sent to each expert, on the device."""
        def count(probs: torch.Tensor, experts: torch.Tensor) -> None:
            with self._lock:
                if (s, m) not in self._real:
                    self._real[(s, m)] = real_tokens(targets.to(self.device, non_blocking=True))
                real = self._real[(s, m)]
            counts = torch.zeros(self.num_experts, dtype=torch.float32, device=experts.device)
            counts.index_add_(0, experts.reshape(-1), real.repeat_interleave(experts.shape[-1]))
            with self._lock:
                self._counts[(s, i, m)] = counts
        return count

    def fetch_ranges(self, s: int, i: int, phase: str | None, mbs: Iterable[int]) -> list[Range]:
        """What a fetch of layer ``i`` copies: in the forward all of it (the routing is not
        known yet), before the recompute and backward the shared part and the experts that the
        micro-batches ``mbs`` (those the fetch serves) routed a real token to."""
        sl = self.slices[i]
        used = [True] * sl.num_experts if phase == "forward" else (self.step_counts(s, i, mbs) > 0).tolist()
        with self._lock:
            tally = self._fetched.setdefault(s, [0, 0])
            tally[0] += sum(used) * sl.expert_numel
            tally[1] += sl.num_experts * sl.expert_numel
        return sl.ranges(used)

    def step_counts(self, s: int, i: int, mbs: Iterable[int]) -> torch.Tensor:
        """Real tokens per expert of layer ``i`` over micro-batches ``mbs`` of step ``s`` (this
        process's), on the device: what a fetch reads on the host (on a GPU this waits for those
        forwards, long queued), and what data parallel sums over the processes
        (:meth:`set_summed`), as it sums the gradient."""
        with self._lock:
            parts = [self._counts[(s, i, m)] for m in mbs]
        return sum(parts)  # type: ignore[return-value]

    def set_summed(self, s: int, i: int, counts: torch.Tensor) -> None:
        """Layer ``i``'s counts summed over every process: which experts the step leaves idle is
        then decided by the whole global batch, as one process trained on it would."""
        with self._lock:
            self._summed[(s, i)] = counts

    def step_used(self, s: int, i: int, micro_batches: int) -> list[bool]:
        """The experts of layer ``i`` that any of the step's micro-batches routed to (every
        process's, where they were summed; else this process's ``micro_batches``)."""
        with self._lock:
            used = self._used.get((s, i))
        if used is None:  # read outside the lock: on a GPU the read waits for the device
            used = (self._step_total(s, i, micro_batches) > 0).tolist()
            with self._lock:
                used = self._used.setdefault((s, i), used)
        return used

    def trained_ranges(self, s: int, i: int, micro_batches: int, lo: int, hi: int) -> list[Range]:
        """The parts of ``[lo, hi)`` of layer ``i`` the step updates: the shared part and the
        experts it used (what an offload copies back)."""
        ranges = self.slices[i].ranges(self.step_used(s, i, micro_batches))
        return [(max(a, lo), min(b, hi)) for a, b in ranges if min(b, hi) > max(a, lo)]

    def adam_pieces(self, s: int, i: int, micro_batches: int, unit: UnitState,
                    chunk: int | None) -> list[tuple[int, int, torch.Tensor]]:
        """``(lo, hi, step count)`` of what Adam updates in layer ``i``: the shared part on the
        layer's count, each expert the step used on its own, the idle ones not at all."""
        sl = self.slices[i]
        assert unit.expert_steps is not None
        used = self.step_used(s, i, micro_batches)
        pieces = [(a, b, unit.steps[chunk or 0]) for a, b in sl.shared]
        return pieces + [(a, b, unit.expert_steps[e]) for e, on in enumerate(used) if on for a, b in sl.experts[e]]

    def idle_on_device(self, s: int, i: int, micro_batches: int) -> torch.Tensor:
        """(experts,) fp32 on the device, 1.0 for each expert of layer ``i`` that none of the
        step's ``micro_batches`` routed a real token to: for a resident layer's Adam, which
        reads it where it runs, with no host sync."""
        return (self._step_total(s, i, micro_batches) == 0).float()

    def _step_total(self, s: int, i: int, micro_batches: int) -> torch.Tensor:
        with self._lock:
            summed = self._summed.get((s, i))
        return summed if summed is not None else self.step_counts(s, i, range(micro_batches))

    def end_step(self, s: int) -> float | None:
        """Forget step ``s``; the fraction of the expert weights of the layers that skip idle
        experts that its fetches left in host memory (None where it fetched none)."""
        with self._lock:
            for table in (self._counts, self._real, self._used, self._summed):
                _forget(table, s)
            copied, total = self._fetched.pop(s, (0, 0))
        return 1.0 - copied / total if total else None


def _forget(table: dict, s: int) -> None:
    """Drop the entries of step ``s`` (keys that start with it) from ``table``, in place."""
    for key in [k for k in table if k[0] == s]:
        del table[key]
