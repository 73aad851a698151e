"""What a checkpoint remembers of the run, and when a resume may continue it.

A checkpoint's ``trainer_state.json`` (built by :func:`trainer_state`) holds the steps done,
the skipped-step counters, the run's settings, a fingerprint of the data, the random state and
the run's lineage (:class:`~flowtrain.ckpt.checkpoints.Lineage`: which run wrote it, resumed
from which). The data fingerprint is compared with the data's as loaded, and the data cache
verifies its files' checksums at every load (:mod:`~flowtrain.data.cache`), so a
corrupted cache is rebuilt before the comparison rather than trusted by its stored hash.
A resume continues only where the remaining steps would compute what the original run would
have: :func:`check_compatible` refuses, in one line naming the setting, a checkpoint from a
different model, different data, or different optimizer, schedule or batching settings.
Settings that change *how* the run executes but not *what* it computes (policy, layout,
resident units, device, micro-batch size, compile, memory caps, where outputs go, ``--steps``)
may change on a resume::

    state = trainer_state(cfg, steps_done=4, skipped=0, consecutive=0, data=fp, last_loss=2.3)
    check_compatible(state, cfg, data=fp)       # raises ConfigError naming what differs
"""

from __future__ import annotations

import base64
import math

import msgspec
import torch

from ..errors import CheckpointError, ConfigError

FORMAT = 1

#: TrainConfig fields that decide what the remaining steps compute, with their flags.
MUST_MATCH = {
    "batch_size": "--batch-size", "seq_len": "--seq-len", "lr": "--lr", "weight_decay": "--weight-decay",
    "betas": "--betas", "eps": "--eps", "grad_clip": "--grad-clip", "warmup_steps": "--warmup-steps",
    "lr_schedule": "--lr-schedule", "min_lr": "--min-lr", "seed": "--seed", "shuffle": "--no-shuffle",
    "packing": "--no-packing",
}


def settings_of(cfg) -> dict:
    """The run's settings as JSON-able data; an object given as a setting (a user's policy
    instance) is stored as ``module:Class``."""
    return msgspec.to_builtins(cfg, enc_hook=lambda o: f"{type(o).__module__}:{type(o).__qualname__}")


def trainer_state(cfg, *, steps_done: int, skipped: int, consecutive: int, data: str,
                  last_loss: float | None, lineage: dict | None = None) -> dict:
    """The JSON-able run state stored in a checkpoint after ``steps_done`` steps; ``lineage``
    (:meth:`~flowtrain.ckpt.checkpoints.Lineage.to_json`) says which run wrote it and which
    runs that one descends from."""
    settings = settings_of(cfg)
    return {
        "format": FORMAT,
        "step": steps_done,
        "skipped_steps": skipped,
        "consecutive_skipped": consecutive,
        "last_loss": last_loss if last_loss is not None and math.isfinite(last_loss) else None,
        "data": {"fingerprint": data, "position": steps_done},
        "settings": settings,
        "rng": {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()},
        **({"lineage": lineage} if lineage is not None else {}),
    }


def restore_rng(state: dict) -> None:
    raw = base64.b64decode(state["rng"]["torch"])
    torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))


def steps_done(state: dict, where: str) -> int:
    """The checkpoint's step count, checked."""
    if state.get("format") != FORMAT:
        raise CheckpointError(f"{where}: trainer_state.json has format {state.get('format')!r}; "
                              f"this flowtrain reads format {FORMAT}")
    step = state.get("step")
    if not isinstance(step, int) or step < 1:
        raise CheckpointError(f"{where}: trainer_state.json has no valid step count (got {step!r})")
    return step


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def check_compatible(state: dict, cfg, *, data: str, where: str, total_steps: int) -> None:
    """Refuse to resume from ``state`` when the remaining steps would compute something else."""
    saved = state.get("settings", {})
    now = settings_of(cfg)
    for field, flag in MUST_MATCH.items():
        if field in saved and not _same(saved[field], now[field]):
            raise ConfigError(
                f"--resume {where}: it was trained with {field}={saved[field]!r}, this run has {flag} giving "
                f"{now[field]!r}; use the same setting to continue it, or start a new run"
            )
    if state.get("data", {}).get("fingerprint") != data:
        raise ConfigError(f"--resume {where}: the training data differs from the data this checkpoint was "
                          f"trained on (pass the same --data, tokenised the same way)")
    done = steps_done(state, where)
    if total_steps <= done:
        raise ConfigError(f"--resume {where}: it has done {done} steps already and --steps is {total_steps}; "
                          f"--steps counts the whole run: raise it above {done}")
