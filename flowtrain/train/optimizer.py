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

import msgspec
import torch

from ..errors import ConfigError


class AdamWConfig(msgspec.Struct, frozen=True, kw_only=True):
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    grad_clip: float | None = None

    def validate(self) -> "AdamWConfig":
        b1, b2 = self.betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ConfigError(f"--betas must be two numbers in [0, 1) (got {b1},{b2})")
        if self.lr < 0 or self.eps < 0 or self.weight_decay < 0:
            raise ConfigError("--lr, --eps and --weight-decay must not be negative")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ConfigError(f"--grad-clip must be positive (got {self.grad_clip})")
        return self


class LRSchedule(msgspec.Struct, frozen=True, kw_only=True):
    """Linear warm-up over ``warmup_steps``, then constant or cosine decay to ``min_lr``."""

    lr: float
    warmup_steps: int = 0
    schedule: str = "constant"
    total_steps: int = 1
    min_lr: float = 0.0

    def validate(self) -> "LRSchedule":
        if self.schedule not in ("constant", "cosine", "linear"):
            raise ConfigError(f"--lr-schedule must be constant, cosine or linear (got {self.schedule!r})")
        if self.warmup_steps < 0:
            raise ConfigError("--warmup-steps must not be negative")
        return self

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
) -> None:
    """One AdamW update of one flat unit with torch's fused kernel (CPU or CUDA).

    With ``found_inf`` set to 1.0 the kernel returns before touching master, m or v, and the
    step count is taken back down, as ``torch.optim.AdamW`` does under a gradient scaler: the
    decision stays on the device, with no host sync."""
    step += 1
    b1, b2 = cfg.betas
    torch._fused_adamw_(
        [master], [grad], [exp_avg], [exp_avg_sq], [], [step],
        lr=lr, beta1=b1, beta2=b2, weight_decay=cfg.weight_decay, eps=cfg.eps, amsgrad=False, maximize=False,
        found_inf=found_inf,
    )
    if found_inf is not None:
        step -= found_inf
