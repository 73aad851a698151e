"""Reading and writing a Hugging Face ``config.json``.

:func:`from_hf` turns the dict of a model folder's ``config.json`` into a
:class:`~flowtrain.model.config.ModelConfig`, and :func:`to_hf` writes one back that
transformers loads into the same architecture::

    cfg = from_hf(json.load(open("model/config.json")))
    from_hf(to_hf(cfg)) == cfg                             # True

Reading is where a file from elsewhere meets flowtrain, so it trusts nothing. Each key is read
with its type checked (:func:`_hf_int` refuses ``4.5``, ``true`` and ``"lots"`` where an integer
belongs, :func:`_hf_float` NaN and infinities, :func:`_hf_bool` the string ``"false"``) and a
size against its bound (:data:`~flowtrain.model.config.SIZE_BOUNDS`) before anything is sized
from it. A key left out takes what the family's transformers config class would take
(:class:`~flowtrain.model.families.Family`), so the model read is the model transformers would
build from the same file. The rest is spelling that differs by family and by transformers
version, one helper each: the rotary base and scaling (:func:`_rope`, :func:`_rope_scaling`:
``rope_parameters`` in transformers 5, ``rope_theta`` and ``rope_scaling`` in 4), which layers
slide (:func:`_sliding_window`), Gemma 3's two rotary bases and layer types
(:func:`_gemma_fields`) and the experts of a mixture (:func:`_moe_fields`). Whatever flowtrain
does not implement (another activation, MLP biases, soft-capping, router jitter, another
rope scaling) is refused with a :class:`~flowtrain.errors.ConfigError` that names the key.

Writing spells the rotary settings both ways, so transformers 4 and 5 both read the file, and
refuses a config its architecture cannot express (biases or a window the family lacks).
"""

from __future__ import annotations

import json

import math
from typing import Any

import msgspec

from flowtrain.errors import ConfigError

from .config import SIZE_BOUNDS, ModelConfig, RopeScaling, short_repr
from .families import (
    FAMILIES,
    GEMMA_PATTERN,
    GEMMA_THETA,
    GEMMA_WINDOW,
    MISTRAL_WINDOW,
    QWEN_FULL_LAYERS,
    QWEN_WINDOW,
    Family,
    unsupported,
)

__all__ = ["from_hf", "to_hf"]


_REQUIRED_HF_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)

#: config.json key -> the largest value accepted (:data:`~flowtrain.model.config.SIZE_BOUNDS`)
_HF_BOUNDS = {key: bound for key, bound in SIZE_BOUNDS.values()}


#: ``--layer-path``: "auto" runs a family flowtrain has layer math for natively, any other
#: architecture on the generic path; "native" and "generic" force one.
LAYER_PATHS = ("auto", "native", "generic")


def from_hf(d: dict[str, Any], layer_path: str = "auto") -> ModelConfig:
    """Read a Hugging Face ``config.json`` dict; :class:`ConfigError` if unsupported or if
    a value has the wrong type ("lots", 4.5, true where an integer belongs), is out of
    range or not finite. An absent or null optional key takes transformers' default.

    ``layer_path`` (:data:`LAYER_PATHS`): on the generic path transformers reads the file
    (:mod:`flowtrain.model.generic`)."""
    if not isinstance(d, dict):
        raise ConfigError(f"config.json must hold a JSON object, got {type(d).__name__}")
    if layer_path not in LAYER_PATHS:
        raise ConfigError(f"layer path must be one of {', '.join(LAYER_PATHS)} (got {layer_path!r})")
    if layer_path == "generic" or (layer_path == "auto" and not _native(d)):
        from .generic.describe import generic_config  # torch and transformers: only for this path

        return generic_config(d)
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
    cfg = ModelConfig(
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


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """A ``config.json`` dict that transformers loads into the same architecture.

    Rotary settings are written both as ``rope_parameters`` (transformers 5) and as
    ``rope_theta``/``rope_scaling`` (transformers 4), so either version reads them.
    """
    cfg.validate()
    if cfg.generic:  # the model's own config.json, as it was read
        assert cfg.hf_json is not None
        return dict(json.loads(cfg.hf_json))
    _check_exportable(cfg)
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    rope_scaling = None
    if cfg.rope_scaling is not None:
        rope_scaling = msgspec.structs.asdict(cfg.rope_scaling)
        rope_parameters = {**rope_scaling, "rope_theta": cfg.rope_theta}
    d: dict[str, Any] = {
        "architectures": [cfg.architecture],
        "model_type": cfg.family.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "initializer_range": cfg.initializer_range,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    fam = cfg.family
    if fam.attention_bias:
        d.update(attention_bias=cfg.attention_bias)
    if cfg.architecture == "LlamaForCausalLM":
        d.update(mlp_bias=False, pretraining_tp=1)
    match fam.window:
        case "mistral":
            d.update(sliding_window=cfg.sliding_window)
        case "qwen":
            slides = cfg.sliding_window is not None
            d.update(use_sliding_window=slides, sliding_window=cfg.sliding_window,
                     max_window_layers=cfg.max_window_layers if slides else cfg.num_layers)
        case "gemma":
            _gemma_to_hf(cfg, d)
        case "mixtral":
            d.update(sliding_window=cfg.sliding_window)
        case "qwen_moe":
            d.update(use_sliding_window=cfg.sliding_window is not None,
                     sliding_window=cfg.sliding_window)
    if cfg.moe:
        _moe_to_hf(cfg, d)
    return d


def _check_exportable(cfg: ModelConfig) -> None:
    """Each Hugging Face architecture fixes which biases and windows exist; refuse a
    mismatch."""
    fam, arch = cfg.family, cfg.architecture
    if fam.qkv_bias and (cfg.attention_bias or not cfg.qkv_bias):
        raise ConfigError(
            f"model config: {arch} always has biases on q, k and v and none on o; "
            "set qkv_bias=True and attention_bias=False"
        )
    if not fam.qkv_bias and not fam.attention_bias and cfg.has_qkv_bias:
        raise ConfigError(
            f"model config: {arch} has no attention biases; "
            "use architecture LlamaForCausalLM for a model with biases"
        )
    if not fam.qkv_bias and cfg.qkv_bias and not cfg.attention_bias:
        raise ConfigError(
            f"model config: {arch} cannot express q/k/v-only biases; "
            "use architecture Qwen2ForCausalLM or attention_bias=True"
        )
    every_layer = fam.window in ("mistral", "mixtral", "qwen_moe")
    if cfg.sliding_window is not None and (
        fam.window == "none" or (every_layer and cfg.max_window_layers)
    ):
        raise ConfigError(
            f"model config: {arch} cannot express a sliding window"
            + (" on some layers only" if every_layer else "")
            + "; set sliding_window=None or choose a family that has one"
        )


def _moe_to_hf(cfg: ModelConfig, d: dict[str, Any]) -> None:
    """The experts' keys as each family's config class spells them."""
    d.update(num_experts_per_tok=cfg.num_experts_per_tok, output_router_logits=cfg.output_router_logits,
             router_aux_loss_coef=cfg.router_aux_loss_coef)
    if cfg.family.moe == "mixtral":
        d.update(num_local_experts=cfg.num_experts, router_jitter_noise=0.0)
    else:  # Qwen3MoeConfig reads num_experts (and maps num_local_experts onto it)
        d.update(num_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_intermediate_size,
                 norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=cfg.decoder_sparse_step,
                 mlp_only_layers=list(cfg.mlp_only_layers))


def _gemma_to_hf(cfg: ModelConfig, d: dict[str, Any]) -> None:
    """Gemma 3's spelling: its activation key, two rotary bases, layer types, score scale."""
    del d["hidden_act"]
    local = cfg.rope_local_theta
    d["rope_parameters"] = {"full_attention": d["rope_parameters"],
                            "sliding_attention": {"rope_type": "default", "rope_theta": local}}
    types = cfg.layer_types or ()
    scalar = cfg.query_pre_attn_scalar
    d.update(hidden_activation="gelu_pytorch_tanh", rope_local_base_freq=local,
             sliding_window=cfg.sliding_window, layer_types=list(types),
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


def _sliding_window(d: dict[str, Any], fam: Family, layers: int) -> tuple[int | None, int]:
    """``(window, max_window_layers)`` as transformers reads them; ``(None, 0)`` when no
    layer slides (then the window cannot matter and is dropped)."""
    match fam.window:
        case "mistral":
            # An absent key means MistralConfig's 4096, an explicit null no window.
            window = _hf_int(d, "sliding_window", None) if "sliding_window" in d else MISTRAL_WINDOW
            return window, 0
        case "qwen":
            if not _hf_bool(d, "use_sliding_window", False):
                return None, 0
            window = _hf_int(d, "sliding_window", None) if "sliding_window" in d else QWEN_WINDOW
            full = _hf_int(d, "max_window_layers", QWEN_FULL_LAYERS, minimum=0)
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
            return (_hf_int(d, "sliding_window", None) if "sliding_window" in d else QWEN_WINDOW), 0
    return None, 0


def _native(d: dict[str, Any]) -> bool:
    """Whether ``d`` names a family flowtrain has layer math for (or names no architecture,
    which the native reader refuses in its own words)."""
    archs = d.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str):
        return True
    return archs[0] in FAMILIES or not archs[0].endswith("ForCausalLM")


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
                f"{', '.join(FAMILIES)}"
            )
    if arch not in FAMILIES:
        raise ConfigError(unsupported(arch))
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
        theta = _hf_float(full, "rope_theta", GEMMA_THETA[0], where="rope_parameters.full_attention.")
        scaling = _rope_scaling(full, "rope_parameters.full_attention.")
        local_theta = _hf_float(local, "rope_theta", GEMMA_THETA[1], where="rope_parameters.sliding_attention.")
        if _rope_scaling(local, "rope_parameters.sliding_attention.") is not None:
            raise ConfigError("config.json scales the rotary of sliding layers; flowtrain scales global layers only")
    else:
        theta, scaling = _rope(d, theta_default=GEMMA_THETA[0])
        local_theta = _hf_float(d, "rope_local_base_freq", GEMMA_THETA[1])
    window = _hf_int(d, "sliding_window", None) if "sliding_window" in d else GEMMA_WINDOW
    types = d.get("layer_types")
    if types is None:
        pattern = _hf_int(d, "sliding_window_pattern", GEMMA_PATTERN)
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
