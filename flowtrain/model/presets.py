"""The model shapes flowtrain knows by name: ``--model llama-8b`` and the like.

Each preset is a :class:`~flowtrain.model.config.ModelConfig` with a real model's shape (and
no weights: a preset trains from a random initialisation, or is planned and simulated), from
``tiny`` (trains on a CPU in seconds) to ``qwen3-235b-a22b`` (for ``plan`` and ``simulate``)::

    preset("llama-8b").num_parameters()     # 8,030,261,248
    preset("nosuch")                        # ConfigError: unknown model preset 'nosuch'; choose one of ...
"""

from __future__ import annotations

import msgspec

from ..errors import ConfigError
from .config import ModelConfig, RopeScaling

__all__ = ["HF_PRESETS", "PRESETS", "preset"]

_LLAMA3_SCALING = RopeScaling(
    rope_type="llama3",
    factor=32.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)

PRESETS: dict[str, ModelConfig] = {
    # Byte-level vocabulary, trains on a CPU in seconds; for tests and smoke runs.
    "tiny": ModelConfig(
        vocab_size=256, hidden_size=64, intermediate_size=172, num_layers=2,
        num_heads=4, num_kv_heads=2, max_position_embeddings=1024,
    ),
    # Qwen2.5-0.5B's shape (tied): the smallest real-size model, for CPU runs of a real shape.
    "qwen-0.5b": ModelConfig(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
        num_heads=14, num_kv_heads=2, qkv_bias=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=32768, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151643,
        architecture="Qwen2ForCausalLM",
    ),
    # Llama-3.2-1B's shape.
    "llama-1b": ModelConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
        num_heads=32, num_kv_heads=8, rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING,
        max_position_embeddings=131072, tie_word_embeddings=True,
        bos_token_id=128000, eos_token_id=128001,
    ),
    # Llama-3.2-3B's shape with an untied head.
    "llama-3b": ModelConfig(
        vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_layers=28,
        num_heads=24, num_kv_heads=8, rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING,
        max_position_embeddings=131072, bos_token_id=128000, eos_token_id=128001,
    ),
    # Llama-3-8B.
    "llama-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, rope_theta=500000.0, max_position_embeddings=8192,
        bos_token_id=128000, eos_token_id=128001,
    ),
    # Qwen2.5-7B's shape (untied): the system this project follows measures itself on it.
    "qwen2.5-7b": ModelConfig(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
        num_heads=28, num_kv_heads=4, qkv_bias=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=32768, bos_token_id=151643, eos_token_id=151643,
        architecture="Qwen2ForCausalLM",
    ),
    # Qwen2.5-14B's shape.
    "qwen-14b": ModelConfig(
        vocab_size=152064, hidden_size=5120, intermediate_size=13824, num_layers=48,
        num_heads=40, num_kv_heads=8, qkv_bias=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=32768, bos_token_id=151643, eos_token_id=151643,
        architecture="Qwen2ForCausalLM",
    ),
    # Qwen2.5-32B's shape (64 GB in bf16: a LoRA base, --lora-rank).
    "qwen2.5-32b": ModelConfig(
        vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_layers=64,
        num_heads=40, num_kv_heads=8, qkv_bias=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=32768, bos_token_id=151643, eos_token_id=151643,
        architecture="Qwen2ForCausalLM",
    ),
    # Qwen3-8B's shape: per-head q/k norms, untied.
    "qwen3-8b": ModelConfig(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645,
        architecture="Qwen3ForCausalLM",
    ),
    # Gemma-3-1B's shape: five sliding layers (window 512) per global one, tied.
    "gemma3-1b": ModelConfig(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_layers=26,
        num_heads=4, num_kv_heads=1, head_dim=256, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=32768, tie_word_embeddings=True, bos_token_id=2, eos_token_id=1,
        pad_token_id=0, architecture="Gemma3ForCausalLM", sliding_window=512,
        rope_local_theta=10000.0, query_pre_attn_scalar=256.0,
    ),
}


#: Qwen3-30B-A3B's shape: 48 layers of 128 experts (768 wide), 8 per token, renormalised.
PRESETS["qwen3-30b-a3b"] = ModelConfig(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48,
    num_heads=32, num_kv_heads=4, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
    max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645,
    architecture="Qwen3MoeForCausalLM", num_experts=128, num_experts_per_tok=8,
    moe_intermediate_size=768, norm_topk_prob=True, router_aux_loss_coef=0.001,
)
#: The same layer, 12 of them: Qwen3-30B-A3B's expert shapes at a quarter of its depth.
PRESETS["qwen3-moe-12l"] = msgspec.structs.replace(PRESETS["qwen3-30b-a3b"], num_layers=12)
#: Qwen3-235B-A22B's shape (for plan and simulate: 2.8 TB of host state): 94 layers of 128
#: experts (1536 wide), 8 per token.
PRESETS["qwen3-235b-a22b"] = msgspec.structs.replace(
    PRESETS["qwen3-30b-a3b"], hidden_size=4096, intermediate_size=12288, num_layers=94, num_heads=64,
    moe_intermediate_size=1536)
#: Mixtral-8x7B's shape: 32 layers of 8 experts (14336 wide), 2 per token.
PRESETS["mixtral-8x7b"] = ModelConfig(
    vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
    num_heads=32, num_kv_heads=8, rope_theta=1000000.0, rms_norm_eps=1e-5,
    max_position_embeddings=32768, bos_token_id=1, eos_token_id=2,
    architecture="MixtralForCausalLM", num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=14336, norm_topk_prob=True, router_aux_loss_coef=0.02,
)
#: Four of Mixtral-8x7B's layers.
PRESETS["mixtral-4l"] = msgspec.structs.replace(PRESETS["mixtral-8x7b"], num_layers=4)


def _long_context(base: ModelConfig, positions: int) -> ModelConfig:
    """``base`` with Llama 3.1's rope scaling stretched from 8,192 original positions to
    ``positions`` (factor positions / 8192): a shape for long-context training."""
    scaling = RopeScaling(rope_type="llama3", factor=positions / 8192, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)
    return msgspec.structs.replace(base, rope_scaling=scaling, max_position_embeddings=positions)


#: One sequence of up to 262,144 tokens on Llama-3-8B's shape, 524,288 on llama-3b's.
PRESETS["llama-8b-256k"] = _long_context(PRESETS["llama-8b"], 262144)
PRESETS["llama-3b-512k"] = _long_context(PRESETS["llama-3b"], 524288)


#: Models the generic layer path runs (:mod:`flowtrain.model.generic`), by name: their
#: ``config.json`` as transformers reads it (a preset of a family without native layer math).
HF_PRESETS: dict[str, dict] = {
    # Qwen3.5-9B's text model: 32 layers, every 4th full attention (16 heads of 256, 4 KV heads,
    # gated output), the others gated delta-net linear attention (16 key heads, 32 value heads of
    # 128); SwiGLU of 12,288; a 248,320-token vocabulary.
    "qwen3.5-9b": {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": 248320,
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32, "num_attention_heads": 16,
        "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": 248044, "pad_token_id": None,
    },
    # Its first 16 layers (4 of them full attention): the largest part whose fp32 weights and
    # Adam state an all-on-GPU run holds on one H200, for comparing with transformers alone.
    "qwen3.5-9b-16l": {},
    # The same layers at a CPU test's size.
    "qwen3.5-tiny": {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": 256,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        "full_attention_interval": 2, "max_position_embeddings": 4096, "tie_word_embeddings": False,
    },
}
HF_PRESETS["qwen3.5-9b-16l"] = {**HF_PRESETS["qwen3.5-9b"], "num_hidden_layers": 16}


def preset(name: str) -> ModelConfig:
    """The preset called ``name``; :class:`ConfigError` listing valid names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(
            f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}"
        ) from None
