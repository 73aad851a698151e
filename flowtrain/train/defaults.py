"""Default values of ``flowtrain train``, in a module that imports nothing.

The command line builds its parser from these (``flowtrain train --help`` must not import
torch, and the trainer does), and :class:`~flowtrain.train.trainer.TrainConfig` takes its field
defaults from them, so the two cannot drift apart::

    from flowtrain.train import defaults
    parser.add_argument("--lr", type=float, default=defaults.LR)

Only the numbers a user is likely to look up live here; flags whose default is "off" (``None``,
``False``, ``0``) keep it next to the flag.
"""

from __future__ import annotations

STEPS = 200
BATCH_SIZE = 16  # sequences per optimizer step
MICRO_BATCH_SIZE = 8
SEQ_LEN = 128
LR = 3e-3
WEIGHT_DECAY = 0.01
BETAS = (0.9, 0.999)
EPS = 1e-8
SEED = 0
POLICY = "double_buffer"
MAX_SKIPPED = 3  # steps in a row skipped as not finite before the run stops
UNDO_MEM = 1.0  # GiB of host memory for undoing a step whose gradients turn non-finite late
