"""Flat-buffer layouts, bind() views and per-unit initialisation."""

from __future__ import annotations

import pytest
import torch
from model_helpers import hf_config, small_cfg
from transformers import AutoModelForCausalLM

from flowtrain.model import (
    ALIGN,
    bind,
    init_unit,
    model_flat_maps,
    unit_numel_max,
)

CONFIGS = {
    "untied": small_cfg(),
    "tied": small_cfg(tie_word_embeddings=True),
    "attention-bias": small_cfg(attention_bias=True),
    "qwen2": small_cfg(architecture="Qwen2ForCausalLM", qkv_bias=True),
    "head-dim": small_cfg(head_dim=32, intermediate_size=77),
    "qwen3": small_cfg(architecture="Qwen3ForCausalLM", head_dim=32),
    "qwen3-bias-tied": small_cfg(architecture="Qwen3ForCausalLM", head_dim=8, attention_bias=True,
                                 tie_word_embeddings=True),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_layout_names_and_shapes_match_transformers(name):
    cfg = CONFIGS[name]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(cfg))
    state = model.state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the same tensor as the embedding
    entries = [e for lay in model_flat_maps(cfg) for e in lay.entries]
    assert {e.name: e.shape for e in entries} == {k: tuple(v.shape) for k, v in state.items()}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_units_order_keys_and_offsets(name):
    cfg = CONFIGS[name]
    layouts = model_flat_maps(cfg)
    assert [lay.key for lay in layouts] == (
        ["embed"] + [f"layer.{i}" for i in range(cfg.num_layers)] + ["head"]
    )
    assert [lay.layer for lay in layouts[1:-1]] == list(range(cfg.num_layers))
    for lay in layouts:
        end = 0
        for e in lay.entries:
            assert e.offset % ALIGN == 0 and e.offset >= end  # aligned, in order, disjoint
            assert e.numel == torch.Size(e.shape).numel()
            assert e.offset - end < ALIGN  # padding only as much as alignment needs
            end = e.offset + e.numel
        assert lay.numel % ALIGN == 0 and end <= lay.numel < end + ALIGN
    assert unit_numel_max(layouts) == max(lay.numel for lay in layouts)


def test_layer_key_order():
    keys = [e.key for e in model_flat_maps(small_cfg(attention_bias=True))[1].entries]
    assert keys == ["input_layernorm", "q_proj", "k_proj", "v_proj", "q_bias", "k_bias",
                    "v_bias", "o_bias", "o_proj", "post_attention_layernorm", "gate_proj",
                    "up_proj", "down_proj"]
    qwen = model_flat_maps(CONFIGS["qwen2"])[1]
    assert "o_bias" not in [e.key for e in qwen.entries] and qwen.entry("v_bias").shape == (32,)
    qwen3 = model_flat_maps(CONFIGS["qwen3"])[1]
    assert [e.name for e in qwen3.entries if e.key.endswith("_norm")] == [
        "model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"]
    assert qwen3.entry("q_norm").shape == qwen3.entry("k_norm").shape == (32,)
    assert qwen3.entry("q_proj").shape == (4 * 32, 64)
    head = model_flat_maps(CONFIGS["tied"])[-1]
    assert [e.key for e in head.entries] == ["norm"]
    with pytest.raises(KeyError, match="lm_head"):
        head.entry("lm_head")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bind_returns_views_not_copies(dtype):
    lay = model_flat_maps(CONFIGS["attention-bias"])[1]
    flat = torch.zeros(lay.numel + 10, dtype=dtype)
    views = bind(flat, lay)
    for e in lay.entries:
        v = views[e.key]
        assert v.shape == e.shape and v.dtype == dtype and v.is_contiguous()
        assert v.data_ptr() == flat.data_ptr() + e.offset * flat.element_size()
        v.fill_(3.0)
        assert (flat[e.offset : e.offset + e.numel] == 3.0).all()
    with pytest.raises(ValueError, match="at least"):
        bind(torch.zeros(lay.numel - 1), lay)
    with pytest.raises(ValueError, match="1-D"):
        bind(torch.zeros(2, lay.numel), lay)


def _init_all(cfg, seed, dtype=torch.float32, order=None):
    layouts = model_flat_maps(cfg)
    flats = [torch.full((lay.numel,), float("nan"), dtype=dtype) for lay in layouts]
    for k in order or range(len(layouts)):
        init_unit(flats[k], layouts[k], cfg, seed)
    return layouts, flats


@pytest.mark.parametrize("name", ["attention-bias", "qwen3-bias-tied"])
def test_init_values_by_kind(name):
    cfg = CONFIGS[name]
    layouts, flats = _init_all(cfg, seed=1)
    for lay, flat in zip(layouts, flats):
        covered = torch.zeros(lay.numel, dtype=torch.bool)
        for e in lay.entries:
            covered[e.offset : e.offset + e.numel] = True
        assert (flat[~covered] == 0).all()  # alignment padding
        for key, w in bind(flat, lay).items():
            if key.endswith("norm"):
                assert (w == 1).all()
            elif key.endswith("_bias"):
                assert (w == 0).all()
            else:
                # Standard error of a sample std is std/sqrt(2n): these bounds are > 6 sigma.
                assert abs(w.std().item() / cfg.initializer_range - 1) < 6 / (2 * w.numel()) ** 0.5
                assert abs(w.mean().item()) < 6 * cfg.initializer_range / w.numel() ** 0.5


def test_init_is_deterministic_and_order_independent():
    cfg = small_cfg(num_layers=3)
    _, a = _init_all(cfg, seed=7)
    _, b = _init_all(cfg, seed=7, order=[4, 2, 0, 3, 1])
    _, c = _init_all(cfg, seed=8)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert not torch.equal(a[1], c[1])
    assert not torch.equal(a[1], a[2])  # units draw from different streams


def test_init_bf16_is_fp32_rounded():
    cfg = CONFIGS["qwen2"]
    _, f32 = _init_all(cfg, seed=3)
    _, b16 = _init_all(cfg, seed=3, dtype=torch.bfloat16)
    for x, y in zip(f32, b16):
        assert torch.equal(x.to(torch.bfloat16), y)

