"""The shape of a Llama-family model.

A :class:`ModelConfig` is everything the layer math, the flat maps of its units and the
checkpoint code need to know about a model: sizes, rotary settings and which optional
biases exist. It is a frozen ``msgspec.Struct``, so it hashes, compares by value and
round-trips through JSON; :mod:`flowtrain.model.hf_config` converts it to and from a Hugging
Face ``config.json`` dict::

    cfg = preset("tiny")                        # flowtrain.model.presets; or from_hf(json.load(f))
    cfg.num_parameters()                        # 123,712
    from_hf(to_hf(cfg)) == cfg                  # True (flowtrain.model.hf_config)

The model's description is four modules, each building on the one before:

- :mod:`flowtrain.model.families`: the Hugging Face architectures flowtrain trains, one
  :class:`~flowtrain.model.families.Family` each (which biases, norms, windows and experts
  the layer has, and the defaults of the family's config class); ``cfg.family`` is its row.
- this module: the sizes and options (:class:`ModelConfig`), the bounds a model's sizes must
  keep (:data:`SIZE_BOUNDS`), :meth:`ModelConfig.validate`, which refuses what cannot form a
  model, and the parameter counts (``cfg.num_parameters()``).
- :mod:`flowtrain.model.counts`: model FLOPs per token (:func:`~.counts.model_flops_per_token`).
- :mod:`flowtrain.model.hf_config`: reading and writing ``config.json``
  (:func:`~.hf_config.from_hf`, :func:`~.hf_config.to_hf`), where each key is type- and
  bound-checked and a key left out takes transformers' default.

Sliding windows are applied layer by layer (:meth:`ModelConfig.layer_window`); experts sit in
the layers :meth:`ModelConfig.layer_sparse` names. Anything flowtrain does not implement is
refused with a :class:`~flowtrain.errors.ConfigError` rather than trained wrongly.
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec

from flowtrain.errors import ConfigError

from .families import FAMILIES, GEMMA_PATTERN, GEMMA_THETA, Family, unsupported

__all__ = [
    "FAMILIES",
    "Family",
    "ModelConfig",
    "RopeScaling",
    "short_repr",
]

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
    #: "native": flowtrain's own layer math (the families of :mod:`~flowtrain.model.families`);
    #: "generic": transformers' own modules run over the streamed weights
    #: (:mod:`flowtrain.model.generic`), for any decoder-only model transformers builds
    layer_path: str = "native"
    #: the generic path: the model's ``config.json`` as read (JSON text; written back as it was)
    hf_json: str | None = None
    #: the generic path: each unit's tensors, embed, layers, head: (key, checkpoint name, shape)
    generic_units: tuple[tuple[tuple[str, str, tuple[int, ...]], ...], ...] = ()
    #: the generic path: weights transformers fuses from one checkpoint tensor per expert (name ->
    #: per-expert name templates, :attr:`flowtrain.model.flat_map.Entry.parts`)
    generic_parts: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def __post_init__(self) -> None:
        # head_dim is always an int after construction; None only means "derive it".
        if self.head_dim is None and self.num_heads > 0:
            msgspec.structs.force_setattr(self, "head_dim", self.hidden_size // self.num_heads)
        fam = FAMILIES.get(self.architecture)
        if fam is not None and fam.gemma and self.layer_types is None and self.num_layers > 0:
            # Gemma3TextConfig's default: every GEMMA_PATTERN-th layer attends globally.
            types = tuple("sliding_attention" if (i + 1) % GEMMA_PATTERN else "full_attention"
                          for i in range(self.num_layers))
            msgspec.structs.force_setattr(self, "layer_types", types)
        if fam is not None and fam.gemma:  # Gemma3TextConfig's defaults, spelled out
            if self.rope_local_theta is None:
                msgspec.structs.force_setattr(self, "rope_local_theta", GEMMA_THETA[1])
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
    def generic(self) -> bool:
        """Whether the model runs on the generic layer path (transformers' modules)."""
        return self.layer_path == "generic"

    @property
    def family(self) -> Family:
        """The :class:`Family` of ``architecture``; :class:`ConfigError` if unsupported. On the
        generic path, a family with none of the native layer's options."""
        if self.generic:
            return Family(self.architecture, "generic", self.max_position_embeddings)
        fam = FAMILIES.get(self.architecture)
        if fam is None:
            raise ConfigError(unsupported(self.architecture))
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
        self._check_sizes()
        if self.layer_path not in ("native", "generic"):
            raise ConfigError(f"model config: layer_path must be 'native' or 'generic', got {self.layer_path!r}")
        if self.generic:
            return self._check_generic()
        return self._check_native()

    def _check_generic(self) -> ModelConfig:
        """The generic path's model: transformers built it; its units must match its layers."""
        if self.hf_json is None or len(self.generic_units) != self.num_layers + 2:
            raise ConfigError(f"model config: the generic layer path needs config.json and {self.num_layers + 2} "
                              f"units, got {len(self.generic_units)}")
        self._check_parameter_count()
        return self

    def _check_sizes(self) -> None:
        for name, (_, bound) in SIZE_BOUNDS.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model config: {name} must be a positive integer, got {value!r}")
            if value > bound:
                raise ConfigError(f"model config: {name} {short_repr(value)} is above the bound {bound:,}; "
                                  "no model that size can be trained")

    def _check_native(self) -> ModelConfig:
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
        if self.architecture not in FAMILIES:
            raise ConfigError(unsupported(self.architecture))
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

    # ------------------------------------------------------------------ parameter counts

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
        if self.generic:
            return sum(math.prod(shape) for unit in self.generic_units for _, _, shape in unit)
        embed = self.vocab_size * self.hidden_size
        head = self.hidden_size + (0 if self.tie_word_embeddings else embed)
        if self.moe:
            return embed + sum(self.layer_parameters(i) for i in range(self.num_layers)) + head
        return embed + self.num_layers * self.layer_parameters() + head

    def active_parameters(self) -> int:
        """Parameters one token's forward uses: for a mixture of experts, every weight but the
        experts it is not routed to (the router and num_experts_per_tok experts per sparse
        layer); for a dense model, :meth:`num_parameters`. Model FLOPs count these (6 per
        parameter per token, :func:`~flowtrain.model.counts.model_flops_per_token`)."""
        if self.generic:
            return self._generic_active_parameters()
        if not self.moe:
            return self.num_parameters()
        inactive = sum(self.mlp_parameters(i) - self.mlp_parameters(i, active=True) for i in self.sparse_layers())
        return self.num_parameters() - inactive


    def _generic_active_parameters(self) -> int:
        """The generic path: every weight, but of a stacked expert weight (experts, ...) only
        the num_experts_per_tok experts a token is routed to."""
        assert self.hf_json is not None
        d = json.loads(self.hf_json)
        experts = next((d[k] for k in ("num_experts", "num_local_experts", "n_routed_experts")
                        if isinstance(d.get(k), int) and d[k] > 0), 0)
        per_token = d.get("num_experts_per_tok") or 0
        n = 0
        for unit in self.generic_units[1:-1]:
            for _, _, shape in unit:
                size = math.prod(shape)
                n += size * per_token // experts if experts and len(shape) == 3 and shape[0] == experts else size
        return n + sum(math.prod(s) for u in (self.generic_units[0], self.generic_units[-1]) for _, _, s in u)

    @property
    def separates_documents(self) -> bool:
        """Whether every layer keeps packed documents apart. A native layer and an attention
        layer do (their masks restart at each document); on the generic path a linear-attention,
        state-space or hybrid layer carries its state from one document into the next, so rows
        of such a model hold one example each (``layer_types``, or config keys of such layers)."""
        if not self.generic:
            return True
        if self.layer_types is not None:
            return all("attention" in t and "linear" not in t for t in self.layer_types)
        keys = json.loads(self.hf_json or "{}")
        return not any(k.startswith(("mamba", "ssm", "linear_", "conv_", "recurrent")) for k in keys)

    def attention_layers(self) -> int:
        """Layers whose tokens attend over the sequence (their score and value products cost
        ``6 h S`` per token): every layer, but on the generic path not the linear-attention,
        state-space or recurrent layers its ``layer_types`` name."""
        if not self.generic or self.layer_types is None:
            return self.num_layers
        linear = ("linear", "mamba", "ssm", "recurrent", "conv")
        return sum(1 for t in self.layer_types if not any(w in t for w in linear))


def short_repr(v: Any, limit: int = 80) -> str:
    """``repr(v)`` cut to ``limit`` characters: an error line quotes a value, not a file."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 200:
        return f"an integer of {v.bit_length()} bits"  # str() of a huge int is slow, or refused
    text = repr(v)
    return text if len(text) <= limit else text[: limit - 3] + "..."


#: Tokens per micro-batch above which a layer's MLP runs in pieces of this many
#: (:mod:`flowtrain.model.mlp`; 16 pieces at 512K tokens).
MLP_CHUNK_TOKENS = 32768


def default_chunk_tokens(vocab_size: int) -> int:
    """Tokens per head chunk: at most ~1 GiB of fp32 logits, between 256 and 4096 tokens."""
    fit = (1 << 30) // (4 * vocab_size)
    return max(256, min(4096, fit // 256 * 256))
