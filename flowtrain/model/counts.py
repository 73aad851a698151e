"""How many FLOPs a trained token costs: the benchmarks' model FLOPs, as MFU counts them.

Integer arithmetic over a :class:`~flowtrain.model.config.ModelConfig`'s sizes and its
parameter counts (``cfg.num_parameters()``, ``cfg.active_parameters()``: a mixture of experts
has two counts, every parameter, which is stored and updated, and the *active* ones a token's
forward multiplies by, which its FLOPs are counted from)::

    cfg = preset("tiny")
    model_flops_per_token(cfg, 128)      # 6 N_matmul + 6 L (heads x head_dim) S

This is the one place the convention is defined; docs/benchmarks.md ("Model FLOPs") states it
for readers, and every report (``flowtrain bench``, ``flowtrain simulate``, the GPU gate) uses it.
"""

from __future__ import annotations

from .config import ModelConfig

__all__ = ["model_flops_per_token"]


def model_flops_per_token(cfg: ModelConfig, seq_len: int, adapter_params: float | None = None) -> float:
    """Model FLOPs per trained token: ``6 N_matmul + 6 L (heads x head_dim) S``.

    ``6 N_matmul``: a forward and a backward multiply-add (2 + 4 FLOPs) per weight a token
    multiplies by. The input embedding is a lookup and is left out; the head is a matrix product
    and counts (a tied head too: the one matrix is counted once, as the head). For a mixture of
    experts only the weights a token's forward uses
    (:meth:`~flowtrain.model.config.ModelConfig.active_parameters`: attention, norms, each sparse
    layer's router and its num_experts_per_tok experts, the dense layers).

    ``6 L (heads x head_dim) S``: causal attention's score and value products (half of the full
    square's 12), over the query heads' width, which can differ from the hidden size (Qwen3-MoE:
    32 heads x 128 against a hidden size of 2,048). On the generic path, L counts the layers
    that attend over the sequence (not linear-attention or state-space layers). Recompute is not
    counted.

    LoRA (``adapter_params``: the adapters' parameters a token multiplies by):
    ``4 N_matmul + 6 N_adapter + 6 L (heads x head_dim) S``. The frozen base costs a forward and
    the backward's input gradients (2 + 2 FLOPs per weight, no weight gradient), the adapters a
    full 6 each; the same count as the all-on-GPU PEFT run's. Over a mixture of experts N_adapter
    too counts the active ones (:func:`flowtrain.plan.adapters.adapter_active_numel`)."""
    n = cfg.active_parameters() if cfg.moe or cfg.generic else cfg.num_parameters()
    n -= 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size  # the lookup
    attention = 6.0 * cfg.attention_layers() * cfg.num_heads * cfg.head_size * seq_len
    if adapter_params is not None:
        return 4.0 * n + 6.0 * adapter_params + attention
    return 6.0 * n + attention
