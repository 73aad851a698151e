"""AdamW on the CPU, one unit at a time, exactly as ``torch.optim.AdamW`` defines it.

Each unit's fp32 master weights, Adam moments and step count are flat host tensors; the
update is torch's fused CPU AdamW kernel (``torch._fused_adamw_``), the same kernel
``torch.optim.AdamW(fused=True)`` calls, so learning rate, betas, eps, decoupled weight decay
and bias correction follow torch's definition to the bit. Gradient clipping multiplies the
gradient by ``min(1, max_norm / (total_norm + 1e-6))`` first, as ``clip_grad_norm_`` does.

The learning rate is constant unless a warm-up or schedule says otherwise::

    sched = LRSchedule(lr=3e-4, warmup_steps=100, schedule="cosine", total_steps=1000, min_lr=3e-5)
    sched(step)   # the rate for optimizer step ``step`` (0-based)
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import msgspec
import torch

from ..errors import ConfigError

#: ``--weight-decay-skip``: which parameters get no weight decay.
DECAY_SKIPS = ("none", "norms-biases")
#: A weight is a norm's if a dotted part of its Hugging Face name is a norm module, as Hugging
#: Face's Trainer decides (``input_layernorm``, ``model.norm``, ``q_norm``, ...).
_NORM_PART = re.compile(r"(^|_)norm$|layernorm|rmsnorm")


class AdamWConfig(msgspec.Struct, frozen=True, kw_only=True):
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    grad_clip: float | None = None
    #: ``none``: decay every parameter (one torch AdamW group); ``norms-biases``: not the
    #: weights of norms nor any bias (two groups, as fine-tuning recipes and HF's Trainer do)
    weight_decay_skip: str = "none"

    def validate(self) -> "AdamWConfig":
        b1, b2 = self.betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ConfigError(f"{{betas}} must be two numbers in [0, 1) (got {b1},{b2})", named=True)
        if self.lr < 0 or self.eps < 0 or self.weight_decay < 0:
            raise ConfigError("{lr}, {eps} and {weight_decay} must not be negative", named=True)
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ConfigError(f"{{grad_clip}} must be positive (got {self.grad_clip})", named=True)
        if self.weight_decay_skip not in DECAY_SKIPS:
            raise ConfigError(f"{{weight_decay_skip}} must be one of {', '.join(DECAY_SKIPS)} (got {self.weight_decay_skip!r})", named=True)
        return self


def skips_decay(name: str) -> bool:
    """Whether the parameter called ``name`` (Hugging Face's name) is a norm's weight or a bias."""
    return name.endswith(".bias") or any(_NORM_PART.search(part) for part in name.split(".")[:-1])


def no_decay_ranges(entries, rule: str) -> list[tuple[int, int]]:  # layout entries
    """``[lo, hi)`` element ranges of a unit's flat buffer that ``rule`` exempts from weight
    decay, merged where adjacent (padding between entries is zero and decays to zero anyway)."""
    if rule == "none":
        return []
    out: list[tuple[int, int]] = []
    for e in sorted(entries, key=lambda e: e.offset):
        if skips_decay(e.name):
            if out and out[-1][1] >= e.offset:
                out[-1] = (out[-1][0], e.offset + e.numel)
            else:
                out.append((e.offset, e.offset + e.numel))
    return out


def decay_segments(lo: int, hi: int, no_decay: list[tuple[int, int]]) -> list[tuple[int, int, bool]]:
    """``[lo, hi)`` cut into ``(start, end, decays)`` pieces, relative to ``lo``."""
    out, at = [], lo
    for a, b in no_decay:
        a, b = max(a, lo), min(b, hi)
        if a >= b:
            continue
        if a > at:
            out.append((at - lo, a - lo, True))
        out.append((a - lo, b - lo, False))
        at = b
    if at < hi:
        out.append((at - lo, hi - lo, True))
    return out


class LRSchedule(msgspec.Struct, frozen=True, kw_only=True):
    """Linear warm-up over ``warmup_steps``, then constant or cosine decay to ``min_lr``."""

    lr: float
    warmup_steps: int = 0
    schedule: str = "constant"
    total_steps: int = 1
    min_lr: float = 0.0

    def validate(self) -> "LRSchedule":
        if self.schedule not in ("constant", "cosine", "linear"):
            raise ConfigError(f"{{lr_schedule}} must be constant, cosine or linear (got {self.schedule!r})", named=True)
        if self.warmup_steps < 0:
            raise ConfigError("{warmup_steps} must not be negative", named=True)
        return self

    def with_total_steps(self, total_steps: int) -> "LRSchedule":
        """The same schedule over ``total_steps`` steps (a resume rebuilds the run's own from its
        checkpoint: :func:`flowtrain.ckpt.resume.resumed_schedule`)."""
        return msgspec.structs.replace(self, total_steps=total_steps)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return self.lr
        span = max(self.total_steps - self.warmup_steps, 1)
        frac = min((step - self.warmup_steps) / span, 1.0)
        if self.schedule == "cosine":
            return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1 + math.cos(math.pi * frac))
        return self.lr + (self.min_lr - self.lr) * frac


def clip_coefficient(total_norm: float, max_norm: float | None) -> torch.Tensor:
    """``clip_grad_norm_``'s factor: ``min(1, max_norm / (total_norm + 1e-6))`` in fp32."""
    if max_norm is None:
        return torch.ones((), dtype=torch.float32)
    coef = torch.tensor(max_norm, dtype=torch.float32) / (torch.tensor(total_norm, dtype=torch.float32) + 1e-6)
    return torch.clamp(coef, max=1.0)


def adamw_step(
    master: torch.Tensor,  # (n,) fp32, updated in place
    grad: torch.Tensor,  # (n,) fp32
    exp_avg: torch.Tensor,  # (n,) fp32
    exp_avg_sq: torch.Tensor,  # (n,) fp32
    step: torch.Tensor,  # () fp32 step count, incremented here
    cfg: AdamWConfig,
    lr: float,
    found_inf: torch.Tensor | None = None,  # () fp32 on master's device: 1.0 leaves everything as it was
    no_decay: list[tuple[int, int]] | None = None,  # ranges of ``master`` without weight decay
) -> None:
    """One AdamW update of one flat unit with torch's fused kernel (CPU or CUDA).

    With ``found_inf`` set to 1.0 the kernel returns before touching master, m or v, and the
    step count is taken back down, as ``torch.optim.AdamW`` does under a gradient scaler: the
    decision stays on the device, with no host sync. The ``no_decay`` ranges are updated without
    weight decay, as a second torch parameter group would be (one kernel call per group)."""
    step += 1
    _fused(master, grad, exp_avg, exp_avg_sq, [(0, master.numel(), step)], cfg, lr, 0, no_decay, found_inf)
    if found_inf is not None:
        step -= found_inf


def adamw_pieces(
    master: torch.Tensor,  # (n,) fp32, the whole unit, updated in place where ``pieces`` say
    grad: torch.Tensor,  # fp32 gradient whose element 0 is the unit's element ``grad_lo``
    exp_avg: torch.Tensor,  # (n,) fp32
    exp_avg_sq: torch.Tensor,  # (n,) fp32
    pieces: list[tuple[int, int, torch.Tensor]],  # (lo, hi, step count) in the unit's elements
    cfg: AdamWConfig,
    lr: float,
    *,
    grad_lo: int = 0,
    no_decay: list[tuple[int, int]] | None = None,  # the unit's ranges without weight decay
) -> None:
    """AdamW of some pieces of one flat unit, each piece counting its own steps: what
    ``torch.optim.AdamW`` does for several parameters of which some have no gradient this step
    (those are skipped: weights, moments and step count stay). Pieces that share a step count
    (one parameter cut in several) pass the same count, a tensor or a view of the same element,
    which is incremented once."""
    for step in {s.data_ptr(): s for _, _, s in pieces}.values():
        step += 1
    _fused(master, grad, exp_avg, exp_avg_sq, pieces, cfg, lr, grad_lo, no_decay)


def adamw_experts(
    master: torch.Tensor,  # (n,) fp32: a sparse layer's weights, updated in place
    grad: torch.Tensor,  # (n,) fp32
    exp_avg: torch.Tensor,  # (n,) fp32
    exp_avg_sq: torch.Tensor,  # (n,) fp32
    shared: Sequence[tuple[int, int]],  # what every token uses, on the layer's step count ``step``
    step: torch.Tensor,
    experts: Sequence[Sequence[tuple[int, int]]],  # each expert's pieces, on its count in ``expert_steps``
    expert_steps: torch.Tensor,  # (experts,) fp32
    idle: torch.Tensor,  # (experts,) fp32 on the device: 1.0 where no token reached the expert
    cfg: AdamWConfig,
    lr: float,
    *,
    found_inf: torch.Tensor | None = None,  # () fp32: 1.0 leaves everything as it was
    no_decay: list[tuple[int, int]] | None = None,
) -> None:
    """:func:`adamw_pieces` for a sparse layer whose idle experts are known on the device only:
    each expert is updated by the fused kernel under its own ``found_inf`` (idle, or the step
    not finite), and its step count is taken back down where it was skipped, as
    :func:`adamw_step` does for a whole unit: no host sync."""
    step += 1
    _fused(master, grad, exp_avg, exp_avg_sq, [(lo, hi, step) for lo, hi in shared], cfg, lr, 0, no_decay, found_inf)
    if found_inf is not None:
        step -= found_inf
    skip = idle if found_inf is None else torch.maximum(idle, found_inf)
    expert_steps += 1
    for e, pieces in enumerate(experts):
        _fused(master, grad, exp_avg, exp_avg_sq, [(lo, hi, expert_steps[e]) for lo, hi in pieces], cfg, lr, 0,
               no_decay, skip[e])
    expert_steps -= skip


def _fused(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
           pieces: list[tuple[int, int, torch.Tensor]], cfg: AdamWConfig, lr: float, grad_lo: int,
           no_decay: list[tuple[int, int]] | None, found_inf: torch.Tensor | None = None) -> None:
    """torch's fused AdamW kernel over ``pieces`` (their step counts already incremented), one
    call per weight-decay group."""
    b1, b2 = cfg.betas
    groups: dict[bool, tuple[list[torch.Tensor], ...]] = {}
    for lo, hi, step in pieces:
        for a, b, decays in decay_segments(lo, hi, no_decay or []):
            a, b = lo + a, lo + b
            ps, gs, ms, vs, ss = groups.setdefault(decays, ([], [], [], [], []))
            ps.append(master[a:b])
            gs.append(grad[a - grad_lo : b - grad_lo])
            ms.append(exp_avg[a:b])
            vs.append(exp_avg_sq[a:b])
            ss.append(step)
    for decays, (ps, gs, ms, vs, ss) in groups.items():
        torch._fused_adamw_(ps, gs, ms, vs, [], ss, lr=lr, beta1=b1, beta2=b2,
                            weight_decay=cfg.weight_decay if decays else 0.0, eps=cfg.eps,
                            amsgrad=False, maximize=False, found_inf=found_inf)
