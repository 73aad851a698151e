"""LoRA adapters as PEFT keeps them on disk: ``adapter_config.json`` and ``adapter_model.safetensors``.

A folder written by :func:`save_adapter` is what ``peft.PeftModel.from_pretrained(base, folder)``
loads, and :func:`read_adapter` reads what PEFT's ``save_pretrained`` wrote (a LoRA adapter of a
causal LM over the linear maps flowtrain adapts)::

    save_adapter(out, spec, layouts, flats, base_model="meta-llama/Llama-3.2-3B")
    spec, layouts, flats = read_adapter(out, cfg)

The tensors are named as PEFT saves them (``base_model.model.model.layers.0.self_attn.q_proj.
lora_A.weight``: :func:`flowtrain.model.adapters.adapter_flat_maps`). What PEFT can express and
flowtrain does not run (DoRA, per-layer ranks or alphas, trained biases,
extra trained modules, a subset of layers) is refused in one line naming the setting, rather
than read as something else. ``target_modules`` is read as PEFT matches it against the model's
module names: a map's own name (``q_proj``), its full name (``model.layers.3.self_attn.q_proj``,
as PEFT saves ``all-linear`` over a model of fewer than 20 maps) or a regular expression; the
maps it reaches, less those ``exclude_modules`` names (a dense model's), must be the same in
every layer, as must ``layers_to_transform`` name every layer. rsLoRA's scaling
(``use_rslora``) is read and written.

A mixture of experts' router and stacked experts are adapted as PEFT adapts them over
transformers 5: named in ``target_parameters`` (``gate.weight``, ``gate_up_proj``, ``down_proj``),
the gate-and-up adapter's rank and alpha in ``rank_pattern`` / ``alpha_pattern`` where they are
not ``r`` and ``lora_alpha``. A config naming the experts' maps as PEFT did before (``gate_proj``,
``up_proj``, ``down_proj``, ``gate``; Mixtral's ``w1``, ``w3``, ``w2``) is read as PEFT converts it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from flowtrain.errors import CheckpointError
from flowtrain.model.adapters import DEFAULT_TARGETS, LoraSpec, adapter_flat_maps, linear_maps
from flowtrain.model.config import ModelConfig
from flowtrain.model.flat_map import FlatMap, bind

from .hf import fsync_dir, write_safetensors

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "adapter_config_text", "read_adapter", "read_spec", "save_adapter"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

#: PEFT settings flowtrain does not run, and the value that means "off" (as written);
#: ``rank_pattern`` and ``alpha_pattern`` are read where they name the experts' gate_up_proj only
_UNSUPPORTED = {"use_dora": False, "bias": "none",
                "modules_to_save": None, "fan_in_fan_out": False, "lora_bias": False,
                "alora_invocation_tokens": None}

#: a mixture of experts' parameters as PEFT names them in target_parameters, and flowtrain's targets
_PARAMETERS = {"gate.weight": ("router",), "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
#: the names PEFT converts from target_modules into target_parameters, per family of experts
_CONVERTED = {"qwen3": {"gate": "router", "gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"},
              "mixtral": {"gate": "router", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}}
_GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"


def _pattern_hits(key: str, names: list[str]) -> list[str]:
    """The names a ``rank_pattern`` / ``alpha_pattern`` key reaches, matched as PEFT matches them
    (``(.*[.])?(key)$``); a key that is no regular expression reaches all of them."""
    try:
        pattern = re.compile(rf"(.*\.)?({key})$")
    except re.error:
        return names
    return [n for n in names if pattern.match(n)]


def _fused_rank(config: dict[str, Any], path: Path, gate_up: bool, spec: LoraSpec) -> int | None:
    """The experts' gate-and-up rank a config's ``rank_pattern`` sets (None: none), after
    checking that its patterns reach that weight only and keep the scale of ``lora_alpha`` and
    ``r`` (``spec``'s rule: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA).
    PEFT also writes patterns naming experts the adapter does not adapt, which it ignores."""
    adapted = [f"model.layers.{i}.{part}.{t}" for i in range(1024) for part in ("self_attn", "mlp")
               for t in DEFAULT_TARGETS] + [f"model.layers.{i}.mlp.{p}" for i in range(1024)
                                            for p in ("gate.weight", "experts.down_proj")]
    ranks: dict[str, float] = {}
    for field in ("rank_pattern", "alpha_pattern"):
        patterns = config.get(field) or {}
        if not isinstance(patterns, dict):
            raise CheckpointError(f"{path}: {field} = {patterns!r} is a PEFT setting flowtrain does not run")
        for key, value in patterns.items():
            if _pattern_hits(key, adapted):
                raise CheckpointError(f"{path}: {field} {key!r}: per-map ranks and alphas are a PEFT setting flowtrain "
                                      "runs only for the experts' gate_up_proj")
            if gate_up and _pattern_hits(key, [_GATE_UP]):
                ranks[field] = value
    if not ranks:
        return None
    rank, alpha = ranks.get("rank_pattern", config["r"]), ranks.get("alpha_pattern", config["lora_alpha"])
    if abs(spec.scale_at(rank, alpha) - spec.scale) > 1e-9 * abs(spec.scale):
        raise CheckpointError(f"{path}: the experts' gate_up_proj has rank {rank} and alpha {alpha}, a scale other "
                              f"than the other adapters'; flowtrain runs one scale for every adapter")
    return int(rank)


def _is_off(value: Any, off: Any) -> bool:
    """Whether a PEFT setting's value leaves it off: absent, None, false, empty, or the off value
    itself. A number is a choice (``layers_to_transform: 0`` names layer 0)."""
    if value is None or isinstance(value, bool):
        return not value
    if isinstance(value, (dict, list, str)):
        return not value or value == off
    return False


def _config(spec: LoraSpec, layouts: Sequence[FlatMap], base_model: str | None) -> dict[str, Any]:
    """What PEFT reads: the linear maps the layouts adapt in ``target_modules``, a mixture of
    experts' router and stacked weights in ``target_parameters`` (the gate-and-up adapter's rank in
    ``rank_pattern`` where it is not ``r``)."""
    keys = {e.key.removesuffix(".lora_A") for lay in layouts for e in lay.entries if e.key.endswith(".lora_A")}
    names = {"router": "gate.weight", "experts_gate_up": "gate_up_proj", "experts_down": "down_proj"}
    parameters = sorted(names[k] for k in keys if k in names)
    ranks: dict[str, Any] = {}
    alphas: dict[str, Any] = {}
    if "experts_gate_up" in keys and spec.gate_up_rank != spec.rank:  # (never with rsLoRA: check_model)
        ranks[r".*\.gate_up_proj"] = spec.gate_up_rank
        alphas[r".*\.gate_up_proj"] = spec.alpha * spec.gate_up_rank / spec.rank
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
            "lora_dropout": spec.dropout, "target_modules": sorted(keys - set(names)),
            "target_parameters": parameters or None, "rank_pattern": ranks, "alpha_pattern": alphas,
            "base_model_name_or_path": _reference(base_model), "inference_mode": True, "init_lora_weights": True,
            "layers_pattern": None, "revision": None, "use_rslora": spec.rslora, "layers_to_transform": None,
            "exclude_modules": None, **_UNSUPPORTED}


def _reference(base_model: str | None) -> str | None:
    """How the adapter names its base for PEFT: a local folder by its absolute path (a relative
    one would resolve against wherever the adapter is loaded from), a Hub id or preset as given."""
    if base_model is not None and os.path.isdir(base_model):
        return os.path.abspath(base_model)
    return base_model


def adapter_config_text(spec: LoraSpec, layouts: Sequence[FlatMap], base_model: str | None = None) -> str:
    """The ``adapter_config.json`` PEFT reads for the adapters of ``layouts`` (of ``spec``) over
    ``base_model``."""
    return json.dumps(_config(spec, layouts, base_model), indent=2) + "\n"


def save_adapter(out_dir: str | os.PathLike[str], spec: LoraSpec, layouts: Sequence[FlatMap],
                 flats: Sequence[Tensor], base_model: str | None = None, dtype: torch.dtype = torch.float32) -> None:
    """Write ``flats`` (one buffer per adapter flat map) as a PEFT adapter in ``out_dir``: the
    weights first, then the config, each to a temporary name renamed into place, so a folder
    holding ``adapter_config.json`` holds the weights it describes."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = [(e.name, bind(flat, lay)[e.key]) for lay, flat in zip(layouts, flats) for e in lay.entries]
    tmp = out / f".{ADAPTER_WEIGHTS}.tmp"
    write_safetensors(tmp, tensors, dtype, metadata={"format": "pt"})
    os.replace(tmp, out / ADAPTER_WEIGHTS)
    tmp = out / f".{ADAPTER_CONFIG}.tmp"
    with open(tmp, "w") as f:
        f.write(adapter_config_text(spec, layouts, base_model))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out / ADAPTER_CONFIG)
    fsync_dir(out)


def read_spec(adapter_dir: str | os.PathLike[str], cfg: ModelConfig | None = None) -> LoraSpec:
    """The adapter's rank, alpha, targets and dropout from its ``adapter_config.json``, its
    names read as PEFT reads them over the model ``cfg`` (None: a dense one); ``CheckpointError``
    naming the file and the setting where flowtrain cannot run it."""
    path = Path(adapter_dir) / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{adapter_dir} holds no {ADAPTER_CONFIG}: not a PEFT adapter folder") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise CheckpointError(f"{path} is not a LoRA adapter (peft_type {config.get('peft_type')!r})"
                              if isinstance(config, dict) else f"{path} is not a PEFT adapter config")
    for key, off in _UNSUPPORTED.items():
        if not _is_off(config.get(key), off):
            raise CheckpointError(f"{path}: {key} = {config[key]!r} is a PEFT setting flowtrain does not run")
    try:
        targets, direct = _targets(config, path, cfg)
        spec = LoraSpec(rank=int(config["r"]), alpha=float(config["lora_alpha"]), targets=targets,
                        dropout=float(config.get("lora_dropout") or 0.0), rslora=bool(config.get("use_rslora")))
        fused = _fused_rank(config, path, "gate_proj" in targets, spec)
        if fused is None and direct:  # named as gate_up_proj, with no pattern: the rank r
            fused = spec.rank
        spec = msgspec.structs.replace(spec, fused_rank=fused)
        spec.validate()
        if cfg is not None:
            spec.check_model(cfg)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise CheckpointError(f"{path}: {e}") from None
    return spec


def _targets(config: dict[str, Any], path: Path, cfg: ModelConfig | None) -> tuple[tuple[str, ...], bool]:
    """flowtrain's targets for a config's ``target_modules`` and ``target_parameters``, and
    whether the experts' gate_up_proj was named as itself (then its rank is ``r`` unless a
    pattern says otherwise; PEFT gives ``gate_proj`` and ``up_proj`` converted into it twice ``r``)."""
    modules = config.get("target_modules")
    _check_layers(config, path, cfg, regex=isinstance(modules, str) and modules.lower() != "all-linear")
    if cfg is not None and cfg.generic:
        return _generic_targets(config, path, cfg), False
    model = cfg
    if isinstance(modules, str) and modules.lower() == "all-linear":  # every linear map, a router and experts
        modules, cfg = list(DEFAULT_TARGETS), None
    elif modules is None:
        modules = []
    elif isinstance(modules, str) and cfg is not None and not cfg.moe:
        modules = _by_path(_matched(modules, cfg, path), cfg, path)
    elif isinstance(modules, str) or not isinstance(modules, list):
        raise CheckpointError(f"{path}: target_modules {modules!r}: give the maps as a list "
                              f"(of {', '.join(DEFAULT_TARGETS)})")
    elif any("." in str(name) for name in modules):  # as PEFT saves all-linear over a model of few maps
        modules = _by_path(modules, cfg, path)
    converted = _CONVERTED.get(cfg.family.moe or "", {}) if cfg is not None and cfg.sparse_layers() else {}
    targets: list[str] = []
    for name in modules:
        if name in converted:
            targets.append(converted[name])
        elif converted and name in ("gate_proj", "up_proj", "down_proj"):
            continue  # Mixtral has no such maps: PEFT adapts nothing by these names
        else:
            targets.append(name)
    parameters = config.get("target_parameters") or []
    if not isinstance(parameters, list):
        raise CheckpointError(f"{path}: target_parameters {parameters!r}: give them as a list")
    direct = False
    for name in parameters:
        found = [p for p in _PARAMETERS if name == p or name.endswith("." + p)]
        if not found:
            raise CheckpointError(f"{path}: target_parameters {name!r}: flowtrain adapts a mixture of experts' "
                                  f"{', '.join(_PARAMETERS)}")
        targets += _PARAMETERS[found[0]]
        direct = direct or found[0] == "gate_up_proj"
    if not _is_off(config.get("exclude_modules"), None):
        targets = _without_excluded(targets, config["exclude_modules"], model, path)
    known = [t for t in DEFAULT_TARGETS if t in targets]  # in one order, whatever order the file lists them in
    return tuple(known + [t for t in dict.fromkeys(targets) if t not in known]), direct


def _generic_targets(config: dict[str, Any], path: Path, cfg: ModelConfig) -> tuple[str, ...]:
    """The targets of an adapter over a model on the generic layer path: the names of the
    layers' linear maps that ``target_modules`` reaches as PEFT matches it (a list of names,
    whole or as their last parts; a pattern against the whole module name; ``all-linear``)."""
    maps = set(linear_maps(cfg))
    modules = config.get("target_modules")
    if config.get("target_parameters") or not _is_off(config.get("exclude_modules"), None):
        raise CheckpointError(f"{path}: target_parameters and exclude_modules are PEFT settings flowtrain does not run "
                              f"over {cfg.architecture} (the generic layer path)")
    if isinstance(modules, str) and modules.lower() == "all-linear":
        reached = maps
    elif isinstance(modules, str):
        regex = _regex("target_modules", modules, path)
        reached = {m for m in maps if regex.fullmatch(m)}
    elif isinstance(modules, list) and all(isinstance(n, str) for n in modules):
        reached = {m for m in maps if any(m == n or m.endswith("." + n) for n in modules)}
    else:
        raise CheckpointError(f"{path}: target_modules {modules!r}: give the maps as a list of names")
    if not reached:
        raise CheckpointError(f"{path}: target_modules {modules!r} reaches no linear map of {cfg.architecture}'s layers")
    return tuple(sorted({m.rsplit(".", 1)[-1] for m in reached}))


def _check_layers(config: dict[str, Any], path: Path, cfg: ModelConfig | None, regex: bool) -> None:
    """``layers_to_transform`` (PEFT applies it to a list of targets, not to a pattern) naming
    every layer of the model adapts what it would without it; some layers only are refused."""
    layers = config.get("layers_to_transform")
    if regex or _is_off(layers, None):
        return
    named = {layers} if isinstance(layers, int) else set(layers) if isinstance(layers, list) else None
    pattern = config.get("layers_pattern")
    if named is None or not _is_off(pattern, None) and pattern not in ("layers", ["layers"]):
        raise CheckpointError(f"{path}: layers_to_transform = {layers!r} (layers_pattern {pattern!r}) is a PEFT "
                              "setting flowtrain runs only naming every layer")
    if cfg is not None and named != set(range(cfg.num_layers)):
        some = ", ".join(str(i) for i in sorted(named))
        raise CheckpointError(f"{path}: layers_to_transform adapts layers {some} of the model's {cfg.num_layers}; "
                              "flowtrain adapts a map in every layer")


def _without_excluded(targets: list[str], exclude: Any, cfg: ModelConfig | None, path: Path) -> list[str]:
    """The targets PEFT's ``exclude_modules`` leaves, matched as PEFT matches them (a pattern
    against the whole module name; a list's names whole or as its last parts), over a dense
    model; what is left must be the same maps in every layer."""
    if cfg is None or cfg.moe:
        raise CheckpointError(f"{path}: exclude_modules = {exclude!r} over a mixture of experts is a PEFT setting "
                              "flowtrain does not run")
    names = _map_names(cfg, targets)
    if isinstance(exclude, str):
        regex = _regex("exclude_modules", exclude, path)
        kept = [n for n in names if not regex.fullmatch(n)]
    elif isinstance(exclude, list):
        kept = [n for n in names if n not in exclude and not any(n.endswith(f".{e}") for e in exclude)]
    else:
        raise CheckpointError(f"{path}: exclude_modules {exclude!r}: give a list of names or a pattern")
    if not kept:
        raise CheckpointError(f"{path}: exclude_modules {exclude!r} leaves none of the targets to adapt")
    return _by_path(kept, cfg, path)


_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_MAP_PATH = re.compile(r"(?:.*\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)")


def _map_names(cfg: ModelConfig, targets: Sequence[str] = _ATTENTION + _MLP) -> list[str]:
    """The full module names of a dense model's maps among ``targets``, layer by layer, as PEFT
    matches ``target_modules`` and ``exclude_modules`` against them."""
    return [f"model.layers.{i}.{part}.{t}" for i in range(cfg.num_layers)
            for part, maps in (("self_attn", _ATTENTION), ("mlp", _MLP)) for t in maps if t in targets]


def _regex(field: str, pattern: str, path: Path) -> re.Pattern[str]:
    """A config's ``field`` given as a regular expression, compiled; one that is none is refused."""
    try:
        return re.compile(pattern)
    except re.error as e:
        raise CheckpointError(f"{path}: {field} {pattern!r} is no regular expression: {e}") from None


def _matched(pattern: str, cfg: ModelConfig, path: Path) -> list[str]:
    """The module names of a dense model that a ``target_modules`` regular expression reaches, as
    PEFT matches them (the whole name); one reaching the head or the embedding, or nothing, is
    refused."""
    regex = _regex("target_modules", pattern, path)
    for other in ("lm_head", "model.embed_tokens"):  # PEFT adapts these too; flowtrain does not
        if regex.fullmatch(other):
            raise CheckpointError(f"{path}: target_modules {pattern!r} reaches {other}; flowtrain adapts the maps "
                                  f"of attention and the MLP ({', '.join(_ATTENTION + _MLP)})")
    hits = [n for n in _map_names(cfg) if regex.fullmatch(n)]
    if not hits:
        raise CheckpointError(f"{path}: target_modules {pattern!r} reaches none of the model's maps "
                              f"({', '.join(_ATTENTION + _MLP)} of its layers)")
    return hits


def _by_path(modules: list[Any], cfg: ModelConfig | None, path: Path) -> list[str]:
    """A ``target_modules`` list whose maps are named by their full module names
    (``model.layers.3.self_attn.q_proj``), beside or instead of their own names, as the names
    flowtrain adapts in every layer. A map adapted in some layers only is refused, as is a dense
    MLP of a mixture of experts (PEFT adapts it by its full name; flowtrain does not)."""
    layers: dict[str, set[int]] = {}
    short = [name for name in modules if "." not in str(name)]  # a map's own name: every layer's
    for name in (name for name in modules if "." in str(name)):
        m = _MAP_PATH.fullmatch(str(name))
        if m is None or m[3] not in (_ATTENTION if m[2] == "self_attn" else _MLP):
            raise CheckpointError(f"{path}: target_modules {name!r}: flowtrain adapts "
                                  f"{', '.join(_ATTENTION)} (self_attn) and {', '.join(_MLP)} (mlp) of every layer")
        layers.setdefault(m[3], set()).add(int(m[1]))
    if cfg is not None:
        for target, got in layers.items():
            if target in _MLP and cfg.moe:
                raise CheckpointError(f"{path}: target_modules adapt {target} of a dense layer by its full name; "
                                      "flowtrain gives a mixture of experts' dense layers no MLP adapters")
            if got != set(range(cfg.num_layers)):
                some = ", ".join(str(i) for i in sorted(got))
                raise CheckpointError(f"{path}: target_modules adapt {target} in layers {some} of the model's "
                                      f"{cfg.num_layers}; flowtrain adapts a map in every layer")
    return short + [t for t in layers if t not in short]


def _dense_mlp_note(extra: list[str], cfg: ModelConfig) -> str:
    """Why a file's extra tensors have no place, where they are adapters on a mixture of
    experts' dense-layer MLP: PEFT 0.22's ``all-linear`` makes those, PEFT up to 0.21 and
    flowtrain do not (docs/lora.md, "PEFT versions"). Empty otherwise."""
    if not cfg.sparse_layers():
        return ""
    for name in extra:
        match = _MAP_PATH.match(name)
        if (match and ".lora_" in name and match.group(2) == "mlp" and match.group(3) in _MLP
                and not cfg.layer_sparse(int(match.group(1)))):
            return (f" (adapters on the MLP of layer {match.group(1)}, a layer without experts, as PEFT 0.22's "
                    "all-linear makes them in a mixture of experts: flowtrain runs PEFT 0.21's layout, "
                    "without them)")
    return ""


def read_adapter(adapter_dir: str | os.PathLike[str], cfg: ModelConfig
                 ) -> tuple[LoraSpec, list[FlatMap], list[Tensor]]:
    """A PEFT adapter for the model ``cfg``: its spec, its layouts and one fp32 buffer per
    layer. Every tensor the layouts name must be there with its shape, finite, and no other."""
    spec = read_spec(adapter_dir, cfg)
    layouts = adapter_flat_maps(cfg, spec)
    path = Path(adapter_dir) / ADAPTER_WEIGHTS
    flats = [torch.zeros(lay.numel) for lay in layouts]
    wanted = {e.name: (lay, flat, e) for lay, flat in zip(layouts, flats) for e in lay.entries}
    try:
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())
            missing, extra = sorted(set(wanted) - names), sorted(names - set(wanted))
            if missing or extra:
                raise CheckpointError(f"{path} does not fit the model: "
                                      + (f"{len(missing)} tensors missing, the first {missing[0]}" if missing else
                                         f"{len(extra)} tensors it has no place for, the first {extra[0]}")
                                      + _dense_mlp_note(extra, cfg))
            for name, (lay, flat, e) in wanted.items():
                t = f.get_tensor(name)
                if tuple(t.shape) != e.shape:
                    raise CheckpointError(f"{path}: {name} has shape {tuple(t.shape)}, the model needs {e.shape}")
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):  # training would only spread it
                    raise CheckpointError(f"{path}: the adapter weight {name} holds NaN or inf")
                bind(flat, lay)[e.key].copy_(t)
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    return spec, layouts, flats
