"""The model's math as pure functions of tensors: no modules, no parameters held anywhere.

A decoder layer is ``decoder_layer(x, w, cos, sin, cfg)`` where ``w`` is :func:`bind`'s
dict of views into that layer's flat buffer, so the runtime can stream any layer's weights
into any GPU slot and call the same function. Everything is device and dtype agnostic:
bf16 on a GPU for speed, fp32 on a CPU to check against Hugging Face to ~1e-6::

    cos, sin = rope_tables(cfg, seq, device, dtype)         # (seq, head_dim) each
    x = embed(ids, w_embed["embed_tokens"])                 # (batch, seq, hidden)
    for w in layer_weights:
        x = decoder_layer(x, w, cos, sin, cfg)
    loss_sum, dx, dnorm, dhead = head_loss_and_grads(
        x, w_head["norm"], w_head["lm_head"], targets, cfg.rms_norm_eps, scale=1 / n_tokens)

The head never builds (tokens x vocabulary) logits for a whole micro-batch: with a 128K
vocabulary that is gigabytes. It walks the tokens in chunks and, per chunk, computes the
cross-entropy and its gradients by hand (softmax minus one-hot), so the only large
temporary is one chunk's logits.

Rounding follows Hugging Face's Llama: RMSNorm statistics in fp32, the normalised
activations cast back to the input dtype *before* the weight multiplies them; rotary
tables computed in fp32, then cast.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from flowtrain.model.attention import Documents, self_attention
from flowtrain.model.config import ModelConfig, default_chunk_tokens  # re-exported
from flowtrain.model.gemma import gemma_layer, gemma_rms_norm
from flowtrain.model.mlp import layer_mlp
from flowtrain.model.moe import RouterTap, moe_decoder_layer

__all__ = [
    "IGNORE_INDEX",
    "decoder_layer",
    "default_chunk_tokens",
    "embed",
    "head_loss",
    "head_loss_and_grads",
    "head_token_logprobs",
    "inv_freq",
    "rms_norm",
    "rope_tables",
]

IGNORE_INDEX = -100


# ---------------------------------------------------------------------- rotary embeddings


def inv_freq(cfg: ModelConfig, device: torch.device | str | None = None, local: bool = False) -> Tensor:
    """Rotary inverse frequencies, (head_dim // 2,) fp32, with the configured scaling.
    ``local``: Gemma 3's sliding layers, which rotate with ``rope_local_theta``, unscaled."""
    assert cfg.head_dim is not None
    dim = cfg.head_dim
    theta = cfg.rope_local_theta if local and cfg.rope_local_theta is not None else cfg.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    freq = 1.0 / (theta**exponents)
    rs = cfg.rope_scaling
    if rs is None or local:
        return freq
    if rs.rope_type == "linear":
        return freq / rs.factor
    # Llama 3.1: keep short wavelengths, stretch long ones by `factor`, blend in between.
    wavelength = 2 * math.pi / freq
    long_cutoff = rs.original_max_position_embeddings / rs.low_freq_factor
    short_cutoff = rs.original_max_position_embeddings / rs.high_freq_factor
    stretched = torch.where(wavelength > long_cutoff, freq / rs.factor, freq)
    blend = (rs.original_max_position_embeddings / wavelength - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    blended = (1 - blend) * stretched / rs.factor + blend * stretched
    in_band = (wavelength >= short_cutoff) & (wavelength <= long_cutoff)
    return torch.where(in_band, blended, stretched)


def rope_tables(
    cfg: ModelConfig,
    seq_len: int,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    local: bool = False,
) -> tuple[Tensor, Tensor]:
    """``(cos, sin)``, each (seq_len, head_dim), for positions 0..seq_len-1 (``local``: the
    tables of Gemma 3's sliding layers, see :meth:`ModelConfig.layer_rope_local`).

    Angles are computed in fp32 (bf16 positions would be wrong past 256) and cast last.
    The two halves of head_dim repeat the same frequencies, matching the rotate-half
    convention Hugging Face checkpoints use.
    """
    freq = inv_freq(cfg, device, local)
    positions = torch.arange(seq_len, dtype=torch.int64, device=device).float()
    angles = positions[:, None] * freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


# ---------------------------------------------------------------------- layers


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim: statistics in fp32, cast back to x's dtype, then scaled."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def embed(ids: Tensor, weight: Tensor, multiplier: float | None = None) -> Tensor:
    """Token embedding: ids (batch, seq) int64, weight (vocab, hidden) -> (batch, seq, hidden),
    times ``multiplier`` rounded to the weight's dtype where there is one (Gemma 3:
    :func:`~flowtrain.model.gemma.embed_multiplier`)."""
    out = F.embedding(ids, weight)
    if multiplier is not None:
        out = out * torch.tensor(multiplier, dtype=weight.dtype, device=weight.device)
    return out


def decoder_layer(
    x: Tensor,  # (batch, seq, hidden) compute dtype
    w: Mapping[str, Tensor],  # bind(flat, layer_layout), same dtype and device as x
    cos: Tensor,  # (seq, head_dim) x's dtype, or (batch, 1, seq, head_dim): rotary_for
    sin: Tensor,  # same shape as cos
    cfg: ModelConfig,
    docs: Documents | None = None,
    window: int | None = None,
    router: RouterTap | None = None,
) -> Tensor:
    """One pre-norm Llama block: x + attn(norm(x)), then + SwiGLU(norm(.)). Returns x's shape.

    Qwen3 (``cfg.qk_norm``) also normalises each head of q and k, before the rotation.
    Attention is causal (:func:`~flowtrain.model.attention.attend`): within each
    document of ``docs`` when rows are packed, within the last ``window`` positions in a
    sliding-window layer (``cfg.layer_window(i)``). Padding sits at the right of a row, so
    real tokens never attend to it, and padded positions are dropped from the loss instead.

    Qwen3-MoE and Mixtral (``cfg.moe``) run :func:`~flowtrain.model.moe.moe_decoder_layer`,
    which hands each sparse layer's routing to ``router`` where one is given.
    """
    if cfg.moe:
        return moe_decoder_layer(x, w, cos, sin, cfg, rms_norm, docs, window, router)
    if cfg.family.gemma:
        return gemma_layer(x, w, cos, sin, cfg, docs, window)
    h = rms_norm(x, w["input_layernorm"], cfg.rms_norm_eps)
    x = x + self_attention(h, w, cos, sin, cfg, docs, window, rms_norm)

    h = rms_norm(x, w["post_attention_layernorm"], cfg.rms_norm_eps)
    return x + layer_mlp(h, w, F.silu)


# ---------------------------------------------------------------------- head and loss


def _step(chunk_tokens: int | None, vocab_size: int) -> int:
    step = chunk_tokens if chunk_tokens is not None else default_chunk_tokens(vocab_size)
    if step <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {step}")
    return step


def _logits_and_ce(
    n: Tensor, head_w: Tensor, t: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """fp32 logits (c, vocab), their logsumexp (c,), safe targets (c,), valid mask (c,)."""
    logits = F.linear(n, head_w).float()
    valid = t != IGNORE_INDEX
    safe_t = t.clamp_min(0)
    lse = torch.logsumexp(logits, dim=-1)
    return logits, lse, safe_t, valid


@torch.no_grad()
def head_loss(
    hidden: Tensor,  # (batch, seq, hidden) compute dtype
    norm_w: Tensor,  # (hidden,)
    head_w: Tensor,  # (vocab, hidden); the embedding matrix for tied models
    targets: Tensor,  # (batch, seq) int64, IGNORE_INDEX (-100) = ignore
    eps: float,
    chunk_tokens: int | None = None,
    plus_one: bool = False,
) -> Tensor:
    """Summed cross-entropy over non-ignored targets: a detached fp32 scalar. ``plus_one``:
    the final norm is Gemma 3's (scaled by ``1 + norm_w``, in fp32)."""
    x = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    step = _step(chunk_tokens, head_w.shape[0])
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    norm = gemma_rms_norm if plus_one else rms_norm
    for start in range(0, x.shape[0], step):
        n = norm(x[start : start + step], norm_w, eps)
        logits, lse, safe_t, valid = _logits_and_ce(n, head_w, t[start : start + step])
        picked = logits.gather(1, safe_t[:, None]).squeeze(1)
        total += torch.where(valid, lse - picked, 0.0).sum()
    return total


@torch.no_grad()
def head_token_logprobs(
    hidden: Tensor,  # (batch, seq, hidden) compute dtype
    norm_w: Tensor,  # (hidden,)
    head_w: Tensor,  # (vocab, hidden)
    targets: Tensor,  # (batch, seq) int64, IGNORE_INDEX (-100) = ignore
    eps: float,
    chunk_tokens: int | None = None,
    plus_one: bool = False,
) -> Tensor:
    """Each target's log-probability, ``(batch, seq)`` fp32, 0 where ignored: minus
    :func:`head_loss`'s per-token terms, chunk by chunk (what preference and policy losses
    read; ``plus_one`` as there)."""
    x = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    step = _step(chunk_tokens, head_w.shape[0])
    out = torch.zeros(t.shape, dtype=torch.float32, device=hidden.device)
    norm = gemma_rms_norm if plus_one else rms_norm
    for start in range(0, x.shape[0], step):
        n = norm(x[start : start + step], norm_w, eps)
        logits, lse, safe_t, valid = _logits_and_ce(n, head_w, t[start : start + step])
        picked = logits.gather(1, safe_t[:, None]).squeeze(1)
        out[start : start + step] = torch.where(valid, picked - lse, 0.0)
    return out.view(targets.shape)


@torch.no_grad()
def head_loss_and_grads(
    hidden: Tensor,  # (batch, seq, hidden) compute dtype
    norm_w: Tensor,  # (hidden,)
    head_w: Tensor,  # (vocab, hidden)
    targets: Tensor,  # (batch, seq) int64, already shifted; -100 = ignore
    eps: float,
    scale: float | Tensor,  # a number, or (batch, seq) fp32: one weight per token
    chunk_tokens: int | None = None,
    plus_one: bool = False,
    weight_grads: bool = True,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """Final norm + head + cross-entropy, forward and backward, one token chunk at a time.

    Returns ``(loss_sum, d_hidden, d_norm_w, d_head_w)``: ``loss_sum`` is the unscaled CE
    sum (fp32 scalar); the gradients are of ``loss_sum * scale`` and have their inputs'
    shapes and dtypes. Ignored positions get zero gradient. No host synchronisation.
    Without ``weight_grads`` (a frozen head) the last two are None and not computed.
    ``scale`` may be a tensor of the targets' shape: the gradients are then those of
    ``sum(scale * ce)`` over the tokens (a preference or policy loss's weights, any sign).

    Per chunk of rows ``x`` (c, hidden), with ``r = rsqrt(mean(x^2) + eps)``,
    ``xh = x * r`` and ``n = norm_w * xh``, ``logits = n @ head_w.T``:

    * ``g = scale * (softmax(logits) - onehot(target))`` (zero on ignored rows),
    * ``d_head_w += g.T @ n``, ``d_n = g @ head_w``, ``d_norm_w += sum(d_n * xh)``,
    * ``d_x = r * (d_xh - xh * mean(d_xh * xh))`` with ``d_xh = d_n * norm_w``.

    ``plus_one`` (Gemma 3): ``n = (xh * (1 + norm_w))`` in fp32, cast last; the same
    gradients with ``1 + norm_w`` in place of ``norm_w``.
    """
    dt = hidden.dtype
    x = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    step = _step(chunk_tokens, head_w.shape[0])
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    d_x = torch.empty_like(x)
    d_head = torch.zeros_like(head_w) if weight_grads else None
    d_norm = torch.zeros(norm_w.shape, dtype=torch.float32, device=norm_w.device) if weight_grads else None
    per_token = scale.reshape(-1) if isinstance(scale, Tensor) else None
    for start in range(0, x.shape[0], step):
        xc, tc = x[start : start + step], t[start : start + step]
        xf = xc.float()
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        xh_f = xf * r
        if plus_one:
            w_f = 1.0 + norm_w.float()
            xh, n = xh_f, (xh_f * w_f).to(dt)
        else:
            xh = xh_f.to(dt)
            n = norm_w * xh

        logits, lse, safe_t, valid = _logits_and_ce(n, head_w, tc)
        picked = logits.gather(1, safe_t[:, None]).squeeze(1)
        loss += torch.where(valid, lse - picked, 0.0).sum()

        # softmax - onehot, in place over the fp32 logits, then row weights (0 if ignored).
        probs = logits.sub_(lse[:, None]).exp_()
        probs.scatter_add_(1, safe_t[:, None], torch.full_like(lse[:, None], -1.0))
        weight = scale if per_token is None else per_token[start : start + step]
        probs.mul_((valid.float() * weight)[:, None])
        g = probs.to(dt)
        del logits, probs

        if d_head is not None and d_norm is not None:
            d_head.addmm_(g.t(), n)
        d_n = g @ head_w
        del g
        if d_norm is not None:
            d_norm += (d_n.float() * xh.float()).sum(0)
        d_xh = d_n.float() * w_f if plus_one else (d_n * norm_w).float()
        d_xf = r * (d_xh - xh_f * (d_xh * xh_f).mean(-1, keepdim=True))
        d_x[start : start + step] = d_xf.to(dt)
    return loss, d_x.view_as(hidden), (d_norm.to(norm_w.dtype) if d_norm is not None else None), d_head
