"""How many FLOPs a trained token costs: the benchmarks' model FLOPs.

Integer arithmetic over a :class:`~flowtrain.model.config.ModelConfig`'s sizes and its
parameter counts (``cfg.num_parameters()``, ``cfg.active_parameters()``: a mixture of experts
has two counts, every parameter, which is stored and updated, and the *active* ones a token's
forward multiplies by, which its FLOPs are counted from)::

    cfg = preset("tiny")
    model_flops_per_token(cfg, 128)      # 6 N + 6 L h S
"""

from __future__ import annotations

from .config import ModelConfig

__all__ = ["model_flops_per_token"]


def model_flops_per_token(cfg: ModelConfig, seq_len: int, adapter_params: float | None = None) -> float:
    """Model FLOPs per trained token, the benchmarks' convention: ``6 N + 6 L h S``.

    ``6 N``: a forward and a backward multiply-add per weight (2 + 4 FLOPs), N counting the
    embedding matrices as the baselines do; ``6 L h S``: causal attention's score and value
    products, half of ``12 L h S``. Recompute is not counted. For a mixture of experts, N is
    the *active* parameters (:meth:`~flowtrain.model.config.ModelConfig.active_parameters`: attention, norms, each
    sparse layer's router and the num_experts_per_tok experts a token runs through, the dense
    layers, the embeddings), since a token's forward multiplies by those weights only.

    LoRA (``adapter_params``: the adapters' parameters): ``4 N + 6 N_adapter + 6 L h S``. The
    frozen base costs a forward and the backward's input gradients (2 + 2 FLOPs per weight, no
    weight gradient), the adapters a full 6 each; the same count as the all-on-GPU PEFT run's.
    Over a mixture of experts N_adapter too counts the active ones: of a stacked weight's
    per-expert adapters, the num_experts_per_tok a token reaches
    (:func:`flowtrain.plan.adapters.adapter_active_numel`)."""
    n = cfg.active_parameters() if cfg.moe or cfg.generic else cfg.num_parameters()
    attention = 6.0 * cfg.attention_layers() * cfg.hidden_size * seq_len
    if adapter_params is not None:
        return 4.0 * n + 6.0 * adapter_params + attention
    return 6.0 * n + attention
