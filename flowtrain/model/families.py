"""The Hugging Face architectures flowtrain trains, one :class:`Family` each.

A family is what one ``config.json`` ``"architectures"`` entry fixes about the decoder layer
(which biases exist, whether q and k are normalised per head, how a sliding window is spelled,
whether the MLP is a mixture of experts) and what its transformers config class assumes when
``config.json`` leaves a key out. :class:`~flowtrain.model.config.ModelConfig` asks its family
(``cfg.family``) instead of testing architecture names, and
:mod:`flowtrain.model.hf_config` reads and writes ``config.json`` by it::

    FAMILIES["Qwen2ForCausalLM"].qkv_bias     # True: q, k and v always carry biases
    FAMILIES["MistralForCausalLM"].window     # "mistral": one window on every layer

The seven families: ``LlamaForCausalLM`` (optional biases on q, k, v and o),
``MistralForCausalLM`` (a sliding window), ``Qwen2ForCausalLM`` (biases on q, k and v, an
optional sliding window), ``Qwen3ForCausalLM`` (RMSNorm over each head of q and k, an explicit
head_dim, an optional sliding window), ``Gemma3ForCausalLM`` (Gemma 3's text model: sliding and
global layers, q/k norms, sandwich norms, GeGLU, scaled embeddings; the layer math is
:mod:`flowtrain.model.gemma`), and two mixtures of experts, ``Qwen3MoeForCausalLM`` (Qwen3's
attention; experts in the layers that :meth:`ModelConfig.layer_sparse
<flowtrain.model.config.ModelConfig.layer_sparse>` names, a dense MLP in the others) and
``MixtralForCausalLM`` (Mistral's attention, experts in every layer; the layer math of both is
:mod:`flowtrain.model.moe`). Anything else is refused with a
:class:`~flowtrain.errors.ConfigError` rather than trained wrongly.

A new family that reuses these layer options is one more row in :data:`FAMILIES` (and, where
its config class spells a key its own way, a case in :mod:`flowtrain.model.hf_config`); one
that needs new layer math also needs the option here and its use in the layer.
"""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = ["FAMILIES", "Family", "register_family", "unsupported"]


class Family(msgspec.Struct, frozen=True):
    """What one Hugging Face architecture fixes about the layer, and what its config class
    assumes when config.json leaves a key out (reading a config must give the model
    transformers would build from the same file)."""

    architecture: str
    model_type: str
    max_position_embeddings: int       # default when absent
    rms_norm_eps: float = 1e-6         # default when absent
    head_dim: int | None = None        # default when absent; None: hidden_size // num_heads
    qkv_bias: bool = False             # q, k and v always carry biases, o none (Qwen2)
    attention_bias: bool = False       # config.json's attention_bias may bias q, k, v and o
    qk_norm: bool = False              # RMSNorm over each head of q and k, before rotary
    # How config.json spells a sliding window. "mistral": sliding_window (absent: 4096) on
    # every layer; "qwen": sliding_window on the layers from max_window_layers on, only
    # when use_sliding_window is true.
    # "mixtral": sliding_window on every layer, absent meaning none; "qwen_moe": sliding_window
    # (absent: 4096) on every layer, only when use_sliding_window is true.
    window: Literal["none", "mistral", "qwen", "gemma", "mixtral", "qwen_moe"] = "none"
    # Gemma 3's layer: norms scale by (1 + weight) in fp32 and also follow attention and the
    # MLP, embeddings are multiplied by sqrt(hidden_size), the MLP is GeGLU (tanh GELU),
    # attention scores by query_pre_attn_scalar ** -0.5, sliding layers rotate with their
    # own base (rope_local_base_freq).
    gemma: bool = False
    tied: bool = False                 # tie_word_embeddings when absent
    # Mixture of experts (:mod:`flowtrain.model.moe`): "qwen3" (Qwen3-MoE: the top-k weights
    # renormalised only with norm_topk_prob, dense MLP layers by mlp_only_layers and
    # decoder_sparse_step; checkpoint names mlp.gate, mlp.experts.E.{gate,up,down}_proj) or
    # "mixtral" (every layer sparse, always renormalised; block_sparse_moe.gate,
    # block_sparse_moe.experts.E.{w1,w2,w3}). "none": a dense model.
    moe: Literal["none", "qwen3", "mixtral"] = "none"


FAMILIES: dict[str, Family] = {f.architecture: f for f in (
    Family("LlamaForCausalLM", "llama", max_position_embeddings=2048, attention_bias=True),
    Family("MistralForCausalLM", "mistral", max_position_embeddings=4096 * 32, window="mistral"),
    Family("Qwen2ForCausalLM", "qwen2", max_position_embeddings=32768, qkv_bias=True,
           window="qwen"),
    Family("Qwen3ForCausalLM", "qwen3", max_position_embeddings=32768, head_dim=128,
           attention_bias=True, qk_norm=True, window="qwen"),
    Family("Gemma3ForCausalLM", "gemma3_text", max_position_embeddings=131072, head_dim=256,
           attention_bias=True, qk_norm=True, window="gemma", gemma=True, tied=True),
    Family("Qwen3MoeForCausalLM", "qwen3_moe", max_position_embeddings=32768, attention_bias=True,
           qk_norm=True, window="qwen_moe", moe="qwen3"),
    Family("MixtralForCausalLM", "mixtral", max_position_embeddings=4096 * 32, rms_norm_eps=1e-5,
           window="mixtral", moe="mixtral"),
)}



def register_family(family: Family) -> Family:
    """Make ``family`` one that flowtrain trains, as a row of :data:`FAMILIES` in this file
    would (docs/concepts.md, "Adding a model family"); an architecture already known is
    refused, so a built-in row is never replaced by accident."""
    if family.architecture in FAMILIES:
        raise ValueError(f"architecture {family.architecture!r} is already a family")
    FAMILIES[family.architecture] = family
    return family

# What the families' config classes take when config.json leaves a key out (and, for Gemma 3,
# what ModelConfig fills in when it is built without them).
MISTRAL_WINDOW = 4096   # MistralConfig's sliding_window when config.json omits the key
QWEN_WINDOW = 4096      # Qwen2Config's and Qwen3Config's, used only with use_sliding_window
QWEN_FULL_LAYERS = 28   # their max_window_layers default
GEMMA_WINDOW = 4096     # Gemma3TextConfig's sliding_window
GEMMA_PATTERN = 6       # its sliding_window_pattern: every 6th layer attends globally
GEMMA_THETA = (1e6, 1e4)  # its rope_theta (global layers) and rope_local_base_freq


def unsupported(arch: object) -> str:
    """The error line for an architecture that is no family's: it lists those that are, and
    says what the generic layer path takes."""
    hint = ("; a vision-language model trains through its text model: give a config.json of its text_config, "
            "with that model's ...ForCausalLM as its architecture") if str(arch).endswith("ForConditionalGeneration") else ""
    return (
        f"unsupported architecture {arch!r}: flowtrain trains {', '.join(FAMILIES)} natively, and any decoder-only "
        f"...ForCausalLM transformers has on its generic layer path{hint}"
    )
