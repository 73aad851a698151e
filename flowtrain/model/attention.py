"""Causal attention over packed documents and sliding windows, exact on every device.

A row of a micro-batch may hold several documents packed end to end (see
:mod:`flowtrain.data.source`): a token must see only earlier tokens *of its own document*, and,
in a sliding-window layer, only the last ``window`` of them (itself included, the way Hugging
Face's Mistral, Qwen and Gemma define ``sliding_window``). :class:`Documents` describes where
the documents of one micro-batch start; :func:`attend` computes attention under those rules::

    docs = Documents.from_positions(positions)      # (batch, seq) int64, 0 at each start
    docs = docs.to(device)                          # once per micro-batch, not per layer
    out = attend(q, k, v, docs, window=4096)        # q (batch, heads, seq, head_dim)

Which kernel runs:

* no documents (``docs`` None: callers pass None where every row is one document, see
  :attr:`Documents.packed`) and no window shorter than the row: SDPA with ``is_causal``,
  exactly what an unpacked run computes. On a GPU, which fused kernel SDPA picks is the run's
  :func:`attention_backends` choice: by default cuDNN's where it can run (on an H200 causal
  GQA attention forward+backward ran at about 500 TFLOP/s with it against about 265-320 with
  flash, PyTorch's default), else flash;
* otherwise on a GPU, when torch has it: variable-length flash attention
  (``torch.nn.attention.varlen``) over the flattened batch, with the document starts as its
  cumulative lengths and the window as its left window, so no (seq x seq) mask is built and
  masked-out blocks are never computed;
* otherwise: SDPA with an explicit boolean mask (batch, 1, seq, seq), the reference the tests
  compare everything else with.

The positions a document's tokens get restart at 0 at its start: :func:`rotary_for` gathers the
rotary tables at those positions so that every document is rotated as if it stood alone.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from flowtrain.model import saved_attention
from flowtrain.model.lora import project

if TYPE_CHECKING:
    from flowtrain.model.config import ModelConfig

__all__ = ["ATTENTION_BACKENDS", "Documents", "attend", "attention_backends", "rotary_for", "self_attention"]

#: ``--attention-backend``: ``auto`` tries cuDNN's fused attention first, then flash (then
#: PyTorch's other kernels); ``flash`` keeps PyTorch's own order (flash first).
ATTENTION_BACKENDS = ("auto", "flash")


#: the run's ``--attention-backend`` while :func:`attention_backends` is entered on CUDA
_BACKEND: str | None = None


@contextlib.contextmanager
def attention_backends(name: str, device_type: str) -> Iterator[None]:
    """While inside, plain causal attention on CUDA prefers the kernels ``name`` (one of
    :data:`ATTENTION_BACKENDS`) orders first, falling back along the order where a kernel
    cannot run a call (a head size, a mask). :func:`attend` applies the order around its SDPA
    call, so a compiled layer traces the order into its graph: a layer compiled under one
    choice is never served from torch's compile cache under the other. Elsewhere it changes
    nothing: the CPU has one kernel."""
    global _BACKEND
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(ATTENTION_BACKENDS)} (got {name!r})")
    before, _BACKEND = _BACKEND, (name if device_type == "cuda" else None)
    try:
        yield
    finally:
        _BACKEND = before


def _kernel_order() -> list[SDPBackend] | None:
    """The run's kernel priority (``--attention-backend``), or None for PyTorch's own."""
    if _BACKEND is None:
        return None
    if _BACKEND == "flash":  # PyTorch's own order
        return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH,
                SDPBackend.CUDNN_ATTENTION]
    return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
            SDPBackend.MATH]


def _causal_sdpa(q: Tensor, k: Tensor, v: Tensor, gqa: bool, scale: float | None) -> Tensor:
    """SDPA with ``is_causal``, under the run's kernel order where one is set; while an
    attention record is open, through :func:`~flowtrain.model.saved_attention.causal`."""
    order = _kernel_order()
    if saved_attention.MODE is not None:
        return saved_attention.causal(q, k, v, gqa, scale, order)
    if order is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale)
    with sdpa_kernel(order, set_priority=True):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale)


@dataclass(frozen=True, eq=False)
class Documents:
    """Where the documents of one micro-batch start.

    ``positions`` (batch, seq) int64 is each token's position inside its document (0 where a
    document starts; every row starts a document). ``cu_seqlens`` int32 are the document
    boundaries in the flattened (batch * seq) token order, ``max_len`` a bound on the longest
    document: what variable-length kernels take. A compiled layer is specialised on shapes and
    ints, and the number of documents changes every micro-batch, so ``max_len`` is the row
    length and ``cu_seqlens`` is padded with empty documents (the total repeated) to a power of
    two entries: a run compiles the layer for a handful of sizes, not for every count. ``count``
    is the number of real documents. Built on the host from CPU positions (no device
    synchronisation later), then moved with :meth:`to`.
    """

    positions: Tensor
    cu_seqlens: Tensor
    max_len: int
    count: int

    @classmethod
    def from_positions(cls, positions: Tensor) -> Documents:
        """From CPU positions (batch, seq); a row always starts a new document."""
        if positions.ndim != 2:
            raise ValueError(f"positions must be (batch, seq), got {tuple(positions.shape)}")
        batch, seq = positions.shape
        flat = positions.reshape(-1)
        starts = flat == 0
        starts[::seq] = True
        idx = torch.nonzero(starts).reshape(-1)
        entries = max(8, 1 << len(idx).bit_length())  # a power of two above count + 1
        cu = torch.full((entries,), batch * seq, dtype=torch.int32)
        cu[: len(idx)] = idx
        return cls(positions, cu, seq, len(idx))

    @property
    def packed(self) -> bool:
        """Whether some row holds more than one document."""
        return self.count > self.positions.shape[0]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Documents:
        return Documents(
            self.positions.to(device, non_blocking=non_blocking),
            self.cu_seqlens.to(device, non_blocking=non_blocking),
            self.max_len,
            self.count,
        )

    def doc_ids(self) -> Tensor:
        """(batch, seq) int64: a document number per token, counted over the whole batch."""
        batch, seq = self.positions.shape
        starts = torch.zeros(batch * seq + 1, dtype=torch.int64, device=self.positions.device)
        starts[self.cu_seqlens.long()] = 1  # the padding entries all mark the end
        return (starts[:-1].cumsum(0) - 1).view(batch, seq)


def rotary_for(cos: Tensor, sin: Tensor, docs: Documents | None) -> tuple[Tensor, Tensor]:
    """Rotary tables for a micro-batch: the (seq, head_dim) tables as they are without
    documents, else gathered at each token's position, (batch, 1, seq, head_dim), to
    broadcast over the heads."""
    if docs is None:
        return cos, sin
    return cos[docs.positions].unsqueeze(1), sin[docs.positions].unsqueeze(1)


def self_attention(
    h: Tensor,  # (batch, seq, hidden): the normed layer input
    w: Mapping[str, Tensor],
    cos: Tensor,
    sin: Tensor,
    cfg: ModelConfig,
    docs: Documents | None,
    window: int | None,
    norm: Callable[[Tensor, Tensor, float], Tensor],
) -> Tensor:
    """The attention half of a decoder layer, up to and including o_proj: projections (with
    their biases where the layer has them), per-head ``norm`` of q and k where the family
    has it (Qwen3, Gemma 3), rotary, :func:`attend`. Returns (batch, seq, hidden)."""
    assert cfg.head_dim is not None
    batch, seq, _ = h.shape
    heads, kv_heads, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = project(h, w, "q_proj", w.get("q_bias")).view(batch, seq, heads, hd)
    k = project(h, w, "k_proj", w.get("k_bias")).view(batch, seq, kv_heads, hd)
    v = project(h, w, "v_proj", w.get("v_bias")).view(batch, seq, kv_heads, hd).transpose(1, 2)
    if cfg.qk_norm:
        q, k = norm(q, w["q_norm"], cfg.rms_norm_eps), norm(k, w["k_norm"], cfg.rms_norm_eps)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    scalar = cfg.query_pre_attn_scalar
    attn = attend(q, k, v, docs, window, scale=None if scalar is None else scalar**-0.5)
    attn = attn.transpose(1, 2).reshape(batch, seq, heads * hd)
    return project(attn, w, "o_proj", w.get("o_bias"))


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding of x (batch, heads, seq, head_dim): cos/sin (seq, head_dim) or
    (batch, 1, seq, head_dim), the rotate-half convention of Hugging Face checkpoints."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


def attend(q: Tensor, k: Tensor, v: Tensor, docs: Documents | None, window: int | None,
           scale: float | None = None) -> Tensor:
    """Causal attention within documents and windows: q (batch, heads, seq, head_dim), k and v
    (batch, kv_heads, seq, head_dim), kv heads shared by groups of query heads. Returns q's
    shape. ``window``: how many positions a token sees, itself included (None: all).
    ``scale`` multiplies the scores (None: head_dim ** -0.5)."""
    if window is not None and window >= q.shape[2]:
        window = None
    if docs is None and window is None:
        return _causal_sdpa(q, k, v, k.shape[1] < q.shape[1], scale)
    if docs is None:
        docs = _whole_rows(q.shape[0], q.shape[2], q.device)
    if q.is_cuda and q.dtype in _FLASH_DTYPES and _varlen_kwargs(window) is not None:
        return _varlen(q, k, v, docs, window, scale)  # traced into a compiled layer
    return _attend_masked(q, k, v, docs, window, scale)


_FLASH_DTYPES = (torch.float16, torch.bfloat16)
"""What the variable-length flash kernel runs; fp32 on a GPU takes the masked reference."""


def _attend_masked(q: Tensor, k: Tensor, v: Tensor, docs: Documents, window: int | None,
                   scale: float | None) -> Tensor:
    """The reference: SDPA with an explicit (batch, 1, seq, seq) mask. Compiled layers call
    it eagerly: its mask depends on the documents' positions."""
    global _MASKED_EAGER
    if _MASKED_EAGER is None:  # made when first needed: torch.compiler loads slowly
        _MASKED_EAGER = torch.compiler.disable(_masked_sdpa)
    return _MASKED_EAGER(q, k, v, docs, window, scale)


_MASKED_EAGER: Callable | None = None


def _masked_sdpa(q: Tensor, k: Tensor, v: Tensor, docs: Documents, window: int | None,
                 scale: float | None) -> Tensor:
    gqa = k.shape[1] < q.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_mask(docs, window), enable_gqa=gqa,
                                          scale=scale)


def _whole_rows(batch: int, seq: int, device: torch.device) -> Documents:
    positions = torch.arange(seq, device=device).expand(batch, seq)
    cu = torch.arange(0, batch * seq + 1, seq, device=device, dtype=torch.int32)
    return Documents(positions, cu, seq, batch)


def _mask(docs: Documents, window: int | None) -> Tensor:
    """(batch, 1, seq, seq) bool: True where query i may attend to key j."""
    ids = docs.doc_ids()
    seq = ids.shape[1]
    i = torch.arange(seq, device=ids.device)
    allowed = i[None, :] <= i[:, None]                      # causal
    if window is not None:
        allowed = allowed & (i[:, None] - i[None, :] < window)
    same = ids[:, :, None] == ids[:, None, :]               # (batch, seq, seq)
    return (same & allowed).unsqueeze(1)


def _varlen_params() -> frozenset[str] | None:
    """The keyword arguments this torch's varlen_attn takes; None where it has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return frozenset(inspect.signature(varlen_attn).parameters)


#: read once at import, so that a compiled layer sees a constant; only where there is a GPU to
#: run the kernel on (importing it loads torch's compiler, a second of every command's start)
_VARLEN_PARAMS = _varlen_params() if torch.cuda.is_available() else None


def _varlen_kwargs(window: int | None) -> dict | None:
    """How to ask this torch's varlen_attn for causal attention with ``window``; None if it
    cannot (then the masked SDPA path runs)."""
    params = _VARLEN_PARAMS
    if params is None:
        return None
    if "window_size" in params:
        return {"window_size": (-1 if window is None else window - 1, 0)}
    if "is_causal" in params and window is None:
        return {"is_causal": True}
    return None


def _varlen(q: Tensor, k: Tensor, v: Tensor, docs: Documents, window: int | None,
            scale: float | None) -> Tensor:
    from torch.nn.attention.varlen import varlen_attn

    batch, heads, seq, hd = q.shape
    kv_heads = k.shape[1]
    kwargs = _varlen_kwargs(window)
    assert kwargs is not None
    if scale is not None:
        kwargs["scale"] = scale
    if kv_heads < heads:
        if "enable_gqa" in _VARLEN_PARAMS:  # type: ignore[operator]
            kwargs["enable_gqa"] = True
        else:
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)

    def tokens(t: Tensor) -> Tensor:  # (batch, h, seq, hd) -> (batch * seq, h, hd)
        return t.transpose(1, 2).reshape(batch * seq, t.shape[1], hd)

    out = cast(Tensor, varlen_attn(tokens(q), tokens(k), tokens(v), docs.cu_seqlens, docs.cu_seqlens,
                                   docs.max_len, docs.max_len, **kwargs))  # the output alone: no lse asked for
    return out.view(batch, seq, heads, hd).transpose(1, 2)
