"""What a layer's backward differentiates: the whole model, or LoRA's adapters over it.

A part the step program is composed with, chosen once per run (:func:`trained_part`), so that
no task body asks whether LoRA is on:

- :class:`WholeModel`: every unit trains. A layer's weights are the views of its slot (or its
  own copy, resident); its backward takes the gradient with respect to the *flat* weight leaf.
- :class:`LoraAdapters` (``state.lora``): the model's units are frozen: fetched as they are
  (in the compute dtype), read, never written. Each layer's adapters (``state.adapters``) are
  fp32, resident on the device or streamed behind the layer's weights in its slot, and bound
  with the layer's weights (:func:`~flowtrain.model.lora.adapted`); a layer's backward takes
  the gradient with respect to its input and its adapters only, into the adapters' own
  accumulator. The head takes no gradient, the loss computes the last hidden state's only,
  and layer 0's backward hands its input gradient to nobody. In training the adapters'
  dropout masks are drawn from the run's seed, the step, the layer and the micro-batch, alike
  in the forward and the recompute.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...graph.tasks import WEIGHTS, Task
from ...model import bind
from ...model.lora import adapted, dropout_masks
from ...runtime.engine import TaskContext
from ..host_state import HostState, UnitState
from ..kept import Kept, forward_kept
from ..weight_grads import weight_leaves
from .slots import Slots

#: the layer's math given its input and its weights as a mapping
LayerRun = Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]
#: the step, the micro-batch and its rows' shape: what seeds a training forward's dropout masks
Dropout = tuple[int, int, tuple[int, ...]]


class WholeModel:
    """Every unit trains: a layer's gradient is taken with respect to its flat weights."""

    #: whether the head takes a gradient (the loss then adds it into the head's slot)
    head_trains = True

    def __init__(self, state: HostState, slots: Slots) -> None:
        self.state = state
        self.slots = slots

    def trained(self, i: int) -> UnitState:
        """The unit layer ``i``'s backward adds a gradient into."""
        return self.state.unit("layer", i)

    def fetched_with(self, task: Task) -> list[UnitState]:
        """Units a fetch copies into the slot after ``task``'s own."""
        return []

    def hands_input_grad(self, i: int) -> bool:
        """Whether layer ``i``'s backward passes its input gradient on (to the layer below, or
        the embedding's backward)."""
        return True

    def flat(self, i: int, ctx: TaskContext) -> torch.Tensor:
        """Layer ``i``'s flat compute-dtype weights, as a task reads them."""
        unit = self.state.unit("layer", i)
        return self.slots.weights(unit, ctx)[: unit.flat_map.numel]

    def layer_weights(self, i: int, ctx: TaskContext, leaves: dict[str, torch.Tensor] | None = None,
                      dropout: Dropout | None = None) -> dict[str, torch.Tensor]:
        """Layer ``i``'s weights as its math reads them, bound from its slot (or its own copy)."""
        return bind(self.flat(i, ctx), self.state.unit("layer", i).flat_map)

    def base_weights(self, i: int, ctx: TaskContext) -> dict[str, torch.Tensor]:
        """Layer ``i``'s own weights, without LoRA's adapters (DPO's reference under LoRA)."""
        return WholeModel.layer_weights(self, i, ctx)

    def backward_weights(self, i: int, ctx: TaskContext,
                         dropout: Dropout) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """``(leaves, weights)`` of a backward's rebuild: what takes the gradient, and the
        mapping the layer's math reads (here the same: the flat weight leaf's views)."""
        unit = self.state.unit("layer", i)
        leaves = weight_leaves(self.flat(i, ctx), unit.flat_map)
        return leaves, leaves

    def forward_kept(self, run: LayerRun, x: torch.Tensor, i: int, ctx: TaskContext,
                     dropout: Dropout) -> tuple[torch.Tensor, Kept]:
        """A forward whose graph stays for the backward (:mod:`flowtrain.train.kept`)."""
        return forward_kept(run, x, self.flat(i, ctx), self.state.unit("layer", i).flat_map)


class LoraAdapters(WholeModel):
    """LoRA: a frozen base streamed through the GPU, each layer's adapters trained."""

    head_trains = False

    def __init__(self, state: HostState, slots: Slots, *, seed: int) -> None:
        super().__init__(state, slots)
        assert state.lora is not None
        self.lora = state.lora
        self.seed = seed
        device = slots.device
        #: LoRA's scale and dropout rescale, made on the device once (see flowtrain.model.lora.adapted)
        self.scale = torch.tensor(state.lora.scale, device=device)
        self.rescale = torch.tensor(1.0 / (1.0 - state.lora.dropout), device=device)

    def trained(self, i: int) -> UnitState:
        return self.state.adapters[i]

    def fetched_with(self, task: Task) -> list[UnitState]:
        if task.unit == "layer" and not self.state.adapters[task.layer].resident:  # type: ignore[index]
            return [self.state.adapters[task.layer]]  # type: ignore[index]  # its adapters, from host memory
        return []

    def hands_input_grad(self, i: int) -> bool:
        return i > 0  # a frozen embedding has no backward to take it

    def adapters(self, i: int, ctx: TaskContext) -> torch.Tensor:
        """Layer ``i``'s flat adapters as its math reads them: their own fp32 masters where
        resident, else their copy in the compute dtype that came with the layer into its slot."""
        a = self.state.adapters[i]
        if a.resident:
            return a.master
        n = self.state.unit("layer", i).flat_map.numel
        return self.slots.weight_c[ctx.read(WEIGHTS)][n : n + a.flat_map.numel]

    def layer_weights(self, i: int, ctx: TaskContext, leaves: dict[str, torch.Tensor] | None = None,
                      dropout: Dropout | None = None) -> dict[str, torch.Tensor]:
        """Layer ``i``'s weights joined by its adapters (``leaves``: the leaves a backward
        differentiates) and, in training (``dropout``), the keep masks of the adapters' dropout."""
        w = super().layer_weights(i, ctx)
        a = self.state.adapters[i]
        out = adapted(w, leaves if leaves is not None else bind(self.adapters(i, ctx), a.flat_map), self.scale)
        if dropout is not None and self.lora.dropout > 0:
            s, m, rows = dropout
            seed = hash((self.seed, s, i, m))  # ints hash to themselves: the same in every process
            out.update(dropout_masks(out, rows, self.lora.dropout, seed, self.slots.device),
                       lora_rescale=self.rescale)
        return out

    def backward_weights(self, i: int, ctx: TaskContext,
                         dropout: Dropout) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        leaves = weight_leaves(self.adapters(i, ctx), self.state.adapters[i].flat_map)
        return leaves, self.layer_weights(i, ctx, leaves, dropout)

    def forward_kept(self, run: LayerRun, x: torch.Tensor, i: int, ctx: TaskContext,
                     dropout: Dropout) -> tuple[torch.Tensor, Kept]:
        # the adapters are the leaves; the base's views are kept by place
        s, m, _ = dropout
        return forward_kept(
            lambda x, leaves: run(x, self.layer_weights(i, ctx, leaves, (s, m, tuple(x.shape[:-1])))),
            x, self.flat(i, ctx), self.state.unit("layer", i).flat_map,
            trained=(self.adapters(i, ctx), self.state.adapters[i].flat_map))


def trained_part(state: HostState, slots: Slots, *, seed: int) -> WholeModel:
    """The part for this run: LoRA's adapters where ``state.lora`` is set, else the whole model."""
    if state.lora is not None:
        return LoraAdapters(state, slots, seed=seed)
    return WholeModel(state, slots)
