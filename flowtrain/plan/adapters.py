"""LoRA's own bytes in the memory plan: the adapters' sizes, where they live, and the work a
layer's adapters add on the GPU.

The frozen base of a LoRA run is counted by :mod:`.memory` as a streamed model whose host state
is its weights in the compute dtype and nothing else. What the adapters add is here::

    adapter_numel(cfg, req)               # every layer's adapter parameters
    lora_host_bytes(cfg, req)             # {"adapters", "undo_record"}: with --lora-state host
    lora_gpu_bytes(cfg, req, tokens, 2)   # {"adapters", "lora_work"}: one layer's adapter work

The sizes come from the adapters' flat maps themselves (:func:`flowtrain.model.adapters.adapter_flat_maps`),
so they count what a run allocates: padding, a mixture of experts' dense layers without MLP
adapters, the gate-and-up adapter's own rank. The simulator reads the sizes too
(:mod:`flowtrain.sim.predict`).
"""

from __future__ import annotations

import msgspec

from ..model.adapters import LoraSpec, adapter_flat_maps
from ..model.config import ModelConfig
from .buffer_sizes import undo_arena_bytes
from .request import RunRequest

__all__ = ["adapter_active_numel", "adapter_active_outputs", "adapter_inputs", "adapter_numel",
           "adapter_slot_numel", "host_adapters", "layer_adapter_numels", "lora_gpu_bytes", "lora_host_bytes"]

GiB = 2**30


def host_adapters(req: RunRequest) -> bool:
    """Whether LoRA's adapters live in host memory (``--lora-state host``, as ``auto`` resolves
    it in :func:`flowtrain.plan.planner.plan_run`)."""
    return req.lora_rank > 0 and req.lora_state == "host"


def adapter_slot_numel(cfg: ModelConfig, req: RunRequest) -> int:
    """The elements a weight or gradient slot holds beside a layer's weights for its adapters:
    the largest layer's with the adapters in host memory (its fetch brings them), else 0."""
    return max(layer_adapter_numels(cfg, req), default=0) if host_adapters(req) else 0


def lora_host_bytes(cfg: ModelConfig, req: RunRequest) -> dict[str, int]:
    """Host bytes of the adapters in host memory (none on the GPU): fp32 weights, Adam moments
    and a whole gradient each, pinned, and without clipping the record ``cpu_adam`` keeps of
    them until the step is known finite."""
    if not host_adapters(req):
        return {}
    out = {"adapters": 16 * adapter_numel(cfg, req)}
    if not req.grad_clip:
        out["undo_record"] = undo_arena_bytes([(n, 1) for n in layer_adapter_numels(cfg, req)], 0,
                                              int(req.undo_mem * GiB), touched=True)
    return out


def lora_gpu_bytes(cfg: ModelConfig, req: RunRequest, tokens: int, cbytes: int) -> dict[str, int]:
    """GPU bytes of a LoRA run beyond the base's: the adapters with their gradient and Adam
    moments in fp32 (unless in host memory), and one layer's adapter work for ``tokens`` tokens
    in a compute dtype of ``cbytes`` bytes.

    Beside a map's own work: in the forward its low-rank update and the sum (two of its output);
    in the backward the update's output gradient and the adapter's input gradient added to the
    base's (one of its output, two of its input). The MLP's intermediate is the widest of both,
    and all three may be live at once: llama-8b at 16,384 tokens under ``--gpu-mem 10`` ran out
    of memory in its second step's backward with two counted."""
    work = 3 * cbytes * tokens * max(cfg.intermediate_size, cfg.hidden_size)
    if req.lora_dropout > 0:  # a byte per input element of every adapted map: the layer's keep masks
        work += tokens * adapter_inputs(cfg, req)
    if cfg.sparse_layers() and set(req.lora_targets) & {"gate_proj", "up_proj", "down_proj"}:
        # the experts' updates, beside their own work: per (token, expert) pair the gate-and-up
        # update (2 inter) and the down one (hidden), and their thin inputs
        work += cbytes * tokens * cfg.num_experts_per_tok * (2 * cfg.moe_intermediate_size + cfg.hidden_size)
    return {"adapters": 0 if host_adapters(req) else 16 * adapter_numel(cfg, req), "lora_work": work}


def adapter_numel(cfg: ModelConfig, req: RunRequest) -> int:
    """Parameters of every layer's LoRA adapters (0 without LoRA)."""
    return _adapter_sizes(cfg, req)[0] if req.lora_rank else 0


def adapter_active_numel(cfg: ModelConfig, req: RunRequest) -> float:
    """The adapter parameters one token multiplies by (0 without LoRA): every adapter but a
    stacked expert weight's, of which a token reaches ``num_experts_per_tok`` of ``num_experts``
    experts' pairs. Model FLOPs count these (:func:`flowtrain.model.counts.model_flops_per_token`)."""
    return _adapter_sizes(cfg, req)[3] if req.lora_rank else 0


def layer_adapter_numels(cfg: ModelConfig, req: RunRequest) -> tuple[int, ...]:
    """Each decoder layer's adapter parameters (a mixture of experts' dense layers have fewer)."""
    return _adapter_sizes(cfg, req)[2] if req.lora_rank else ()


def adapter_active_outputs(cfg: ModelConfig, req: RunRequest) -> float:
    """The output features of the adapted maps one token passes through in one layer, averaged
    over the layers (0 without LoRA): each adapter's product is that wide before it is added to
    its map's output; of a stacked expert weight's, the ``num_experts_per_tok`` experts' a
    token reaches. The simulator's elementwise cost of the adapters."""
    return _adapter_sizes(cfg, req)[4] if req.lora_rank else 0.0


def adapter_inputs(cfg: ModelConfig, req: RunRequest) -> int:
    """The input features of a layer's adapted maps, added up (the widest layer's)."""
    return _adapter_sizes(cfg, req)[1]


def _adapter_sizes(cfg: ModelConfig, req: RunRequest) -> tuple[int, int, tuple[int, ...], float, float]:
    """``(adapters' parameters, widest layer's adapted inputs, each layer's parameters, those a
    token multiplies by, the adapted outputs a token passes through per layer)``, from the
    adapters' flat maps built once per model and adapter shape: every candidate plan asks (as
    :func:`flowtrain.plan.memory` does the model's)."""
    key = (msgspec.json.encode(cfg), req.lora_rank, req.lora_targets, req.lora_gate_up_rank)
    if key not in _ADAPTER_SIZES:
        if len(_ADAPTER_SIZES) >= 8:
            _ADAPTER_SIZES.clear()
        lays = adapter_flat_maps(cfg, LoraSpec(req.lora_rank, 1.0, req.lora_targets, fused_rank=req.lora_gate_up_rank))
        inputs = max((sum(e.shape[1] for e in lay.entries if e.key.endswith(".lora_A")) for lay in lays), default=0)
        share = cfg.num_experts_per_tok / cfg.num_experts if cfg.num_experts else 1.0
        active = sum(e.numel * (share if e.key.startswith("experts_") else 1.0) for lay in lays for e in lay.entries)
        reach = cfg.num_experts_per_tok if cfg.num_experts else 1
        outputs = sum(e.shape[0] * (reach if e.key.startswith("experts_") else 1)
                      for lay in lays for e in lay.entries if e.key.endswith(".lora_B")) / max(len(lays), 1)
        _ADAPTER_SIZES[key] = (sum(lay.numel for lay in lays), inputs, tuple(lay.numel for lay in lays), active,
                               outputs)
    return _ADAPTER_SIZES[key]


_ADAPTER_SIZES: dict[tuple, tuple[int, int, tuple[int, ...], float, float]] = {}
