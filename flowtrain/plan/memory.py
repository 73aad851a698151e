"""The memory plan: where every byte of a training run lives, decided before anything is allocated.

``flowtrain train`` follows the plan and refuses a run that does not fit; ``flowtrain plan``
prints it::

    req = RunRequest(seq_len=4096, batch_size=16, micro_batch_size=4, gpu_mem=10)
    plan = plan_run(preset("llama-8b"), req, device=torch.device("cuda"), dtype=torch.bfloat16)
    plan.fits, plan.host, plan.gpu, plan.spec.resident, plan.max_micro_batch

The planner itself needs no torch: ``device`` and ``dtype`` are only read for their type and
element size, and CUDA is asked for its free memory only when planning for this machine's GPU
(``local_gpu=False`` plans for another machine: ``flowtrain simulate --machine``).

What the plan decides:

- **Layout** of the streamed units' host state (see ``host_state``): ``staged`` (12 bytes per
  parameter: fp32 master and Adam m, v; gradients pass through a few pinned staging slots) by
  default, ``full`` (16: a whole host gradient) where ``--grad-clip`` needs every gradient before
  any update, ``stream-bf16`` (14: a pinned bf16 copy, half the PCIe bytes per fetch) on request.
- **Placement**: on a GPU, which units are *resident* (state in GPU memory, Adam there). For
  speed, the embedding and head (whose Adam and fetch sit at the step boundary) and the bottom
  third of the layers (the first the next step's forward needs, while CPU Adam of the layers
  above is still running), as far as GPU memory allows;
  for capacity, further layers while the host cannot hold the streamed state.
- **Loss chunk** size: the largest (up to the default) whose logits fit the GPU budget.

Host bytes: ``master`` (4 per streamed parameter), ``adam`` (8), ``gradients`` (4, full
layout), ``streaming_copy`` (2, stream-bf16), ``staging`` (the ring), ``tied_gradient``,
``runtime`` (the Python process with torch loaded, measured), ``checkpoint_load`` (the largest
checkpoint file, mapped while it is read) and ``undo_record`` (without clipping: up to
``--undo-mem`` of the master, m and v that ``cpu_adam`` copies aside until the step is known
finite; see :mod:`flowtrain.train.nonfinite`) and ``data`` (the token batches in use, see
:func:`data_host_bytes`). GPU bytes: ``weight_slots``,
``landing`` (the fp32 piece buffer of casting fetches), ``grad_slots``, ``resident`` (master, m,
v, gradient and compute copy: 18 bytes per parameter in bf16), ``checkpoints``, ``recompute``,
``layer_work`` (one layer under autograd), ``kept_activations`` (the layers whose forward
keeps its activations for backward instead of recomputing: :func:`place_activations`),
``saved_attention`` (the recomputing layers whose forward keeps its attention output for the
rebuild: :mod:`.attention`) and ``loss_chunks``. On a CPU-only run the GPU
categories are host memory too. A LoRA run's host holds its frozen ``base`` instead of master
and Adam, and LoRA's own terms (``adapters``, ``lora_work``) are :mod:`.adapters`'.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import msgspec

from ..errors import ConfigError
from ..graph.compiler import StepSpec, compile_step
from ..graph.tasks import ACTS, GRADS, HOST_GRADS, WEIGHTS
from ..model.config import MLP_CHUNK_TOKENS, ModelConfig, default_chunk_tokens
from ..model.adapters import DEFAULT_TARGETS
from ..model.layout import model_layouts
from .adapters import adapter_slot_numel, host_adapters, lora_gpu_bytes, lora_host_bytes
from .attention import attention_pays, forward_flops_saved, plan_saved_attention
from .experts import dense_mlp_layers, expert_bytes_per_token, expert_kept_bytes_per_token, grouped_experts
from .host_layout import LANDING_NUMEL, LAYOUTS, grad_chunks, slot_numel, staging_numel, undo_arena_bytes

if TYPE_CHECKING:
    import torch

GiB = 2**30
#: ``--activations``: where each layer's activations wait for its backward (see TrainConfig)
ACTIVATIONS = ("auto", "keep", "offload", "recompute", "attention")
#: Host items that the processes of a node share (one copy per node, ``StepSpec.share``).
SHARED_HOST = ("master", "adam", "streaming_copy")
#: Host memory of the process itself (interpreter, torch, flowtrain; on CUDA also the CUDA
#: libraries and compile workers), measured as peak RSS minus allocated state: 0.23-0.3 GiB on
#: the CPU, 1.4-1.9 GiB in five H200 runs from 3.6B to 14.8B parameters (docs/benchmarks.md).
RUNTIME_HOST = {"cpu": int(0.30 * GiB), "cuda": int(1.75 * GiB)}
#: Fraction of the free GPU memory the plan fills where no ``--gpu-mem`` is given: the caching
#: allocator's fixed segments need room to round and split.
GPU_FILL = 0.92
#: ``--gpu-mem N`` is a card of N GiB as ``nvidia-smi`` shows it (a "10 GB" RTX 3080 shows
#: 10,240 MiB). Part of it is never PyTorch's: the CUDA context, the kernels of cuBLAS, cuDNN and
#: inductor as they load, and library workspaces outside the caching allocator. Measured on the
#: H200 as a run's device memory in use less what the allocator reserved, after its steps
#: (``flowtrain bench``'s ``gpu_outside_allocator_gib``: 0.88-0.89 GiB in every run of the GPU
#: gate, from llama-3b to llama-8b; docs/benchmarks.md).
CUDA_OUTSIDE_ALLOCATOR_GIB = 0.9
#: Of a card, what flowtrain leaves to everything else on it: a desktop's display, the driver,
#: a second small process. A 10 GB card then gives a run at most 9.5 GiB in all.
CARD_HEADROOM_GIB = 0.5
#: Fraction of a card's allocator share the plan fills. Capped runs use expandable segments
#: (:func:`flowtrain.train.trainer.prefer_expandable_segments`), which map 2 MiB pages and do
#: not strand split blocks, and the plan's counts are upper bounds (within 10% above every
#: measured peak of the gate), so the plan may come this close to the cap.
GPU_FILL_CAPPED = 0.99
#: Fraction of the host budget the plan fills: page cache, the data set, pinned-page bookkeeping.
HOST_FILL = 0.95
#: Steps whose batches are alive at once: the one being cut into micro-batches and the two the
#: training loop keeps in flight.
DATA_BATCHES = 3


class Target(NamedTuple):
    """A device as the planner reads one: its ``type``. A ``torch.device`` is one; so is this,
    for planning a GPU elsewhere without importing torch (``flowtrain simulate``)."""

    type: str


class Precision(NamedTuple):
    """A compute dtype as the planner reads one: its ``itemsize`` (a ``torch.dtype`` is one)."""

    itemsize: int


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
    #: reached alone, their backward-side fetches following the routing (``StepSpec.routed``)
    skip_idle_experts: bool = False


def checkpoint_read_bytes(model_dir: str | os.PathLike[str] | None) -> int:
    """The largest safetensors file of a model directory: loading maps one file at a time, and
    its pages count towards the process's resident memory while the state is filled."""
    if model_dir is None:
        return 0
    return max((f.stat().st_size for f in Path(model_dir).glob("*.safetensors")), default=0)


def data_host_bytes(req: RunRequest) -> int:
    """Host bytes of the training data: ``DATA_BATCHES`` batches of input ids, targets and
    positions (int64), gathered from the data cache. The data set itself stays on disk, mapped
    (:mod:`flowtrain.data.cache`); the pages a batch reads are page cache that the kernel
    drops under pressure, like the checkpoint pages, so the file's size is not counted."""
    return DATA_BATCHES * req.batch_size * req.seq_len * 3 * 8


def run_request(cfg: Any, model_dir: str | os.PathLike[str] | None = None, processes: int = 1,
                share: int = 1) -> RunRequest:
    """The request of a ``TrainConfig`` (or anything with the same attributes); with several
    data-parallel ``processes``, ``cfg`` is one process's share (``distributed.local_share``),
    ``share`` of them on each node sharing the host state."""
    return RunRequest(seq_len=cfg.seq_len, batch_size=cfg.batch_size, micro_batch_size=cfg.micro_batch_size,
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
                      skip_idle_experts=bool(getattr(cfg, "skip_idle_experts", False)))


class Plan(msgspec.Struct, kw_only=True):
    device: str
    params: int
    layout: str
    spec: StepSpec
    budgets: dict[str, int]
    chunk_tokens: int
    host: dict[str, int]
    gpu: dict[str, int]
    host_limit: int | None
    gpu_limit: int | None
    #: processes on the node (``--nproc-per-node``): they share one host copy of the state
    #: (``spec.share``), or, with LoRA, each keeps its own base and adapters
    node_processes: int = 1
    max_micro_batch: int | None = None
    suggestions: list[str] = msgspec.field(default_factory=list)
    #: how ``--order auto`` was decided, where it was by prediction (:mod:`.order_choice`)
    order_choice: str | None = None
    #: where ``--activations auto`` or ``--layout auto`` took an alternative to the rules' plan
    #: because it was predicted faster (:mod:`.placement_choice`)
    placement_choice: str | None = None

    @property
    def host_total(self) -> int:
        """Peak host bytes. Loading a checkpoint happens before any activation exists, so of the
        file being read and (on a CPU-only run) the device-side items only the larger counts."""
        load = self.host.get("checkpoint_load", 0)
        on_host = self.gpu_total if self.device == "cpu" else 0
        return sum(self.host.values()) - load + max(load, on_host)

    @property
    def host_node_total(self) -> int:
        """Peak host bytes of the node: the shared state once, every process's own part (its
        buffers, runtime, data; with LoRA also its base and adapters) once per process."""
        shared = sum(self.host.get(k, 0) for k in SHARED_HOST)  # (none with LoRA)
        return shared + self.node_processes * (self.host_total - shared)

    @property
    def gpu_total(self) -> int:
        """Peak device bytes: everything at once, except what belongs to phases that never meet.
        The loss chunks (forward's end) and one layer's backward working set are never live
        together, so only the larger counts; where checkpoints are offloaded, the forward's
        checkpoints in flight to the host and the loss and backward's layer gradients with that
        working set are two phases too (on the H200 the 10 GiB llama-8b step peaked in its
        backward, within 1% of this count; docs/benchmarks.md)."""
        return gpu_peak(self.gpu)

    @property
    def host_state_bytes_per_param(self) -> float:
        """Host bytes of model and optimizer state (runtime excluded) per model parameter."""
        transient = sum(self.host.get(k, 0) for k in ("runtime", "checkpoint_load", "data"))
        return (sum(self.host.values()) - transient) / self.params

    @property
    def host_fits(self) -> bool:
        return self.host_limit is None or self.host_node_total <= self.host_limit

    @property
    def gpu_fits(self) -> bool:
        return self.device == "cpu" or self.gpu_limit is None or self.gpu_total <= self.gpu_limit

    @property
    def fits(self) -> bool:
        return self.host_fits and self.gpu_fits

    def refusal(self) -> str:
        """One line: what does not fit, by how much, and what would make it fit."""
        parts = []
        if self.host_limit is not None and not self.host_fits:  # a limit is what it does not fit
            who = f" for {self.node_processes} processes" if self.node_processes > 1 else ""
            parts.append(f"host memory: needs {self.host_node_total / GiB:.1f} GiB{who}, {self.host_limit / GiB:.1f} GiB usable")
        if self.gpu_limit is not None and not self.gpu_fits:
            parts.append(f"GPU memory: needs {self.gpu_total / GiB:.1f} GiB, {self.gpu_limit / GiB:.1f} GiB usable")
        fix = "; ".join(self.suggestions) or "use a smaller model"
        return f"the run does not fit ({'; '.join(parts)}); {fix} (see `flowtrain plan`)"

    def to_dict(self) -> dict:
        return {
            "device": self.device, "params": self.params, "layout": self.layout,
            "resident": list(self.spec.resident), "budgets": self.budgets, "chunk_tokens": self.chunk_tokens,
            "grad_chunks": self.spec.grad_chunks,
            "host": self.host, "gpu": self.gpu, "host_total": self.host_total, "gpu_total": self.gpu_total,
            "host_limit": self.host_limit, "gpu_limit": self.gpu_limit,
            "processes_sharing_host": self.spec.share, "host_node_total": self.host_node_total,
            "host_state_bytes_per_param": round(self.host_state_bytes_per_param, 3),
            "fits": self.fits, "host_fits": self.host_fits, "gpu_fits": self.gpu_fits,
            "max_micro_batch": self.max_micro_batch, "suggestions": self.suggestions,
            "order": self.spec.order, "order_choice": self.order_choice,
            "placement_choice": self.placement_choice, "save_attention": list(self.spec.save_attention),
            "host_adapters": self.spec.host_adapters,
        }


# ---- limits -------------------------------------------------------------------------------
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


def _limits(req: RunRequest, device: torch.device, local_gpu: bool) -> tuple[int | None, int | None]:
    """The usable host and GPU bytes: what the request says, else what is free here; the GPU
    never more than is free on this machine's GPU now, unless the plan is for another machine
    (``local_gpu=False``)."""
    host = int(req.host_mem * GiB) if req.host_mem is not None else host_available()
    caps = [] if req.gpu_mem is None else [int(allocator_share(req.gpu_mem) * GPU_FILL_CAPPED)]
    if device.type == "cuda" and local_gpu:
        import torch

        if torch.cuda.is_available():
            caps.append(int(torch.cuda.mem_get_info(device)[0] * GPU_FILL))
    gpu = min(caps) if caps else None
    return (None if host is None else int(host * HOST_FILL)), gpu


def gpu_peak(g: dict[str, int]) -> int:
    """Peak device bytes of the GPU items ``g`` (see :attr:`Plan.gpu_total`)."""
    work, loss = g.get("layer_work", 0), g.get("loss_chunks", 0)
    forward, gradients = g.get("offload_in_flight", 0), g.get("layer_gradients", 0)
    shared = sum(g.values()) - work - loss - forward - gradients
    return shared + max(forward, gradients + max(work, loss))


def allocator_share(gpu_mem: float) -> int:
    """Bytes PyTorch's caching allocator may reserve on a card of ``gpu_mem`` GiB (as
    ``nvidia-smi`` shows it): the card less what the CUDA context and libraries take outside
    the allocator (:data:`CUDA_OUTSIDE_ALLOCATOR_GIB`) and the headroom left to the rest of the
    machine (:data:`CARD_HEADROOM_GIB`)."""
    share = gpu_mem - CUDA_OUTSIDE_ALLOCATOR_GIB - CARD_HEADROOM_GIB
    if share <= 0:
        raise ConfigError(f"--gpu-mem {gpu_mem:g} is smaller than what CUDA itself takes on a card "
                          f"(about {CUDA_OUTSIDE_ALLOCATOR_GIB:g} GiB for the context and libraries, "
                          f"and {CARD_HEADROOM_GIB:g} GiB left to the display and driver)")
    return int(share * GiB)


def card_for(allocator_bytes: int) -> float:
    """The ``--gpu-mem`` (card size in GiB) whose plan budget is ``allocator_bytes``: the
    inverse of what :func:`_limits` makes of a card."""
    return allocator_bytes / GPU_FILL_CAPPED / GiB + CUDA_OUTSIDE_ALLOCATOR_GIB + CARD_HEADROOM_GIB


def cap_gpu_memory(device: torch.device, gib: float) -> None:
    """Enforce ``--gpu-mem``: the caching allocator refuses to grow this process past its share
    of a card of ``gib`` GiB (:func:`allocator_share`), so the whole process fits the card."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, allocator_share(gib) / total), index)


# ---- the byte counts ----------------------------------------------------------------------
_LAYOUTS: dict[bytes, tuple] = {}


def _layouts(cfg: ModelConfig) -> tuple:
    """``model_layouts(cfg)``, built once per model: every candidate plan reads them, and for
    100 layers they take ~2 ms to build, three times per candidate, ~50 candidates."""
    key = msgspec.json.encode(cfg)
    if key not in _LAYOUTS:
        if len(_LAYOUTS) >= 8:
            _LAYOUTS.clear()
        _LAYOUTS[key] = tuple(model_layouts(cfg))
    return _LAYOUTS[key]


def _bytes(cfg: ModelConfig, req: RunRequest, device: torch.device, dtype: torch.dtype, layout: str,
           resident: tuple[str, ...], budgets: dict[str, int], chunk_tokens: int) -> tuple[dict, dict]:
    layouts = _layouts(cfg)
    res = set(resident)
    streamed = [lay for lay in layouts if lay.key not in res]
    streamed_n = sum(lay.numel for lay in streamed)
    resident_n = sum(lay.numel for lay in layouts if lay.key in res)
    embed_n = layouts[0].numel
    cbytes = dtype.itemsize
    tied_streamed = cfg.tie_word_embeddings and "head" not in res
    slot_n = slot_numel(list(layouts), resident, cfg.tie_word_embeddings)
    stage_n = staging_numel(layouts, resident)

    lora = req.lora_rank > 0  # a frozen base: its weights in the compute dtype, nothing else
    in_host = host_adapters(req)
    adapter_slot_n = adapter_slot_numel(cfg, req)
    if lora:
        host = {"base": cbytes * streamed_n, **lora_host_bytes(cfg, req)}
    else:
        host = {"master": 4 * streamed_n, "adam": 8 * streamed_n}
        if layout == "full":
            host["gradients"] = 4 * streamed_n
        else:
            host["staging"] = budgets.get(HOST_GRADS, 0) * stage_n * 4
        if layout == "stream-bf16" and cbytes != 4:
            host["streaming_copy"] = cbytes * streamed_n
        if tied_streamed:
            host["tied_gradient"] = 4 * embed_n
    host["runtime"] = RUNTIME_HOST["cuda" if device.type == "cuda" else "cpu"]
    host["data"] = data_host_bytes(req)
    if req.load_bytes:
        host["checkpoint_load"] = req.load_bytes
    if not req.grad_clip and streamed and not lora:
        chunks = grad_chunks(layouts, resident, stage_n) if layout != "full" else {}
        units = [(lay.numel, chunks.get(lay.key, 1)) for lay in streamed]
        # --undo-mem is the node's: processes sharing the state record only the units they own
        host["undo_record"] = undo_arena_bytes(units, stage_n, int(req.undo_mem * GiB) // req.share, touched=not resident)

    tokens = req.micro_batch_size * req.seq_len
    hidden = tokens * cfg.hidden_size * cbytes
    live_mbs = _live_micro_batches(req)
    k = req.checkpoint_every
    compiled = device.type == "cuda" and compile_backend(req.compile, device.type) == "inductor"
    layer_work = layer_work_bytes(cfg, tokens, cbytes, compiled)
    chunk = min(chunk_tokens, tokens)
    casting = cbytes != 4 and slot_n > 0 and (in_host if lora else layout != "stream-bf16")
    resident_per = cbytes if lora else 16 + (cbytes if cbytes != 4 else 0)
    gpu = {
        "weight_slots": budgets[WEIGHTS] * (slot_n + adapter_slot_n) * cbytes,  # host adapters come with their layer
        "landing": 4 * min(slot_n, LANDING_NUMEL) if casting else 0,
        "grad_slots": budgets[GRADS] * (adapter_slot_n if lora else slot_n) * 4,
        "resident": resident_per * resident_n,
        "checkpoints": math.ceil(cfg.num_layers / k) * live_mbs * hidden,
        "recompute": (k - 1) * live_mbs * hidden,
        "layer_work": layer_work,
        # fp32 logits and their softmax in place, the bf16 gradient, the head's gradient
        # before accumulation, and the micro-batch's hidden-state gradient.
        "loss_chunks": chunk * cfg.vocab_size * (4 + 4 + cbytes) + 2 * hidden
        + (0 if lora else cbytes * cfg.vocab_size * cfg.hidden_size),
    }
    if lora:
        gpu.update(lora_gpu_bytes(cfg, req, tokens, cbytes))
    if req.activations == "offload":  # all offloaded here; _bring_back returns what fits (auto)
        host["offloaded_activations"] = gpu["checkpoints"]
        gpu.update(_offloading_gpu(req, hidden))
    return host, gpu


def _offloading_gpu(req: RunRequest, hidden: int) -> dict[str, int]:
    """The device items of a step whose checkpoints are offloaded, by phase: the forward's
    checkpoints waiting for their copies (``offload_in_flight``), and in the loss and backward,
    the layer outputs of every live micro-batch before the loss and their gradients between two
    layers' backward (``layer_gradients``) beside the ``acts`` slots the checkpoints come back
    into (``checkpoints``). :attr:`Plan.gpu_total` counts the two phases apart."""
    live = _live_micro_batches(req)
    return {"checkpoints": _act_slots(req) * hidden, "offload_in_flight": (2 * live + 2) * hidden,
            "layer_gradients": live * hidden}


def layer_work_bytes(cfg: ModelConfig, tokens: int, cbytes: int, compiled: bool) -> int:
    """Device bytes of one layer's backward for ``tokens`` tokens: its forward rebuilt under
    autograd (the tensors it saves), the gradients flowing back, the fused attention backward's
    own buffers (an fp32 accumulator for dq and, with grouped KV heads, dk and dv expanded to
    every query head before they are summed), and the weight gradient in the compute dtype
    before it is added to the fp32 accumulator.

    ``compiled``: the layer runs through inductor in one graph, whose partitioner saves about a
    fifth less than eager autograd (norms, rotary and SwiGLU recomputed in the backward; the
    units are :func:`kept_bytes_per_token`'s). A layer that saves its attention output breaks
    its graph at attention, so its planner counts eager bytes (:mod:`.attention`). On the
    H200 the count is within 10% of the measured peak of every run of the GPU gate
    (docs/benchmarks.md)."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    q = cfg.num_heads * cfg.head_size
    kv = cfg.num_kv_heads * cfg.head_size
    if compiled:
        per_token, mlp_units = 4 * h + 3 * q + 2 * kv + 2 * cfg.head_size, 3 * f
    else:
        per_token, mlp_units = 6 * h + 2 * q + 4 * kv, 4 * f
    layer_n = max((lay.numel for lay in _layouts(cfg) if lay.unit == "layer"), default=0)
    work = tokens * cbytes * per_token + cbytes * layer_n
    work += tokens * (4 * q + (2 * cbytes * (q - kv) if kv < q else 0))  # attention backward's buffers
    if cfg.moe:  # the larger of a sparse layer's routing and experts and a dense layer's MLP
        return work + _moe_mlp_work(cfg, tokens, cbytes, mlp_units)
    if tokens > MLP_CHUNK_TOKENS:  # the MLP in pieces: one piece's intermediates, fp32 weight gradients
        return work + MLP_CHUNK_TOKENS * cbytes * mlp_units + 12 * h * f
    return work + tokens * cbytes * mlp_units


def _moe_mlp_work(cfg: ModelConfig, tokens: int, cbytes: int, mlp_units: int) -> int:
    """A mixture of experts' MLP work in the layer whose MLP needs most: a sparse layer's
    routing and T k expert rows (:mod:`.experts`; never run in pieces), or a dense layer's."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    dense = 0
    if dense_mlp_layers(cfg):
        dense = (MLP_CHUNK_TOKENS * cbytes * mlp_units + 12 * h * f if tokens > MLP_CHUNK_TOKENS
                 else tokens * cbytes * mlp_units)
    return max(dense, tokens * expert_bytes_per_token(cfg, cbytes) if cfg.sparse_layers() else 0)


def _offload_in_flight(req: RunRequest, hidden: int) -> int:
    """Device bytes of checkpoints with every one offloaded: the inputs of the layer the forward
    is at and its outputs (the inputs of the next), one output being written and one input
    whose copy to the host is still running (the step graph holds each forward until the
    offload ``StepSpec.offload_lag`` layers below it is issued), and in backward the
    checkpoints back from the host ahead of their backward (the ``acts`` slots of
    :func:`flowtrain.policy.base.budgets`)."""
    return sum(v for k, v in _offloading_gpu(req, hidden).items() if k != "layer_gradients")


def _act_slots(req: RunRequest) -> int:
    """The ``acts`` budget the built-in policies give an offloading step."""
    from ..policy.base import act_slots

    return act_slots(req.order, req.checkpoint_every, req.batch_size // req.micro_batch_size)


# ---- the decision -------------------------------------------------------------------------
def _layout(req: RunRequest) -> str:
    if req.layout == "auto":
        return "full" if req.grad_clip else "staged"
    if req.layout not in LAYOUTS:
        raise ConfigError(f"--layout must be auto or one of {', '.join(LAYOUTS)} (got {req.layout!r})")
    return req.layout


def _explicit_resident(req: RunRequest) -> tuple[str, ...] | None:
    if req.resident == "auto":
        return None
    if req.resident in ("none", ""):
        return ()
    return tuple(k.strip() for k in req.resident.split(",") if k.strip())  # StepSpec checks the keys


def _make(cfg, req, device, dtype, policy, layout, resident, chunk_tokens, shrink: dict[str, int],
          grow: dict[str, int] | None = None) -> Plan:
    """One candidate plan; ``grow`` raises and ``shrink`` caps the policy's slot budgets."""
    spec = _spec(cfg, req, layout, resident)
    budgets, floor = _policy_budgets(spec, policy)
    for pool, want in (grow or {}).items():
        if pool in budgets:
            budgets[pool] = max(budgets[pool], want)
    for pool, cap in shrink.items():
        if pool in budgets:
            budgets[pool] = max(floor.get(pool, 1), min(budgets[pool], cap))
    if spec.lora:  # no gradient of the base leaves the device or waits in a slot (host adapters' do)
        budgets.update({pool: 0 for pool in ((HOST_GRADS,) if spec.host_adapters else (GRADS, HOST_GRADS))
                        if pool in budgets})
    host, gpu = _bytes(cfg, req, device, dtype, layout, resident, budgets, chunk_tokens)
    params = sum(lay.numel for lay in _layouts(cfg))
    return Plan(device=device.type, params=params, layout=layout, spec=spec, budgets=budgets, node_processes=req.share,
                chunk_tokens=chunk_tokens, host=host, gpu=gpu, host_limit=None, gpu_limit=None)


class _BudgetCache:
    """The slot budgets a policy proposes for one step shape, and their floor, asked once each.

    Planning tries many candidates (placements, smaller loss chunks and slot caps, every
    micro-batch size, the simulator's alternatives), and each needs its policy's budgets. A
    policy proposes from the compiled step graph, which takes ~30 ms to build for 100 layers
    and 16 micro-batches, while the answer depends only on the policy and the ``StepSpec``: so
    each pair is compiled and asked once. A policy object is keyed by identity and kept alive by
    its entries (its id cannot be reused while they exist); a name also by what it is
    registered as now.
    """

    def __init__(self, size: int = 512) -> None:
        self.size = size
        self._entries: dict[tuple, tuple[Any, dict[str, int], dict[str, int]]] = {}

    def __call__(self, spec: StepSpec, policy: Any) -> tuple[dict[str, int], dict[str, int]]:
        """(budgets, floor): the policy's proposal over the built-ins' defaults, and the least
        each pool may be shrunk to."""
        from ..policy import POLICIES

        who = (policy, POLICIES.get(policy)) if isinstance(policy, str) else id(policy)
        key = (who, msgspec.json.encode(spec))
        if key not in self._entries:
            if len(self._entries) >= self.size:
                self._entries.pop(next(iter(self._entries)))  # the oldest
            self._entries[key] = (policy, *self._ask(spec, policy))
        _, budgets, floor = self._entries[key]
        return dict(budgets), dict(floor)

    @staticmethod
    def _ask(spec: StepSpec, policy: Any) -> tuple[dict[str, int], dict[str, int]]:
        from ..policy import resolve_policy
        from ..policy.base import budgets as default_budgets
        from ..policy.base import min_grad_slots

        graph = compile_step(spec)
        # A pool the graph takes from but the policy did not budget (a user's policy written
        # for another layout, say) gets the built-ins' default.
        budgets = {**default_budgets(graph, weights=2, grads=1), **resolve_policy(policy).propose(graph).budgets}
        return budgets, {WEIGHTS: 1, GRADS: min_grad_slots(graph)}


_policy_budgets = _BudgetCache()


def _spec(cfg: ModelConfig, req: RunRequest, layout: str, resident: tuple[str, ...]) -> StepSpec:
    layouts = _layouts(cfg)
    staged = layout != "full"
    chunks = grad_chunks(layouts, resident, staging_numel(layouts, resident)) if staged else {}
    return StepSpec(layers=cfg.num_layers, micro_batches=req.batch_size // req.micro_batch_size,
                    checkpoint_every=req.checkpoint_every, order=req.order, tied=cfg.tie_word_embeddings,
                    grad_clip=req.grad_clip, resident=resident, staged=staged, grad_chunks=chunks,
                    # LoRA's processes each keep their own base and adapters: nothing to share
                    reduce=req.processes > 1, share=1 if req.lora_rank > 0 else req.share, lora=req.lora_rank > 0,
                    host_adapters=host_adapters(req), routed=_routed(cfg, req)).validate()


def _routed(cfg: ModelConfig, req: RunRequest) -> tuple[int, ...]:
    """The layers whose idle experts are skipped: every sparse layer, with ``--skip-idle-experts``."""
    return tuple(cfg.sparse_layers()) if req.skip_idle_experts else ()


def _backlog(cfg: ModelConfig, resident: tuple[str, ...], weights: bool = True) -> dict[str, int]:
    """Extra slots for speed where every layer's gradient is finished by one backward pass (one
    micro-batch per step, or micro-batch order). Backward then outruns CPU Adam, so finished
    gradients queue, and the CPU runs Adam in the order the next step needs the units
    (:func:`~flowtrain.policy.base.optimizer_urgency`), which leaves the top layers' gradients
    waiting longest. They wait in pinned host staging slots (half the streamed layers can), not
    on the GPU, so backward never waits for Adam. And the next step's forward through the
    streamed layers is shorter than their fetches: with weight slots for a third of them
    (``weights``), their fetches start during the backward of the resident layers below, once
    each layer's Adam is done. Both measured on W1 in ``flowtrain simulate``: more gained
    nothing. The plan takes them only where memory holds them, and before kept activations
    (:func:`_keep` fills what is left), which save less per GPU byte where fetches bound the
    forward."""
    streamed_layers = sum(1 for i in range(cfg.num_layers) if f"layer.{i}" not in resident)
    out = {HOST_GRADS: 3 + math.ceil(streamed_layers / 2)}
    if weights:
        out[WEIGHTS] = max(2, math.ceil(streamed_layers / 3))
    return out


def _plan_once(cfg, req, device, dtype, policy, host_limit, gpu_limit) -> Plan:
    """The plan for one micro-batch size (:func:`_plan_placed`). With LoRA and ``lora_state``
    auto, the adapters stay on the GPU where that plan fits, else go to host memory where that
    one fits (or, fitting neither, where the GPU's budget holds: host memory is then short)."""
    if req.lora_rank <= 0 or req.lora_state != "auto":
        return _plan_placed(cfg, req, device, dtype, policy, host_limit, gpu_limit)
    on_gpu = _plan_placed(cfg, msgspec.structs.replace(req, lora_state="gpu"), device, dtype, policy, host_limit,
                          gpu_limit)
    explicit = _explicit_resident(req) or ()
    if on_gpu.fits or device.type != "cuda" or any(u.startswith("layer.") for u in explicit):
        return on_gpu  # (a resident layer has no fetch to bring its adapters from host memory)
    on_host = _plan_placed(cfg, msgspec.structs.replace(req, lora_state="host"), device, dtype, policy, host_limit,
                           gpu_limit)
    return on_host if on_host.fits or (on_host.gpu_fits and not on_gpu.gpu_fits) else on_gpu


def _plan_placed(cfg, req, device, dtype, policy, host_limit, gpu_limit) -> Plan:
    """The plan for one micro-batch size: state placement first, then activations.

    The state is placed with every checkpoint on the GPU, as recompute keeps them. Where
    offloading is allowed (``offload``, or ``auto`` on a GPU) and that plan does not fit or had
    to give up weight or gradient slots to fit, the state is placed again with every checkpoint
    on the host, and :func:`_bring_back` returns to the GPU as many as then fit. A checkpoint
    saves more copying per GPU byte than a resident layer, so residency only gets what the
    checkpoints leave, as long as they fit. A plan that offloads checkpoints keeps no layers.
    At long sequences ``auto`` then compares that plan with one that saves attention outputs
    (:mod:`.attention`)."""
    if req.activations == "offload":
        return _bring_back(_plan_state(cfg, req, device, dtype, policy, host_limit, gpu_limit), cfg, req)
    if req.activations == "attention":
        _check_activations(req)
        every = _with_saved_attention(cfg, req, device, dtype, policy, host_limit, gpu_limit, every=True)
        assert every is not None  # with every layer saving, plan_saved_attention always answers
        return every
    plan = _plan_state(cfg, req, device, dtype, policy, host_limit, gpu_limit)
    if req.activations == "auto" and device.type == "cuda" and (not plan.fits or _squeezed(plan, policy)):
        offloading = msgspec.structs.replace(req, activations="offload")
        away = _bring_back(_plan_state(cfg, offloading, device, dtype, policy, host_limit, gpu_limit), cfg, req)
        # taken only where it fits and fits better: it costs host memory, which may be what is
        # short (then residency, not offloading, is the way to fit)
        if away.fits and (not plan.fits or not _squeezed(away, policy, than=plan)):
            plan = away
        elif not plan.fits and away.gpu_fits and not plan.gpu_fits:
            # neither fits, but offloading keeps the GPU in budget: host memory is what is
            # short, and that plan's refusal says so
            plan = away
    if not plan.spec.offload:
        plan = place_activations(plan, cfg, req, dtype)
    if (req.activations == "auto" and device.type == "cuda" and req.checkpoint_every == 1
            and attention_pays(cfg, req.seq_len)):
        saving = _with_saved_attention(cfg, req, device, dtype, policy, host_limit, gpu_limit, every=False)
        if saving is not None and saving.fits and (
                forward_flops_saved(saving, cfg, req.seq_len) > forward_flops_saved(plan, cfg, req.seq_len)):
            return saving
    return plan


def _with_saved_attention(cfg, req, device, dtype, policy, host_limit, gpu_limit, every: bool) -> Plan | None:
    """The plan that saves attention outputs (:mod:`.attention`): the state placed (where
    attention pays, with residency only for capacity: a step is then long enough that fetches
    and CPU Adam hide), checkpoints offloaded as far as needed, the GPU spent on the outputs."""
    speed = not attention_pays(cfg, req.seq_len)
    eager_work = layer_work_bytes(cfg, req.micro_batch_size * req.seq_len, dtype.itemsize, compiled=False)
    return plan_saved_attention(
        cfg, req, dtype.itemsize, req.micro_batch_size * req.seq_len * _live_micro_batches(req), eager_work,
        lambda r: _plan_state(cfg, r, device, dtype, policy, host_limit, gpu_limit, speed=speed),
        _offload_in_flight(req, req.micro_batch_size * req.seq_len * cfg.hidden_size * dtype.itemsize),
        _act_slots(req), every)


def _squeezed(plan: Plan, policy: Any, than: Plan | None = None) -> bool:
    """Whether ``plan`` has fewer weight or gradient slots than the policy proposes for its step
    (or, with ``than``, than that plan has): it gave up prefetch or overlap to fit."""
    want = than.budgets if than is not None else _policy_budgets(plan.spec, policy)[0]
    return any(plan.budgets[p] < want[p] for p in (WEIGHTS, GRADS) if p in want)


def _live_micro_batches(req: RunRequest) -> int:
    """Micro-batches whose activations are alive at once: all of the step's layer-major (each
    layer runs every micro-batch before the next layer), one micro-batch-major."""
    return req.batch_size // req.micro_batch_size if req.order == "layer" else 1


def kept_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, compiled: bool = False, grouped: bool = False) -> int:
    """Device bytes one token's kept activations take in one decoder layer: the saved tensors
    of the layer's forward under autograd (norm statistics in fp32, q, k and v before and after
    rotary, the attention output and its log-sum-exp, the MLP's gate, up and product), fitted
    on transformers-shaped layers of each family and rounded up (``tests/train/test_kept.py``
    holds it at or above what autograd saves).

    ``compiled``: the layer runs through inductor, whose partitioner saves less and recomputes
    cheap elementwise work in the backward instead (the layer input and both normed inputs, the
    rotated q and k, v, the attention output in both layouts, the residual, the MLP's gate, up
    and activation): about two thirds of the eager bytes. On the H200 a compiled kept llama-3b
    layer took 1.38 GiB at 16,384 tokens (docs/benchmarks.md), this formula 1.48.

    ``grouped``: a mixture of experts' layers run the grouped experts, which keep less than the
    loop (:func:`~flowtrain.plan.experts.expert_kept_bytes_per_token`)."""
    c = dtype.itemsize
    h, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_size, cfg.num_kv_heads * cfg.head_size
    units: float
    if compiled:
        units = 4 * h + 3 * q + 2 * kv + 3 * f + 2 * cfg.head_size
        if cfg.qk_norm:
            units += q + kv
        if cfg.family.gemma:
            units += h
        if cfg.moe and cfg.sparse_layers():  # routing and expert rows in place of the MLP's 3 f
            mlp = max(expert_kept_bytes_per_token(cfg, c, True, grouped), c * 3 * f if dense_mlp_layers(cfg) else 0)
            return int(c * (units - 3 * f)) + mlp + 4 * cfg.num_heads + 8
        return int(c * units) + 4 * cfg.num_heads + 8
    units = 8 * h + 3 * q + 2.5 * kv + 4 * f
    if cfg.qk_norm:
        units += 3 * q + 3 * kv
    if cfg.family.gemma:
        units += 12 * h
    if cfg.moe and cfg.sparse_layers():  # a sparse layer keeps its routing and expert rows instead
        mlp = max(expert_kept_bytes_per_token(cfg, c, False, grouped), c * 4 * f if dense_mlp_layers(cfg) else 0)
        return int(c * (units - 4 * f)) + mlp + 4 * cfg.num_heads
    return int(c * units) + 4 * cfg.num_heads


def place_activations(plan: Plan, cfg: ModelConfig, req: RunRequest, dtype: torch.dtype) -> Plan:
    """Where each layer's activations wait for its backward (``StepSpec.keep`` and ``.offload``),
    and their bytes: ``keep`` keeps every layer's on the GPU, ``recompute`` keeps a checkpoint
    every ``--activation-checkpoint-every`` layers on the GPU and recomputes the rest, ``offload``
    sends every checkpoint to pinned host memory and brings it back before its backward.

    This places kept layers; offloaded checkpoints are placed before, with the state
    (:func:`_plan_once`), and a plan that offloads some keeps none. ``auto`` (on a GPU;
    recompute on the CPU) spends the GPU budget in order of what it saves per byte: first
    checkpoints on the GPU instead of the host, then, once every checkpoint is on the GPU, kept
    layers from the top (their backward comes first, so their memory is freed first). Kept
    layers need a checkpoint at every layer, so ``--activation-checkpoint-every`` above 1 means
    recompute or offload."""
    mode = req.activations
    _check_activations(req)
    compiled = compile_backend(req.compile, plan.device) == "inductor"
    grouped = cfg.moe and grouped_experts(plan.device, dtype)
    per_layer = (kept_bytes_per_token(cfg, dtype, compiled, grouped) * req.micro_batch_size * req.seq_len
                 * _live_micro_batches(req))
    L = cfg.num_layers
    if mode == "keep":
        n = L
    elif mode == "recompute" or plan.device != "cuda" or req.checkpoint_every != 1:
        n = 0
    elif plan.gpu_limit is None:
        n = L
    else:
        free = plan.gpu_limit - plan.gpu_total
        n = max(0, min(L, free // per_layer)) if per_layer else L
    if n == 0:
        return plan
    # A kept layer's input is no checkpoint any more: its graph holds what backward needs.
    checkpoints = plan.gpu.get("checkpoints", 0) * (L - n) // L
    plan.spec = msgspec.structs.replace(plan.spec, keep=tuple(range(L - n, L)))
    plan.gpu = {**plan.gpu, "checkpoints": checkpoints, "kept_activations": n * per_layer}
    return plan


def _check_activations(req: RunRequest) -> None:
    mode = req.activations
    if mode not in ACTIVATIONS:
        raise ConfigError(f"--activations must be one of {', '.join(ACTIVATIONS)} (got {mode!r})")
    if mode in ("keep", "attention") and req.checkpoint_every != 1:
        raise ConfigError(f"--activations {mode} needs --activation-checkpoint-every 1: a segment of "
                          "several layers recomputes them all")


def _bring_back(plan: Plan, cfg: ModelConfig, req: RunRequest) -> Plan:
    """From a plan with every checkpoint offloaded (:func:`_bytes`): ``offload`` keeps it so;
    ``auto`` brings checkpoints back to the GPU from the top while the budget holds them, and
    offloads the rest, the bottom ones (``StepSpec.offload``): they are away longest, so their
    copies have the most time to hide behind compute. With none left offloaded, the plan is a
    plain recompute plan."""
    starts = list(range(0, cfg.num_layers, req.checkpoint_every))
    per_ck = plan.host["offloaded_activations"] // len(starts)
    slots = plan.gpu["checkpoints"]
    offloading = plan.gpu
    recomputing = {k: v for k, v in offloading.items() if k not in ("offload_in_flight", "layer_gradients")}
    recomputing["checkpoints"] = len(starts) * per_ck

    def with_back(n_off: int) -> dict[str, int]:  # the GPU items with all but n_off checkpoints back
        if n_off == 0:
            return recomputing
        return {**offloading, "checkpoints": slots + (len(starts) - n_off) * per_ck}

    if req.activations == "offload":
        n_off = len(starts)
    elif plan.gpu_limit is None:
        n_off = 0
    else:  # the fewest offloaded (from the bottom) that fit, else all of them
        limit = plan.gpu_limit
        n_off = next((n for n in range(len(starts) + 1) if gpu_peak(with_back(n)) <= limit), len(starts))
    plan.gpu = with_back(n_off)
    host = {k: v for k, v in plan.host.items() if k != "offloaded_activations"}
    if n_off == 0:
        plan.host = host
        return plan
    plan.host = {**host, "offloaded_activations": n_off * per_ck}
    plan.spec = msgspec.structs.replace(plan.spec, offload=tuple(starts[:n_off]))
    plan.budgets = {**plan.budgets, ACTS: _act_slots(req)}
    return plan


def _plan_state(cfg, req, device, dtype, policy, host_limit, gpu_limit, speed: bool = True) -> Plan:
    """Layout, resident units, loss chunk and slot budgets for one micro-batch size. Without
    ``speed``, ``--resident auto`` makes units resident only as host memory needs, and no slots
    are added for a backlog (:func:`_backlog`)."""
    layout = _layout(req)
    explicit = _explicit_resident(req)
    default_chunk = req.chunk_tokens or default_chunk_tokens(cfg.vocab_size)

    def build(resident: tuple[str, ...]) -> Plan:
        """The plan for one placement, shrunk to the GPU budget: smaller loss chunks first, then
        one gradient accumulator instead of two, then one weight slot (no prefetch)."""
        chunk, shrink = default_chunk, dict[str, int]()
        if speed and device.type == "cuda" and (req.batch_size == req.micro_batch_size or req.order == "micro"):
            for weights in (True, False):
                p = _make(cfg, req, device, dtype, policy, layout, resident, chunk, shrink,
                          _backlog(cfg, resident, weights))
                p.host_limit, p.gpu_limit = host_limit, gpu_limit
                if p.host_fits and p.gpu_fits:
                    return p
        p = _make(cfg, req, device, dtype, policy, layout, resident, chunk, shrink)
        while device.type == "cuda" and gpu_limit is not None and p.gpu_total > gpu_limit:
            if req.chunk_tokens is None and chunk > 256:
                chunk = max(256, chunk // 2)
            elif GRADS not in shrink and p.budgets[GRADS] > 1:
                shrink = {**shrink, GRADS: 1}
            elif p.budgets[WEIGHTS] > 1 and WEIGHTS not in shrink:
                shrink = {**shrink, WEIGHTS: 1}
            else:
                break
            p = _make(cfg, req, device, dtype, policy, layout, resident, chunk, shrink)
        p.host_limit, p.gpu_limit = host_limit, gpu_limit
        return p

    if explicit is not None or device.type != "cuda":
        return build(explicit or ())
    return _choose_resident(cfg, build, policy, speed, never=never_resident(cfg, req))


def never_resident(cfg: ModelConfig, req: RunRequest) -> frozenset[str]:
    """The layers no ``--resident auto`` choice may keep on the GPU: with adapters in host
    memory, every layer (a layer's fetch is what brings its adapters)."""
    return frozenset(f"layer.{i}" for i in range(cfg.num_layers)) if host_adapters(req) else frozenset()


def _choose_resident(cfg: ModelConfig, build, policy: Any, speed: bool = True,  # noqa: ANN001 - build(resident) -> Plan
                     never: frozenset[str] = frozenset()) -> Plan:
    """The resident units: embedding and head if they fit, then layers bottom-up, as many as
    the GPU holds up to the speed set (a third of the layers: past it, one more resident layer
    saves less than it costs in slots) without shrinking the weight and gradient slots (a
    resident layer saves less than a prefetch slot costs), and past that only as many as host
    memory needs. Without ``speed``, only the layers host memory needs (where the step is long
    enough that fetches and CPU Adam hide behind compute, residency buys nothing).

    GPU bytes grow and host bytes shrink with every resident layer, so the count is found by
    bisection: about 2 log2(layers) plans instead of one per layer (a 100-layer plan compiles
    a step graph per candidate, ~30 ms each). The layers in ``never`` stay streamed."""
    plan = build(())
    head = ("embed", "head")
    base: tuple[str, ...] = ()
    if speed:
        trial = build(head)
        base = head if trial.gpu_fits and not _squeezed(trial, policy) else ()
        if base:
            plan = trial
    layers = [f"layer.{i}" for i in range(cfg.num_layers) if f"layer.{i}" not in never]
    L = len(layers)
    tried: dict[int, Plan] = {0: plan}

    def at(k: int) -> Plan:
        if k not in tried:
            tried[k] = build(base + tuple(layers[:k]))
        return tried[k]

    def first(lo: int, hi: int, pred) -> int:  # noqa: ANN001
        """The least k in [lo, hi] with pred(k), or hi + 1; pred is false then true."""
        while lo <= hi:
            mid = (lo + hi) // 2
            if pred(mid):
                hi = mid - 1
            else:
                lo = mid + 1
        return lo

    def fits(k: int) -> bool:  # on the GPU without giving up slots the policy proposes
        return at(k).gpu_fits and not _squeezed(at(k), policy)

    n_speed = min(L, math.ceil(L / 3)) if speed else 0
    k0 = n_speed if fits(n_speed) else first(1, n_speed, lambda k: not fits(k)) - 1  # the most that fit
    if at(k0).host_fits:
        return at(k0)
    # Then add layers until host memory fits or the GPU is full (slots may shrink here: this
    # residency is for capacity, without which the run does not fit at all).
    k = first(k0, L, lambda k: at(k).host_fits or not at(k).gpu_fits)
    if k > L or not at(k).gpu_fits:
        k -= 1
    # never below k0: where even k0 overflows the GPU, more residency cannot help it, and the
    # plan says so against the GPU budget rather than moving the whole model onto it
    return at(max(k, k0))


def compile_backend(name: str | None, device_type: str) -> str | None:
    """The torch.compile backend ``--compile`` gives the layer on a device of this type, or None
    for eager. ``auto`` compiles on CUDA (fused norms, rotary and SwiGLU: 8% faster than eager
    at W1 on the H200, docs/benchmarks.md) and stays eager on the CPU, where compiling costs more
    than it saves on small test runs."""
    if name in (None, "none", "eager"):
        return None
    if name == "auto":
        return "inductor" if device_type == "cuda" else None
    return name



#: ``choose(req, plan_one) -> (req, plan, why_order, why_placement)``: the choices a plan leaves
#: to a prediction (``--order auto``, the placement rules' alternatives), made from above by
#: :func:`flowtrain.sim.choose_plan.plan_and_choose`; ``plan_one`` plans one request
Chooser = Callable[[RunRequest, Callable[[RunRequest], Plan]], tuple[RunRequest, Plan, str | None, str | None]]


def plan_run(cfg: ModelConfig, req: RunRequest, *, device: torch.device, dtype: torch.dtype,
             policy: Any = "double_buffer", local_gpu: bool = True, choose: Chooser | None = None) -> Plan:
    """The plan for ``req`` on ``device``, with the largest micro-batch that fits and, if the run
    does not fit, what would. ``local_gpu=False`` plans for a GPU elsewhere (the simulator's
    machine): its memory is ``req.gpu_mem`` alone, not capped by what is free on this one.
    ``choose`` makes the choices that need a prediction; without it ``--order auto`` is
    ``layer`` and the placement rules' plan stands (what ``plan_and_choose`` also answers on the
    CPU, or where no machine model describes the GPU)."""
    if req.batch_size < 1 or req.micro_batch_size < 1 or req.batch_size % req.micro_batch_size:
        raise ConfigError(f"{{micro_batch_size}} {req.micro_batch_size} does not divide {{batch_size}} {req.batch_size}",
                          named=True)
    host_limit, gpu_limit = _limits(req, device, local_gpu)

    def plan_one(r: RunRequest) -> Plan:
        return _plan_once(cfg, r, device, dtype, policy, host_limit, gpu_limit)

    if choose is None:
        req = msgspec.structs.replace(req, order="layer") if req.order == "auto" else req
        plan, order_choice, placement_choice = plan_one(req), None, None
    else:
        req, plan, order_choice, placement_choice = choose(req, plan_one)
    plan.order_choice, plan.placement_choice = order_choice, placement_choice
    divisors = [b for b in range(req.batch_size, 0, -1) if req.batch_size % b == 0]
    for b in divisors:
        trial = plan if b == req.micro_batch_size else _plan_once(
            cfg, msgspec.structs.replace(req, micro_batch_size=b), device, dtype, policy, host_limit, gpu_limit)
        if trial.fits:
            plan.max_micro_batch = b
            break
    if not plan.fits:
        plan.suggestions = _suggest(plan, cfg, req, device, dtype, policy, host_limit, gpu_limit)
    return plan


def _changes(plan: Plan, req: RunRequest, policy: Any) -> list[tuple[str, RunRequest, Any]]:
    """Single changes that can lower memory, in the order a user would rather make them (what
    costs least speed or exactness first); none is a setting already in use."""
    replace = msgspec.structs.replace
    out = []
    mbs, steps = req.micro_batch_size, req.batch_size // req.micro_batch_size
    if req.activations == "attention":  # as many saved outputs as fit, and the rest recompute
        out.append(("--activations auto", replace(req, activations="auto"), policy))
    if req.activations in ("keep", "recompute", "attention"):  # checkpoints to host memory: PCIe time, often hidden
        out.append(("--activations offload", replace(req, activations="offload"), policy))
    for n in sorted({steps - 1, *(steps >> i for i in range(1, steps.bit_length()))} - {0}, reverse=True):
        # fewer micro-batches per step: fewer layer inputs kept for backward
        out.append((f"--batch-size {n * mbs}", replace(req, batch_size=n * mbs), policy))
    for k in (2, 4, 8):
        if k != req.checkpoint_every and req.activations not in ("keep", "attention"):  # these need every layer's input
            out.append((f"--checkpoint-every {k}", replace(req, checkpoint_every=k), policy))
    if plan.spec.resident and req.resident != "none":
        out.append(("--resident none", replace(req, resident="none"), policy))
    if req.layout == "full" or (req.layout == "auto" and plan.layout == "full" and not req.grad_clip):
        out.append(("--layout staged", replace(req, layout="staged"), policy))
    if req.grad_clip:
        out.append(("no --grad-clip (gradients staged: 12 bytes per parameter instead of 16)",
                    replace(req, grad_clip=False), policy))
    if policy != "sequential":
        out.append(("--policy sequential", req, "sequential"))
    return out


def _largest_model(plan: Plan) -> str:
    """The size of model that the host budget would hold: the plan's per-parameter state
    (master weights, Adam, gradient buffers, streaming copy) scaled, the rest (the process,
    staging, activations) as planned."""
    assert plan.host_limit is not None
    scaled = ("master", "adam", "gradients", "streaming_copy", "base", "adapters")  # LoRA: its base and adapters
    copies = plan.node_processes if plan.spec.lora else 1  # LoRA's processes each keep their own
    per_param = copies * sum(plan.host.get(k, 0) for k in scaled) / plan.params
    fixed = plan.host_node_total - per_param * plan.params
    most = max(0.0, (plan.host_limit - fixed) / per_param)
    what = "for LoRA's frozen base and adapters" if plan.spec.lora else f"in the {plan.layout} layout"
    return (f"or a model of at most about {most / 1e9:.1f} B parameters ({plan.host_limit / GiB:.0f} GiB usable, "
            f"{per_param:.0f} host bytes per parameter {what})")


def _suggest(plan: Plan, cfg: ModelConfig, req: RunRequest, device, dtype, policy, host_limit, gpu_limit) -> list[str]:
    """What would make a run that does not fit fit: each suggestion is a change that was planned
    and fits (the largest micro-batch, the largest batch, ...), not a guess; if no single change
    does, what memory it would take."""
    out = []
    if plan.max_micro_batch is not None and plan.max_micro_batch < req.micro_batch_size:
        out.append(f"use --micro-batch-size {plan.max_micro_batch} (the largest that fits)")
    tried_batch = False
    for text, trial_req, trial_policy in _changes(plan, req, policy):
        if text.startswith("--batch-size") and tried_batch:
            continue
        trial = _plan_once(cfg, trial_req, device, dtype, trial_policy, host_limit, gpu_limit)
        if trial.fits:
            tried_batch |= text.startswith("--batch-size")
            out.append(f"use {text}")
    if not out:
        if not plan.host_fits:
            host = math.ceil(plan.host_node_total / GiB / HOST_FILL)
            out.append(f"run where about {host} GiB of host memory is free (--host-mem {host})")
            out.append(_largest_model(plan))
        if not plan.gpu_fits:
            card = math.ceil(card_for(plan.gpu_total))
            out.append(f"a GPU of about {card} GiB (--gpu-mem {card})")
    return out
