"""Attention outputs saved in the forward pass, so that the rebuild before backward skips attention.

A layer that recomputes (``--activations recompute`` or ``offload``) runs its forward
twice: in the forward pass without autograd, and again under autograd just before its backward.
At long sequences attention is most of that forward (one sequence of 262,144 tokens through an
8B Llama layer: about 1 s of attention forward in a layer's 5.8 s on an H200), and the fused
kernels' backward needs only q, k and v, which the rebuild makes from the layer input with a few
GEMMs, and the forward's output and log-sum-exp. A layer placed ``attention`` keeps those two
from its forward pass, and its rebuild takes them instead of running the kernel again::

    record = AttentionRecord()
    with recording(record):                        # the forward pass, no autograd
        y = decoder_layer(x, w, ...)               # attend() keeps out and lse in record
    ...
    with replaying(record), torch.enable_grad():   # the rebuild before the layer's backward
        y = decoder_layer(x, w, ...)               # attend() hands back the kept output
        torch.autograd.grad(y, ...)                # its backward reads the kept lse

The cost is device memory: the output is the size of the layer input (``tokens x heads x
head_dim`` in the compute dtype), plus the log-sum-exp, 4 bytes per token and head.

Exactness: the kernel is the one SDPA would pick under the run's kernel order
(``torch._fused_sdp_choice``), called with the arguments SDPA gives it, and asked for the
log-sum-exp as SDPA asks under autograd. The rebuild reads the same layer input and weights as
the forward pass did (Adam runs after the step's backward), so it makes the same q, k and v, and
the backward kernel gets what SDPA's own backward would. On the CPU the gradients are
bit-identical to a plain rebuild (``tests/train/test_saved_attention.py``). On a GPU the forward
pass itself takes the output computed with the log-sum-exp, as the rebuild would, where without
autograd SDPA may ask cuDNN for a variant without it.

Which calls keep anything: plain causal attention (no packed documents, no window shorter than
the row) where SDPA picks cuDNN's kernel or flash (on CUDA with a head size that needs no
padding; on the CPU its flash kernel). Any other call runs as usual and keeps nothing, and its
rebuild runs attention again. :func:`attend` calls :func:`causal` only while a record is open, so
a compiled layer outside recording and replaying traces SDPA as before; inside, the call is a
graph break (eager), which costs little at the lengths where keeping pays.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["AttentionRecord", "causal", "recording", "replaying"]

aten = torch.ops.aten

#: "record" or "replay" while a record is open (read by ``attend``, and traced into a compiled
#: layer as a constant: a layer is compiled once per mode), else None
MODE: str | None = None
#: the open record; read only outside compiled code
_RECORD: AttentionRecord | None = None


class AttentionRecord:
    """One layer's (and micro-batch's) kept attention: the kernel that ran and what its
    backward reads. Empty until a recorded forward keeps something."""

    __slots__ = ("kernel", "saved", "scale")

    def __init__(self) -> None:
        self.kernel: str | None = None  # "cudnn", "flash" or "cpu_flash"
        self.saved: tuple[Any, ...] | None = None  # (out, lse, *the kernel's other outputs)
        self.scale: float | None = None

    @property
    def kept(self) -> bool:
        return self.saved is not None

    def nbytes(self) -> int:
        """Device bytes of the kept tensors (output and log-sum-exp)."""
        if self.saved is None:
            return 0
        return sum(t.untyped_storage().nbytes() for t in self.saved[:2])

    def clear(self) -> None:
        self.kernel = self.saved = None


@contextlib.contextmanager
def _open(mode: str, record: AttentionRecord | None) -> Iterator[None]:
    global MODE, _RECORD
    if record is None:  # nothing to keep or hand back: attention as usual
        yield
        return
    before = MODE, _RECORD
    MODE, _RECORD = mode, record
    try:
        yield
    finally:
        MODE, _RECORD = before


def recording(record: AttentionRecord | None) -> contextlib.AbstractContextManager[None]:
    """While inside, the (one) plain causal attention call keeps its output in ``record``
    (None: nothing changes)."""
    return _open("record", record)


def replaying(record: AttentionRecord | None) -> contextlib.AbstractContextManager[None]:
    """While inside, the attention call hands back what ``record`` kept (if it kept anything)
    and its backward reads the kept log-sum-exp; the record is emptied by that backward (None:
    nothing changes)."""
    return _open("replay", record)


def _kernel(q: Tensor, k: Tensor, v: Tensor, gqa: bool, scale: float | None) -> str | None:
    """The fused kernel SDPA would run for this causal call under the current kernel order, if
    it is one whose output and log-sum-exp can be kept; else None."""
    choice = SDPBackend(torch._fused_sdp_choice(q, k, v, None, 0.0, True, scale=scale, enable_gqa=gqa))
    if choice == SDPBackend.FLASH_ATTENTION:
        if not q.is_cuda:
            return "cpu_flash"
        return "flash" if q.shape[-1] % 8 == 0 else None  # SDPA pads other head sizes
    if choice == SDPBackend.CUDNN_ATTENTION:
        return "cudnn"
    return None


def _forward(kernel: str, q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> tuple[Any, ...]:
    """(out, lse, *rest): the kernel's forward as SDPA calls it under autograd."""
    if kernel == "cudnn":
        out = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=scale)
        return tuple(out[:8])
    if kernel == "flash":
        return tuple(aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)[:8])
    return tuple(aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, attn_mask=None, scale=scale))


def _backward(kernel: str, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, saved: tuple[Any, ...],
              scale: float | None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv): the kernel's backward with the arguments SDPA's own backward passes."""
    if kernel == "cudnn":
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset = saved
        return aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, True, scale=scale)
    if kernel == "flash":
        out, lse, cum_q, cum_k, max_q, max_k, rng, unused = saved
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, rng, unused, scale=scale)
    out, lse = saved
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, True, attn_mask=None, scale=scale)


class _Kept(torch.autograd.Function):
    """Attention whose forward was run in the forward pass: hands back the kept output, and
    its backward is the kernel's backward on the kept output and log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, record):
        ctx.save_for_backward(q, k, v)
        ctx.record = record
        return record.saved[0].detach()

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        record = ctx.record
        dq, dk, dv = _backward(record.kernel, dout, q, k, v, record.saved, record.scale)
        record.clear()
        return dq, dk, dv, None


def _plain(q: Tensor, k: Tensor, v: Tensor, gqa: bool, scale: float | None) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale)


@torch.compiler.disable
def causal(q: Tensor, k: Tensor, v: Tensor, gqa: bool, scale: float | None,
           order: list[SDPBackend] | None) -> Tensor:
    """Causal attention while a record is open (:data:`MODE`): keep the output (``record``)
    or hand back the kept one (``replay``). ``order``: the run's kernel priority, as
    ``attend`` applies it (None: PyTorch's own)."""
    record = _RECORD
    assert record is not None and MODE is not None
    with sdpa_kernel(order, set_priority=True) if order is not None else contextlib.nullcontext():
        if MODE == "replay":
            if record.saved is None:  # nothing was kept: attention runs again
                return _plain(q, k, v, gqa, scale)
            return _Kept.apply(q, k, v, record)
        kernel = _kernel(q, k, v, gqa, scale)
        if kernel is None:
            return _plain(q, k, v, gqa, scale)
        if kernel == "flash" and scale is None:  # SDPA hands flash the scale it computes
            scale = 1.0 / math.sqrt(q.shape[-1])
        record.kernel, record.scale = kernel, scale
        record.saved = _forward(kernel, q, k, v, scale)
        return record.saved[0]
