"""A :class:`~flowtrain.model.config.ModelConfig` for a model on the generic layer path.

The native path reads each family's keys itself (:mod:`flowtrain.model.hf_config`); the generic
path lets transformers read ``config.json`` and build the model (on the meta device:
:func:`~flowtrain.model.generic.skeleton.skeleton`), then keeps what the rest of flowtrain sizes
from: the units' tensors (the flat maps are cut from them), the sizes the planner and the model
FLOPs use, the special tokens, and the ``config.json`` text itself, which outputs and
checkpoints write back unchanged, so ``from_pretrained`` builds the same model from them::

    cfg = generic_config(json.load(open("config.json")))
    cfg.layer_path, cfg.num_parameters()        # ("generic", 9_653_104_128)
"""

from __future__ import annotations

import json
from typing import Any

from flowtrain.errors import ConfigError

from ..config import ModelConfig
from .routing import load_balance_of
from .skeleton import skeleton

__all__ = ["generic_config"]


def _int(config: Any, *names: str, default: int | None = None) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    if default is None:
        raise ConfigError(f"{type(config).__name__} has none of {', '.join(names)}; the generic layer path sizes "
                          "the model from them")
    return default


def _token(config: Any, name: str) -> int | None:
    value = getattr(config, name, None)
    if isinstance(value, list):  # several end tokens: the first is the one flowtrain appends
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _layer_types(config: Any, layers: int) -> tuple[str, ...] | None:
    types = getattr(config, "layer_types", None)
    if isinstance(types, (list, tuple)) and len(types) == layers and all(isinstance(t, str) for t in types):
        return tuple(types)
    return None


def _conversions(model_type: str) -> list[tuple[tuple[str, ...], str]]:
    """transformers' rules that fuse one checkpoint tensor per expert into a stacked weight,
    as ``(source patterns, target)``: only rules that stack experts along the first dimension
    (and concatenate the sources along the second), the form :attr:`Entry.parts
    <flowtrain.model.flat_map.Entry.parts>` reads."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return []
    rules = []
    for rule in get_checkpoint_conversion_mapping(model_type) or []:
        ops = [(type(op).__name__, getattr(op, "dim", None)) for op in getattr(rule, "operations", [])]
        targets = list(getattr(rule, "target_patterns", []))
        sources = tuple(getattr(rule, "source_patterns", []))
        if type(rule).__name__ == "WeightConverter" and len(targets) == 1 and ops in (
                [("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)]) and all(
                s.count("*") == 1 for s in sources) and len(sources) == (2 if len(ops) == 2 else 1):
            rules.append((sources, targets[0]))
    return rules


def _expert_parts(model_type: str, layers: tuple) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """For each layer weight transformers fuses from per-expert checkpoint tensors, its name
    and the checkpoint's per-expert name templates."""
    rules = _conversions(model_type)
    found = []
    for unit in layers:
        for _, name, shape in unit:
            for sources, target in rules:
                if name.endswith(target) and len(shape) >= 2 and shape[1] % len(sources) == 0:
                    prefix = name[: len(name) - len(target)]
                    found.append((name, tuple(prefix + s.replace("*", "{}") for s in sources)))
    return tuple(found)


def generic_config(d: dict[str, Any]) -> ModelConfig:
    """The model ``config.json`` (``d``) describes, on the generic layer path; a
    :class:`ConfigError` naming the part where the path cannot run it."""
    # what says how a file was stored or made, not what the model is
    d = {k: v for k, v in d.items() if k not in ("transformers_version", "_name_or_path", "dtype", "torch_dtype")}
    text = json.dumps(d, sort_keys=True)
    sk = skeleton(text)
    load_balance_of(text)  # output_router_logits: routers flowtrain cannot find are refused now
    c = sk.model.config
    vocab, hidden = sk.units[0][0][2]
    heads = _int(c, "num_attention_heads", default=1)
    head_dim = _int(c, "head_dim", default=max(1, hidden // heads))
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=_int(c, "intermediate_size", "moe_intermediate_size", "ffn_hidden_size", default=4 * hidden),
        num_layers=len(sk.layers),
        num_heads=heads,
        num_kv_heads=_int(c, "num_key_value_heads", default=heads),
        head_dim=head_dim,
        max_position_embeddings=_int(c, "max_position_embeddings", default=1 << 20),
        tie_word_embeddings=sk.head_name is None,
        initializer_range=float(getattr(c, "initializer_range", 0.02) or 0.02),
        bos_token_id=_token(c, "bos_token_id"),
        eos_token_id=_token(c, "eos_token_id"),
        pad_token_id=_token(c, "pad_token_id"),
        architecture=type(sk.model).__name__,
        layer_types=_layer_types(c, len(sk.layers)),
        layer_path="generic",
        hf_json=text,
        generic_units=sk.units,
        generic_parts=_expert_parts(str(d.get("model_type")), sk.units[1:-1]),
    ).validate()
