"""Shared reference machinery for the model tests: Hugging Face models nobody here wrote.

``hf_model(cfg)`` builds the transformers model for a :class:`ModelConfig` (eager
attention, fp32, CPU) with every parameter randomised, norms and biases included, so a
wrong rounding order or a dropped bias shows up. ``flats_from_hf`` copies its weights into
flowtrain's flat buffers by checkpoint name.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from flowtrain.model import ModelConfig, RopeScaling, bind, model_flat_maps
from flowtrain.model.hf_config import to_hf


def rel_err(a: Tensor, b: Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def small_cfg(**overrides) -> ModelConfig:
    """A CPU-sized config; the defaults exercise grouped-query attention."""
    base = dict(
        vocab_size=96, hidden_size=64, intermediate_size=88, num_layers=2,
        num_heads=4, num_kv_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=256,
    )
    base.update(overrides)
    return ModelConfig(**base)


LLAMA3_SMALL = RopeScaling(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=64,
)


def hf_config(cfg: ModelConfig):
    d = to_hf(cfg)
    return AutoConfig.for_model(d.pop("model_type"), **d)


def hf_model(cfg: ModelConfig, seed: int) -> PreTrainedModel:
    """The transformers model for ``cfg`` with all parameters randomised (seeded)."""
    model = AutoModelForCausalLM.from_config(hf_config(cfg), attn_implementation="eager")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.08 * noise)
    return model.eval()


def assert_grads_match(model: PreTrainedModel, layouts, flats: list[Tensor], tol: float) -> None:
    """Every gradient in ``flats[i].grad`` (by checkpoint name) within ``tol`` of the
    transformers model's own ``.grad``."""
    params = dict(model.named_parameters())
    for lay, flat in zip(layouts, flats):
        grads = bind(flat.grad, lay)
        for e in lay.entries:
            assert rel_err(grads[e.key], params[e.name].grad) < tol, e.name


def flats_from_hf(model: PreTrainedModel, cfg: ModelConfig, dtype=torch.float32) -> list[Tensor]:
    """flowtrain flat buffers holding ``model``'s weights, copied by checkpoint name."""
    state = model.state_dict()
    flats = []
    for layout in model_flat_maps(cfg):
        flat = torch.zeros(layout.numel, dtype=dtype)
        views = bind(flat, layout)
        for e in layout.entries:
            views[e.key].copy_(state[e.name])
        flats.append(flat)
    return flats
