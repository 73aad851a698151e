"""The model: its config, flat-buffer layout, pure layer math, init and HF checkpoints.

Weights never live in ``nn.Module``s. Each unit (embedding, decoder layer, head) owns one
flat buffer; :func:`model_layouts` says where each matrix sits in it, :func:`bind` cuts it
into views, and :func:`decoder_layer` is a pure function of activations and those views::

    cfg = preset("tiny")
    layouts = model_layouts(cfg)
    flats = [torch.empty(lay.numel) for lay in layouts]
    for lay, flat in zip(layouts, flats):
        init_unit(flat, lay, cfg, seed=0)
    cos, sin = rope_tables(cfg, seq_len=128, device="cpu")
    x = embed(ids, bind(flats[0], layouts[0])["embed_tokens"])
    for lay, flat in zip(layouts[1:-1], flats[1:-1]):
        x = decoder_layer(x, bind(flat, lay), cos, sin, cfg)
"""

from flowtrain.train.model.checkpoint import load_into, read_config, save_hf
from flowtrain.train.model.config import PRESETS, ModelConfig, RopeScaling, preset
from flowtrain.train.model.functional import (
    IGNORE_INDEX,
    decoder_layer,
    default_chunk_tokens,
    embed,
    head_loss,
    head_loss_and_grads,
    rms_norm,
    rope_tables,
)
from flowtrain.train.model.init import init_unit
from flowtrain.train.model.layout import (
    ALIGN,
    Entry,
    UnitLayout,
    bind,
    model_layouts,
    unit_numel_max,
)

__all__ = [
    "ALIGN",
    "IGNORE_INDEX",
    "PRESETS",
    "Entry",
    "ModelConfig",
    "RopeScaling",
    "UnitLayout",
    "bind",
    "decoder_layer",
    "default_chunk_tokens",
    "embed",
    "head_loss",
    "head_loss_and_grads",
    "init_unit",
    "load_into",
    "model_layouts",
    "preset",
    "read_config",
    "rms_norm",
    "rope_tables",
    "save_hf",
    "unit_numel_max",
]
