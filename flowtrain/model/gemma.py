"""Gemma 3's decoder layer (``Gemma3ForCausalLM``), as pure functions like the Llama layer.

What differs from :func:`~flowtrain.model.functional.decoder_layer`:

* every RMSNorm scales by ``1 + weight`` and does so in fp32 before casting back (Llama
  casts first, then scales); the weights start at zero;
* norms sandwich both halves: ``x + norm(attn(norm(x)))``, then
  ``x + norm(mlp(norm(x)))`` -- four norms per layer, plus q and k normed per head;
* the MLP is GeGLU: ``gelu_tanh(gate(h)) * up(h)``;
* attention scores are scaled by ``query_pre_attn_scalar ** -0.5``; sliding layers see
  ``sliding_window`` positions and rotate with their own base (``rope_local_theta``),
  global layers see everything and rotate with ``rope_theta`` (and its scaling);
* embeddings are multiplied by ``sqrt(hidden_size)`` (rounded to the compute dtype), and the
  head is always the embedding matrix, unscaled.

The per-layer choices (window, rotary tables) are made by the caller from
``cfg.layer_window(i)`` and ``cfg.layer_rope_local(i)``, as for every family.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from flowtrain.model.attention import Documents, self_attention
from flowtrain.model.mlp import gelu_tanh, layer_mlp

if TYPE_CHECKING:
    from flowtrain.model.config import ModelConfig

__all__ = ["embed_multiplier", "gemma_layer", "gemma_rms_norm"]


def gemma_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm scaled by ``1 + weight``, all in fp32, cast back to x's dtype last."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def embed_multiplier(cfg: ModelConfig) -> float | None:
    """What embeddings are multiplied by: ``sqrt(hidden_size)`` for Gemma 3, else None."""
    return math.sqrt(cfg.hidden_size) if cfg.family.gemma else None


def gemma_layer(
    x: Tensor,
    w: Mapping[str, Tensor],
    cos: Tensor,
    sin: Tensor,
    cfg: ModelConfig,
    docs: Documents | None = None,
    window: int | None = None,
) -> Tensor:
    """One Gemma 3 block; arguments as :func:`~flowtrain.model.functional.decoder_layer`."""
    eps = cfg.rms_norm_eps
    h = gemma_rms_norm(x, w["input_layernorm"], eps)
    attn = self_attention(h, w, cos, sin, cfg, docs, window, gemma_rms_norm)
    x = x + gemma_rms_norm(attn, w["post_attention_layernorm"], eps)
    h = gemma_rms_norm(x, w["pre_feedforward_layernorm"], eps)
    mlp = layer_mlp(h, w, gelu_tanh)
    return x + gemma_rms_norm(mlp, w["post_feedforward_layernorm"], eps)
