"""Hugging Face checkpoints in and out of flat buffers, and the errors for bad ones."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from flowtrain.ckpt import hf as ckpt
from flowtrain.ckpt.hf import load_into, save_hf
from flowtrain.errors import CheckpointError, ConfigError
from flowtrain.model import RopeScaling, bind, init_unit, model_flat_maps, read_config

sys.path.insert(0, str(Path(__file__).parents[1] / "model"))
from model_helpers import flats_from_hf, hf_model, small_cfg

CONFIGS = {
    "untied": small_cfg(),
    "tied": small_cfg(tie_word_embeddings=True),
    "qwen2": small_cfg(architecture="Qwen2ForCausalLM", qkv_bias=True),
    "attention-bias-head-dim": small_cfg(attention_bias=True, head_dim=32),
    "qwen3": small_cfg(architecture="Qwen3ForCausalLM", head_dim=32),
    "qwen3-bias-tied-window": small_cfg(architecture="Qwen3ForCausalLM", head_dim=8,
                                        attention_bias=True, tie_word_embeddings=True,
                                        sliding_window=32, max_window_layers=1),
    "mistral-window": small_cfg(architecture="MistralForCausalLM", sliding_window=32),
    "gemma3-tied": small_cfg(architecture="Gemma3ForCausalLM", head_dim=16, num_layers=3,
                             tie_word_embeddings=True, sliding_window=8, rope_local_theta=5e3,
                             query_pre_attn_scalar=12.0, rope_scaling=RopeScaling("linear", 8.0)),
    "gemma3-untied-bias": small_cfg(architecture="Gemma3ForCausalLM", head_dim=8, attention_bias=True,
                                    layer_types=("full_attention", "sliding_attention")),
}


def _fresh(cfg, seed, dtype=torch.float32):
    layouts = model_flat_maps(cfg)
    flats = []
    for lay in layouts:
        flat = torch.empty(lay.numel, dtype=dtype)
        init_unit(flat, lay, cfg, seed)
        # Make norms and biases non-trivial so a mix-up between them is visible.
        for e in lay.entries:
            if e.key.endswith(("norm", "_bias")):
                gen = torch.Generator().manual_seed(seed + e.offset)
                flat[e.offset : e.offset + e.numel].normal_(generator=gen)
        flats.append(flat)
    return layouts, flats


def _empty(cfg, dtype=torch.float32):
    layouts = model_flat_maps(cfg)
    return layouts, [torch.full((lay.numel,), float("nan"), dtype=dtype) for lay in layouts]


def _assert_same_weights(model, layouts, flats, dtype=torch.float32):
    state = model.state_dict()
    for lay, flat in zip(layouts, flats):
        for key, view in bind(flat, lay).items():
            ref = state[lay.entry(key).name]
            assert ref.dtype == dtype
            assert torch.equal(ref, view.to(dtype)), lay.entry(key).name


@pytest.mark.parametrize("name", list(CONFIGS))
def test_save_hf_loads_in_transformers(tmp_path, name):
    cfg = CONFIGS[name]
    layouts, flats = _fresh(cfg, seed=1)
    save_hf(tmp_path, cfg, layouts, flats)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(model).__name__ == cfg.architecture
    _assert_same_weights(model, layouts, flats)
    if cfg.tie_word_embeddings:
        assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert read_config(tmp_path) == cfg


def test_save_hf_bf16_in_small_pieces(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt, "_WRITE_PIECE", 100)  # every tensor streams in many pieces
    cfg = CONFIGS["untied"]
    layouts, flats = _fresh(cfg, seed=2)
    save_hf(tmp_path, cfg, layouts, flats, dtype=torch.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    _assert_same_weights(model, layouts, flats, dtype=torch.bfloat16)


def test_save_hf_bf16_flats_streamed_as_is(tmp_path, monkeypatch):
    """With dtype equal to the flats' dtype, bytes go out without conversion copies."""
    cfg = CONFIGS["qwen2"]
    layouts, flats = _fresh(cfg, seed=3, dtype=torch.bfloat16)
    converted = []
    real_to = torch.Tensor.to

    def spy(self, *args, **kwargs):
        out = real_to(self, *args, **kwargs)
        if out.data_ptr() != self.data_ptr():
            converted.append(out.numel())
        return out

    monkeypatch.setattr(torch.Tensor, "to", spy)
    save_hf(tmp_path, cfg, layouts, flats, dtype=torch.bfloat16)
    monkeypatch.undo()
    assert converted == []
    loaded = load_file(tmp_path / "model.safetensors")
    for lay, flat in zip(layouts, flats):
        for e in lay.entries:
            assert torch.equal(loaded[e.name], bind(flat, lay)[e.key])


@pytest.mark.parametrize("name", ["untied", "tied", "qwen2"])
@pytest.mark.parametrize("shard", [None, "20KB"])
def test_load_into_from_transformers_save(tmp_path, name, shard):
    cfg = CONFIGS[name]
    model = hf_model(cfg, seed=4)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(tmp_path, **kwargs)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    assert read_config(tmp_path) == cfg
    layouts, flats = _empty(cfg)
    load_into(tmp_path, cfg, layouts, flats)
    _assert_same_weights(model, layouts, flats)
    # Into bf16 buffers: each tensor cast on the way in.
    layouts, flats16 = _empty(cfg, torch.bfloat16)
    load_into(tmp_path, cfg, layouts, flats16)
    for lay, f32, f16 in zip(layouts, flats_from_hf(model, cfg), flats16):
        for e in lay.entries:
            assert torch.equal(bind(f32, lay)[e.key].to(torch.bfloat16), bind(f16, lay)[e.key])


def test_save_then_load_round_trip(tmp_path):
    cfg = CONFIGS["attention-bias-head-dim"]
    layouts, flats = _fresh(cfg, seed=5)
    save_hf(tmp_path, cfg, layouts, flats)
    _, back = _empty(cfg)
    load_into(tmp_path, cfg, layouts, back)
    for lay, a, b in zip(layouts, flats, back):
        for e in lay.entries:
            assert torch.equal(bind(a, lay)[e.key], bind(b, lay)[e.key])


def test_extra_tensors_are_skipped_and_reported(tmp_path, caplog):
    cfg = CONFIGS["untied"]
    layouts, flats = _fresh(cfg, seed=6)
    save_hf(tmp_path, cfg, layouts, flats)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    tensors["model.something_new.weight"] = torch.ones(3)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    _, back = _empty(cfg)
    with caplog.at_level(logging.WARNING):
        load_into(tmp_path, cfg, layouts, back)
    assert "model.something_new.weight" in caplog.text and "inv_freq" not in caplog.text
    for lay, a, b in zip(layouts, flats, back):
        for e in lay.entries:
            assert torch.equal(bind(a, lay)[e.key], bind(b, lay)[e.key])


# ---------------------------------------------------------------------- errors


@pytest.fixture
def saved(tmp_path):
    cfg = CONFIGS["untied"]
    layouts, flats = _fresh(cfg, seed=7)
    save_hf(tmp_path, cfg, layouts, flats)
    return tmp_path, cfg, layouts


def test_read_config_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        read_config(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no config.json"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match="unsupported architecture 'GPT2LMHeadModel'"):
        read_config(tmp_path)


def test_load_truncated_file(saved):
    path, cfg, layouts = saved
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_into(path, cfg, layouts, _empty(cfg)[1])


def test_load_garbage_file(saved):
    path, cfg, layouts = saved
    (path / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_into(path, cfg, layouts, _empty(cfg)[1])


def test_load_missing_tensor(saved):
    path, cfg, layouts = saved
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    needle = r"'model.layers.1.mlp.up_proj.weight' is missing from .*model.safetensors"
    with pytest.raises(CheckpointError, match=needle):
        load_into(path, cfg, layouts, _empty(cfg)[1])


def test_load_wrong_shape(saved):
    path, _, _ = saved
    other = small_cfg(intermediate_size=96)
    needle = r"gate_proj.weight' in .* has shape \(88, 64\).*\(96, 64\)"
    with pytest.raises(CheckpointError, match=needle):
        load_into(path, other, *_empty(other))


def test_load_untied_needs_lm_head(tmp_path):
    cfg = CONFIGS["tied"]
    save_hf(tmp_path, cfg, *_fresh(cfg, seed=8))
    untied = CONFIGS["untied"]
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load_into(tmp_path, untied, *_empty(untied))


def test_load_sharded_errors(tmp_path):
    cfg = CONFIGS["untied"]
    hf_model(cfg, seed=9).save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.layers.1.self_attn.k_proj.weight"]
    (tmp_path / shard).unlink()
    with pytest.raises(CheckpointError, match=f"shard .*{shard}.* does not exist"):
        load_into(tmp_path, cfg, *_empty(cfg))
    del index["weight_map"]["model.norm.weight"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="'model.norm.weight' is missing from .*index.json"):
        load_into(tmp_path, cfg, *_empty(cfg))


def test_load_without_weights(tmp_path):
    cfg = CONFIGS["untied"]
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="neither model.safetensors.*pytorch_model.bin"):
        load_into(tmp_path, cfg, *_empty(cfg))
    with pytest.raises(CheckpointError, match="does not exist"):
        load_into(tmp_path / "missing", cfg, *_empty(cfg))
