"""Saved attention outputs in the plan: which layers keep theirs, and where the memory comes from.

A recomputing layer runs its forward twice; a layer placed ``attention`` keeps its attention
output and log-sum-exp from the forward pass, and its rebuild before backward skips the
attention kernel (:mod:`flowtrain.model.saved_attention`). What that buys grows with the
sequence (attention's FLOPs grow with its square) and what it costs does not (the output is
the size of the layer input): one layer of an 8B Llama on one sequence of 262,144 tokens saves
about 1 s of its 5.8 s for 2 GiB, where at 4,096 tokens a kept layer saves more per byte.

So ``--activations auto`` considers it where attention's forward outweighs the layer's GEMMs
(:func:`attention_pays`: ``seq_len x heads x head_dim >= layer parameters``, from about 33K
tokens for llama-3b), and plans it the way such a step wants memory spent:

1. every unit streamed unless host memory needs some resident: at these lengths a step is
   minutes of compute, so fetches and CPU Adam hide anyway and a resident layer only takes GPU
   memory a saved output could use;
2. layer inputs (checkpoints) offloaded to host memory as far as it holds them: their copies
   too hide behind the compute. With a state folder (``--state-dir``), host memory also holds
   what the folder frees: everything ``--disk-state moments`` or ``all`` moves there, and under
   ``--activations attention`` with ``--disk-state auto``, as much as moving every streamed
   unit's state would free (the disk tier then moves only what the plan needs; whether its
   reads and writes hide behind the step depends on the disk, which ``flowtrain plan`` and
   ``flowtrain simulate`` weigh);
3. the GPU memory left holds saved attention outputs, from the top layer down (their backward
   comes first), and what is left after every layer has one brings checkpoints back.

The plan is taken where it fits and saves more forward FLOPs than the plan without it (kept
layers save a whole forward each). ``--activations attention`` asks for every layer's output,
with checkpoints offloaded as far as that needs; it does not fit where memory does not hold them.
"""

from __future__ import annotations

from typing import Any, Callable

import msgspec

from ..graph.tasks import ACTS
from ..model.config import ModelConfig

__all__ = ["attention_pays", "forward_flops_saved", "plan_saved_attention", "saved_attention_bytes"]


def _layer_numel(cfg: ModelConfig) -> int:
    from ..model.flat_map import model_flat_maps

    return max((lay.numel for lay in model_flat_maps(cfg) if lay.unit == "layer"), default=0)


def _attention_forward_flops(cfg: ModelConfig, seq_len: int) -> float:
    """Causal attention forward FLOPs per token of one layer: 2 x seq x heads x head_dim."""
    return 2.0 * seq_len * cfg.num_heads * cfg.head_size


def attention_pays(cfg: ModelConfig, seq_len: int) -> bool:
    """Whether a layer's attention forward is at least the forward of its GEMMs (2 FLOPs per
    parameter and token), the regime where ``auto`` considers saving attention outputs."""
    return _attention_forward_flops(cfg, seq_len) >= 2.0 * _layer_numel(cfg)


def forward_flops_saved(plan: Any, cfg: ModelConfig, seq_len: int) -> float:
    """Per token of a micro-batch: the forward FLOPs the plan's backward does not run again (a
    kept layer's whole forward, a saved attention output's attention forward)."""
    attn = _attention_forward_flops(cfg, seq_len)
    return len(plan.spec.keep) * (2.0 * _layer_numel(cfg) + attn) + len(plan.spec.save_attention) * attn


def saved_attention_bytes(cfg: ModelConfig, tokens: int, itemsize: int) -> int:
    """Device bytes one layer's saved attention takes for ``tokens`` (every micro-batch alive at
    once): the output in the compute dtype and the log-sum-exp in fp32, per head."""
    heads = cfg.num_heads
    return tokens * heads * (cfg.head_size * itemsize + 4)


def plan_saved_attention(cfg: ModelConfig, req: Any, itemsize: int, live_tokens: int, layer_work: int,
                         state: Callable[[Any], Any], in_flight: int, act_slots: int, every: bool,
                         disk_room: Callable[[Any], int] = lambda plan: 0) -> Any:
    """The plan with saved attention outputs, built from ``state(request)``: the state placed
    for a request that recomputes, every checkpoint on the GPU (the caller decides whether its
    residency is for capacity only).

    ``every``: every layer saves its output (``--activations attention``), and checkpoints are
    offloaded as far as that needs; else as many layers as fit once checkpoints are offloaded as
    far as host memory holds them (None where not one fits). ``live_tokens``: the tokens of the
    micro-batches whose activations are alive at once; ``layer_work``: one layer's backward as
    eager autograd runs it (a saved output breaks a compiled layer's graph at attention);
    ``in_flight`` and ``act_slots``: the GPU bytes of checkpoints and the ``acts`` budget of a
    step that offloads them; ``disk_room(plan)``: the host bytes the state folder frees for
    checkpoints beside what ``plan`` holds (0 without one)."""
    plan = state(msgspec.structs.replace(req, activations="recompute"))
    plan.gpu = {**plan.gpu, "layer_work": max(plan.gpu["layer_work"], layer_work)}
    L = cfg.num_layers
    n_ck = L  # a checkpoint at every layer (checked by StepSpec)
    per_ck = plan.gpu["checkpoints"] // n_ck
    per_attn = saved_attention_bytes(cfg, live_tokens, itemsize)
    gpu_base = plan.gpu_total - plan.gpu["checkpoints"]
    host_room = None if plan.host_limit is None else plan.host_limit - plan.host_node_total + disk_room(plan)
    gpu_room = None if plan.gpu_limit is None or plan.device == "cpu" else plan.gpu_limit - gpu_base
    most_off = n_ck if host_room is None or not per_ck else max(0, min(n_ck, host_room // (per_ck * plan.spec.share)))

    def gpu_need(n_off: int, n_attn: int) -> int:
        return (in_flight if n_off else 0) + (n_ck - n_off) * per_ck + n_attn * per_attn

    if every or gpu_room is None:
        n_attn = L
    else:
        n_attn = max(0, min(L, (gpu_room - gpu_need(most_off, 0)) // per_attn))
        if n_attn == 0:
            return None
    # the fewest offloaded checkpoints that make room (where the GPU has no limit, none)
    n_off = 0 if gpu_room is None else next(
        (n for n in range(most_off + 1) if gpu_need(n, n_attn) <= gpu_room), most_off)
    if n_off:
        plan.host = {**plan.host, "offloaded_activations": n_off * per_ck}
        plan.budgets = {**plan.budgets, ACTS: act_slots}
    plan.gpu = {**plan.gpu, "checkpoints": gpu_need(n_off, 0), "saved_attention": n_attn * per_attn}
    plan.spec = msgspec.structs.replace(plan.spec, offload=tuple(range(n_off)),
                                        save_attention=tuple(range(L - n_attn, L)))
    return plan
