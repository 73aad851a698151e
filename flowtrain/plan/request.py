"""What a run asks the planner for: a :class:`RunRequest`, the planning-relevant part of a
``TrainConfig`` (:func:`run_request` makes one from it), which every byte count of the plan
reads::

    req = RunRequest(seq_len=4096, batch_size=16, micro_batch_size=4, gpu_mem=10)
    req = run_request(train_config, model_dir)      # the same from a run's settings
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec

from ..model.adapters import DEFAULT_TARGETS

__all__ = ["RunRequest", "checkpoint_read_bytes", "run_request"]


class RunRequest(msgspec.Struct, kw_only=True):
    """What the user asked for (the planning-relevant part of ``TrainConfig``)."""

    seq_len: int
    batch_size: int
    micro_batch_size: int
    checkpoint_every: int = 1
    #: "keep", "offload", "recompute", "attention" or "auto" (see TrainConfig.activations)
    activations: str = "auto"
    order: str = "layer"
    grad_clip: bool = False
    #: the decoder layer's ``--compile`` backend: what a kept layer saves depends on it
    compile: str | None = "auto"
    layout: str = "auto"
    resident: str = "auto"
    gpu_mem: float | None = None  # GiB
    host_mem: float | None = None  # GiB
    chunk_tokens: int | None = None
    #: bytes of the largest checkpoint file read at start (mapped while it is copied in)
    load_bytes: int = 0
    #: GiB the undo record of a step not yet known finite may hold
    undo_mem: float = 1.0
    #: data-parallel processes in all; the request is one process's share (``reduce_grad``)
    processes: int = 1
    #: processes of a node that share one host copy of the state (``StepSpec.share``)
    share: int = 1
    #: ``--attention-backend`` (auto: cuDNN's fused attention on CUDA; flash): the kernel whose
    #: rate the simulator predicts attention at (flowtrain.sim.costs)
    attention_backend: str = "auto"
    #: LoRA: the adapters' rank (0: the whole model trains) and the linear maps they adapt
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = DEFAULT_TARGETS
    lora_gate_up_rank: int | None = None
    lora_dropout: float = 0.0
    #: ``--lora-state``: where the adapters' fp32 weights and AdamW live: "gpu", "host"
    #: (streamed with their layers, updated by CPU AdamW) or "auto" (the GPU where that fits)
    lora_state: str = "auto"
    #: ``--skip-idle-experts``: a mixture of experts' sparse layers leave the experts no token
    #: reached alone, their backward-side fetches following the routing (``StepSpec.skip_idle_experts``)
    skip_idle_experts: bool = False
    #: whether the GPU runs a mixture of experts' grouped GEMMs (a plan for another machine:
    #: ``Machine.grouped_mm``); None asks this computer's GPU (:func:`.experts.runs_grouped`)
    grouped_experts: bool | None = None
    #: ``--disk-state`` where ``--state-dir`` is given (``none`` without one): what of the
    #: optimizer state lives on disk (:mod:`flowtrain.plan.disk`), and how many reads run ahead
    disk_state: str = "none"
    disk_ahead: int = 2
    #: ``--objective dpo``: the data's sequences (two a pair) whose reference log-probability
    #: the run computes before its first step and keeps in host memory, fp32 each
    #: (:func:`~.memory.reference_host_bytes`); 0 for every other run, or where the data is not known
    reference_rows: int = 0


def checkpoint_read_bytes(model_dir: str | os.PathLike[str] | None) -> int:
    """The largest safetensors file of a model directory: loading maps one file at a time, and
    its pages count towards the process's resident memory while the state is filled."""
    if model_dir is None:
        return 0
    return max((f.stat().st_size for f in Path(model_dir).glob("*.safetensors")), default=0)


def run_request(cfg: Any, model_dir: str | os.PathLike[str] | None = None, processes: int = 1,
                share: int = 1, reference_rows: int = 0) -> RunRequest:
    """The request of a ``TrainConfig`` (or anything with the same attributes); with several
    data-parallel ``processes``, ``cfg`` is one process's share (``distributed.local_share``),
    ``share`` of them on each node sharing the host state. ``reference_rows``: a DPO run's
    sequences of data (every process computes and keeps the reference of all of them)."""
    return RunRequest(seq_len=int(cfg.seq_len), batch_size=cfg.batch_size, micro_batch_size=cfg.micro_batch_size,
                      checkpoint_every=cfg.checkpoint_every, activations=cfg.activations, order=cfg.order,
                      grad_clip=cfg.grad_clip is not None,
                      layout=cfg.layout, resident=cfg.resident, gpu_mem=cfg.gpu_mem, host_mem=cfg.host_mem,
                      chunk_tokens=cfg.chunk_tokens, load_bytes=checkpoint_read_bytes(model_dir),
                      undo_mem=getattr(cfg, "undo_mem", 1.0), processes=processes, share=share,
                      compile=getattr(cfg, "compile", "auto"),
                      attention_backend=getattr(cfg, "attention_backend", "auto"),
                      lora_rank=getattr(cfg, "lora_rank", None) or 0,
                      lora_targets=tuple(getattr(cfg, "lora_targets", None) or DEFAULT_TARGETS),
                      lora_gate_up_rank=getattr(cfg, "lora_gate_up_rank", None),
                      lora_dropout=getattr(cfg, "lora_dropout", 0.0) or 0.0,
                      lora_state=getattr(cfg, "lora_state", "auto"),
                      skip_idle_experts=bool(getattr(cfg, "skip_idle_experts", False)),
                      disk_state=getattr(cfg, "disk_state", "none") if getattr(cfg, "state_dir", None) else "none",
                      reference_rows=reference_rows)
