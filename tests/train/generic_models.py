"""Tiny random models of families flowtrain has no layer math for, built and saved by transformers.

Each is a few layers of the family's own config class with its distinctive parts switched on
(linear-attention layers, experts, latent attention, attention sinks, chunked attention,
state-space layers), small enough for a CPU test::

    model = make_family(path, "Qwen3_5ForCausalLM", vocab=64)     # saved to path, and returned
"""

from __future__ import annotations

import torch

transformers = __import__("transformers")

COMMON = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_conv_kernel_dim=4, full_attention_interval=2)
EXPERTS = dict(num_experts_per_tok=2, moe_intermediate_size=16)

#: architecture -> config keys beyond COMMON that give it its distinctive layers
FAMILIES = {
    "Qwen3_5ForCausalLM": LINEAR,
    "Qwen3NextForCausalLM": dict(LINEAR, num_experts=4, shared_expert_intermediate_size=16, **EXPERTS),
    "GptOssForCausalLM": dict(num_local_experts=4, sliding_window=6, num_experts_per_tok=2),
    "Gemma2ForCausalLM": dict(sliding_window=6),
    "Phi3ForCausalLM": {},
    "Glm4ForCausalLM": {},
    "Olmo2ForCausalLM": {},
    "DeepseekV3ForCausalLM": dict(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16,
                                  kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, head_dim=4,
                                  num_key_value_heads=4, n_group=2, topk_group=1, **EXPERTS),
    "Llama4ForCausalLM": dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=48,
                              attention_chunk_size=6, interleave_moe_layer_step=2),
    "FalconH1ForCausalLM": dict(mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1,
                                mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=4),
}


def family_config(arch: str, vocab: int = 64, **extra):
    cls = getattr(transformers, arch)
    config = cls.config_class(**{**COMMON, "vocab_size": vocab, **FAMILIES[arch], **extra})
    config.architectures = [arch]
    return config


def make_family(path, arch: str, *, seed: int = 0, vocab: int = 64, **extra):
    """A random ``arch`` model saved to ``path`` (None: not saved); returned in fp32."""
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(family_config(arch, vocab, **extra)).float()
    if path is not None:
        model.save_pretrained(path)
    return model
