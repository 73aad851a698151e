"""The final model in the shape a user fine-tuning a pretrained checkpoint expects.

The source is a tiny Llama written by transformers itself, in bf16, with a
``generation_config.json`` and a config key nobody here knows. What flowtrain writes must come
back through ``AutoModelForCausalLM.from_pretrained`` as the trained masters cast to the saved
dtype, keep the config as it was, and shard like ``save_pretrained(max_shard_size=...)``::

    source (bf16) --load--> fp32 masters --"train"--> save_final_model --> out
                                                          | auto: bf16, one file or
                                                          | shards + index
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, LlamaForCausalLM

from flowtrain.ckpt.hf import hf_config_text, load_into, unit_tensors
from flowtrain.ckpt.output import resolve_save_dtype, save_final_model
from flowtrain.errors import ConfigError
from flowtrain.model import preset, read_config
from flowtrain.train.host_state import HostState

EXTRA = {"flowtrain_test_extra": {"kept": [1, 2]}}
DTYPE_KEYS = ("torch_dtype", "dtype")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A tiny Llama saved by transformers in bf16, plus a generation config and an unknown key."""
    d = tmp_path_factory.mktemp("source")
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=88, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(d)
    GenerationConfig(bos_token_id=1, eos_token_id=2, do_sample=True, temperature=0.6, top_p=0.9).save_pretrained(d)
    cfg = json.loads((d / "config.json").read_text())
    assert "bfloat16" in [cfg.get(k) for k in DTYPE_KEYS]
    (d / "config.json").write_text(json.dumps({**cfg, **EXTRA}, indent=2))
    return d


def trained(source: Path) -> HostState:
    """The source's weights loaded into fp32 masters and moved off the bf16 grid (a "step")."""
    state = HostState.create(read_config(source), pin=False)
    state.load_checkpoint(source)
    gen = torch.Generator().manual_seed(1)
    for u in state.units:
        u.master.add_(1e-4 * torch.randn(u.master.shape, generator=gen))
    return state


def masters(state: HostState) -> dict[str, torch.Tensor]:
    return {name: t for u in state.units for name, t in unit_tensors(u.master, u.flat_map)}


def stored_dtypes(out: Path) -> set[str]:
    dtypes = set()
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            names = st.keys()
            dtypes |= {st.get_slice(k).get_dtype() for k in names}
    return dtypes


def assert_loads_as(out: Path, state: HostState, dtype: torch.dtype) -> None:
    model = AutoModelForCausalLM.from_pretrained(out, dtype=dtype)
    sd = model.state_dict()
    for name, t in masters(state).items():
        assert sd[name].dtype == dtype and torch.equal(sd[name], t.to(dtype)), name


def test_auto_saves_in_the_sources_dtype_and_keeps_its_config(source, tmp_path):
    state = trained(source)
    out = save_final_model(state, tmp_path / "out", source)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert stored_dtypes(out) == {"BF16"}
    assert json.loads((out / "config.json").read_text()) == json.loads((source / "config.json").read_text())
    assert (out / "generation_config.json").read_bytes() == (source / "generation_config.json").read_bytes()
    assert_loads_as(out, state, torch.bfloat16)


def test_fp32_on_request_changes_only_the_dtype_in_the_config(source, tmp_path):
    state = trained(source)
    out = save_final_model(state, tmp_path / "out", source, save_dtype="fp32")
    assert stored_dtypes(out) == {"F32"}
    src, got = (json.loads((p / "config.json").read_text()) for p in (source, out))
    assert {k: got.pop(k) for k in DTYPE_KEYS if k in src} == {k: "float32" for k in DTYPE_KEYS if k in src}
    assert got == {k: v for k, v in src.items() if k not in DTYPE_KEYS}
    assert got["flowtrain_test_extra"] == EXTRA["flowtrain_test_extra"]
    assert_loads_as(out, state, torch.float32)


def test_above_the_shard_size_shards_greedily_with_an_index(source, tmp_path):
    state = trained(source)
    sizes = {name: t.numel() * 2 for name, t in masters(state).items()}  # bf16 bytes, in model order
    limit = 3 * max(sizes.values()) // 2
    out = save_final_model(state, tmp_path / "out", source, max_shard_bytes=limit)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    assert index["metadata"]["total_size"] == sum(sizes.values())
    assert list(weight_map) == sorted(sizes) and weight_map.keys() == sizes.keys()
    # greedy in model order: shard numbers never go back, no shard exceeds the limit, and each
    # shard's first tensor would not have fitted into the shard before it
    files = [weight_map[name] for name in sizes]
    n = len(set(files))
    assert n > 2 and sorted(set(files)) == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert files == sorted(files)
    shard_bytes = {f: sum(sizes[k] for k in sizes if weight_map[k] == f) for f in set(files)}
    assert max(shard_bytes.values()) <= limit
    for prev, name in zip(list(sizes), list(sizes)[1:]):
        if weight_map[name] != weight_map[prev]:
            assert shard_bytes[weight_map[prev]] + sizes[name] > limit
    for f in set(files):  # every shard holds exactly the tensors the index gives it
        with safe_open(str(out / f), framework="pt") as st:
            assert set(st.keys()) == {k for k in sizes if weight_map[k] == f}
    assert not (out / "model.safetensors").exists() and stored_dtypes(out) == {"BF16"}
    assert_loads_as(out, state, torch.bfloat16)
    # flowtrain reads its own sharded output back
    back = HostState.create(read_config(out), pin=False)
    load_into(out, back.cfg, back.flat_maps, [u.master for u in back.units])
    got = masters(back)
    for name, t in masters(state).items():
        assert torch.equal(got[name], t.to(torch.bfloat16).float()), name
    assert resolve_save_dtype("auto", out) == torch.bfloat16


def test_at_the_shard_size_one_file_and_just_above_two(source, tmp_path):
    state = trained(source)
    total = sum(t.numel() * 2 for t in masters(state).values())
    one = save_final_model(state, tmp_path / "one", source, max_shard_bytes=total)
    assert sorted(p.name for p in one.glob("model*")) == ["model.safetensors"]
    two = save_final_model(state, tmp_path / "two", source, max_shard_bytes=total - 1)
    assert sorted(p.name for p in two.glob("model*")) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]


def test_a_single_file_model_replaces_a_sharded_one_whole(source, tmp_path):
    state = trained(source)
    out = save_final_model(state, tmp_path / "out", source, max_shard_bytes=20_000)
    assert (out / "model.safetensors.index.json").exists()
    save_final_model(state, out, source)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert_loads_as(out, state, torch.bfloat16)


def test_auto_falls_back_to_the_weights_dtype_then_fp32(source, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(source, bare)
    cfg = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k not in DTYPE_KEYS}))
    assert resolve_save_dtype("auto", bare) == torch.bfloat16
    assert resolve_save_dtype("auto", None) == torch.float32
    assert resolve_save_dtype("fp16", source) == torch.float16


def test_a_preset_saves_fp32_with_flowtraines_own_config(tmp_path):
    state = HostState.create(preset("tiny"), pin=False)
    state.init_random(0)
    out = save_final_model(state, tmp_path / "out", None)
    assert stored_dtypes(out) == {"F32"}
    assert (out / "config.json").read_text() == hf_config_text(state.cfg, torch.float32)


def test_a_bad_dtype_name_is_refused_in_one_line_before_writing(source, tmp_path):
    with pytest.raises(ConfigError) as e:
        save_final_model(trained(source), tmp_path / "out", source, save_dtype="float8")
    assert "\n" not in str(e.value) and str(e.value).startswith("save_dtype ") and "bf16" in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_a_source_config_of_another_model_yields_to_flowtrains_values(source, tmp_path, caplog):
    other = tmp_path / "other"
    other.mkdir()
    cfg = json.loads((source / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 0.125}))
    state = trained(source)
    out = save_final_model(state, tmp_path / "out", None, source_dir=other)
    got = json.loads((out / "config.json").read_text())
    assert got["rms_norm_eps"] == state.cfg.rms_norm_eps and got["flowtrain_test_extra"] == EXTRA["flowtrain_test_extra"]
    assert "does not describe the model saved" in caplog.text
    assert_loads_as(out, state, torch.bfloat16)
