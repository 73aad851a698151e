"""Device bytes of a mixture-of-experts layer's routing and experts, per token (no torch).

A sparse layer's unit bytes need nothing special: its layout holds the router and every expert
(:func:`flowtrain.model.layout.model_layouts`), so its weight slot, gradient slot and host state
are counted from the layout like any layer's. What differs is the work of its forward and
backward. With T tokens, k experts per token, E experts, hidden h and expert width I:

* routing: the router's logits (T, E) in the compute dtype, their fp32 softmax, the top-k
  indices (int64) and weights (fp32);
* experts: the (token, expert) rows gathered by expert, T k of them whatever the routing
  (a grouped GEMM's buffer; the loop's too, one expert at a time). In the worst case every
  token goes to the same expert, which then holds T rows (a token picks an expert at most
  once), still within the T k: so the bound below holds for any load. Per row: its input,
  its weighted output and the output of ``down`` (3 h), and gate, up, their activation and
  product (4 I), all kept for the backward.

:func:`expert_bytes_per_token` is that sum per token; the planner uses it where a dense layer
counts its MLP's ``4 x intermediate_size`` per token (:func:`flowtrain.plan.memory.layer_work_bytes`,
:func:`flowtrain.plan.memory.kept_bytes_per_token`)::

    expert_bytes_per_token(preset("qwen3-30b-a3b"), 2)   # 8 x (3 x 2048 + 4 x 768) x 2 + ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..model.config import ModelConfig

__all__ = ["dense_mlp_layers", "expert_bytes_per_token"]


def expert_bytes_per_token(cfg: ModelConfig, cbytes: int) -> int:
    """Device bytes one token's routing and expert rows take in a sparse layer (see the module
    docstring); ``cbytes``: bytes per element of the compute dtype."""
    h, k, e, inter = cfg.hidden_size, cfg.num_experts_per_tok, cfg.num_experts, cfg.moe_intermediate_size
    routing = e * (cbytes + 4) + k * (8 + 4)
    return routing + k * cbytes * (3 * h + 4 * inter)


def dense_mlp_layers(cfg: ModelConfig) -> bool:
    """Whether any decoder layer has a dense MLP (every layer of a dense model; a mixture of
    experts' ``mlp_only_layers`` and off-step layers)."""
    return any(not cfg.layer_sparse(i) for i in range(cfg.num_layers))
