"""Host state: what lives in host memory for every unit of the model.

Per unit (the embedding, each decoder layer, the head), all flat fp32:

- ``master``: the weights (pinned on a CUDA machine: it is what ``fetch`` copies to the GPU,
  where it is cast to the compute dtype, so no separate streaming copy is kept),
- ``exp_avg``, ``exp_avg_sq``: Adam's moments,
- ``grad``: the gradient that ``offload_grad`` writes and ``cpu_adam`` reads (pinned on CUDA),
- ``step``: Adam's step count.

That is 16 bytes per parameter. A state is built unit by unit, either from a seeded random
initialisation or from a Hugging Face checkpoint, so the model never exists twice in memory::

    state = HostState.create(cfg, pin=False)
    state.init_random(seed=0)           # or state.load_checkpoint(model_dir)
"""

from __future__ import annotations

from pathlib import Path

import torch

from .model import ModelConfig, UnitLayout, init_unit, load_into, model_layouts, save_hf

BYTES_PER_PARAM = 16


def pinned_zeros(n: int, pin: bool) -> torch.Tensor:
    """A zeroed fp32 host tensor of ``n`` elements, page-locked when ``pin``.

    Pinning registers the tensor's own pages with CUDA (``cudaHostRegister``) rather than using
    torch's pinned allocator, which rounds every block up to a power of two (up to 2x the
    memory for layer-sized buffers)."""
    t = torch.zeros(n, dtype=torch.float32)
    if pin:
        rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
        if int(rc) != 0:  # fall back to torch's pinned allocator
            t = torch.zeros(n, dtype=torch.float32, pin_memory=True)
    return t


class UnitState:
    """The flat host tensors of one unit."""

    __slots__ = ("layout", "master", "exp_avg", "exp_avg_sq", "grad", "step")

    def __init__(self, layout: UnitLayout, pin: bool) -> None:
        n = layout.numel
        self.layout = layout
        self.master = pinned_zeros(n, pin)
        self.grad = pinned_zeros(n, pin)
        self.exp_avg = torch.zeros(n, dtype=torch.float32)
        self.exp_avg_sq = torch.zeros(n, dtype=torch.float32)
        self.step = torch.zeros((), dtype=torch.float32)


class HostState:
    """All units' host tensors, indexed like :func:`model_layouts` (embed, layers, head)."""

    def __init__(self, cfg: ModelConfig, units: list[UnitState]) -> None:
        self.cfg = cfg
        self.units = units

    @classmethod
    def create(cls, cfg: ModelConfig, *, pin: bool) -> "HostState":
        return cls(cfg, [UnitState(layout, pin) for layout in model_layouts(cfg)])

    @property
    def layouts(self) -> list[UnitLayout]:
        return [u.layout for u in self.units]

    @property
    def embed(self) -> UnitState:
        return self.units[0]

    @property
    def head(self) -> UnitState:
        return self.units[-1]

    def unit(self, unit: str, layer: int | None) -> UnitState:
        """The state of ``("embed", None)``, ``("layer", i)`` or ``("head", None)``."""
        if unit == "embed":
            return self.units[0]
        if unit == "head":
            return self.units[-1]
        return self.units[1 + layer]  # type: ignore[operator]

    def init_random(self, seed: int) -> None:
        for u in self.units:
            init_unit(u.master, u.layout, self.cfg, seed)

    def load_checkpoint(self, model_dir: str | Path) -> None:
        load_into(model_dir, self.cfg, self.layouts, [u.master for u in self.units])

    def save(self, out_dir: str | Path) -> None:
        save_hf(out_dir, self.cfg, self.layouts, [u.master for u in self.units])

    @staticmethod
    def nbytes(cfg: ModelConfig) -> int:
        """Host bytes this state takes for ``cfg`` (padding included)."""
        return sum(BYTES_PER_PARAM * lay.numel for lay in model_layouts(cfg))
