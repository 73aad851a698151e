"""What a checkpoint remembers of the run, and when a resume may continue it.

A checkpoint's ``trainer_state.json`` (built by :func:`trainer_state`) holds the steps done,
the skipped-step counters, the run's settings, the learning-rate schedule's total steps (and
any extensions of it, :class:`ContinuedSchedule`), a fingerprint of the data, the random state and
the run's lineage (:class:`~flowtrain.ckpt.checkpoints.Lineage`: which run wrote it, resumed
from which). The data fingerprint is compared with the data's as loaded, and the data cache
verifies its files' checksums at every load (:mod:`~flowtrain.data.cache`), so a
corrupted cache is rebuilt before the comparison rather than trusted by its stored hash.
A resume continues only where the remaining steps would compute what the original run would
have: :func:`check_compatible` refuses, in one line naming the setting, a checkpoint from a
different model, different data, or different optimizer, schedule or batching settings.
Settings that change *how* the run executes but not *what* it computes (policy, layout,
resident units, device, micro-batch size, compile, memory caps, where outputs go) may change
on a resume. ``--steps`` may change where the schedule does not depend on it (``constant``);
a cosine or linear decay would be stretched or squeezed, so a changed ``--steps`` is refused
there unless ``--extend-schedule`` says how to go on: from the rate the checkpoint reached,
the same decay to ``--min-lr`` at the new last step (:func:`resumed_schedule`)::

    state = trainer_state(cfg, steps_done=4, skipped=0, consecutive=0, data=fp, last_loss=2.3)
    check_compatible(state, cfg, data=fp, where="out/checkpoint-4", total_steps=cfg.steps)
    schedule = resumed_schedule(LRSchedule(...), state, where="out/checkpoint-4")  # the rate of every step

A checkpoint of a :class:`~flowtrain.train.policy_session.PolicyTrainer` keeps, under
:data:`POLICY_LOSS`, the loss settings that are the session's arguments rather than the
config's (``loss_type``, ``beta``, ``epsilon``, ``epsilon_high``): a session resumes only such
a checkpoint, with the same settings, and ``train`` resumes none.
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Annotated, Sequence

import msgspec
import torch

from ..errors import CheckpointError, ConfigError
from .saved_state import Schedule

FORMAT = 1

#: TrainConfig fields that decide what the remaining steps compute (an error names the field;
#: the command line spells it as its flag)
MUST_MATCH = ("batch_size", "seq_len", "lr", "weight_decay", "betas", "eps", "grad_clip", "warmup_steps",
              "lr_schedule", "min_lr", "seed", "shuffle", "packing", "weight_decay_skip", "lora_rank", "lora_alpha",
              "lora_targets", "lora_dropout", "lora_gate_up_rank", "lora_rslora", "skip_idle_experts",
              "objective", "dpo_beta", "dpo_loss")
#: The key of ``trainer_state.json`` that holds a PolicyTrainer's loss settings (see the module)
POLICY_LOSS = "policy_loss"
#: Learning-rate schedules whose rates depend on ``--steps``: they decay until the last step.
DECAYING = ("cosine", "linear")


def settings_of(cfg) -> dict:
    """The run's settings as JSON-able data; an object given as a setting (a user's policy
    instance) is stored as ``module:Class``."""
    return msgspec.to_builtins(cfg, enc_hook=lambda o: f"{type(o).__module__}:{type(o).__qualname__}")


def trainer_state(cfg, *, steps_done: int, skipped: int, consecutive: int, data: str,
                  last_loss: float | None, lineage: dict | None = None, schedule: dict | None = None,
                  base: str | None = None) -> dict:
    """The JSON-able run state stored in a checkpoint after ``steps_done`` steps; ``lineage``
    (:meth:`~flowtrain.ckpt.checkpoints.Lineage.to_json`) says which run wrote it and which
    runs that one descends from; ``schedule`` (:meth:`ContinuedSchedule.record`) how the
    learning rate goes on; ``base`` a LoRA run's base weights' fingerprint
    (:func:`~flowtrain.model.model_dir.weights_fingerprint`), which the checkpoint does not hold."""
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
        **({"schedule": schedule} if schedule is not None else {}),
        **({"base": {"fingerprint": base}} if base is not None else {}),
    }


def restore_rng(state: dict) -> None:
    raw = base64.b64decode(state["rng"]["torch"])
    torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))


class _Position(msgspec.Struct):
    fingerprint: str
    position: Annotated[int, msgspec.Meta(ge=0)]


class _Rng(msgspec.Struct):
    torch: str


class _StateShape(msgspec.Struct):
    """The fields of a trainer_state.json a resume reads, with their types and bounds (a file
    edited by hand, its manifest entry updated to match, is refused here in one line)."""

    step: Annotated[int, msgspec.Meta(ge=1)]
    data: _Position
    rng: _Rng
    settings: dict
    skipped_steps: Annotated[int, msgspec.Meta(ge=0)] = 0
    consecutive_skipped: Annotated[int, msgspec.Meta(ge=0)] = 0
    last_loss: float | None = None


def steps_done(state: dict, where: str) -> int:
    """The checkpoint's step count, the whole state checked: its format, the types and bounds
    of what a resume reads, a data position within the steps done, and a random generator
    state torch can take."""
    if state.get("format") != FORMAT:
        raise CheckpointError(f"{where}: trainer_state.json has format {state.get('format')!r}; "
                              f"this flowtrain reads format {FORMAT}")
    try:
        shape = msgspec.convert(state, _StateShape)
    except msgspec.ValidationError as e:
        raise CheckpointError(f"{where}: trainer_state.json is not a trainer state flowtrain wrote ({e})") from None
    if max(shape.data.position, shape.skipped_steps, shape.consecutive_skipped) > shape.step:
        raise CheckpointError(f"{where}: trainer_state.json counts more than its {shape.step} steps "
                              f"(data position {shape.data.position}, {shape.skipped_steps} skipped, {shape.consecutive_skipped} in a row)")
    try:
        rng = base64.b64decode(shape.rng.torch, validate=True)
    except (binascii.Error, ValueError):
        rng = b""
    if len(rng) != torch.get_rng_state().numel():
        raise CheckpointError(f"{where}: trainer_state.json's rng.torch is not a torch generator state")
    return shape.step


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def check_compatible(state: dict, cfg, *, data: str, where: str, total_steps: int) -> None:
    """Refuse to resume from ``state`` when the remaining steps would compute something else."""
    saved = state.get("settings", {})
    now = settings_of(cfg)
    for field in MUST_MATCH:
        if field in saved and not _same(saved[field], now[field]):
            raise ConfigError(
                f"{{resume}} {where}: it was trained with {field}={saved[field]!r}, this run has {{{field}}} giving "
                f"{now[field]!r}; use the same setting to continue it, or start a new run", named=True)
    if state.get("data", {}).get("fingerprint") != data:
        raise ConfigError(f"{{resume}} {where}: the training data differs from the data this checkpoint was "
                          f"trained on (pass the same {{data}}, tokenised the same way)", named=True)
    done = steps_done(state, where)
    if total_steps <= done:
        raise ConfigError(f"{{resume}} {where}: it has done {done} steps already and {{steps}} is {total_steps}; "
                          f"{{steps}} counts the whole run: raise it above {done}", named=True)
    _check_schedule_steps(state, where, total_steps, extend=bool(getattr(cfg, "extend_schedule", False)))


def _check_schedule_steps(state: dict, where: str, total_steps: int, *, extend: bool) -> None:
    """A decaying schedule set for another ``--steps`` continues only with ``--extend-schedule``."""
    shape = state.get("settings", {}).get("lr_schedule")
    first, extended = schedule_record(state, where)
    before = extended[-1][1] if extended else first
    if extend or before is None or before == total_steps or shape not in DECAYING:
        return
    raise ConfigError(
        f"{{resume}} {where}: its {shape} schedule decays to {{min_lr}} at step {before}, this run has {{steps}} {total_steps}, "
        f"which would stretch that schedule and change the learning rate of every step left; give {{steps}} {before} to "
        f"finish it, or add {{extend_schedule}} to decay from the rate it reached to {{min_lr}} at step {total_steps}", named=True)


def schedule_record(state: dict, where: str) -> tuple[int | None, list[tuple[int, int]]]:
    """``(the first run's --steps, the extensions)`` that a checkpoint's ``trainer_state.json``
    records (:meth:`ContinuedSchedule.record`); a checkpoint written before schedules were
    recorded has its settings' ``--steps`` and none."""
    if "schedule" not in state:
        steps = state.get("settings", {}).get("steps")
        return (steps if isinstance(steps, int) else None), []
    record = state["schedule"]
    steps = record.get("steps") if isinstance(record, dict) else None
    extended = record.get("extended") if isinstance(record, dict) else None
    if not (isinstance(steps, int) and isinstance(extended, list)
            and all(isinstance(x, list) and len(x) == 2 and all(isinstance(v, int) for v in x) for x in extended)):
        raise CheckpointError(f"{where}: trainer_state.json has a malformed \"schedule\" (want {{\"steps\": N, "
                              f"\"extended\": [[START, TOTAL], ...]}}, got {str(record)[:80]})")
    return steps, [(a, b) for a, b in extended]


def _cosine(frac: float) -> float:
    return 0.5 * (1 + math.cos(math.pi * frac))


#: The share of the way from ``--min-lr`` up to the rate a decay starts at that each decaying
#: schedule keeps, a fraction ``frac`` of the way through the decay (1 at its start, 0 at its
#: end): the shapes of :class:`~flowtrain.train.optimizer.LRSchedule`.
_SHAPES = {"cosine": _cosine, "linear": lambda frac: 1.0 - frac}


class ContinuedSchedule:
    """The learning rate of every (0-based) step of a run, ``--extend-schedule`` included.

    Without extensions it is ``base``, the run's :class:`~flowtrain.train.optimizer.LRSchedule`.
    Each extension ``(start, total)`` (a resume that changed ``--steps`` to ``total``) keeps
    every rate before ``start`` and from there decays, in the same shape, from the rate reached
    at ``start`` to ``min_lr`` at ``total``: no jump. ``start`` is the step the resumed run
    began at, or the end of the warm-up if that came later (a decay that had not begun is simply
    laid over the new ``--steps``). Checkpoints keep :meth:`record`, so every later resume
    rebuilds the same rates::

        base = LRSchedule(lr=1e-3, schedule="cosine", total_steps=100)
        lr = ContinuedSchedule(base, [(60, 200)])   # resumed from checkpoint-60 with --steps 200
        lr(59) == base(59) and lr(60) == base(60) and lr(199) < lr(60)
    """

    def __init__(self, base: Schedule, extended: Sequence[tuple[int, int]] = ()) -> None:
        self.base = base
        self.extended = [(int(a), int(b)) for a, b in extended]

    def __call__(self, step: int) -> float:
        return self._rate(step, len(self.extended))

    def _rate(self, step: int, upto: int) -> float:
        """The rate of ``step`` under the base schedule and the first ``upto`` extensions."""
        for i in reversed(range(upto)):
            start, total = self.extended[i]
            if step >= start:
                top, low = self._rate(start, i), self.base.min_lr
                frac = min((step - start) / max(total - start, 1), 1.0)
                return low + (top - low) * _SHAPES[self.base.schedule](frac)
        return self.base(step)

    @property
    def total_steps(self) -> int:
        """The step the schedule ends at (its last extension's, else the base's)."""
        return self.extended[-1][1] if self.extended else self.base.total_steps

    def record(self) -> dict:
        """What a checkpoint keeps: the base schedule's total steps and the extensions."""
        return {"steps": self.base.total_steps, "extended": [list(x) for x in self.extended]}


def resumed_schedule(schedule: Schedule, state: dict, *, where: str) -> ContinuedSchedule:
    """The rates of a run that resumes ``state`` (checked by :func:`check_compatible`) with
    ``schedule``, the settings it runs with (``total_steps``: its ``--steps``): the checkpoint's
    schedule as it was, extended to ``--steps`` where that changed under a decaying schedule
    (``--extend-schedule``). Refused where the rate had already reached ``--min-lr``: extending
    would only train on at that rate."""
    first, extended = schedule_record(state, where)
    sched = ContinuedSchedule(schedule.with_total_steps(first or schedule.total_steps), extended)
    if schedule.schedule not in DECAYING or sched.total_steps == schedule.total_steps:
        return sched
    done = steps_done(state, where)
    start = max(done, schedule.warmup_steps)
    if start >= schedule.total_steps:  # the run ends before its warm-up does: no decay to lay out
        return sched
    reached = sched(start)
    if reached <= schedule.min_lr:
        raise ConfigError(
            f"{{resume}} {where} {{extend_schedule}}: its {schedule.schedule} schedule had already decayed to {{min_lr}} "
            f"{schedule.min_lr:g} by step {done}, so it would train on at that rate; to train on at a new rate, start a "
            f"new run from it ({{model}} {where}: its weights, a new optimizer state)", named=True)
    return ContinuedSchedule(sched.base, [*sched.extended, (start, schedule.total_steps)])
