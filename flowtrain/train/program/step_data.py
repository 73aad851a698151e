"""What the program holds for one optimizer step, or one held-out evaluation, while it runs.

:meth:`StepProgram.begin_step <flowtrain.train.program.StepProgram.begin_step>` makes a
:class:`StepData` from the step's micro-batches; the step's tasks add to it (the loss, the
squared gradient norms, the clip coefficient, the finiteness check) and
:meth:`~flowtrain.train.program.StepProgram.end_step` reads and drops it. An evaluation's
:class:`EvalData` collects one fp32 cross-entropy sum per micro-batch.
"""

from __future__ import annotations

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

    @property
    def micro_batches(self) -> int:
        return len(self.ids)


class EvalData:
    """Host-side inputs and per-micro-batch CE sums of one held-out loss evaluation."""

    def __init__(self, ids: list[torch.Tensor], targets: list[torch.Tensor], n_targets: int,
                 docs: list[Documents | None], reference: bool = False) -> None:
        self.ids = ids
        self.targets = targets
        self.docs = docs
        self.n_targets = n_targets
        #: a reference pass (DPO): per row, the summed log-probability of its targets, with the
        #: weights as they were before training (under LoRA: the base without its adapters)
        self.reference = reference
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
