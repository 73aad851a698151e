"""Default values of ``flowtrain train``, in a module that imports nothing.

The second stop of :mod:`flowtrain.train.config`, after the declaration. The command line
builds its parser from these (``flowtrain train --help`` must not import torch, and the trainer
does), and :class:`~flowtrain.train.config.run_config.TrainConfig` takes its field defaults
from them, so the two cannot drift apart::

    from flowtrain.train.config import defaults
    parser.add_argument("--steps", type=int, default=defaults.STEPS)

Only the numbers a user is likely to look up live here; flags whose default is "off" (``None``,
``False``, ``0``) keep it next to the flag.

The optimizer's defaults depend on where the weights come from (:func:`optimizer_defaults`):
a preset trained from random weights (the demo) takes a high constant rate; a pretrained model
folder takes what a careful fine-tuner would (a small rate, a short warm-up, cosine decay, no
weight decay on norms and biases); a resumed run takes its checkpoint's settings. Those
fields are ``None`` in ``TrainConfig`` until the run decides.
"""

from __future__ import annotations

from typing import Literal


class SeqLenDefault(int):
    """The ``--seq-len`` of a run that gives none: an ``int`` equal to :data:`SEQ_LEN` (so that
    ``TrainConfig()`` is a valid config that prints 128 everywhere), whose type says the data
    decides. The trainer replaces it with a plain ``int`` once the data is read
    (``flowtrain.data.source.FromData``): a token stream (text, .txt, 1-D .npy, the bundled
    corpus) keeps 128; a file of examples takes its longest example, rounded up to a multiple of
    :data:`SEQ_LEN_MULTIPLE`, at most the model's ``max_position_embeddings``. Any ``--seq-len``
    a user types, or ``TrainConfig(seq_len=...)``, is a plain ``int`` and is used as given."""


def seq_len_given(seq_len: int) -> bool:
    """Whether ``seq_len`` was chosen by the user (not :class:`SeqLenDefault`)."""
    return not isinstance(seq_len, SeqLenDefault)


class MicroBatchDefault(int):
    """The ``--micro-batch-size`` of a run that gives none: an ``int`` equal to 8 whose type says
    it may shrink. Where it does not divide ``--batch-size`` (a batch of 4, or 12), the run takes
    the largest micro-batch up to 8 that does (:func:`micro_batch_for`) rather than refusing a
    flag the user never typed; one the user types is used as given."""


def micro_batch_for(batch_size: int, micro_batch_size: int) -> int:
    """``micro_batch_size``, or where it is the default and does not divide ``batch_size`` the
    largest divisor of ``batch_size`` below it."""
    if not isinstance(micro_batch_size, MicroBatchDefault) or batch_size % micro_batch_size == 0:
        return micro_batch_size
    return max(d for d in range(1, micro_batch_size + 1) if batch_size % d == 0)


STEPS = 200
BATCH_SIZE = 16  # sequences per optimizer step
MICRO_BATCH_SIZE = MicroBatchDefault(8)  # at most; a batch it does not divide takes a divisor
SEQ_LEN = SeqLenDefault(128)  # token streams; examples: from the data (SeqLenDefault)
#: a seq_len from the data is rounded up to a multiple of this: attention kernels and tensor cores
#: work in tiles of 64 (or 128) tokens, so a row of 1,000 tokens costs what one of 1,024 does, and
#: the rounding adds under 64 tokens of padding a row (which packing fills with other examples)
SEQ_LEN_MULTIPLE = 64
#: examples longer than --seq-len: "auto" stops a run on conversations before training, naming
#: them (a cut conversation trains on a reply without its end, often without its last turns; a
#: dropped one is data the user meant to train on: the user chooses, --long-examples drop or
#: truncate, knowing how many), and cuts every other row, keeping its start, as text is cut into
#: windows; the start-up block counts what was cut or dropped either way
LONG_EXAMPLES: Literal["auto", "error", "drop", "truncate"] = "auto"
BETAS = (0.9, 0.999)
EPS = 1e-8
SEED = 0
POLICY = "double_buffer"
MAX_SKIPPED = 3  # steps in a row skipped as not finite before the run stops
UNDO_MEM = 1.0  # GiB of host memory for undoing a step whose gradients turn non-finite late

#: random weights (a preset): the demo's settings
FROM_SCRATCH = {"lr": 3e-3, "lr_schedule": "constant", "warmup_steps": 0, "weight_decay": 0.01,
                "weight_decay_skip": "none"}
#: a pretrained model folder: a careful fine-tune (warm-up: 3% of the steps, at least 1)
FINE_TUNE = {"lr": 2e-5, "lr_schedule": "cosine", "warmup_steps": None, "weight_decay": 0.01,
             "weight_decay_skip": "norms-biases"}
#: LoRA adapters over a pretrained model: the common PEFT recipes' rate, ten times a full
#: fine-tune's (the update is low-rank and starts at zero)
LORA = {**FINE_TUNE, "lr": 2e-4, "weight_decay_skip": "none"}
WARMUP_FRACTION = 0.03


def optimizer_defaults(pretrained: bool, steps: int, lora: bool = False) -> dict:
    """The optimizer settings a run gets for what it does not set itself."""
    if not pretrained:
        return dict(FROM_SCRATCH)
    out = dict(LORA if lora else FINE_TUNE)
    out["warmup_steps"] = max(1, round(WARMUP_FRACTION * steps))
    return out
