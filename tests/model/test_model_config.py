"""ModelConfig: Hugging Face config.json in and out, validation, presets and sizes."""

from __future__ import annotations

import msgspec
import pytest
import torch
from model_helpers import LLAMA3_SMALL, hf_config, small_cfg
from transformers import AutoModelForCausalLM

from flowtrain.errors import ConfigError
from flowtrain.model import PRESETS, ModelConfig, RopeScaling, model_flat_maps, preset
from flowtrain.model.hf_config import from_hf, to_hf

VARIANTS = {
    "llama-gqa": small_cfg(),
    "llama-mha-tied": small_cfg(num_kv_heads=4, tie_word_embeddings=True),
    "llama-bias-rope3": small_cfg(attention_bias=True, rope_scaling=LLAMA3_SMALL),
    "llama-head-dim": small_cfg(head_dim=32, eos_token_id=5, bos_token_id=4),
    "mistral": small_cfg(architecture="MistralForCausalLM", rms_norm_eps=1e-6),
    "qwen2": small_cfg(architecture="Qwen2ForCausalLM", qkv_bias=True, rope_theta=1e6),
    "mistral-window": small_cfg(architecture="MistralForCausalLM", sliding_window=16),
    "qwen2-window": small_cfg(architecture="Qwen2ForCausalLM", qkv_bias=True, sliding_window=16,
                              max_window_layers=1),
    "qwen3-head-dim": small_cfg(architecture="Qwen3ForCausalLM", head_dim=32, rms_norm_eps=1e-6),
    "qwen3-bias-tied-window": small_cfg(architecture="Qwen3ForCausalLM", head_dim=8,
                                        attention_bias=True, tie_word_embeddings=True,
                                        sliding_window=64),
    "gemma3-tied": small_cfg(architecture="Gemma3ForCausalLM", head_dim=16, num_layers=3,
                             tie_word_embeddings=True, sliding_window=8, rope_local_theta=5e3,
                             query_pre_attn_scalar=12.0, rope_scaling=RopeScaling("linear", 8.0)),
    "gemma3-untied-bias": small_cfg(architecture="Gemma3ForCausalLM", head_dim=8, attention_bias=True,
                                    layer_types=("full_attention", "sliding_attention")),
}


@pytest.mark.parametrize("name", [*PRESETS, *VARIANTS])
def test_from_hf_inverts_to_hf(name):
    cfg = PRESETS.get(name) or VARIANTS[name]
    assert from_hf(to_hf(cfg)) == cfg


@pytest.mark.parametrize("name", list(VARIANTS))
def test_transformers_reads_to_hf_as_the_same_model(name):
    cfg = VARIANTS[name]
    hc = hf_config(cfg)
    # Gemma 3's text-only model is configured by Gemma3TextConfig.
    family = cfg.architecture.removesuffix("ForCausalLM")
    assert type(hc).__name__.removesuffix("Config") in (family, family + "Text")
    assert hc.head_dim == cfg.head_dim
    # transformers' own serialisation of that config reads back to the same ModelConfig.
    d = hc.to_dict()
    d["architectures"] = [cfg.architecture]
    assert from_hf(d) == cfg


def test_head_dim_defaults_to_hidden_over_heads():
    cfg = ModelConfig(vocab_size=10, hidden_size=48, intermediate_size=8, num_layers=1,
                      num_heads=6, num_kv_heads=3)
    assert cfg.head_dim == 8
    d = to_hf(cfg)
    del d["head_dim"]
    assert from_hf(d).head_dim == 8


def test_from_hf_legacy_rope_keys_and_eos_list():
    cfg = small_cfg(rope_scaling=LLAMA3_SMALL, rope_theta=5e5)
    d = to_hf(cfg)
    del d["rope_parameters"]  # transformers 4 spelling only
    d["rope_scaling"] = {**d["rope_scaling"], "type": d["rope_scaling"].pop("rope_type")}
    d["eos_token_id"] = [7, 9, 11]
    got = from_hf(d)
    assert got.rope_scaling == LLAMA3_SMALL and got.rope_theta == 5e5
    assert got.eos_token_id == 7


def test_from_hf_missing_optional_keys_uses_transformers_defaults():
    d = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16,
         "intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 2}
    cfg = from_hf(d)
    hc = hf_config(cfg)
    assert cfg.num_kv_heads == 2 and cfg.rope_scaling is None
    from transformers import LlamaConfig
    ref = LlamaConfig(**{k: v for k, v in d.items() if k != "architectures"})
    assert cfg.rms_norm_eps == ref.rms_norm_eps == hc.rms_norm_eps
    assert cfg.max_position_embeddings == ref.max_position_embeddings


def _hf(**changes):
    d = to_hf(small_cfg())
    d.update(changes)
    return d


@pytest.mark.parametrize(
    "d, needle",
    [
        (_hf(architectures=["GPT2LMHeadModel"]), "unsupported architecture 'GPT2LMHeadModel'"),
        (_hf(architectures=["Qwen3_5ForConditionalGeneration"]), "give a config.json of its text_config"),
        (_hf(architectures=None, model_type="gpt2"), "unsupported architecture 'gpt2'"),
        ({k: v for k, v in _hf().items() if k != "hidden_size"}, "hidden_size"),
        (_hf(hidden_act="gelu"), "hidden_act 'gelu'"),
        (_hf(mlp_bias=True), "mlp_bias"),
        (_hf(architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=16,
             layer_types=["sliding_attention", "full_attention"]), "layer_types mixes"),
        (_hf(architectures=["MistralForCausalLM"], sliding_window=0), "sliding_window must be"),
        (_hf(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), "'yarn'"),
        (_hf(num_key_value_heads=3), "num_kv_heads 3 does not divide num_heads 4"),
        (_hf(num_attention_heads=5), "num_heads 5 does not divide hidden_size 64"),
        (_hf(head_dim=15), "head_dim 15 is odd"),
    ],
)
def test_from_hf_rejects_with_a_reason(d, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        from_hf(d)


def test_unsupported_message_lists_supported_architectures():
    with pytest.raises(ConfigError) as info:
        from_hf(_hf(architectures=["GPT2LMHeadModel"]))
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in str(info.value)
    assert "\n" not in str(info.value)


def test_mistral_with_window_covering_all_positions_is_accepted():
    d = _hf(architectures=["MistralForCausalLM"], sliding_window=256)
    assert from_hf(d).architecture == "MistralForCausalLM"


@pytest.mark.parametrize("d", [
    _hf(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=16),
    _hf(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=True,
        sliding_window=16, max_window_layers=1),
    _hf(architectures=["Qwen3ForCausalLM"], model_type="qwen3", use_sliding_window=True,
        sliding_window=16, max_window_layers=0),
])
def test_sliding_window_is_read_per_layer(d):
    """The window applies to the layers transformers slides (Mistral: all; Qwen: from
    max_window_layers on); sequences longer than it are trained, only positions bound them."""
    cfg = from_hf(d)
    assert cfg.sliding_window == 16
    assert hf_config(cfg).sliding_window == 16  # written back for transformers
    full = {"MistralForCausalLM": 0, "Qwen2ForCausalLM": 1, "Qwen3ForCausalLM": 0}[cfg.architecture]
    assert [cfg.layer_window(i) for i in range(cfg.num_layers)] == (
        [None] * full + [16] * (cfg.num_layers - full))
    cfg.check_seq_len(32)
    with pytest.raises(ConfigError, match="beyond the model's 256 positions"):
        cfg.check_seq_len(257)


@pytest.mark.parametrize("changes", [
    dict(use_sliding_window=False, sliding_window=16),         # switched off
    dict(use_sliding_window=True, sliding_window=16, max_window_layers=2),  # no layer slides
    dict(use_sliding_window=True, sliding_window=None),
])
def test_qwen_window_that_no_layer_uses_is_dropped(changes):
    for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        cfg = from_hf(_hf(architectures=[arch], **changes))
        assert cfg.sliding_window is None and cfg.max_window_layers == 0
        cfg.check_seq_len(256)


def test_absent_keys_take_each_family_transformers_default():
    """Mistral without a sliding_window key slides over 4096 (MistralConfig's default), with
    an explicit null it does not; Qwen3 without head_dim has 128-wide heads."""
    from transformers import MistralConfig, Qwen3Config

    d = {k: v for k, v in _hf(architectures=["MistralForCausalLM"]).items() if k != "sliding_window"}
    assert from_hf(d).sliding_window == MistralConfig().sliding_window == 4096
    assert from_hf({**d, "sliding_window": None}).sliding_window is None
    d = {k: v for k, v in _hf(architectures=["Qwen3ForCausalLM"]).items()
         if k not in ("head_dim", "attention_bias", "max_position_embeddings")}
    cfg, ref = from_hf(d), Qwen3Config()
    assert cfg.head_dim == ref.head_dim == 128 and cfg.qk_norm and not cfg.has_qkv_bias
    assert cfg.max_position_embeddings == ref.max_position_embeddings


def test_qwen3_attention_bias_is_honoured():
    cfg = from_hf(_hf(architectures=["Qwen3ForCausalLM"], attention_bias=True))
    assert cfg.attention_bias and cfg.has_qkv_bias and cfg.qk_norm


def test_to_hf_refuses_biases_the_architecture_cannot_hold():
    with pytest.raises(ConfigError, match="Qwen2ForCausalLM"):
        to_hf(small_cfg(architecture="Qwen2ForCausalLM"))
    with pytest.raises(ConfigError, match="q/k/v-only"):
        to_hf(small_cfg(qkv_bias=True))
    with pytest.raises(ConfigError, match="q/k/v-only"):
        to_hf(small_cfg(architecture="Qwen3ForCausalLM", qkv_bias=True))
    with pytest.raises(ConfigError, match="cannot express a sliding window"):
        to_hf(small_cfg(sliding_window=16))


def test_preset_unknown_lists_names():
    with pytest.raises(ConfigError) as info:
        preset("llama-70b")
    assert all(name in str(info.value) for name in PRESETS)
    assert preset("tiny") is PRESETS["tiny"]


def test_configs_are_frozen_hashable_and_json_round_trip():
    cfg = PRESETS["llama-1b"]
    with pytest.raises(AttributeError):
        cfg.hidden_size = 1  # type: ignore[misc]
    assert len({cfg, PRESETS["llama-1b"], PRESETS["tiny"]}) == 2
    assert msgspec.json.decode(msgspec.json.encode(cfg), type=ModelConfig) == cfg


@pytest.mark.parametrize("name", list(PRESETS))
def test_num_parameters_matches_transformers_and_layout(name):
    cfg = PRESETS[name]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(cfg))
    hf_count = sum(p.numel() for p in model.parameters())  # tied weights counted once
    assert cfg.num_parameters() == hf_count
    assert sum(e.numel for lay in model_flat_maps(cfg) for e in lay.entries) == hf_count


def test_published_sizes():
    # Published totals: Llama-3.2-1B 1.24B, Llama-3-8B 8.03B, Qwen2.5-14B 14.7B; the 3B
    # preset unties Llama-3.2-3B's head (3.21B + 0.39B).
    assert PRESETS["llama-1b"].num_parameters() == pytest.approx(1.24e9, rel=0.01)
    assert PRESETS["llama-3b"].num_parameters() == pytest.approx(3.6e9, rel=0.01)
    assert PRESETS["llama-8b"].num_parameters() == pytest.approx(8.03e9, rel=0.001)
    assert PRESETS["qwen-14b"].num_parameters() == pytest.approx(14.77e9, rel=0.01)
    assert PRESETS["qwen3-8b"].num_parameters() == pytest.approx(8.19e9, rel=0.001)


def _gemma(**changes):
    d = to_hf(preset("gemma3-1b"))
    d.update(num_hidden_layers=3, layer_types=["sliding_attention"] * 2 + ["full_attention"])
    d.update(changes)
    return d


@pytest.mark.parametrize("changes, message", [
    (dict(final_logit_softcapping=30.0), "sets final_logit_softcapping; flowtrain's Gemma 3 has no soft-capping"),
    (dict(attn_logit_softcapping=50.0), "sets attn_logit_softcapping"),
    (dict(use_bidirectional_attention=True), "trains causal models only"),
    (dict(layer_types=["sliding_attention"]), "layer_types must list"),
    (dict(layer_types=["sliding_attention", "chunked_attention", "full_attention"]), "layer_types must list"),
    (dict(hidden_activation="silu"), "GeGLU MLP supports 'gelu_pytorch_tanh' only"),
])
def test_gemma3_options_flowtrain_lacks_are_refused(changes, message):
    with pytest.raises(ConfigError, match=message):
        from_hf(_gemma(**changes))


def test_gemma3_transformers4_spelling_and_default_pattern():
    """Configs on the Hub spell the local base rope_local_base_freq and the layer pattern as
    sliding_window_pattern; both read as Gemma3TextConfig reads them."""
    d = _gemma(rope_theta=2e6, rope_local_base_freq=7e3, rope_scaling={"rope_type": "linear", "factor": 8.0},
               num_hidden_layers=7, sliding_window_pattern=3)
    del d["rope_parameters"], d["layer_types"]
    cfg = from_hf(d)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling.factor) == (2e6, 7e3, 8.0)
    assert [cfg.layer_window(i) for i in range(7)] == [512, 512, None, 512, 512, None, 512]
    assert [cfg.layer_rope_local(i) for i in range(7)] == [True, True, False, True, True, False, True]
    assert hf_config(cfg).layer_types == list(cfg.layer_types)
