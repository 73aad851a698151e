"""A policy trainer for RL loops in Python (GRPO, REINFORCE): one optimizer step at a time.

The caller generates (with transformers, vLLM, anything), scores and computes advantages; the
session keeps the engine, the weights and the optimizer alive between steps and does one
streamed optimizer step of GRPO's loss (:mod:`flowtrain.train.objectives`) per call::

    with PolicyTrainer(TrainConfig(model="path/to/model", batch_size=8, seq_len=256, steps=100)) as session:
        for _ in range(100):
            session.to_hf(hf_model)                       # the current weights, for generating
            ids, mask = ...                               # prompts + completions, (8, T)
            out = session.step(ids, mask, advantages)     # (8,) or (8, T)
            out.logps, out.metrics.loss, out.metrics.policy["kl"]
        session.save("policy")

Every tensor is aligned with ``input_ids`` (rows, T): ``completion_mask[r, t]`` says token
``t`` of row ``r`` is one the policy generated, and ``logps[r, t]`` is the log-probability of
``input_ids[r, t]`` given ``input_ids[r, :t]`` (0 where the mask is 0; column 0 has none). Rows
start at their first token (no left padding) and are right-padded to at most ``seq_len``.

A step is the run's own step (:meth:`~flowtrain.train.loop.TrainingLoop.one_step`): the same
graph, checkpoints (``save_every``: ``out/checkpoint-N`` after step N), skipped non-finite
steps, ``metrics`` file and progress lines as ``train``; only its data comes from the call.
Forward-only log-probabilities (:meth:`PolicyTrainer.logprobs`) run the evaluation graph, as
DPO's reference pass does.

A session resumes as ``train`` does: ``resume`` in the config opens it with the checkpoint's
weights, Adam state, learning-rate schedule and random state, and its ``steps_done`` at the
checkpoint's step; the steps that follow compute what the session that wrote it would have,
given the same rows::

    cfg = TrainConfig(model="path/to/model", batch_size=8, seq_len=256, steps=100, out="out", save_every=10,
                      resume="out/checkpoint-40")
    with PolicyTrainer(cfg) as session:
        session.steps_done                        # 40: the next step is step 41

Each checkpoint keeps the loss's settings (``loss_type``, ``beta``, ``epsilon``,
``epsilon_high``) beside the config's; a checkpoint of other settings, or one ``train`` wrote
(SFT, or DPO with its reference log-probabilities), is refused in one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import msgspec
import torch

from ..ckpt.output import resolve_out
from ..ckpt.resume import POLICY_LOSS
from ..errors import ConfigError, DataError
from ..model.attention import attention_backends
from ..model.functional import IGNORE_INDEX
from ..runtime.engine import use_uvloop
from ..runtime.trace import Instrument
from .config.run_config import TrainConfig
from .distributed import world_from_env
from .loop import TrainingLoop
from .objectives import POLICY_LOSSES, policy_token_weights
from .prepare import prefer_expandable_segments
from .program.step_data import PolicyBatch
from .reporting import StepMetrics
from .run import close_run, open_run, save_model
from .shutdown import Shutdown

__all__ = ["PolicyStep", "PolicyTrainer"]


@dataclass
class PolicyStep:
    """What :meth:`PolicyTrainer.step` returns: each token's log-probability under the policy
    *before* the step's update (``input_ids``'s shape, fp32, 0 outside ``completion_mask``),
    and the step's metrics (``metrics.loss``, ``metrics.grad_norm``, ``metrics.policy`` with
    ``kl`` and ``clip_ratio/region_mean``, ``metrics.skipped``)."""

    logps: torch.Tensor
    metrics: StepMetrics


class PolicyTrainer:
    """One streamed optimizer step of GRPO's loss per :meth:`step`; see the module.

    ``config``: a :class:`TrainConfig` as for ``train``, without ``data`` (each step's rows
    come from the call): ``batch_size`` rows a step, cut into ``micro_batch_size``, at most
    ``seq_len`` tokens each, ``steps`` the most steps the session may take (the learning-rate
    schedule runs over them). ``loss_type``: ``"dapo"`` (TRL's default: a token mean over the
    step) or ``"grpo"`` (each completion's token mean, averaged). ``beta``: the KL coefficient
    (TRL's default 0.0: no reference needed). ``epsilon``, ``epsilon_high``: the clip range
    ``[1 - epsilon, 1 + epsilon_high]`` (``epsilon_high`` defaults to ``epsilon``). With
    ``resume`` in the config the session goes on from that checkpoint (see the module), whose
    loss settings must be these.
    """

    def __init__(self, config: TrainConfig, *, loss_type: str = "dapo", beta: float = 0.0, epsilon: float = 0.2,
                 epsilon_high: float | None = None, on_step: Callable[[StepMetrics], None] | None = None,
                 instruments: Sequence[Instrument] = ()) -> None:
        _check_config(config, loss_type, beta, epsilon, epsilon_high)
        self.loss_type, self.beta = loss_type, beta
        world = world_from_env()
        if world.parallel:
            raise ConfigError("PolicyTrainer runs in one process; data parallel (torchrun) is not supported yet")
        prefer_expandable_segments(config)
        cfg = msgspec.structs.replace(config, out=resolve_out(config.out))
        self._held = contextlib.ExitStack()
        self._closed = False
        self._failed = False
        try:
            record = {"loss_type": loss_type, "beta": float(beta), "epsilon": float(epsilon),
                      "epsilon_high": float(epsilon if epsilon_high is None else epsilon_high)}
            self._opened = opened = open_run(cfg, world, self._held, rows_given=True,
                                             resume_check=lambda state, where: _check_resumed(state, where, record))
            self.cfg = cfg = opened.run.cfg
            opened.program.policy_loss = (beta, epsilon, epsilon_high)
            hooks: list[Instrument] = [*instruments, *([opened.recorder] if opened.recorder else [])]
            self._loop = TrainingLoop(opened.run, opened.state, opened.program, opened.reporter,
                                      Shutdown(graceful=False), on_step, hooks, keep={POLICY_LOSS: record})
            self._held.callback(close_run, opened, self._loop)
            self._held.enter_context(attention_backends(cfg.attention_backend, opened.run.device.type))
            use_uvloop()
            self._runner = asyncio.Runner()
            self._held.callback(self._runner.close)
            self._engine = self._loop.engine()
            self._runner.run(self._engine.__aenter__())
            self._stream = self._loop.stream()
        except BaseException:
            self._held.close()
            raise
        self._next = opened.run.first_step

    # ---- lifetime ----------------------------------------------------------------------------
    def __enter__(self) -> "PolicyTrainer":
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close(save=exc_type is None)

    def close(self, save: bool = True) -> None:
        """Stop the engine and let go of everything; with ``save`` and ``out`` in the config,
        write the final model there first, as ``train`` does. Leaving the ``with`` block calls
        it (without saving if an exception left it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        with self._held:
            failed = self._failed or not save
            # after a failure the engine is cancelled: nothing still queued runs
            self._runner.run(self._engine.__aexit__(RuntimeError if failed else None, None, None))
            if not failed and self.cfg.out:
                save_model(self._opened.run, self._opened.state, self.cfg.out)

    # ---- steps -------------------------------------------------------------------------------
    def step(self, input_ids: Any, completion_mask: Any, advantages: Any, old_logps: Any = None,
             ref_logps: Any = None) -> PolicyStep:
        """One optimizer step of GRPO's loss over ``batch_size`` rows (see the module for the
        alignment): ``advantages`` per row ``(rows,)`` or per token; ``old_logps`` the
        generating policy's log-probabilities (None: this policy's own, detached: ratio 1, and
        the step is REINFORCE's ``-A log p``); ``ref_logps`` the reference's, needed where
        ``beta`` is not 0. Returns the tokens' log-probabilities before the update and the
        step's metrics."""
        self._check_usable()
        cfg = self.cfg
        if self._next >= cfg.steps:
            raise ConfigError(f"the session has taken its {cfg.steps} steps (TrainConfig.steps, over which the "
                              "learning-rate schedule runs): give a larger steps")
        rows = _Rows.of(input_ids, completion_mask, cfg.seq_len, self._opened.run.mcfg.vocab_size,
                        batch=cfg.batch_size)
        if rows.mask[:, 1:].sum() == 0:
            raise DataError("completion_mask marks no token after the first of a row: the step has nothing to train on")
        adv = _floats("advantages", advantages, rows, per_row=True)
        old = None if old_logps is None else _floats("old_logps", old_logps, rows)
        ref = None if ref_logps is None else _floats("ref_logps", ref_logps, rows)
        if self.beta != 0.0 and ref is None:
            raise DataError(f"beta is {self.beta}: give ref_logps, the reference's log-probabilities (or beta=0.0)")
        weights = policy_token_weights(rows.targets != IGNORE_INDEX, self.loss_type)
        s, mbs = self._next, cfg.micro_batch_size
        cut = range(0, len(rows.ids), mbs)
        policy = [PolicyBatch(weights[i:i + mbs], adv[i:i + mbs], None if old is None else old[i:i + mbs],
                              None if ref is None else ref[i:i + mbs]) for i in cut]
        program, run = self._opened.program, self._opened.run

        def begin() -> None:
            program.begin_step(s, [rows.ids[i:i + mbs] for i in cut], [rows.targets[i:i + mbs] for i in cut],
                               run.schedule(s), policy=policy)

        metrics = self._run(self._loop.one_step(self._engine, self._stream, s, begin, rows.tokens))
        self._next += 1
        return PolicyStep(rows.aligned(program.token_logps.pop(s)), metrics)

    def logprobs(self, input_ids: Any, completion_mask: Any = None, *, reference: bool = False) -> torch.Tensor:
        """Each token's log-probability under the current weights, forward only (any number of
        rows, ``micro_batch_size`` at a time): ``input_ids``'s shape, 0 outside
        ``completion_mask`` (None: every token but a row's first). ``reference``: under LoRA,
        the base without its adapters (the reference of a LoRA run, at no memory)."""
        self._check_usable()
        if reference and self._opened.state.lora is None:
            raise ConfigError("reference=True reads the base without LoRA's adapters, and this session trains every "
                              "weight: compute ref_logps with logprobs() before the first step, and keep them")
        rows = _Rows.of(input_ids, completion_mask, self.cfg.seq_len, self._opened.run.mcfg.vocab_size)
        mbs = self.cfg.micro_batch_size
        cut = range(0, len(rows.ids), mbs)
        lp = self._run(self._loop.forward_only(self._engine, self._next, [rows.ids[i:i + mbs] for i in cut],
                                               [rows.targets[i:i + mbs] for i in cut], per_token=True,
                                               reference=reference))
        return rows.aligned(lp)

    # ---- the weights ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The current weights by the Hub's names (fp32 copies on the CPU; under LoRA the base
        with the adapters merged), as ``transformers``' ``load_state_dict`` takes them."""
        self._check_usable()
        return {name: t.detach().clone() for name, t in self._opened.state.hf_tensors()}

    @torch.no_grad()
    def to_hf(self, model: torch.nn.Module) -> torch.nn.Module:
        """Copy the current weights into ``model`` (a transformers model of the same
        architecture), tensor by tensor, without a second copy of the model; returns it."""
        self._check_usable()
        theirs = model.state_dict()
        copied = set()
        for name, t in self._opened.state.hf_tensors():
            if name not in theirs or theirs[name].shape != t.shape:
                raise ConfigError(f"to_hf: the model has no tensor {name} of shape {tuple(t.shape)}; give a "
                                  "transformers model of the session's architecture (or load session.save's folder)")
            theirs[name].copy_(t)
            copied.add(name)
            del t  # a unit read back from disk: let go before the next is read
        tied = {"lm_head.weight"} if self._opened.run.mcfg.tie_word_embeddings else set()
        missed = [n for n, p in model.named_parameters() if n not in copied and n not in tied]
        if missed:
            raise ConfigError(f"to_hf: the session holds no weight for the model's {missed[0]}"
                              + (f" (and {len(missed) - 1} more)" if len(missed) > 1 else ""))
        return model

    def save(self, out: str | Path) -> Path:
        """The model as it is now into ``out``, as ``train`` writes its final model: Hugging
        Face's format with the tokenizer's files, or under LoRA the PEFT adapter."""
        self._check_usable()
        run = self._opened.run
        if self._opened.state.lora is not None and self.cfg.merge:  # merging changes the base: only at the end
            run = dataclasses.replace(run, cfg=msgspec.structs.replace(self.cfg, merge=False))
        save_model(run, self._opened.state, out)
        return Path(out)

    @property
    def steps_done(self) -> int:
        """Optimizer steps taken so far (a resumed session's count from its checkpoint's)."""
        return self._next

    # ---- inside -------------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._closed:
            raise ConfigError("the PolicyTrainer is closed")
        if self._failed:
            raise ConfigError("a step of this PolicyTrainer failed: close it and start another")

    def _run(self, coro):  # type: ignore[no-untyped-def]
        try:
            return self._runner.run(coro)
        except BaseException as e:
            if not isinstance(e, (DataError,)):
                self._failed = True
            raise


def _check_config(cfg: TrainConfig, loss_type: str, beta: float, epsilon: float, epsilon_high: float | None) -> None:
    if loss_type not in POLICY_LOSSES:
        raise ConfigError(f"loss_type must be one of {', '.join(POLICY_LOSSES)} (got {loss_type!r})")
    if not beta >= 0:
        raise ConfigError(f"beta must be >= 0 (got {beta})")
    for name, value in (("epsilon", epsilon), ("epsilon_high", epsilon_high)):
        if value is not None and not 0 < value:
            raise ConfigError(f"{name} must be > 0 (got {value})")
    for field, why in (("data", "each step's rows come from step()"),
                       ("eval_data", "a held-out cross-entropy is not a policy's metric")):
        if getattr(cfg, field) is not None:
            raise ConfigError(f"PolicyTrainer takes no {field} ({why}): leave it out")
    if cfg.objective != "sft":
        raise ConfigError(f"PolicyTrainer trains GRPO's loss; objective {cfg.objective} is for train()")


def _check_resumed(state: dict, where: Path, record: dict) -> None:
    """The checkpoint to resume is a session's, written with the loss settings ``record``
    holds (the config's are checked as ``train`` checks them)."""
    saved = state.get(POLICY_LOSS)
    if not isinstance(saved, dict):
        objective = state.get("settings", {}).get("objective", "sft")
        raise ConfigError(f"resume {where} was written by train (objective {objective}), not by a PolicyTrainer, and "
                          "a session resumes only its own checkpoints; to start one from its weights, give it as "
                          "model (a new optimizer state)")
    for name, value in record.items():
        if saved.get(name) != value:
            raise ConfigError(f"resume {where}: it was trained with {name}={saved.get(name)!r}, this session has "
                              f"{name}={value!r}; give the same {name} to continue it, or start a new session from "
                              "its weights (as model)")


@dataclass
class _Rows:
    """A call's rows made into the model's: ids right-padded to ``seq_len`` and each
    position's target (the next token where the mask marks it), plus the user's width."""

    ids: torch.Tensor  # (rows, seq_len)
    targets: torch.Tensor  # (rows, seq_len), shifted
    mask: torch.Tensor  # (rows, T) bool, as given
    width: int  # T

    @property
    def tokens(self) -> int:
        return int(self.mask.shape[0] * self.width)

    @classmethod
    def of(cls, input_ids: Any, completion_mask: Any, seq_len: int, vocab: int, batch: int | None = None) -> "_Rows":
        ids = torch.as_tensor(input_ids)
        if ids.ndim != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.numel() == 0:
            raise DataError(f"input_ids must be a (rows, tokens) integer tensor (got {tuple(ids.shape)} {ids.dtype})")
        rows, width = ids.shape
        if batch is not None and rows != batch:
            raise DataError(f"input_ids has {rows} rows; a step takes batch_size {batch} rows (the plan is made for them)")
        if width > seq_len:
            raise DataError(f"input_ids has {width} tokens a row, more than seq_len {seq_len}: give a larger seq_len")
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise DataError(f"input_ids holds ids outside the vocabulary 0..{vocab - 1}")
        if completion_mask is None:
            mask = torch.ones(rows, width, dtype=torch.bool)
            mask[:, 0] = False
        else:
            mask = torch.as_tensor(completion_mask)
            if mask.shape != ids.shape:
                raise DataError(f"completion_mask is {tuple(mask.shape)}, input_ids {tuple(ids.shape)}: give one shape")
            if not bool(((mask == 0) | (mask == 1)).all()):
                raise DataError("completion_mask must hold 0 and 1 (or booleans)")
            mask = mask.bool()
            if bool(mask[:, 0].any()):
                raise DataError("completion_mask marks a row's first token, which has no log-probability (nothing "
                                "comes before it): the prompt comes first")
        ids = ids.to(torch.int64)
        padded = torch.zeros(rows, seq_len, dtype=torch.int64)
        padded[:, :width] = ids
        targets = torch.full((rows, seq_len), IGNORE_INDEX, dtype=torch.int64)
        targets[:, :width - 1] = torch.where(mask[:, 1:], ids[:, 1:], IGNORE_INDEX)
        return cls(padded, targets, mask, width)

    def shifted(self, x: torch.Tensor) -> torch.Tensor:
        """A (rows, T) tensor aligned with the ids, as the targets are: ``(rows, seq_len)``."""
        out = torch.zeros(self.targets.shape, dtype=torch.float32)
        out[:, :self.width - 1] = torch.where(self.mask[:, 1:], x[:, 1:].float(), 0.0)
        return out

    def aligned(self, lp: torch.Tensor) -> torch.Tensor:
        """The model's per-target log-probabilities ``(rows, seq_len)`` aligned with the ids."""
        out = torch.zeros(self.mask.shape, dtype=torch.float32)
        out[:, 1:] = lp[:, :self.width - 1]
        return out * self.mask


def _floats(name: str, value: Any, rows: _Rows, per_row: bool = False) -> torch.Tensor:
    """``value`` ((rows, T), or with ``per_row`` also (rows,)) checked, finite where the mask
    marks, aligned with the targets."""
    x = torch.as_tensor(value, dtype=torch.float32)
    shape = tuple(rows.mask.shape)
    if per_row and x.shape == shape[:1]:
        x = x[:, None].expand(shape)
    if tuple(x.shape) != shape:
        also = f" or ({shape[0]},)" if per_row else ""
        raise DataError(f"{name} is {tuple(x.shape)}; give {shape}{also}, aligned with input_ids")
    if not bool(torch.isfinite(x[rows.mask]).all()):
        raise DataError(f"{name} is not finite at a token completion_mask marks")
    return rows.shifted(x)
