"""How many parameters a model has, and how many FLOPs a trained token costs.

Integer arithmetic over a :class:`~flowtrain.model.config.ModelConfig`'s sizes, nothing
allocated: :meth:`ModelConfig.validate <flowtrain.model.config.ModelConfig.validate>` bounds a
model by its count before anything is sized from it, the planner sizes buffers by layer, and
the benchmarks report model FLOP/s from :func:`model_flops_per_token`. ``ModelConfig`` has a
method for each count (``cfg.num_parameters()`` calls ``num_parameters(cfg)``)::

    cfg = preset("tiny")
    num_parameters(cfg)                  # 123,712: embeddings, layers, the final norm, the head
    model_flops_per_token(cfg, 128)      # 6 N + 6 L h S

A layer is its two RMSNorm weights, the q, k, v and o projections (with their biases and
per-head q/k norms where the family has them) and its MLP: a dense SwiGLU, or a router and
experts (:mod:`flowtrain.model.moe`). A mixture of experts has two counts: every parameter
(what is stored and updated) and the *active* ones a token's forward multiplies by (what its
FLOPs are counted from).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # config.py builds on this module: its count methods call these
    from .config import ModelConfig

__all__ = ["active_parameters", "layer_parameters", "mlp_parameters", "model_flops_per_token", "num_parameters"]


def layer_parameters(cfg: ModelConfig, layer: int | None = None) -> int:
    """Parameters in decoder layer ``layer`` (None: the largest layer; all of a dense
    model's layers are alike). A sparse layer counts its router and every expert."""
    assert cfg.head_dim is not None
    h = cfg.hidden_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    n = 2 * h                        # the two RMSNorm weights
    n += h * q + 2 * h * kv + q * h  # q, k, v, o projections
    n += mlp_parameters(cfg, layer)
    if cfg.has_qkv_bias:
        n += q + 2 * kv
    if cfg.attention_bias:
        n += h
    if cfg.qk_norm:
        n += 2 * cfg.head_dim
    if cfg.family.gemma:
        n += 2 * h                   # the norms after attention and around the MLP
    return n


def mlp_parameters(cfg: ModelConfig, layer: int | None = None, *, active: bool = False) -> int:
    """Parameters of layer ``layer``'s MLP (None: the largest): a dense SwiGLU of
    intermediate_size, or a router and num_experts experts of moe_intermediate_size each.
    ``active``: those one token uses, the router and its num_experts_per_tok experts."""
    h = cfg.hidden_size
    sparse = cfg.layer_sparse(layer) if layer is not None else bool(cfg.sparse_layers())
    if not sparse:
        return 3 * h * cfg.intermediate_size
    experts = cfg.num_experts_per_tok if active else cfg.num_experts
    return h * cfg.num_experts + experts * 3 * h * cfg.moe_intermediate_size


def num_parameters(cfg: ModelConfig) -> int:
    """Total trainable parameters (a tied head counts once, as the embedding)."""
    embed = cfg.vocab_size * cfg.hidden_size
    head = cfg.hidden_size + (0 if cfg.tie_word_embeddings else embed)
    if cfg.moe:
        return embed + sum(layer_parameters(cfg, i) for i in range(cfg.num_layers)) + head
    return embed + cfg.num_layers * layer_parameters(cfg) + head


def active_parameters(cfg: ModelConfig) -> int:
    """Parameters one token's forward uses: for a mixture of experts, every weight but the
    experts it is not routed to (the router and num_experts_per_tok experts per sparse
    layer); for a dense model, :func:`num_parameters`. Model FLOPs count these (6 per
    parameter per token, :func:`model_flops_per_token`)."""
    if not cfg.moe:
        return num_parameters(cfg)
    inactive = sum(mlp_parameters(cfg, i) - mlp_parameters(cfg, i, active=True) for i in cfg.sparse_layers())
    return num_parameters(cfg) - inactive


def model_flops_per_token(cfg: ModelConfig, seq_len: int, adapter_params: float | None = None) -> float:
    """Model FLOPs per trained token, the benchmarks' convention: ``6 N + 6 L h S``.

    ``6 N``: a forward and a backward multiply-add per weight (2 + 4 FLOPs), N counting the
    embedding matrices as the baselines do; ``6 L h S``: causal attention's score and value
    products, half of ``12 L h S``. Recompute is not counted. For a mixture of experts, N is
    the *active* parameters (:func:`active_parameters`: attention, norms, each
    sparse layer's router and the num_experts_per_tok experts a token runs through, the dense
    layers, the embeddings), since a token's forward multiplies by those weights only.

    LoRA (``adapter_params``: the adapters' parameters): ``4 N + 6 N_adapter + 6 L h S``. The
    frozen base costs a forward and the backward's input gradients (2 + 2 FLOPs per weight, no
    weight gradient), the adapters a full 6 each; the same count as the all-on-GPU PEFT run's.
    Over a mixture of experts N_adapter too counts the active ones: of a stacked weight's
    per-expert adapters, the num_experts_per_tok a token reaches
    (:func:`flowtrain.plan.adapters.adapter_active_numel`)."""
    n = active_parameters(cfg) if cfg.moe else num_parameters(cfg)
    attention = 6.0 * cfg.num_layers * cfg.hidden_size * seq_len
    if adapter_params is not None:
        return 4.0 * n + 6.0 * adapter_params + attention
    return 6.0 * n + attention
