"""What the program holds for one optimizer step, or one held-out evaluation, while it runs.

:meth:`StepProgram.begin_step <flowtrain.train.program.StepProgram.begin_step>` makes a
:class:`StepData` from the step's micro-batches; the step's tasks add to it (the loss, the
squared gradient norms, the clip coefficient, the finiteness check) and
:meth:`~flowtrain.train.program.StepProgram.end_step` reads and drops it. An evaluation's
:class:`EvalData` collects one fp32 cross-entropy sum per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...model.attention import Documents
from ..nonfinite import StepCheck


class StepData:
    """Host-side inputs and per-step accumulators of one optimizer step."""

    def __init__(self, ids: list[torch.Tensor], targets: list[torch.Tensor], n_targets: int, lr: float,
                 check: StepCheck, docs: list[Documents | None]) -> None:
        self.ids = ids
        self.targets = targets
        self.docs = docs  # per micro-batch: its packed documents, None for one per row
        self.n_targets = n_targets
        self.lr = lr
        self.loss: torch.Tensor | None = None
        #: a mixture of experts' load-balancing loss, already weighted (flowtrain.train.load_balance)
        self.aux_loss: torch.Tensor | None = None
        self.sq_norms: dict[tuple[str, int | None], torch.Tensor] = {}  # (unit key, chunk) -> squared grad norm
        self.clip: torch.Tensor | None = None  # clip coefficient, once known
        self.total_norm: float | None = None
        self.tied_summed = False
        self.check = check  # is the step finite: see flowtrain.train.nonfinite
        #: DPO: per micro-batch the reference's summed completion log-probability of each row
        #: ((rows,) fp32); None for next-token cross-entropy
        self.reference: list[torch.Tensor] | None = None
        #: DPO: the step's summed chosen and rejected rewards, margins and accuracies ((4,) fp32)
        self.rewards: torch.Tensor | None = None
        #: a policy step (:class:`PolicyBatch` per micro-batch); None otherwise
        self.policy: list[PolicyBatch] | None = None
        #: a policy step: its summed KL and clipped tokens ((2,) fp32), and per micro-batch each
        #: target token's log-probability before the update ((rows, seq) fp32, on the CPU)
        self.policy_sums: torch.Tensor | None = None
        self.logps: dict[int, torch.Tensor] = {}

    @property
    def micro_batches(self) -> int:
        return len(self.ids)


@dataclass
class PolicyBatch:
    """One micro-batch of a policy step (GRPO, REINFORCE), each ``(rows, seq)`` fp32 aligned
    with its targets (0 where a target is ignored): each token's share of the step's loss, its
    advantage, and the log-probabilities of the policy that generated it and of the reference
    (None: this policy's own, detached; no KL term)."""

    weights: torch.Tensor
    advantages: torch.Tensor
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None

    def to(self, device: torch.device, non_blocking: bool = False) -> "PolicyBatch":
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return PolicyBatch(*(move(t) for t in (self.weights, self.advantages, self.old_logps,  # type: ignore[arg-type]
                                               self.ref_logps)))


class EvalData:
    """Host-side inputs and per-micro-batch CE sums of one held-out loss evaluation."""

    def __init__(self, ids: list[torch.Tensor], targets: list[torch.Tensor], n_targets: int,
                 docs: list[Documents | None], reference: bool = False, per_token: bool = False) -> None:
        self.ids = ids
        self.targets = targets
        self.docs = docs
        self.n_targets = n_targets
        #: a reference pass (DPO): per row, the summed log-probability of its targets, with the
        #: weights as they were before training (under LoRA: the base without its adapters)
        self.reference = reference
        #: each target token's log-probability ((rows, seq) per micro-batch) instead of sums
        self.per_token = per_token
        self.sums: dict[int, torch.Tensor] = {}  # micro-batch -> fp32 CE sum (device scalar), or per row


def documents(positions: list[torch.Tensor | None] | None, n: int) -> list[Documents | None]:
    """Per micro-batch, its documents where some row holds several (else None: one per row,
    the plain causal kernel and the shared rotary tables)."""
    out: list[Documents | None] = [None] * n
    for m, pos in enumerate(positions or []):
        if pos is not None:
            docs = Documents.from_positions(pos)
            out[m] = docs if docs.packed else None
    return out
