"""LoRA adapters as PEFT keeps them on disk: ``adapter_config.json`` and ``adapter_model.safetensors``.

A folder written by :func:`save_adapter` is what ``peft.PeftModel.from_pretrained(base, folder)``
loads, and :func:`read_adapter` reads what PEFT's ``save_pretrained`` wrote (a LoRA adapter of a
causal LM over the linear maps flowtrain adapts)::

    save_adapter(out, spec, layouts, flats, base_model="meta-llama/Llama-3.2-3B")
    spec, layouts, flats = read_adapter(out, cfg)

The tensors are named as PEFT saves them (``base_model.model.model.layers.0.self_attn.q_proj.
lora_A.weight``: :func:`flowtrain.model.adapters.adapter_layouts`). What PEFT can express and
flowtrain does not run (DoRA, rsLoRA's scaling, per-layer ranks or alphas, trained biases,
extra trained modules, a subset of layers) is refused in one line naming the setting, rather
than read as something else.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from flowtrain.errors import CheckpointError
from flowtrain.model.adapters import DEFAULT_TARGETS, LoraSpec, adapter_layouts
from flowtrain.model.config import ModelConfig
from flowtrain.model.layout import UnitLayout, bind

from .hf import fsync_dir, write_safetensors

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "adapter_config_text", "read_adapter", "read_spec", "save_adapter"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

#: PEFT settings flowtrain does not run, and the value that means "off" (as written)
_UNSUPPORTED = {"use_dora": False, "use_rslora": False, "rank_pattern": {}, "alpha_pattern": {}, "bias": "none",
                "modules_to_save": None, "layers_to_transform": None, "fan_in_fan_out": False, "lora_bias": False,
                "target_parameters": None, "exclude_modules": None, "alora_invocation_tokens": None}


def _reaches_no_target(patterns: dict) -> bool:
    """Whether none of a ``rank_pattern`` / ``alpha_pattern``'s keys names a map flowtrain adapts
    (PEFT matches a key against a module's name as ``(.*[.])?(key)$``). PEFT writes some for a
    mixture of experts' stacked expert weights, which it then ignores itself."""
    names = [f"model.layers.{i}.{part}.{t}" for i in range(1024) for part in ("self_attn", "mlp")
             for t in DEFAULT_TARGETS]
    try:
        keys = [re.compile(rf"(.*\.)?({k})$") for k in patterns]
    except re.error:
        return False
    return not any(k.match(n) for k in keys for n in names)


def _is_off(value: Any, off: Any) -> bool:
    """Whether a PEFT setting's value leaves it off: absent, None, false, empty, or the off value
    itself. A number is a choice (``layers_to_transform: 0`` names layer 0)."""
    if value is None or isinstance(value, bool):
        return not value
    if isinstance(value, (dict, list, str)):
        return not value or value == off
    return False


def _config(spec: LoraSpec, base_model: str | None) -> dict[str, Any]:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
            "lora_dropout": spec.dropout, "target_modules": sorted(spec.targets), "base_model_name_or_path": base_model,
            "inference_mode": True, "init_lora_weights": True, "layers_pattern": None, "revision": None,
            **_UNSUPPORTED}


def adapter_config_text(spec: LoraSpec, base_model: str | None = None) -> str:
    """The ``adapter_config.json`` PEFT reads for adapters of ``spec`` over ``base_model``."""
    return json.dumps(_config(spec, base_model), indent=2) + "\n"


def save_adapter(out_dir: str | os.PathLike[str], spec: LoraSpec, layouts: Sequence[UnitLayout],
                 flats: Sequence[Tensor], base_model: str | None = None, dtype: torch.dtype = torch.float32) -> None:
    """Write ``flats`` (one buffer per adapter layout) as a PEFT adapter in ``out_dir``: the
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
        f.write(adapter_config_text(spec, base_model))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out / ADAPTER_CONFIG)
    fsync_dir(out)


def read_spec(adapter_dir: str | os.PathLike[str]) -> LoraSpec:
    """The adapter's rank, alpha, targets and dropout from its ``adapter_config.json``;
    ``CheckpointError`` naming the file and the setting where flowtrain cannot run it."""
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
        value = config.get(key)
        if key in ("rank_pattern", "alpha_pattern") and isinstance(value, dict) and _reaches_no_target(value):
            continue
        if not _is_off(value, off):
            raise CheckpointError(f"{path}: {key} = {config[key]!r} is a PEFT setting flowtrain does not run")
    targets = config.get("target_modules")
    if targets == "all-linear":
        targets = DEFAULT_TARGETS
    elif isinstance(targets, str) or not isinstance(targets, list):
        raise CheckpointError(f"{path}: target_modules {targets!r}: give the maps as a list "
                              f"(of {', '.join(DEFAULT_TARGETS)})")
    try:
        spec = LoraSpec(rank=int(config["r"]), alpha=float(config["lora_alpha"]), targets=tuple(targets),
                        dropout=float(config.get("lora_dropout") or 0.0))
        spec.validate()
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: {e}") from None
    return spec


def read_adapter(adapter_dir: str | os.PathLike[str], cfg: ModelConfig
                 ) -> tuple[LoraSpec, list[UnitLayout], list[Tensor]]:
    """A PEFT adapter for the model ``cfg``: its spec, its layouts and one fp32 buffer per
    layer. Every tensor the layouts name must be there with its shape, and no other."""
    spec = read_spec(adapter_dir)
    layouts = adapter_layouts(cfg, spec)
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
                                         f"{len(extra)} tensors it has no place for, the first {extra[0]}"))
            for name, (lay, flat, e) in wanted.items():
                t = f.get_tensor(name)
                if tuple(t.shape) != e.shape:
                    raise CheckpointError(f"{path}: {name} has shape {tuple(t.shape)}, the model needs {e.shape}")
                bind(flat, lay)[e.key].copy_(t)
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    return spec, layouts, flats
