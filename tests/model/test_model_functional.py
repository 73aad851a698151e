"""Layer math against Hugging Face transformers (fp32, CPU, eager attention).

Each test randomises a transformers model, copies its weights into flat buffers by
checkpoint name and checks flowtrain's pure functions reproduce it to ~1e-6 relative.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from model_helpers import LLAMA3_SMALL, assert_grads_match, flats_from_hf, hf_model, rel_err, small_cfg

from flowtrain.model import (
    RopeScaling,
    bind,
    decoder_layer,
    embed,
    head_loss,
    head_loss_and_grads,
    model_flat_maps,
    rms_norm,
    rope_tables,
)
from flowtrain.model.gemma import embed_multiplier

TOL = 1e-5

CONFIGS = {
    "gqa": small_cfg(),
    "mha": small_cfg(num_kv_heads=4),
    "mqa-llama3-rope": small_cfg(num_kv_heads=1, rope_scaling=LLAMA3_SMALL),
    "gqa-llama3-rope-theta": small_cfg(rope_scaling=LLAMA3_SMALL, rope_theta=5e5),
    "attention-bias": small_cfg(attention_bias=True),
    "qwen2-qkv-bias": small_cfg(architecture="Qwen2ForCausalLM", qkv_bias=True, rope_theta=1e6),
    "head-dim-32": small_cfg(head_dim=32),
    "mistral-mha-head-dim-8": small_cfg(architecture="MistralForCausalLM", num_kv_heads=4,
                                        head_dim=8),
    "tied": small_cfg(tie_word_embeddings=True),
    # Qwen3: per-head q/k norms; 4 heads of 32 make q 128 wide on a 64-wide model.
    "qwen3-head-dim-32": small_cfg(architecture="Qwen3ForCausalLM", head_dim=32, rope_theta=1e6,
                                   rms_norm_eps=1e-6),
    "qwen3-bias-mqa-tied": small_cfg(architecture="Qwen3ForCausalLM", head_dim=8, num_kv_heads=1,
                                     attention_bias=True, tie_word_embeddings=True),
    # Gemma 3: sandwich norms scaled by 1 + w, GeGLU, scaled embeddings, a score scalar other
    # than head_dim, sliding layers (window 7 < seq) with their own rotary base, and global
    # layers with linear rope scaling; layer 2 of 3 is global.
    "gemma3-tied": small_cfg(architecture="Gemma3ForCausalLM", head_dim=16, num_layers=3,
                             rms_norm_eps=1e-6, tie_word_embeddings=True, sliding_window=7,
                             layer_types=("sliding_attention", "full_attention", "sliding_attention"),
                             rope_theta=1e6, rope_local_theta=1e4, query_pre_attn_scalar=24.0,
                             rope_scaling=RopeScaling(rope_type="linear", factor=4.0)),
    "gemma3-untied-bias": small_cfg(architecture="Gemma3ForCausalLM", head_dim=32, num_layers=2,
                                    attention_bias=True, sliding_window=5),
}


def _capture(model):
    """Hooks recording each decoder layer's input/output and the rotary (cos, sin)."""
    seen = {"layers": [], "rope": None}

    def on_layer(module, args, kwargs, out):
        x = args[0] if args else kwargs["hidden_states"]
        y = out[0] if isinstance(out, tuple) else out
        seen["layers"].append((x.detach().clone(), y.detach().clone()))

    def on_rope(module, args, out):
        seen["rope"] = tuple(t.detach().clone() for t in out)

    for layer in model.model.layers:
        layer.register_forward_hook(on_layer, with_kwargs=True)
    model.model.rotary_emb.register_forward_hook(on_rope)
    return seen


def _ids(cfg, batch, seq, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_decoder_layer_matches_transformers(name):
    cfg = CONFIGS[name]
    model = hf_model(cfg, seed=11)
    seen = _capture(model)
    seq = 40
    with torch.no_grad():
        model(_ids(cfg, 3, seq, seed=12))
    if not cfg.family.gemma:  # Gemma's two tables are checked through its layers below
        hf_cos, hf_sin = seen["rope"]
        cos, sin = rope_tables(cfg, seq, "cpu")
        assert cos.shape == (seq, cfg.head_dim)
        assert rel_err(cos, hf_cos[0]) < 1e-6 and rel_err(sin, hf_sin[0]) < 1e-6

    layouts, flats = model_flat_maps(cfg), flats_from_hf(model, cfg)
    assert len(seen["layers"]) == cfg.num_layers
    for i, (x, ref) in enumerate(seen["layers"]):
        cos, sin = rope_tables(cfg, seq, "cpu", local=cfg.layer_rope_local(i))
        with torch.no_grad():
            y = decoder_layer(x, bind(flats[1 + i], layouts[1 + i]), cos, sin, cfg, None,
                              cfg.layer_window(i))
        assert y.shape == x.shape and y.dtype == x.dtype
        assert rel_err(y, ref) < TOL
        assert rel_err(y - x, ref - x) < TOL  # the layer's own contribution, not the residual


def test_llama3_scaling_changes_the_tables():
    # Guards the test above: with this config the scaled and unscaled rotations differ.
    plain, scaled = small_cfg(), small_cfg(rope_scaling=LLAMA3_SMALL)
    assert rel_err(rope_tables(scaled, 200)[1], rope_tables(plain, 200)[1]) > 0.05


def test_rope_tables_dtype_cast_last():
    cfg = small_cfg(rope_scaling=LLAMA3_SMALL)
    cos32, sin32 = rope_tables(cfg, 300)
    cos16, sin16 = rope_tables(cfg, 300, dtype=torch.bfloat16)
    assert cos16.dtype == torch.bfloat16
    assert torch.equal(cos16, cos32.to(torch.bfloat16))
    assert torch.equal(sin16, sin32.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(5)
    x = (3 * torch.randn(4, 7, 64, generator=gen)).to(dtype)
    ref = LlamaRMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(1 + torch.randn(64, generator=gen))
        assert torch.equal(rms_norm(x, ref.weight, 1e-5), ref(x))


def _layers(cfg, w, ids):
    """Embedding and every decoder layer, each with its own window and rotary tables."""
    x = embed(ids, w[0]["embed_tokens"], embed_multiplier(cfg))
    for i, wl in enumerate(w[1:-1]):
        cos, sin = rope_tables(cfg, ids.shape[1], local=cfg.layer_rope_local(i))
        x = decoder_layer(x, wl, cos, sin, cfg, None, cfg.layer_window(i))
    return x


@pytest.mark.parametrize("name", ["gqa", "qwen2-qkv-bias", "tied", "qwen3-head-dim-32",
                                  "qwen3-bias-mqa-tied", "gemma3-tied", "gemma3-untied-bias"])
def test_full_forward_loss_matches_transformers(name):
    cfg = CONFIGS[name]
    model = hf_model(cfg, seed=21)
    batch, seq = 3, 33
    ids = _ids(cfg, batch, seq, seed=22)
    # Right padding: row 1 has 20 real tokens; padded positions are excluded from the loss.
    targets = torch.cat([ids[:, 1:], torch.full((batch, 1), -100)], dim=1)
    targets[1, 19:] = -100
    with torch.no_grad():
        logits = model(ids).logits
    ref = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1),
                          ignore_index=-100, reduction="sum")

    layouts, flats = model_flat_maps(cfg), flats_from_hf(model, cfg)
    w = [bind(f, lay) for f, lay in zip(flats, layouts)]
    with torch.no_grad():
        x = _layers(cfg, w, ids)
    head_w = w[0]["embed_tokens"] if cfg.tie_word_embeddings else w[-1]["lm_head"]
    for chunk in (None, 10, 1000):
        loss = head_loss(x, w[-1]["norm"], head_w, targets, cfg.rms_norm_eps, chunk,
                         plus_one=cfg.family.gemma)
        assert loss.dtype == torch.float32 and loss.shape == ()
        assert rel_err(loss, ref) < TOL
    # Real tokens do not see later padding: the padded row's loss matches an unpadded run.
    with torch.no_grad():
        short = model(ids[1:2, :20]).logits[0, :19]
    ref_row = F.cross_entropy(short, ids[1, 1:20], reduction="sum")
    row = head_loss(x[1:2], w[-1]["norm"], head_w, targets[1:2], cfg.rms_norm_eps,
                    plus_one=cfg.family.gemma)
    assert rel_err(row, ref_row) < TOL


def _reference_head(hidden, norm_w, head_w, targets, eps, scale):
    """Unchunked autograd reference built from transformers' RMSNorm."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(hidden.shape[-1], eps=eps).to(hidden.dtype)
    h = hidden.detach().clone().requires_grad_()
    hw = head_w.detach().clone().requires_grad_()
    with torch.no_grad():
        norm.weight.copy_(norm_w)
    logits = F.linear(norm(h), hw).float()
    loss = F.cross_entropy(logits.reshape(-1, hw.shape[0]), targets.reshape(-1),
                           ignore_index=-100, reduction="sum")
    (loss * scale).backward()
    return loss.detach(), h.grad, norm.weight.grad, hw.grad


def _head_inputs(seed, batch=3, seq=13, hidden=48, vocab=70, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    hidden_states = (2 * torch.randn(batch, seq, hidden, generator=gen)).to(dtype)
    norm_w = (1 + 0.3 * torch.randn(hidden, generator=gen)).to(dtype)
    head_w = (0.2 * torch.randn(vocab, hidden, generator=gen)).to(dtype)
    targets = torch.randint(0, vocab, (batch, seq), generator=gen)
    targets[torch.rand(batch, seq, generator=gen) < 0.2] = -100
    targets[1] = -100  # a row with nothing to predict
    return hidden_states, norm_w, head_w, targets


@pytest.mark.parametrize("chunk", [1, 4, 7, 13, 16, 39, 1000, None])
def test_head_loss_and_grads_match_autograd(chunk):
    hidden, norm_w, head_w, targets = _head_inputs(seed=chunk or 0)
    scale = 1 / 17.0
    ref = _reference_head(hidden, norm_w, head_w, targets, 1e-5, scale)
    got = head_loss_and_grads(hidden, norm_w, head_w, targets, 1e-5, scale, chunk_tokens=chunk)
    names = ("loss_sum", "d_hidden", "d_norm_w", "d_head_w")
    for name, g, r in zip(names, got, ref):
        assert g.shape == r.shape and not g.requires_grad, name
        assert rel_err(g, r) < TOL, name
    assert got[0].dtype == torch.float32
    assert (got[1][1] == 0).all()  # the fully ignored row gets no gradient
    forward_only = head_loss(hidden, norm_w, head_w, targets, 1e-5, chunk)
    assert rel_err(forward_only, ref[0]) < 1e-6


def test_head_all_ignored_gives_zero_not_nan():
    hidden, norm_w, head_w, targets = _head_inputs(seed=3)
    targets[:] = -100
    loss, dh, dn, dw = head_loss_and_grads(hidden, norm_w, head_w, targets, 1e-5, 1.0, 5)
    assert loss.item() == 0 and not dh.any() and not dn.any() and not dw.any()


def test_head_bf16_dtypes_and_accuracy():
    hidden, norm_w, head_w, targets = _head_inputs(seed=4, dtype=torch.bfloat16)
    got = head_loss_and_grads(hidden, norm_w, head_w, targets, 1e-5, 0.1, chunk_tokens=8)
    ref = _reference_head(hidden.float(), norm_w.float(), head_w.float(), targets, 1e-5, 0.1)
    assert [t.dtype for t in got] == [torch.float32, torch.bfloat16, torch.bfloat16, torch.bfloat16]
    for g, r in zip(got, ref):
        assert rel_err(g, r) < 2e-2


def test_head_never_builds_full_logits(monkeypatch):
    hidden, norm_w, head_w, targets = _head_inputs(seed=6, batch=4, seq=25)
    vocab, widest = head_w.shape[0], []
    real_linear = F.linear

    def spy(x, w, b=None):
        out = real_linear(x, w, b)
        if out.shape[-1] == vocab:
            widest.append(out.numel() // vocab)
        return out

    monkeypatch.setattr(F, "linear", spy)
    head_loss_and_grads(hidden, norm_w, head_w, targets, 1e-5, 1.0, chunk_tokens=16)
    head_loss(hidden, norm_w, head_w, targets, 1e-5, chunk_tokens=16)
    assert widest and max(widest) <= 16


@pytest.mark.parametrize("name", ["attention-bias", "qwen3-head-dim-32", "gemma3-tied",
                                  "gemma3-untied-bias"])
def test_end_to_end_gradients_match_transformers(name):
    """Backprop through head_loss_and_grads and autograd over decoder_layer gives HF's grads."""
    cfg = CONFIGS[name]
    model = hf_model(cfg, seed=31)
    batch, seq = 2, 17
    ids = _ids(cfg, batch, seq, seed=32)
    targets = torch.cat([ids[:, 1:], torch.full((batch, 1), -100)], dim=1)
    targets[0, 10:] = -100
    scale = 1 / (targets != -100).sum().item()
    logits = model(ids).logits
    ref = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1),
                          ignore_index=-100, reduction="sum")
    (ref * scale).backward()

    layouts, flats = model_flat_maps(cfg), flats_from_hf(model, cfg)
    flats = [f.requires_grad_() for f in flats]
    w = [bind(f, lay) for f, lay in zip(flats, layouts)]
    x = _layers(cfg, w, ids)
    head_w = w[0]["embed_tokens"] if cfg.tie_word_embeddings else w[-1]["lm_head"]
    loss, dx, dnorm, dhead = head_loss_and_grads(
        x, w[-1]["norm"], head_w, targets, cfg.rms_norm_eps, scale, chunk_tokens=9,
        plus_one=cfg.family.gemma)
    torch.autograd.backward([x, w[-1]["norm"], head_w], [dx, dnorm, dhead])
    assert rel_err(loss, ref.detach()) < TOL
    assert_grads_match(model, layouts, flats, TOL)
