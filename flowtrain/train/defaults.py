"""Default values of ``flowtrain train``, in a module that imports nothing.

The command line builds its parser from these (``flowtrain train --help`` must not import
torch, and the trainer does), and :class:`~flowtrain.train.trainer.TrainConfig` takes its field
defaults from them, so the two cannot drift apart::

    from flowtrain.train import defaults
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

STEPS = 200
BATCH_SIZE = 16  # sequences per optimizer step
MICRO_BATCH_SIZE = 8
SEQ_LEN = 128
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
WARMUP_FRACTION = 0.03


def optimizer_defaults(pretrained: bool, steps: int) -> dict:
    """The optimizer settings a run gets for what it does not set itself."""
    if not pretrained:
        return dict(FROM_SCRATCH)
    out = dict(FINE_TUNE)
    out["warmup_steps"] = max(1, round(WARMUP_FRACTION * steps))
    return out
