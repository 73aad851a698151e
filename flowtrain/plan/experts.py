"""Device bytes of a mixture-of-experts layer's routing and experts, per token (no torch).

A sparse layer's unit bytes need nothing special: its flat map holds the router and every expert
(:func:`flowtrain.model.flat_map.model_flat_maps`), so its weight slot, gradient slot and host state
are counted from the flat map like any layer's. What differs is the work of its forward and
backward. With T tokens, k experts per token, E experts, hidden h and expert width I:

* routing: the router's logits (T, E) in the compute dtype, their fp32 softmax, the top-k
  indices (int64) and weights (fp32);
* experts: the (token, expert) rows gathered by expert, T k of them whatever the routing
  (a grouped GEMM's buffer; the loop's too, one expert at a time). In the worst case every
  token goes to the same expert, which then holds T rows (a token picks an expert at most
  once), still within the T k: so the bound below holds for any load. Each row also has its
  place in expert order and back (two int64 permutations).

What a row costs depends on the phase:

* a layer's backward (:func:`expert_bytes_per_token`): the row's input, the output of ``down``
  and the gradient flowing back through them (3 h), and gate, up, their activation and product
  or their gradients (4 I);
* a kept layer's saved tensors (:func:`expert_kept_bytes_per_token`). The grouped experts
  (bf16 on a GPU of compute capability 9.0 or newer) keep the row's input (for the gate and up
  weight gradients) and its output gathered back into token order (for the routing weights'
  gradient), 2 h; and gate, up, their activation and product (4 I) under eager autograd, where
  inductor's partitioner keeps only gate and up and recomputes the rest (2 I). On the H200, 4
  kept Qwen3-30B-A3B layers at 16,384 tokens per micro-batch measured within a few percent of
  the compiled count. The loop (every other device and dtype, never compiled) keeps what a
  backward works on, 3 h + 4 I; so does a plan for a GPU that is neither here nor named by a
  machine file (:func:`runs_grouped`).

The planner uses them where a dense layer counts its MLP's intermediates per token
(:func:`flowtrain.plan.memory.layer_work_bytes`, :func:`flowtrain.plan.memory.kept_bytes_per_token`)::

    expert_bytes_per_token(preset("qwen3-30b-a3b"), 2)   # 8 x (3 x 2048 + 4 x 768) x 2 + routing
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ..model.config import ModelConfig
    from .request import RunRequest

__all__ = ["dense_mlp_layers", "expert_bytes_per_token", "expert_kept_bytes_per_token", "grouped_experts", "runs_grouped"]


#: Per (token, expert) row: its place in expert order and back (two int64 permutations).
_ORDER_BYTES = 16


def expert_bytes_per_token(cfg: ModelConfig, cbytes: int) -> int:
    """Device bytes one token's routing and expert rows take in a sparse layer (see the module
    docstring); ``cbytes``: bytes per element of the compute dtype."""
    h, k, inter = cfg.hidden_size, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    return _routing_bytes(cfg, cbytes) + k * (cbytes * (3 * h + 4 * inter) + _ORDER_BYTES)


def expert_kept_bytes_per_token(cfg: ModelConfig, cbytes: int, compiled: bool, grouped: bool = True) -> int:
    """Device bytes a kept sparse layer saves per token for its backward: routing and expert
    rows (see the module docstring); ``compiled``: the layer runs through inductor;
    ``grouped``: the experts run as grouped GEMMs (else the loop's count)."""
    if not grouped:
        return expert_bytes_per_token(cfg, cbytes)
    h, k, inter = cfg.hidden_size, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    return _routing_bytes(cfg, cbytes) + k * (cbytes * (2 * h + (2 if compiled else 4) * inter) + _ORDER_BYTES)


def grouped_experts(device_type: str, dtype: torch.dtype) -> bool:
    """Whether a run in ``dtype`` on this computer's ``device_type`` will take the grouped experts
    (:func:`flowtrain.model.moe.grouped_supported`). False where no GPU is here to ask: a plan
    for a GPU elsewhere takes its machine file's word (:func:`runs_grouped`), else counts the
    loop's larger bytes."""
    import torch

    from ..model.moe import grouped_supported

    return device_type == "cuda" and torch.cuda.is_available() and grouped_supported(torch.device("cuda"), dtype)


def runs_grouped(cfg: ModelConfig, req: RunRequest, device_type: str, dtype: Any) -> bool:
    """Whether the run's sparse layers take the grouped experts: on the GPU the request names
    (``req.grouped_experts``, set from ``Machine.grouped_mm`` by a plan for another machine) in
    bf16, else on this computer's GPU (:func:`grouped_experts`). ``dtype``: a ``torch.dtype``
    or anything with its ``itemsize`` (the planner's compute dtypes are bf16 or fp32)."""
    if not cfg.moe:
        return False
    if req.grouped_experts is not None:
        return req.grouped_experts and device_type == "cuda" and dtype.itemsize == 2
    return grouped_experts(device_type, dtype)


def _routing_bytes(cfg: ModelConfig, cbytes: int) -> int:
    """One token's router logits (compute dtype) and fp32 probabilities over every expert,
    and its k chosen experts (int64) and weights (fp32)."""
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    return e * (cbytes + 4) + k * (8 + 4)


def dense_mlp_layers(cfg: ModelConfig) -> bool:
    """Whether any decoder layer has a dense MLP (every layer of a dense model; a mixture of
    experts' ``mlp_only_layers`` and off-step layers)."""
    return any(not cfg.layer_sparse(i) for i in range(cfg.num_layers))
