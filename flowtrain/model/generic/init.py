"""Fresh weights for a unit of a model on the generic layer path, drawn the model's own way.

transformers knows how each of its modules starts (``_init_weights``: normal matrices, norms
at one, or at zero where a norm scales by ``1 + weight``); this module asks it, one unit at a
time, on a CPU copy of that unit's modules alone, with torch's generator seeded by ``(seed, unit)``
(:func:`flowtrain.model.flat_map.unit_seed`), so a unit always gets the same numbers, in any order
(units initialised by several threads take turns: the generator is global).
"""

from __future__ import annotations

import copy
import threading

import torch
from torch import Tensor, nn

from ..config import ModelConfig
from ..flat_map import FlatMap, bind, unit_seed
from .skeleton import skeleton

__all__ = ["init_generic_unit"]

#: transformers' initialisers draw from torch's global generator: one unit at a time, so that
#: units initialised by a pool of threads still draw each from its own seed
_GLOBAL_GENERATOR = threading.Lock()


def _unit_modules(cfg: ModelConfig, flat_map: FlatMap) -> dict[str, nn.Module]:
    """The modules whose parameters the unit holds, by the checkpoint-name prefix they have."""
    assert cfg.hf_json is not None
    sk = skeleton(cfg.hf_json)
    if flat_map.unit == "layer":
        assert flat_map.layer is not None
        return {f"{sk.layers_name}.{flat_map.layer}": sk.layers[flat_map.layer]}
    if flat_map.unit == "embed":
        return {sk.embed_name: sk.model.get_submodule(sk.embed_name)}
    modules = {sk.norm_name: sk.model.get_submodule(sk.norm_name)}
    if sk.head_name is not None:
        modules[sk.head_name] = sk.model.get_submodule(sk.head_name)
    return modules


def init_generic_unit(flat: Tensor, flat_map: FlatMap, cfg: ModelConfig, seed: int) -> None:
    """Fill ``flat`` with the unit's fresh weights (padding zero), as transformers would
    initialise them."""
    assert cfg.hf_json is not None
    sk = skeleton(cfg.hf_json)
    views = bind(flat, flat_map)
    by_name = {e.name: e.key for e in flat_map.entries}
    flat[: flat_map.numel].zero_()
    with _GLOBAL_GENERATOR, torch.random.fork_rng(devices=[]):
        torch.manual_seed(unit_seed(seed, flat_map))
        for prefix, module in _unit_modules(cfg, flat_map).items():
            real = copy.deepcopy(module).to_empty(device="cpu")
            real.apply(getattr(sk.model, "_init_weights"))
            for name, param in real.named_parameters():
                key = by_name.get(f"{prefix}.{name}")
                if key is not None:
                    views[key].copy_(param.detach())
