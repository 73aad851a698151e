"""Mixture-of-experts layers: a router sends each token to a few experts, as pure functions.

A sparse decoder layer (Qwen3-MoE, Mixtral) is a Llama block whose MLP is replaced by a
*router* (a linear map from hidden to one logit per expert) and ``num_experts`` small SwiGLU
MLPs. Each token runs through the ``num_experts_per_tok`` experts with the highest routing
probability, and their outputs are summed with those probabilities as weights::

    r = route(h, w["router"], cfg)                  # probs (T, E) fp32, top-k experts and weights
    y = run_experts(h, r, w["experts_gate"], w["experts_up"], w["experts_down"])

Routing follows transformers 5: softmax over the router logits in fp32, top-k, the k weights
renormalised to sum to one (Mixtral always, Qwen3-MoE with ``norm_topk_prob``), then cast back
to the logits' dtype (Qwen3-MoE; Mixtral keeps fp32 and casts each expert's weighted output).

Two ways to run the experts, the same sums:

* :func:`experts_loop`, the exact reference: for each expert that received tokens, gather
  them, run the expert, scale by the routing weight and add back (``index_add``). One small
  GEMM per expert and one host sync (which experts are hit); what runs on the CPU.
* :func:`experts_grouped`: the tokens sorted by expert once per layer, then one grouped GEMM
  per projection (``torch._grouped_mm``: one kernel over every expert's rows), then gathered
  back and summed with their weights. Chosen on CUDA in bf16 on Hopper or newer where torch
  has it (:func:`grouped_available`).

LoRA (:mod:`flowtrain.model.lora`): where the layer's mapping holds adapters of the router or of
the stacked experts (:func:`flowtrain.model.adapters.adapter_flat_maps`), the router's runs as a
linear map's, and each expert's weights get their own low-rank update, unmerged as everywhere:
``x W_e^T + s (x A_e^T) B_e^T`` (:class:`ExpertAdapters`). Both ways above run them, the grouped one
with two more grouped GEMMs per adapted projection.

A layer's forward may also hand its routing to a :data:`RouterTap`, a callable the training
program passes in to collect what the load-balancing loss needs (see
:mod:`flowtrain.train.load_balance`); the layer math itself never adds that loss.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from flowtrain.model.attention import Documents, self_attention
from flowtrain.model.lora import project
from flowtrain.model.mlp import layer_mlp

if TYPE_CHECKING:
    from flowtrain.model.config import ModelConfig

__all__ = ["ExpertAdapters", "RouterTap", "Routing",
           "experts_grouped", "experts_loop", "grouped_available", "grouped_supported", "moe_decoder_layer",
           "route", "run_experts"]

#: Called by a sparse layer's forward with its routing probabilities (tokens, experts) fp32
#: (part of the autograd graph where the layer runs under autograd) and the chosen experts
#: (tokens, k) int64.
RouterTap = Callable[[Tensor, Tensor], None]


@dataclass(frozen=True)
class Routing:
    """One sparse layer's routing of T tokens among E experts."""

    logits: Tensor   # (T, E) the router's output, in the compute dtype
    probs: Tensor    # (T, E) fp32 softmax of the logits
    experts: Tensor  # (T, k) int64: each token's experts, most probable first
    weights: Tensor  # (T, k) each chosen expert's weight: logits' dtype (Qwen3-MoE) or fp32 (Mixtral)


def route(h: Tensor, router_w: Tensor | Mapping[str, Tensor], cfg: ModelConfig) -> Routing:
    """Route the tokens of ``h`` (..., hidden) with ``router_w`` (experts, hidden), or with a
    layer's mapping: its ``router``, and the router's LoRA adapter where it holds one."""
    flat = h.reshape(-1, h.shape[-1])
    logits = F.linear(flat, router_w) if isinstance(router_w, Tensor) else project(flat, router_w, "router")
    probs = torch.softmax(logits.float(), dim=-1)
    top, experts = torch.topk(probs, cfg.num_experts_per_tok, dim=-1)
    if cfg.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    if cfg.family.moe == "qwen3":
        top = top.to(logits.dtype)
    return Routing(logits=logits, probs=probs, experts=experts, weights=top)


@dataclass(frozen=True)
class ExpertAdapters:
    """A sparse layer's LoRA adapters of its stacked experts, each expert's pair along the first
    dimension, in the compute dtype: ``gate_up`` (A (E, r', hidden), B (E, 2 inter, r')), its
    update's first ``inter`` outputs the gate's and the rest the up projection's (transformers'
    ``gate_up_proj``); ``down`` (A (E, r, inter), B (E, hidden, r)); either may be None. ``scale``
    is the 0-d ``alpha / r``."""

    gate_up: tuple[Tensor, Tensor] | None
    down: tuple[Tensor, Tensor] | None
    scale: Tensor

    @classmethod
    def of(cls, w: Mapping[str, Tensor], experts: int, dtype: torch.dtype) -> ExpertAdapters | None:
        """The adapters a layer's mapping holds (None: none), from PEFT's layout of each pair:
        ``A`` (E r, in) expert-major, ``B`` (out, r E) with the expert as its fastest index."""
        def pair(key: str) -> tuple[Tensor, Tensor] | None:
            a = w.get(f"{key}.lora_A")
            if a is None:
                return None
            b = w[f"{key}.lora_B"]
            return (a.to(dtype).view(experts, -1, a.shape[-1]),
                    b.to(dtype).view(b.shape[0], -1, experts).permute(2, 0, 1).contiguous())

        gate_up, down = pair("experts_gate_up"), pair("experts_down")
        if gate_up is None and down is None:
            return None
        return cls(gate_up, down, w["lora_scale"].to(dtype))

    def padded(self, align: int) -> ExpertAdapters:
        """These adapters with each rank padded with zeros to a multiple of ``align`` (the
        grouped GEMM's rows must span a multiple of 16 bytes): the zeros add exact zeros to every
        product, and the padding is made from the adapters, so their gradients are the unpadded
        ones."""
        def pad(p: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor] | None:
            n = -p[0].shape[1] % align if p is not None else 0
            return p if p is None or not n else (F.pad(p[0], (0, 0, 0, n)), F.pad(p[1], (0, n)))

        return ExpertAdapters(pad(self.gate_up), pad(self.down), self.scale)


def _expert(x: Tensor, gate: Tensor, up: Tensor, down: Tensor, lora: ExpertAdapters | None = None,
            e: int = 0) -> Tensor:
    """Expert ``e``'s SwiGLU on its tokens x (n, hidden), with its adapters where ``lora`` has them."""
    if lora is None:
        return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
    g, u = F.linear(x, gate), F.linear(x, up)
    if lora.gate_up is not None:
        d = F.linear(F.linear(x, lora.gate_up[0][e]), lora.gate_up[1][e]) * lora.scale
        g, u = g + d[:, :g.shape[1]], u + d[:, g.shape[1]:]
    h = F.silu(g) * u
    y = F.linear(h, down)
    if lora.down is not None:
        y = y + F.linear(F.linear(h, lora.down[0][e]), lora.down[1][e]) * lora.scale
    return y


@torch.compiler.disable  # data-dependent: which experts, how many rows each (a compiled layer runs it eagerly)
def experts_loop(x: Tensor, r: Routing, gate: Tensor, up: Tensor, down: Tensor,
                 lora: ExpertAdapters | None = None) -> Tensor:
    """The reference: each expert that received tokens runs on them, one after another.

    ``x`` (T, hidden); ``gate``, ``up`` (E, inter, hidden), ``down`` (E, hidden, inter).
    Experts are visited in ascending order and their outputs added into a zeroed (T, hidden)
    output, each token's at most once per expert, as transformers' loop does."""
    out = torch.zeros_like(x)
    hit = torch.bincount(r.experts.reshape(-1), minlength=gate.shape[0]).nonzero().flatten().tolist()
    for e in hit:
        token, slot = torch.where(r.experts == e)
        y = _expert(x[token], gate[e], up[e], down[e], lora, e) * r.weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def grouped_available(x: Tensor) -> bool:
    """Whether :func:`experts_grouped` may run on ``x`` (:func:`grouped_supported` for its
    device and dtype)."""
    return grouped_supported(x.device, x.dtype)


def grouped_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch has ``_grouped_mm`` for ``dtype`` on ``device``: bf16 on a CUDA device of
    compute capability 9.0 or newer (what its kernel supports)."""
    return (hasattr(torch, "_grouped_mm") and device.type == "cuda" and dtype == torch.bfloat16
            and torch.cuda.get_device_capability(device) >= (9, 0))


class _Gather(torch.autograd.Function):
    """``src[index]`` along dim 0 where every row of the result is a different (token, expert)
    pair, whose backward is a gather too, never an atomic scatter-add.

    ``inverse[p]`` is where pair ``p`` (= token ``p // k``, its ``p % k``-th expert) sits in the
    result. The backward reads each pair's gradient back in pair order and, where a source row
    was gathered ``k`` times (the dispatch: ``index = order // k``), sums its ``k`` rows in fp32
    (one rounding) instead of adding them one by one into a bf16 buffer."""

    @staticmethod
    def forward(ctx, src: Tensor, index: Tensor, inverse: Tensor, k: int) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(inverse)
        ctx.k = k
        return src.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        (inverse,) = ctx.saved_tensors
        pairs = grad.index_select(0, inverse)
        if ctx.k == 1:
            return pairs, None, None, None
        return pairs.view(pairs.shape[0] // ctx.k, ctx.k, grad.shape[-1]).sum(dim=1), None, None, None


def experts_grouped(x: Tensor, r: Routing, gate: Tensor, up: Tensor, down: Tensor,
                    lora: ExpertAdapters | None = None) -> Tensor:
    """The same sums as :func:`experts_loop`, with three grouped GEMMs instead of 3 E small ones.

    The T k (token, expert) pairs are sorted by expert once (a stable sort: tokens keep their
    order within an expert); ``offsets[e]`` is where expert e's rows end. The tokens are gathered
    into that order, each projection is one ``torch._grouped_mm`` over every expert's rows, and
    the rows are gathered back into pair order, where each token's k rows are summed with their
    routing weights by one batched product ((1, k) by (k, hidden) per token, fp32 accumulation).
    Both gathers differentiate into gathers (:class:`_Gather`), so neither direction adds rows
    with atomics. Buffers: T k rows of hidden and of 3 x inter, whatever the routing; every
    shape is fixed by T, k and E, so a compiled layer traces it whole. An adapted projection
    adds two grouped GEMMs through its rank (:func:`_grouped_update`)."""
    tokens, k = r.experts.shape
    flat = r.experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    position = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    counts = torch.zeros(gate.shape[0], dtype=torch.int32, device=flat.device)
    offsets = torch.cumsum(counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32)), 0, dtype=torch.int32)
    rows = _Gather.apply(x, order // k, position, k)
    g = torch._grouped_mm(rows, gate.transpose(-2, -1), offs=offsets)
    u = torch._grouped_mm(rows, up.transpose(-2, -1), offs=offsets)
    if lora is not None and lora.gate_up is not None:
        d = _grouped_update(rows, lora.gate_up, lora.scale, offsets)
        g, u = g + d[:, :g.shape[1]], u + d[:, g.shape[1]:]
    h = F.silu(g) * u
    y = torch._grouped_mm(h, down.transpose(-2, -1), offs=offsets)
    if lora is not None and lora.down is not None:
        y = y + _grouped_update(h, lora.down, lora.scale, offsets)
    pairs = _Gather.apply(y, position, order, 1).view(tokens, k, y.shape[-1])
    return torch.bmm(r.weights.to(y.dtype).unsqueeze(1), pairs).view(tokens, y.shape[-1]).to(x.dtype)


def _grouped_update(rows: Tensor, pair: tuple[Tensor, Tensor], scale: Tensor, offsets: Tensor) -> Tensor:
    """``s (x A_e^T) B_e^T`` for rows sorted by expert (``offsets`` as the base's)."""
    a, b = pair
    low = torch._grouped_mm(rows, a.transpose(-2, -1), offs=offsets)
    return torch._grouped_mm(low, b.transpose(-2, -1), offs=offsets) * scale


def run_experts(x: Tensor, r: Routing, gate: Tensor, up: Tensor, down: Tensor,
                lora: ExpertAdapters | None = None) -> Tensor:
    """:func:`experts_grouped` where :func:`grouped_available` (the adapters' ranks padded to its
    16-byte rows), else :func:`experts_loop`."""
    if not grouped_available(x):
        return experts_loop(x, r, gate, up, down, lora)
    return experts_grouped(x, r, gate, up, down, lora.padded(16 // x.element_size()) if lora is not None else None)


@torch.compiler.disable  # a compiled layer calls the tap as it is, without tracing (and guarding on) its state
def _hand_over(router: RouterTap, probs: Tensor, experts: Tensor) -> None:
    router(probs, experts)


def sparse_mlp(h: Tensor, w: Mapping[str, Tensor], cfg: ModelConfig, router: RouterTap | None = None) -> Tensor:
    """A sparse layer's MLP on ``h`` (batch, seq, hidden): route, then run the experts."""
    r = route(h, w, cfg)
    if router is not None:
        _hand_over(router, r.probs, r.experts)
    lora = ExpertAdapters.of(w, cfg.num_experts, h.dtype) if "lora_scale" in w else None
    out = run_experts(h.reshape(-1, h.shape[-1]), r, w["experts_gate"], w["experts_up"], w["experts_down"], lora)
    return out.view_as(h)


def moe_decoder_layer(
    x: Tensor,  # (batch, seq, hidden) compute dtype
    w: Mapping[str, Tensor],  # bind(flat, layer_layout)
    cos: Tensor,
    sin: Tensor,
    cfg: ModelConfig,
    norm: Callable[[Tensor, Tensor, float], Tensor],
    docs: Documents | None = None,
    window: int | None = None,
    router: RouterTap | None = None,
) -> Tensor:
    """One Qwen3-MoE or Mixtral block: x + attn(norm(x)), then + MLP(norm(.)), the MLP sparse
    where the layer has a router (``cfg.layer_sparse``), else the dense SwiGLU."""
    h = norm(x, w["input_layernorm"], cfg.rms_norm_eps)
    x = x + self_attention(h, w, cos, sin, cfg, docs, window, norm)
    h = norm(x, w["post_attention_layernorm"], cfg.rms_norm_eps)
    if "router" not in w:  # Qwen3-MoE's mlp_only_layers and off-step layers
        return x + layer_mlp(h, w, F.silu)
    return x + sparse_mlp(h, w, cfg, router)
