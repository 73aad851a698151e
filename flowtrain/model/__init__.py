"""The model: its config, flat-buffer maps, pure layer math and init.

Owns what a model *is*: families and presets, Hugging Face config names, where each matrix sits
in a unit's flat buffer, and the layer math as pure functions. It imports nothing of the
runtime, the planner or training (``lint-imports`` holds it to that); reading and writing
Hugging Face weight files is :mod:`flowtrain.ckpt.hf`'s.

Weights never live in ``nn.Module``s. Each unit (embedding, decoder layer, head) owns one
flat buffer; :func:`model_flat_maps` says where each matrix sits in it, :func:`bind` cuts it
into views, and :func:`decoder_layer` is a pure function of activations and those views::

    cfg = preset("tiny")
    maps = model_flat_maps(cfg)
    flats = [torch.empty(m.numel) for m in maps]
    for m, flat in zip(maps, flats):
        init_unit(flat, m, cfg, seed=0)
    cos, sin = rope_tables(cfg, seq_len=128, device="cpu")
    x = embed(ids, bind(flats[0], maps[0])["embed_tokens"])
    for m, flat in zip(maps[1:-1], flats[1:-1]):
        x = decoder_layer(x, bind(flat, m), cos, sin, cfg)
"""

from flowtrain.model.config import ModelConfig, RopeScaling, default_chunk_tokens
from flowtrain.model.flat_map import ALIGN, Entry, FlatMap, bind, model_flat_maps, unit_numel_max
from flowtrain.model.model_dir import read_config
from flowtrain.model.presets import PRESETS, preset

#: Names whose modules import torch, loaded on first use: the config and the flat maps above are
#: plain data, so ``flowtrain plan`` and ``flowtrain simulate`` read a model without torch.
_LAZY = {
    "IGNORE_INDEX": "functional", "decoder_layer": "functional", "embed": "functional", "head_loss": "functional",
    "head_loss_and_grads": "functional", "head_token_logprobs": "functional", "rms_norm": "functional", "rope_tables": "functional",
    "init_unit": "init",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"flowtrain.model.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ALIGN",
    "IGNORE_INDEX",
    "PRESETS",
    "Entry",
    "FlatMap",
    "ModelConfig",
    "RopeScaling",
    "bind",
    "decoder_layer",
    "default_chunk_tokens",
    "embed",
    "head_loss",
    "head_loss_and_grads",
    "head_token_logprobs",
    "init_unit",
    "model_flat_maps",
    "preset",
    "read_config",
    "rms_norm",
    "rope_tables",
    "unit_numel_max",
]
