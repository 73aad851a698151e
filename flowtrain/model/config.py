"""The shape of a Llama-family model.

A :class:`ModelConfig` is everything the layer math, the flat-buffer layout and the
checkpoint code need to know about a model: sizes, rotary settings and which optional
biases exist. It is a frozen ``msgspec.Struct``, so it hashes, compares by value and
round-trips through JSON; it converts to and from a Hugging Face ``config.json`` dict::

    cfg = preset("tiny")                        # flowtrain.model.presets; or ModelConfig.from_hf(json.load(f))
    cfg.num_parameters()                        # 123,712
    ModelConfig.from_hf(cfg.to_hf()) == cfg     # True

Four Hugging Face architectures share this shape, each described by one :class:`Family`
in :data:`FAMILIES`: ``LlamaForCausalLM`` (optional biases on q, k, v and o),
``MistralForCausalLM`` (a sliding window), ``Qwen2ForCausalLM`` (biases on q, k and v,
an optional sliding window) and ``Qwen3ForCausalLM`` (RMSNorm over each head of q and k, an
explicit head_dim, an optional sliding window) and ``Gemma3ForCausalLM`` (Gemma 3's text
model: sliding and global layers, q/k norms, sandwich norms, GeGLU, scaled embeddings; the
layer math is :mod:`flowtrain.model.gemma`), and two mixtures of experts,
``Qwen3MoeForCausalLM`` (Qwen3's attention; experts in the layers that
:meth:`ModelConfig.layer_sparse` names, a dense MLP in the others) and ``MixtralForCausalLM``
(Mistral's attention, experts in every layer; the layer math of both is
:mod:`flowtrain.model.moe`). Sliding windows are applied layer by layer
(:meth:`ModelConfig.layer_window`). Anything else is refused with a
:class:`~flowtrain.errors.ConfigError` rather than trained wrongly.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import msgspec

from flowtrain.errors import ConfigError

__all__ = [
    "FAMILIES",
    "SUPPORTED_ARCHITECTURES",
    "Family",
    "ModelConfig",
    "RopeScaling",
    "model_flops_per_token",
    "short_repr",
]


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

SUPPORTED_ARCHITECTURES = tuple(FAMILIES)

_MISTRAL_WINDOW = 4096   # MistralConfig's sliding_window when config.json omits the key
_QWEN_WINDOW = 4096      # Qwen2Config's and Qwen3Config's, used only with use_sliding_window
_QWEN_FULL_LAYERS = 28   # their max_window_layers default
_GEMMA_WINDOW = 4096     # Gemma3TextConfig's sliding_window
_GEMMA_PATTERN = 6       # its sliding_window_pattern: every 6th layer attends globally
_GEMMA_THETA = (1e6, 1e4)  # its rope_theta (global layers) and rope_local_base_freq

_REQUIRED_HF_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)

# Bounds on a model's sizes. A corrupt or hostile config.json (vocab_size 10**12, 10**6 layers)
# must be refused with one line before anything is sized from it: the planner, the graph
# compiler and the host state all allocate per layer, per chunk and per parameter. Each bound
# is far above any published model (the largest have ~126 layers, hidden 16,384, intermediate
# 53,248, 128 heads of 256, vocab 262,144, 10M positions) and far below what would exhaust a
# machine just describing the model. Checked with integer arithmetic only.
#: ModelConfig field -> (config.json key, largest accepted value)
SIZE_BOUNDS: dict[str, tuple[str, int]] = {
    "num_layers": ("num_hidden_layers", 4096),
    "hidden_size": ("hidden_size", 1 << 18),
    "intermediate_size": ("intermediate_size", 1 << 21),
    "num_heads": ("num_attention_heads", 4096),
    "num_kv_heads": ("num_key_value_heads", 4096),
    "head_dim": ("head_dim", 1 << 14),
    "vocab_size": ("vocab_size", 1 << 24),
    "max_position_embeddings": ("max_position_embeddings", 1 << 26),
}
_HF_BOUNDS = {key: bound for key, bound in SIZE_BOUNDS.values()}
#: Parameters a model may have: 10**13 fp32 weights are 40 TB, more host memory than any one
#: machine has, so no run could ever hold them.
MAX_PARAMETERS = 10**13
#: Experts a sparse layer may have (the largest published models have a few hundred).
MAX_EXPERTS = 1 << 14


class RopeScaling(msgspec.Struct, frozen=True):
    """Rotary frequency scaling: Llama 3.1's (``rope_type == "llama3"``) or linear.

    llama3: low frequencies (wavelengths longer than ``original_max_position_embeddings /
    low_freq_factor``) are divided by ``factor``, high ones are kept, and the band between
    is interpolated smoothly; this lets a model pre-trained at 8K positions run at 128K.
    linear (Gemma 3's global layers): every frequency is divided by ``factor``; the other
    fields are unused.
    """

    rope_type: str
    factor: float
    low_freq_factor: float = 0.0
    high_freq_factor: float = 0.0
    original_max_position_embeddings: int = 0


class ModelConfig(msgspec.Struct, frozen=True):
    """Sizes and options of one Llama-family decoder-only model.

    ``head_dim`` defaults to ``hidden_size // num_heads``. ``attention_bias`` puts biases on
    q, k, v *and* o (Llama's and Qwen3's option); ``qkv_bias`` on q, k and v only (Qwen2).
    Whether q and k are normalised per head follows from ``architecture`` (:attr:`qk_norm`).

    ``sliding_window`` (None: none) is how many positions each token of the layers from
    ``max_window_layers`` on may see, itself included (Mistral: every layer). flowtrain
    computes full causal attention, the same thing while sequences are no longer than the
    window; :meth:`check_seq_len` refuses longer ones.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qkv_bias: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    architecture: str = "LlamaForCausalLM"
    sliding_window: int | None = None
    max_window_layers: int = 0
    #: Gemma 3: which layers slide ("sliding_attention") or see everything ("full_attention")
    layer_types: tuple[str, ...] | None = None
    #: Gemma 3: the rotary base of sliding layers (``rope_theta`` is the global layers')
    rope_local_theta: float | None = None
    #: Gemma 3: attention scores are scaled by this ** -0.5 (None: head_dim ** -0.5)
    query_pre_attn_scalar: float | None = None
    #: Mixture of experts (0 experts: a dense model): experts per sparse layer, how many each
    #: token is routed to, each expert's intermediate size (Mixtral: intermediate_size)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    #: renormalise the top-k routing weights to sum to one (Mixtral always does)
    norm_topk_prob: bool = False
    #: Qwen3-MoE: layer i has experts when (i + 1) % decoder_sparse_step == 0 and i is not in
    #: mlp_only_layers; the others have a dense MLP of intermediate_size
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    #: train with the load-balancing loss (weight router_aux_loss_coef) added to the loss
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.0

    def __post_init__(self) -> None:
        # head_dim is always an int after construction; None only means "derive it".
        if self.head_dim is None and self.num_heads > 0:
            msgspec.structs.force_setattr(self, "head_dim", self.hidden_size // self.num_heads)
        fam = FAMILIES.get(self.architecture)
        if fam is not None and fam.gemma and self.layer_types is None and self.num_layers > 0:
            # Gemma3TextConfig's default: every _GEMMA_PATTERN-th layer attends globally.
            types = tuple("sliding_attention" if (i + 1) % _GEMMA_PATTERN else "full_attention"
                          for i in range(self.num_layers))
            msgspec.structs.force_setattr(self, "layer_types", types)
        if fam is not None and fam.gemma:  # Gemma3TextConfig's defaults, spelled out
            if self.rope_local_theta is None:
                msgspec.structs.force_setattr(self, "rope_local_theta", _GEMMA_THETA[1])
            if self.query_pre_attn_scalar is None and self.head_dim is not None:
                msgspec.structs.force_setattr(self, "query_pre_attn_scalar", float(self.head_dim))

    # ------------------------------------------------------------------ checks and sizes

    @property
    def head_size(self) -> int:
        """``head_dim`` as the int it always is after construction (the field reads None from a
        config.json that leaves it out)."""
        assert self.head_dim is not None, "head_dim is set by __post_init__"
        return self.head_dim

    @property
    def family(self) -> Family:
        """The :class:`Family` of ``architecture``; :class:`ConfigError` if unsupported."""
        fam = FAMILIES.get(self.architecture)
        if fam is None:
            raise ConfigError(_unsupported(self.architecture))
        return fam

    @property
    def has_qkv_bias(self) -> bool:
        """Whether q, k and v projections carry biases (either option turns them on)."""
        return self.attention_bias or self.qkv_bias

    @property
    def qk_norm(self) -> bool:
        """Whether q and k pass through an RMSNorm over each head (weights of head_dim)."""
        return self.family.qk_norm

    @property
    def moe(self) -> bool:
        """Whether the model routes tokens to experts (:mod:`flowtrain.model.moe`)."""
        return self.family.moe != "none"

    def layer_sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has a router and experts (else a dense MLP)."""
        return (self.moe and self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def sparse_layers(self) -> list[int]:
        """The decoder layers with experts, in order (empty for a dense model)."""
        return [i for i in range(self.num_layers) if self.layer_sparse(i)]

    def check_seq_len(self, seq_len: int) -> None:
        """Raise :class:`ConfigError` if sequences of ``seq_len`` tokens reach beyond the model's
        positions. (A sliding window shorter than the sequence is applied, not refused.)"""
        if seq_len > self.max_position_embeddings:
            raise ConfigError(
                f"{{seq_len}} {seq_len} is beyond the model's {self.max_position_embeddings} positions "
                f"(max_position_embeddings); use {{seq_len}} {self.max_position_embeddings} or less", named=True
            )

    def layer_window(self, layer: int) -> int | None:
        """How many positions a token of decoder layer ``layer`` sees, itself included: the
        sliding window on the layers from ``max_window_layers`` on (or, with ``layer_types``,
        on the "sliding_attention" layers), None (all) elsewhere."""
        if self.sliding_window is None or layer < self.max_window_layers:
            return None
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def layer_rope_local(self, layer: int) -> bool:
        """Whether layer ``layer`` rotates with the local base (Gemma 3's sliding layers)."""
        return (self.rope_local_theta is not None and self.layer_types is not None
                and self.layer_types[layer] == "sliding_attention")

    def validate(self) -> ModelConfig:
        """Raise :class:`ConfigError` if the sizes cannot form a model; return ``self``."""
        for name, (_, bound) in SIZE_BOUNDS.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model config: {name} must be a positive integer, got {value!r}")
            if value > bound:
                raise ConfigError(f"model config: {name} {short_repr(value)} is above the bound {bound:,}; "
                                  "no model that size can be trained")
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"model config: num_heads {self.num_heads} does not divide hidden_size "
                f"{self.hidden_size}; choose a head count that divides it"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model config: num_kv_heads {self.num_kv_heads} does not divide num_heads "
                f"{self.num_heads}; grouped-query attention needs whole groups"
            )
        assert self.head_dim is not None
        if self.head_dim % 2:
            raise ConfigError(
                f"model config: head_dim {self.head_dim} is odd; rotary embeddings rotate pairs, "
                "so head_dim must be even"
            )
        if not (math.isfinite(self.rms_norm_eps) and self.rms_norm_eps > 0):
            raise ConfigError(f"model config: rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
            raise ConfigError(f"model config: rope_theta must be > 0, got {self.rope_theta}")
        if not (math.isfinite(self.initializer_range) and self.initializer_range >= 0):
            raise ConfigError(
                f"model config: initializer_range must be >= 0, got {self.initializer_range}"
            )
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(_unsupported(self.architecture))
        if self.sliding_window is not None and (
            isinstance(self.sliding_window, bool) or self.sliding_window <= 0
        ):
            raise ConfigError(
                f"model config: sliding_window must be a positive integer or None, "
                f"got {self.sliding_window!r}"
            )
        if not 0 <= self.max_window_layers <= self.num_layers:
            raise ConfigError(
                f"model config: max_window_layers must be between 0 and num_layers "
                f"{self.num_layers}, got {self.max_window_layers}"
            )
        self._check_rope_scaling()
        self._check_gemma_fields()
        self._check_moe_fields()
        self._check_parameter_count()
        return self

    def _check_moe_fields(self) -> None:
        """Experts belong to the MoE families only; their counts must form a router."""
        names = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
        if not self.moe:
            if any(getattr(self, n) for n in names) or self.mlp_only_layers or self.output_router_logits:
                raise ConfigError(f"model config: {self.architecture} has no experts; use "
                                  "Qwen3MoeForCausalLM or MixtralForCausalLM for a mixture of experts")
            return
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.num_experts > MAX_EXPERTS:
            raise ConfigError(f"model config: num_experts {self.num_experts:,} is above the bound {MAX_EXPERTS:,}")
        if self.moe_intermediate_size > SIZE_BOUNDS["intermediate_size"][1]:
            raise ConfigError(f"model config: moe_intermediate_size {self.moe_intermediate_size:,} is above "
                              f"the bound {SIZE_BOUNDS['intermediate_size'][1]:,}")
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(f"model config: num_experts_per_tok {self.num_experts_per_tok} is more than the "
                              f"{self.num_experts} experts; route each token to at most num_experts")
        if self.decoder_sparse_step < 1:
            raise ConfigError(f"model config: decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        if any(not 0 <= i < self.num_layers for i in self.mlp_only_layers):
            raise ConfigError(f"model config: mlp_only_layers {list(self.mlp_only_layers)} names layers outside "
                              f"0..{self.num_layers - 1}")
        if not (math.isfinite(self.router_aux_loss_coef) and self.router_aux_loss_coef >= 0):
            raise ConfigError(f"model config: router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef}")
        if self.family.moe == "mixtral" and self.moe_intermediate_size != self.intermediate_size:
            raise ConfigError("model config: Mixtral's experts are intermediate_size wide; set "
                              "moe_intermediate_size to intermediate_size")
        if self.family.moe == "mixtral" and (not self.norm_topk_prob or self.mlp_only_layers
                                             or self.decoder_sparse_step != 1):
            raise ConfigError("model config: Mixtral renormalises its top-k weights and has experts in every "
                              "layer; set norm_topk_prob=True, mlp_only_layers=() and decoder_sparse_step=1")

    def _check_parameter_count(self) -> None:
        """Refuse more than :data:`MAX_PARAMETERS` parameters. Every size is bounded by now, so
        the count is a small exact integer computation; nothing is allocated from it."""
        n = self.num_parameters()
        if n > MAX_PARAMETERS:
            raise ConfigError(
                f"model config: {n:.3g} parameters is above the bound {MAX_PARAMETERS:.0e} (more than a "
                f"machine's host memory holds); check vocab_size {self.vocab_size}, hidden_size "
                f"{self.hidden_size}, intermediate_size {self.intermediate_size}, num_layers {self.num_layers}"
            )

    def _check_rope_scaling(self) -> None:
        rs = self.rope_scaling
        if rs is None:
            return
        if rs.rope_type not in ("llama3", "linear"):
            raise ConfigError(
                f"model config: rope scaling type {rs.rope_type!r} is not supported; "
                "flowtrain implements 'llama3' and 'linear' scaling (or none)"
            )
        if not (math.isfinite(rs.factor) and rs.factor > 0):
            raise ConfigError(f"model config: rope scaling needs factor > 0, got {rs}")
        if rs.rope_type == "llama3":
            finite = all(math.isfinite(x) for x in (rs.low_freq_factor, rs.high_freq_factor))
            if not (finite and rs.high_freq_factor > rs.low_freq_factor > 0
                    and rs.original_max_position_embeddings > 0):
                raise ConfigError(
                    f"model config: llama3 rope scaling needs factor > 0, high_freq_factor > "
                    f"low_freq_factor > 0 and original_max_position_embeddings > 0, got {rs}"
                )

    def _check_gemma_fields(self) -> None:
        """layer_types, rope_local_theta and query_pre_attn_scalar belong to Gemma 3 only."""
        gemma = self.family.gemma
        if not gemma:
            for name in ("layer_types", "rope_local_theta", "query_pre_attn_scalar"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"model config: {name} is a Gemma 3 setting; "
                                      f"{self.architecture} has no such option")
            return
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise ConfigError(f"model config: layer_types names {len(self.layer_types)} layers, "
                              f"the model has {self.num_layers}")
        for name in ("rope_local_theta", "query_pre_attn_scalar"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ConfigError(f"model config: {name} must be > 0, got {v}")

    def _check_exportable(self) -> None:
        """Each Hugging Face architecture fixes which biases and windows exist; refuse a
        mismatch."""
        fam, arch = self.family, self.architecture
        if fam.qkv_bias and (self.attention_bias or not self.qkv_bias):
            raise ConfigError(
                f"model config: {arch} always has biases on q, k and v and none on o; "
                "set qkv_bias=True and attention_bias=False"
            )
        if not fam.qkv_bias and not fam.attention_bias and self.has_qkv_bias:
            raise ConfigError(
                f"model config: {arch} has no attention biases; "
                "use architecture LlamaForCausalLM for a model with biases"
            )
        if not fam.qkv_bias and self.qkv_bias and not self.attention_bias:
            raise ConfigError(
                f"model config: {arch} cannot express q/k/v-only biases; "
                "use architecture Qwen2ForCausalLM or attention_bias=True"
            )
        every_layer = fam.window in ("mistral", "mixtral", "qwen_moe")
        if self.sliding_window is not None and (
            fam.window == "none" or (every_layer and self.max_window_layers)
        ):
            raise ConfigError(
                f"model config: {arch} cannot express a sliding window"
                + (" on some layers only" if every_layer else "")
                + "; set sliding_window=None or choose a family that has one"
            )

    def layer_parameters(self, layer: int | None = None) -> int:
        """Parameters in decoder layer ``layer`` (None: the largest layer; all of a dense
        model's layers are alike). A sparse layer counts its router and every expert."""
        assert self.head_dim is not None
        h = self.hidden_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        n = 2 * h                        # the two RMSNorm weights
        n += h * q + 2 * h * kv + q * h  # q, k, v, o projections
        n += self.mlp_parameters(layer)
        if self.has_qkv_bias:
            n += q + 2 * kv
        if self.attention_bias:
            n += h
        if self.qk_norm:
            n += 2 * self.head_dim
        if self.family.gemma:
            n += 2 * h                   # the norms after attention and around the MLP
        return n

    def mlp_parameters(self, layer: int | None = None, *, active: bool = False) -> int:
        """Parameters of layer ``layer``'s MLP (None: the largest): a dense SwiGLU of
        intermediate_size, or a router and num_experts experts of moe_intermediate_size each.
        ``active``: those one token uses, the router and its num_experts_per_tok experts."""
        h = self.hidden_size
        sparse = self.layer_sparse(layer) if layer is not None else bool(self.sparse_layers())
        if not sparse:
            return 3 * h * self.intermediate_size
        experts = self.num_experts_per_tok if active else self.num_experts
        return h * self.num_experts + experts * 3 * h * self.moe_intermediate_size

    def num_parameters(self) -> int:
        """Total trainable parameters (a tied head counts once, as the embedding)."""
        embed = self.vocab_size * self.hidden_size
        head = self.hidden_size + (0 if self.tie_word_embeddings else embed)
        if self.moe:
            return embed + sum(self.layer_parameters(i) for i in range(self.num_layers)) + head
        return embed + self.num_layers * self.layer_parameters() + head

    def active_parameters(self) -> int:
        """Parameters one token's forward uses: for a mixture of experts, every weight but the
        experts it is not routed to (the router and num_experts_per_tok experts per sparse
        layer); for a dense model, :meth:`num_parameters`. Model FLOPs count these (6 per
        parameter per token, :func:`model_flops_per_token`)."""
        if not self.moe:
            return self.num_parameters()
        inactive = sum(self.mlp_parameters(i) - self.mlp_parameters(i, active=True) for i in self.sparse_layers())
        return self.num_parameters() - inactive

    # ------------------------------------------------------------------ Hugging Face I/O

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face ``config.json`` dict; :class:`ConfigError` if unsupported or if
        a value has the wrong type ("lots", 4.5, true where an integer belongs), is out of
        range or not finite. An absent or null optional key takes transformers' default."""
        if not isinstance(d, dict):
            raise ConfigError(f"config.json must hold a JSON object, got {type(d).__name__}")
        arch = _architecture(d)
        missing = [k for k in _REQUIRED_HF_KEYS if d.get(k) is None]
        if missing:
            raise ConfigError(
                f"config.json for {arch} lacks required key(s) {', '.join(missing)}; "
                "add them (see the model card's config.json)"
            )
        fam = FAMILIES[arch]
        _check_activation(d, fam)
        if _hf_bool(d, "mlp_bias", False):
            raise ConfigError(
                "config.json sets mlp_bias; flowtrain supports MLPs without biases only"
            )
        heads = _hf_int(d, "num_attention_heads")
        layers = _hf_int(d, "num_hidden_layers")
        if fam.gemma:
            extra = _gemma_fields(d, layers)
        else:
            theta, scaling = _rope(d)
            window, full_layers = _sliding_window(d, fam, layers)
            extra = dict(rope_theta=theta, rope_scaling=scaling, sliding_window=window,
                         max_window_layers=full_layers)
        if fam.moe != "none":
            extra.update(_moe_fields(d, fam, layers))
        eos = d.get("eos_token_id")
        if isinstance(eos, list):  # several end tokens: the first is the one flowtrain appends
            eos = eos[0] if eos else None
        cfg = cls(
            vocab_size=_hf_int(d, "vocab_size"),
            hidden_size=_hf_int(d, "hidden_size"),
            intermediate_size=_hf_int(d, "intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=_hf_int(d, "num_key_value_heads", heads),
            head_dim=_hf_int(d, "head_dim", fam.head_dim),
            rms_norm_eps=_hf_float(d, "rms_norm_eps", fam.rms_norm_eps),
            max_position_embeddings=_hf_int(d, "max_position_embeddings",
                                            fam.max_position_embeddings),
            tie_word_embeddings=_hf_bool(d, "tie_word_embeddings", fam.tied),
            attention_bias=fam.attention_bias and _hf_bool(d, "attention_bias", False),
            qkv_bias=fam.qkv_bias,
            initializer_range=_hf_float(d, "initializer_range", 0.02),
            bos_token_id=_hf_int(d, "bos_token_id", None, minimum=None),
            eos_token_id=_hf_int({"eos_token_id": eos}, "eos_token_id", None, minimum=None),
            pad_token_id=_hf_int(d, "pad_token_id", None, minimum=None),
            architecture=arch,
            **extra,
        )
        return cfg.validate()

    def to_hf(self) -> dict[str, Any]:
        """A ``config.json`` dict that transformers loads into the same architecture.

        Rotary settings are written both as ``rope_parameters`` (transformers 5) and as
        ``rope_theta``/``rope_scaling`` (transformers 4), so either version reads them.
        """
        self.validate()
        self._check_exportable()
        rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        rope_scaling = None
        if self.rope_scaling is not None:
            rope_scaling = msgspec.structs.asdict(self.rope_scaling)
            rope_parameters = {**rope_scaling, "rope_theta": self.rope_theta}
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.family.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": rope_scaling,
            "rope_parameters": rope_parameters,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "attention_dropout": 0.0,
            "use_cache": True,
            "torch_dtype": "float32",
            "dtype": "float32",
        }
        fam = self.family
        if fam.attention_bias:
            d.update(attention_bias=self.attention_bias)
        if self.architecture == "LlamaForCausalLM":
            d.update(mlp_bias=False, pretraining_tp=1)
        match fam.window:
            case "mistral":
                d.update(sliding_window=self.sliding_window)
            case "qwen":
                slides = self.sliding_window is not None
                d.update(use_sliding_window=slides, sliding_window=self.sliding_window,
                         max_window_layers=self.max_window_layers if slides else self.num_layers)
            case "gemma":
                self._gemma_to_hf(d)
            case "mixtral":
                d.update(sliding_window=self.sliding_window)
            case "qwen_moe":
                d.update(use_sliding_window=self.sliding_window is not None,
                         sliding_window=self.sliding_window)
        if self.moe:
            self._moe_to_hf(d)
        return d

    def _moe_to_hf(self, d: dict[str, Any]) -> None:
        """The experts' keys as each family's config class spells them."""
        d.update(num_experts_per_tok=self.num_experts_per_tok, output_router_logits=self.output_router_logits,
                 router_aux_loss_coef=self.router_aux_loss_coef)
        if self.family.moe == "mixtral":
            d.update(num_local_experts=self.num_experts, router_jitter_noise=0.0)
        else:  # Qwen3MoeConfig reads num_experts (and maps num_local_experts onto it)
            d.update(num_experts=self.num_experts, moe_intermediate_size=self.moe_intermediate_size,
                     norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=self.decoder_sparse_step,
                     mlp_only_layers=list(self.mlp_only_layers))

    def _gemma_to_hf(self, d: dict[str, Any]) -> None:
        """Gemma 3's spelling: its activation key, two rotary bases, layer types, score scale."""
        del d["hidden_act"]
        local = self.rope_local_theta
        d["rope_parameters"] = {"full_attention": d["rope_parameters"],
                                "sliding_attention": {"rope_type": "default", "rope_theta": local}}
        types = self.layer_types or ()
        scalar = self.query_pre_attn_scalar
        d.update(hidden_activation="gelu_pytorch_tanh", rope_local_base_freq=local,
                 sliding_window=self.sliding_window, layer_types=list(types),
                 query_pre_attn_scalar=int(scalar) if scalar is not None and scalar.is_integer() else scalar,
                 final_logit_softcapping=None, attn_logit_softcapping=None)


_REQUIRED = object()


def _hf_int(d: dict[str, Any], key: str, default: Any = _REQUIRED, *, minimum: int | None = 1,
            where: str = "") -> Any:
    """``d[key]`` as a JSON integer >= ``minimum`` (any integer if None) and, for a size, at most
    its bound in :data:`SIZE_BOUNDS`; absent or null gives ``default``. A float is refused, not
    truncated: 4096.5 layers is a typo, not a size."""
    v = d.get(key)
    if v is None:
        if default is _REQUIRED:
            raise ConfigError(f"config.json lacks required key {where}{key}")
        return default
    if isinstance(v, bool) or not isinstance(v, int) or (minimum is not None and v < minimum):
        what = ("an integer" if minimum is None else "a positive integer" if minimum == 1
                else f"an integer >= {minimum}")
        raise ConfigError(f"config.json: {where}{key} must be {what} (got {short_repr(v)})")
    bound = _HF_BOUNDS.get(key)
    if bound is not None and v > bound:
        raise ConfigError(f"config.json: {key} {short_repr(v)} is above the bound {bound:,}; "
                          "no model that size can be trained (is config.json corrupt?)")
    return v


def short_repr(v: Any, limit: int = 80) -> str:
    """``repr(v)`` cut to ``limit`` characters: an error line quotes a value, not a file."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 200:
        return f"an integer of {v.bit_length()} bits"  # str() of a huge int is slow, or refused
    text = repr(v)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _hf_float(d: dict[str, Any], key: str, default: Any = _REQUIRED, *, where: str = "") -> float:
    """``d[key]`` as a finite number (ranges are :meth:`ModelConfig.validate`'s); absent or null
    gives ``default``."""
    v = d.get(key)
    if v is None:
        if default is _REQUIRED:
            raise ConfigError(f"config.json lacks required key {where}{key}")
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(f"config.json: {where}{key} must be a finite number (got {v!r})")
    return float(v)


def _hf_bool(d: dict[str, Any], key: str, default: bool) -> bool:
    """``d[key]`` as JSON true/false (the string "false" is not false); absent or null gives
    ``default``."""
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ConfigError(f"config.json: {key} must be true or false (got {v!r})")
    return v


def _unsupported(arch: object) -> str:
    return (
        f"unsupported architecture {arch!r}: flowtrain trains "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _sliding_window(d: dict[str, Any], fam: Family, layers: int) -> tuple[int | None, int]:
    """``(window, max_window_layers)`` as transformers reads them; ``(None, 0)`` when no
    layer slides (then the window cannot matter and is dropped)."""
    match fam.window:
        case "mistral":
            # An absent key means MistralConfig's 4096, an explicit null no window.
            window = _hf_int(d, "sliding_window", None) if "sliding_window" in d else _MISTRAL_WINDOW
            return window, 0
        case "qwen":
            if not _hf_bool(d, "use_sliding_window", False):
                return None, 0
            window = _hf_int(d, "sliding_window", None) if "sliding_window" in d else _QWEN_WINDOW
            full = _hf_int(d, "max_window_layers", _QWEN_FULL_LAYERS, minimum=0)
            types = d.get("layer_types")
            if isinstance(types, list):
                sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
                full = sliding[0] if sliding else layers
                if sliding != list(range(full, len(types))):
                    raise ConfigError(
                        "config.json: layer_types mixes full and sliding attention other than "
                        "full layers first, then sliding ones; flowtrain cannot express that"
                    )
            if window is None or full >= layers:
                return None, 0
            return window, full
        case "mixtral":  # MixtralConfig: no window unless config.json names one
            return _hf_int(d, "sliding_window", None), 0
        case "qwen_moe":  # Qwen3MoeConfig: the window on every layer, with use_sliding_window
            if not _hf_bool(d, "use_sliding_window", False):
                return None, 0
            return (_hf_int(d, "sliding_window", None) if "sliding_window" in d else _QWEN_WINDOW), 0
    return None, 0


def _architecture(d: dict[str, Any]) -> str:
    archs = d.get("architectures")
    if isinstance(archs, list) and archs:
        arch = archs[0]
    else:
        # Some configs only carry model_type; map it back when it is one we know.
        by_type = {f.model_type: f.architecture for f in FAMILIES.values()}
        model_type = d.get("model_type")
        arch = by_type.get(model_type, model_type) if isinstance(model_type, str) else model_type
        if arch is None:
            raise ConfigError(
                "config.json names no architecture (no 'architectures' or 'model_type' key); "
                f"add \"architectures\": [\"LlamaForCausalLM\"] or another of "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(_unsupported(arch))
    return arch


def _rope(d: dict[str, Any], theta_default: float = 10000.0) -> tuple[float, RopeScaling | None]:
    """Rotary base and scaling from either the transformers 4 or 5 spelling."""
    params, where = d.get("rope_parameters"), "rope_parameters."
    if not isinstance(params, dict):
        params, where = d.get("rope_scaling") or {}, "rope_scaling."
        if not isinstance(params, dict):
            raise ConfigError(f"config.json: rope_scaling must be an object or null (got {params!r})")
    if params.get("rope_theta") is not None:
        theta = _hf_float(params, "rope_theta", where=where)
    else:
        theta = _hf_float(d, "rope_theta", theta_default)
    return theta, _rope_scaling(params, where)


def _rope_scaling(params: dict[str, Any], where: str) -> RopeScaling | None:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind == "linear":
        if params.get("factor") is None:
            raise ConfigError(f"config.json: linear rope scaling lacks 'factor' ({where})")
        return RopeScaling(rope_type="linear", factor=_hf_float(params, "factor", where=where))
    if kind != "llama3":
        raise ConfigError(
            f"config.json uses rope scaling {kind!r}; flowtrain supports 'llama3' and 'linear' "
            "scaling or none"
        )
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if params.get(key) is None:
            raise ConfigError(f"config.json: llama3 rope scaling lacks {key!r}")
    return RopeScaling(
        rope_type="llama3",
        factor=_hf_float(params, "factor", where=where),
        low_freq_factor=_hf_float(params, "low_freq_factor", where=where),
        high_freq_factor=_hf_float(params, "high_freq_factor", where=where),
        original_max_position_embeddings=_hf_int(params, "original_max_position_embeddings", where=where),
    )


def _check_activation(d: dict[str, Any], fam: Family) -> None:
    """The MLP's activation must be the one flowtrain implements for the family."""
    key, want = ("hidden_activation", "gelu_pytorch_tanh") if fam.gemma else ("hidden_act", "silu")
    act = d.get(key, want)
    if act != want:
        mlp = "GeGLU MLP supports 'gelu_pytorch_tanh'" if fam.gemma else "SwiGLU MLP supports 'silu'"
        raise ConfigError(f"config.json has {key} {act!r}; flowtrain's {mlp} only")


def _moe_fields(d: dict[str, Any], fam: Family, layers: int) -> dict[str, Any]:
    """The experts' sizes and routing options, read as Qwen3MoeConfig and MixtralConfig read
    them (absent keys take their defaults; either spelling of the expert count)."""
    mixtral = fam.moe == "mixtral"
    defaults = (8, 2) if mixtral else (128, 8)
    experts = d.get("num_local_experts") if d.get("num_local_experts") is not None else d.get("num_experts")
    if mixtral and _hf_float(d, "router_jitter_noise", 0.0) != 0.0:
        raise ConfigError("config.json sets router_jitter_noise; flowtrain routes without jitter (set it to 0)")
    only = d.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise ConfigError(f"config.json: mlp_only_layers must be a list of layer indices (got {short_repr(only)})")
    return dict(
        num_experts=_hf_int({"num_experts": experts}, "num_experts", defaults[0]),
        num_experts_per_tok=_hf_int(d, "num_experts_per_tok", defaults[1]),
        moe_intermediate_size=(_hf_int(d, "intermediate_size") if mixtral
                               else _hf_int(d, "moe_intermediate_size", 768)),
        norm_topk_prob=True if mixtral else _hf_bool(d, "norm_topk_prob", False),
        decoder_sparse_step=1 if mixtral else _hf_int(d, "decoder_sparse_step", 1),
        mlp_only_layers=() if mixtral else tuple(sorted(set(only))),
        output_router_logits=_hf_bool(d, "output_router_logits", False),
        router_aux_loss_coef=_hf_float(d, "router_aux_loss_coef", 0.001),
    )


def _gemma_fields(d: dict[str, Any], layers: int) -> dict[str, Any]:
    """Gemma 3's rotary bases (global and local), window, layer types and score scale, read as
    Gemma3TextConfig reads them (transformers 4 or 5 spelling)."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if d.get(key) is not None:
            raise ConfigError(f"config.json sets {key}; flowtrain's Gemma 3 has no soft-capping")
    if _hf_bool(d, "use_bidirectional_attention", False):
        raise ConfigError("config.json sets use_bidirectional_attention; flowtrain trains causal models only")
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full = params.get("full_attention") or {}
        local = params.get("sliding_attention") or {}
        if not isinstance(full, dict) or not isinstance(local, dict):
            raise ConfigError("config.json: rope_parameters.full_attention and .sliding_attention must be objects")
        theta = _hf_float(full, "rope_theta", _GEMMA_THETA[0], where="rope_parameters.full_attention.")
        scaling = _rope_scaling(full, "rope_parameters.full_attention.")
        local_theta = _hf_float(local, "rope_theta", _GEMMA_THETA[1], where="rope_parameters.sliding_attention.")
        if _rope_scaling(local, "rope_parameters.sliding_attention.") is not None:
            raise ConfigError("config.json scales the rotary of sliding layers; flowtrain scales global layers only")
    else:
        theta, scaling = _rope(d, theta_default=_GEMMA_THETA[0])
        local_theta = _hf_float(d, "rope_local_base_freq", _GEMMA_THETA[1])
    window = _hf_int(d, "sliding_window", None) if "sliding_window" in d else _GEMMA_WINDOW
    types = d.get("layer_types")
    if types is None:
        pattern = _hf_int(d, "sliding_window_pattern", _GEMMA_PATTERN)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if (not isinstance(types, list) or len(types) != layers
            or any(t not in ("sliding_attention", "full_attention") for t in types)):
        raise ConfigError(
            f"config.json: layer_types must list 'sliding_attention' or 'full_attention' for each of "
            f"the {layers} layers (got {types!r})"
        )
    return dict(rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta,
                sliding_window=window, layer_types=tuple(types),
                query_pre_attn_scalar=_hf_float(d, "query_pre_attn_scalar", 256.0))


def model_flops_per_token(cfg: ModelConfig, seq_len: int, adapter_params: float | None = None) -> float:
    """Model FLOPs per trained token, the benchmarks' convention: ``6 N + 6 L h S``.

    ``6 N``: a forward and a backward multiply-add per weight (2 + 4 FLOPs), N counting the
    embedding matrices as the baselines do; ``6 L h S``: causal attention's score and value
    products, half of ``12 L h S``. Recompute is not counted. For a mixture of experts, N is
    the *active* parameters (:meth:`ModelConfig.active_parameters`: attention, norms, each
    sparse layer's router and the num_experts_per_tok experts a token runs through, the dense
    layers, the embeddings), since a token's forward multiplies by those weights only.

    LoRA (``adapter_params``: the adapters' parameters): ``4 N + 6 N_adapter + 6 L h S``. The
    frozen base costs a forward and the backward's input gradients (2 + 2 FLOPs per weight, no
    weight gradient), the adapters a full 6 each; the same count as the all-on-GPU PEFT run's.
    Over a mixture of experts N_adapter too counts the active ones: of a stacked weight's
    per-expert adapters, the num_experts_per_tok a token reaches
    (:func:`flowtrain.plan.adapters.adapter_active_numel`)."""
    n = cfg.active_parameters() if cfg.moe else cfg.num_parameters()
    attention = 6.0 * cfg.num_layers * cfg.hidden_size * seq_len
    if adapter_params is not None:
        return 4.0 * n + 6.0 * adapter_params + attention
    return 6.0 * n + attention


#: Tokens per micro-batch above which a layer's MLP runs in pieces of this many
#: (:mod:`flowtrain.model.mlp`; 16 pieces at 512K tokens).
MLP_CHUNK_TOKENS = 32768


def default_chunk_tokens(vocab_size: int) -> int:
    """Tokens per head chunk: at most ~1 GiB of fp32 logits, between 256 and 4096 tokens."""
    fit = (1 << 30) // (4 * vocab_size)
    return max(256, min(4096, fit // 256 * 256))
