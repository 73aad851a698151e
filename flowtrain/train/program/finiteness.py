"""Steps whose loss or gradients are not finite, as a part of the step program.

Each gradient piece is flagged on the device on its way out (:mod:`.gradients`), ``cpu_adam``
skips once anything is known bad and records what it changes until the step is verified,
``verify_step`` puts that back if the step turns out bad, and ``gpu_adam`` passes the step's
``found_inf`` flag to the fused kernel. How, and why without a host sync per layer:
:mod:`flowtrain.train.nonfinite`. This part holds the run's undo budget, the test hook that
writes a NaN into one gradient, and the step-wide verdicts.
"""

from __future__ import annotations

import torch

from ...plan.buffer_sizes import undo_arena_bytes
from ..host_state import HostState, UnitState
from ..nonfinite import Injection, StepCheck, UndoBudget, injection_from_env, nonfinite
from .slots import Slots
from .step_data import StepData
from .tied import UntiedHead


class Finiteness:
    """The undo budget, the injection hook and the per-step checks of one run."""

    def __init__(self, state: HostState, slots: Slots, head: UntiedHead, *, undo_bytes: int,
                 inject: Injection | None) -> None:
        self.state = state
        self.slots = slots
        #: host bytes the undo records of not yet verified steps may hold (see nonfinite.py)
        streamed = [(u.flat_map.numel, len(u.steps)) for u in state.trained if not u.resident]
        self.undo = UndoBudget(undo_bytes, most=undo_arena_bytes(streamed, slots.stage_n, undo_bytes))
        #: a value written into one gradient or loss, for tests (else $FLOWTRAIN_INJECT_NAN)
        self.inject = inject or injection_from_env(state.cfg.num_layers)
        #: host checks that verify a step: a flag per offloaded gradient piece (one per staging
        #: chunk), and the tied embedding's (the head's part, and each chunk of their sum)
        self.checks = sum(len(u.steps) for u in state.trained if not u.resident) + head.host_checks()

    def new_check(self, step: int) -> StepCheck:
        return StepCheck(step, self.checks, bool(self.state.resident), self.undo)

    def poison(self, t: torch.Tensor, step: int, where: str, micro_batch: int) -> torch.Tensor:
        """``t`` with the injected value in its first element where the test hook says so."""
        if self.inject is not None and self.inject.hits(step, where, micro_batch):
            return self.inject.apply(t)
        return t

    def settle(self, data: StepData) -> None:
        """The step's verdict once every flag is on the host (``verify_step``, ``grad_norm`` or
        ``end_step``): put back what its ``cpu_adam`` tasks changed if it was not finite."""
        for saved in data.check.settle():
            saved.restore()
        data.check.release()

    def resident_sq_norm(self, data: StepData, unit: UnitState) -> None:
        """Squared norm and non-finite flag (on the device) of a resident unit's gradient."""
        grad = unit.own_grad()[: unit.flat_map.numel]
        sq = data.sq_norms[(unit.flat_map.key, None)] = torch.dot(grad, grad)
        data.check.resident.append((unit.flat_map.key, nonfinite(grad, sq)))

    def found_inf(self, data: StepData) -> None:
        """Once every gradient of the step is in: 1.0 on the device if the loss or any of them is
        not finite, else 0.0, for every ``gpu_adam`` (and a host copy for ``verify_step``)."""
        for unit in self.state.trained:
            if unit.resident:
                self.resident_sq_norm(data, unit)
        check = data.check
        flags = [~torch.isfinite(data.loss), *(f for _, f, _ in check.pieces), *(f for _, f in check.resident)]  # type: ignore[arg-type]
        check.found_inf = torch.stack(flags).any().float()
        check.found_inf_host = self.slots.host_copy(check.found_inf)
