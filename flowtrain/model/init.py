"""Fresh weights for one unit at a time, reproducibly.

Each unit draws from its own ``torch.Generator`` seeded by ``(seed, unit key)``, so units
can be initialised in any order, one at a time, on any machine, and the same unit always
gets the same numbers (a 14B model never has to exist twice in memory to be initialised)::

    for lay, flat in zip(layouts, flats):
        init_unit(flat, lay, cfg, seed=0)

Matrices are drawn from normal(0, ``cfg.initializer_range``) like Hugging Face's Llama,
norm weights (Qwen3's q_norm and k_norm too) are ones (Gemma 3's zeros: it scales by
1 + weight), biases and alignment padding
zeros. Values are drawn in fp32 on the CPU and then cast, so a bf16 buffer holds the
bf16 rounding of the fp32 buffer's values.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flowtrain.model.config import ModelConfig
from flowtrain.model.flat_map import FlatMap, bind, unit_seed  # unit_seed re-exported

__all__ = ["init_unit", "unit_seed"]

_DRAW = 1 << 22  # elements drawn per step: bounds the fp32 temporary to 16 MiB


def init_unit(flat: Tensor, layout: FlatMap, cfg: ModelConfig, seed: int) -> None:
    """Fill ``flat`` (1-D, >= ``layout.numel`` elements, any dtype/device) with fresh weights
    (on the generic layer path, the model's own initialisation: :mod:`flowtrain.model.generic.init`)."""
    if cfg.generic:
        from flowtrain.model.generic.init import init_generic_unit

        init_generic_unit(flat, layout, cfg, seed)
        return
    views = bind(flat, layout)
    gen = torch.Generator(device="cpu")
    gen.manual_seed(unit_seed(seed, layout))
    flat[: layout.numel].zero_()
    for e in layout.entries:
        view = views[e.key].view(-1)
        if e.key.endswith("norm"):  # the layer norms, q_norm and k_norm, the final norm
            view.fill_(0.0 if cfg.family.gemma else 1.0)  # Gemma scales by (1 + weight)
        elif e.key.endswith("_bias"):
            pass  # already zero
        else:
            _normal(view, cfg.initializer_range, gen)


def _normal(out: Tensor, std: float, gen: torch.Generator) -> None:
    """out (1-D) <- normal(0, std), drawn in fixed-size fp32 pieces on the CPU."""
    tmp = torch.empty(min(_DRAW, out.numel()), dtype=torch.float32)
    for start in range(0, out.numel(), _DRAW):
        piece = tmp[: min(_DRAW, out.numel() - start)]
        piece.normal_(0.0, std, generator=gen)
        out[start : start + piece.numel()].copy_(piece)
