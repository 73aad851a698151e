"""The memory plan: host and GPU bytes of a training run, before anything is allocated.

``flowtrain train`` refuses a run whose plan does not fit; ``flowtrain plan`` prints it::

    p = make_plan(cfg, seq_len=4096, micro_batch_size=4, micro_batches=4, dtype=torch.bfloat16,
                  budgets={"weights": 2, "grads": 2}, checkpoint_every=1)
    p.host_total, p.gpu_total       # bytes

Host (per unit, flat fp32): master, Adam m and v, gradient: 16 bytes per parameter.
GPU: weight slots (fp32 landing buffer, plus a compute-dtype twin in bf16), gradient slots
(fp32), layer-input checkpoints for every micro-batch of a pass, the working set of one
layer's backward, and the chunked loss.
"""

from __future__ import annotations

import math
import os

import msgspec
import torch

from ..errors import PlanError
from ..graph.compiler import StepSpec
from ..graph.tasks import GRADS, WEIGHTS
from .model import ModelConfig, default_chunk_tokens, model_layouts

GiB = 2**30


class Plan(msgspec.Struct, kw_only=True):
    host: dict[str, int]
    gpu: dict[str, int]

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    @property
    def gpu_total(self) -> int:
        return sum(self.gpu.values())


def make_plan(cfg: ModelConfig, *, seq_len: int, micro_batch_size: int, micro_batches: int, dtype: torch.dtype,
              budgets: dict[str, int], checkpoint_every: int,
              chunk_tokens: int | None = None) -> Plan:
    layouts = model_layouts(cfg)
    params = sum(lay.numel for lay in layouts)
    slot_n = max(lay.numel for lay in layouts)
    if cfg.tie_word_embeddings:
        slot_n = max(slot_n, layouts[-1].numel + layouts[0].numel)
    cbytes = torch.empty((), dtype=dtype).element_size()
    host = {"master": 4 * params, "adam": 8 * params, "gradients": 4 * params}
    if cfg.tie_word_embeddings:
        host["tied_gradient"] = 4 * layouts[0].numel
    tokens = micro_batch_size * seq_len
    hidden = tokens * cfg.hidden_size * cbytes
    checkpoints = math.ceil(cfg.num_layers / checkpoint_every) * micro_batches * hidden
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    # One layer under autograd: its saved tensors and the gradients flowing back.
    layer_work = tokens * cbytes * (6 * cfg.hidden_size + 2 * q + 4 * kv + 4 * cfg.intermediate_size)
    layer_work += 4 * slot_n  # the fp32 weight gradient before accumulation (upper bound)
    chunk = min(chunk_tokens or default_chunk_tokens(cfg.vocab_size), tokens)
    loss = 3 * chunk * cfg.vocab_size * 4 + 2 * hidden
    gpu = {
        "weight_slots": budgets[WEIGHTS] * slot_n * (4 + (cbytes if cbytes != 4 else 0)),
        "grad_slots": budgets[GRADS] * slot_n * 4,
        "checkpoints": checkpoints,
        "recompute": (checkpoint_every - 1) * micro_batches * hidden,
        "layer_work": layer_work,
        "loss_chunks": loss,
    }
    return Plan(host=host, gpu=gpu)


def host_available() -> int | None:
    """Bytes of host memory available now (MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seq_len: int, micro_batch_size: int,
               spec: StepSpec, budgets: dict[str, int]) -> Plan:
    """Raise :class:`PlanError` (before anything is allocated) if the run cannot fit."""
    plan = make_plan(cfg, seq_len=seq_len, micro_batch_size=micro_batch_size, micro_batches=spec.micro_batches,
                     dtype=dtype, budgets=budgets, checkpoint_every=spec.checkpoint_every)
    avail = host_available()
    host_need = plan.host_total + (plan.gpu_total if device.type == "cpu" else 0)
    if avail is not None and host_need > avail:
        raise PlanError(
            f"the model needs {host_need / GiB:.1f} GiB of host memory "
            f"({plan.host_total / GiB:.1f} GiB of weights, Adam state and gradients), but only "
            f"{avail / GiB:.1f} GiB is available; use a smaller model"
        )
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if plan.gpu_total > free:
            raise PlanError(
                f"the run needs about {plan.gpu_total / GiB:.1f} GiB of GPU memory but {free / GiB:.1f} GiB is free; "
                f"lower --micro-batch-size or --seq-len, or raise --checkpoint-every"
            )
    return plan
