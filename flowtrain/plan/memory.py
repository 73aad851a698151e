"""The memory plan's bytes: where every byte of a training run lives, counted before anything
is allocated.

A :class:`Plan` is the planner's answer (:mod:`.planner` decides it: layout, placement,
activations, slot budgets); this module counts what a candidate costs for the request it
answers (:class:`~.request.RunRequest`) and the budgets it must fit (the card and the host)::

    req = RunRequest(seq_len=4096, batch_size=16, micro_batch_size=4, gpu_mem=10)
    plan = plan_run(preset("llama-8b"), req, device=torch.device("cuda"), dtype=torch.bfloat16)  # .planner
    plan.host, plan.gpu, plan.gpu_total, plan.fits                # the counts below

Host bytes: ``master`` (4 per streamed parameter), ``adam`` (8), ``gradients`` (4, full
layout), ``streaming_copy`` (2, stream-bf16), ``staging`` (the ring), ``tied_gradient``,
``runtime`` (the Python process with torch loaded, measured), ``autotune_copy`` (on CUDA with
the layer compiled: the compiler's host copy of a micro-batch's layer input while it times its
kernels, :func:`autotune_copy_bytes`), ``checkpoint_load`` (the largest
checkpoint file, mapped while it is read) and ``undo_record`` (without clipping: up to
``--undo-mem`` of the master, m and v that ``cpu_adam`` copies aside until the step is known
finite; see :mod:`flowtrain.train.nonfinite`) and ``data`` (the token batches in use, see
:func:`data_host_bytes`); a DPO run adds ``reference_logps`` (:func:`reference_host_bytes`). GPU bytes: ``weight_slots``,
``landing`` (the fp32 piece buffer of casting fetches), ``grad_slots``, ``resident`` (master, m,
v, gradient and compute copy: 18 bytes per parameter in bf16), ``checkpoints``, ``recompute``,
``layer_gradients`` (in the backward, the gradient of each live micro-batch's layer output),
``layer_work`` (one layer under autograd), ``kept_activations`` (the layers whose forward
keeps its activations for backward instead of recomputing: :func:`.planner.plan_activations`),
``saved_attention`` (the recomputing layers whose forward keeps its attention output for the
rebuild: :mod:`.attention`) and ``loss_chunks``. On a CPU-only run the GPU
categories are host memory too. A LoRA run's host holds its frozen ``base`` instead of master
and Adam, and LoRA's own terms (``adapters``, ``lora_work``) are :mod:`.adapters`'.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import msgspec

from ..errors import ConfigError
from ..graph.compiler import StepSpec
from ..graph.tasks import GRADS, HOST_GRADS, WEIGHTS
from ..model.config import MLP_CHUNK_TOKENS, ModelConfig
from ..model.flat_map import FlatMap, model_flat_maps
from .adapters import adapter_slot_numel, host_adapters, lora_gpu_bytes, lora_host_bytes
from .experts import dense_mlp_layers, expert_bytes_per_token, expert_kept_bytes_per_token, runs_grouped
from .buffer_sizes import LANDING_NUMEL, LAYOUT_STATE_BYTES, grad_chunks, host_memory_total, slot_numel, staging_numel, undo_arena_bytes
from .request import RunRequest

if TYPE_CHECKING:
    import torch


GiB = 2**30
#: Stacked expert weights' worth of gradient the experts' loop holds at once in a sparse
#: layer's backward (each expert's slice differentiated into a zero-filled gradient of the whole
#: stack, summed by autograd): traced on the CPU at 4 to 32 experts (tests/train/test_weight_grads.py).
LOOP_GRADIENT_STACKS = 5
#: ``--activations``: where each layer's activations wait for its backward (see TrainConfig)
ACTIVATIONS = ("auto", "keep", "offload", "recompute", "attention")
#: Host items that the processes of a node share (one copy per node, ``StepSpec.share``).
SHARED_HOST = ("master", "adam", "streaming_copy")
#: Host memory of the process itself (interpreter, torch, flowtrain; on CUDA also the CUDA
#: libraries and compile workers), measured as peak RSS minus allocated state: 0.23-0.3 GiB on
#: the CPU, 1.4-1.9 GiB in five H200 runs from 3.6B to 14.8B parameters
#: (docs/bench/history/2026-12-02-capacity.md).
RUNTIME_HOST = {"cpu": int(0.30 * GiB), "cuda": int(1.75 * GiB)}
#: Fraction of the free GPU memory the plan fills where no ``--gpu-mem`` is given: the caching
#: allocator's fixed segments need room to round and split.
GPU_FILL = 0.92
#: ``--gpu-mem N`` is a card of N GiB as ``nvidia-smi`` shows it (a "10 GB" RTX 3080 shows
#: 10,240 MiB). Part of it is never PyTorch's: the CUDA context, the kernels of cuBLAS, cuDNN and
#: inductor as they load, and library workspaces outside the caching allocator. Measured on the
#: H200 as a run's device memory in use less what the allocator reserved, after its steps
#: (``flowtrain bench``'s ``gpu_outside_allocator_gib``: 0.88-0.89 GiB in every run of the GPU
#: gate, from llama-3b to llama-8b; docs/bench/history/2026-12-05-gpu-gate-runs.md).
CUDA_OUTSIDE_ALLOCATOR_GIB = 0.9
#: Of a card, what flowtrain leaves to everything else on it: a desktop's display, the driver,
#: a second small process. A 10 GB card then gives a run at most 9.5 GiB in all.
CARD_HEADROOM_GIB = 0.5
#: Fraction of a card's allocator share the plan fills at most. Capped runs use expandable
#: segments (:func:`flowtrain.train.prepare.prefer_expandable_segments`), which map 2 MiB pages
#: and unmap the free ones when a request does not fit, and the plan's counts are upper bounds
#: (within 10% above every measured peak of the gate), so the plan may come this close to a
#: large card's cap; on a small one :data:`CAP_STRANDED_GIB` binds first.
GPU_FILL_CAPPED = 0.99
#: What the plan leaves below a card's allocator share however small the card: memory the
#: allocator keeps reserved with nothing allocated in it, which even its out-of-memory retry
#: does not give back. On the H200 under ``--gpu-mem 10``, ``qwen3-moe-12l`` at micro-batch 1
#: and 16 sequences held 0.27 GiB so at its out-of-memory: 7.96 GiB allocated, 8.23 reserved,
#: and a 384 MiB request over the 8.60 GiB share, where its plan (8.43 GiB, 1% below the
#: share) had counted the peak right (8.41 GiB replayed). Planned 0.28 GiB below the share, it
#: trains (docs/bench/history/2026-12-05-mixture-of-experts.md).
CAP_STRANDED_GIB = 0.28
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


def data_host_bytes(req: RunRequest) -> int:
    """Host bytes of the training data: ``DATA_BATCHES`` batches of input ids, targets and
    positions (int64), gathered from the data cache. The data set itself stays on disk, mapped
    (:mod:`flowtrain.data.cache`); the pages a batch reads are page cache that the kernel
    drops under pressure, like the checkpoint pages, so the file's size is not counted."""
    return DATA_BATCHES * req.batch_size * req.seq_len * 3 * 8


#: Host bytes a DPO run keeps per sequence of its data: the reference's summed log-probability
#: of its completion, fp32 (two a pair; ``TrainingLoop.reference``)
REFERENCE_BYTES_PER_ROW = 4


def reference_host_bytes(req: RunRequest) -> int:
    """Host bytes of a DPO run's reference log-probabilities: one fp32 per sequence of the whole
    data, computed before the first step and kept for the run (every process keeps all of
    them); 0 for any other run."""
    return REFERENCE_BYTES_PER_ROW * req.reference_rows


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
    #: where ``--activations auto``, ``--layout auto`` or ``--resident auto`` took an alternative
    #: to the rules' plan because it was predicted faster (:mod:`flowtrain.sim.memory_choice`)
    memory_choice: str | None = None
    #: units whose optimizer state lives in the state folder, by key: the fields there
    #: (``--state-dir``; :mod:`flowtrain.plan.disk`)
    disk: dict[str, tuple[str, ...]] = msgspec.field(default_factory=dict)
    #: whether the run has a state folder at all (what ``to_dict`` then reports)
    disk_tier: bool = False
    #: with a state folder, what the placement put there in words, and whether there was more
    #: to move (what a refusal for host memory says; :func:`~flowtrain.plan.disk.place_on_disk`)
    disk_note: str | None = None

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
        backward, within 1% of this count; docs/bench/history/2026-12-05-gpu-gate-runs.md).
        LoRA's adapter work is a layer's, in its forward or its backward, so it counts in those
        phases, not beside the loss chunks."""
        return gpu_peak(self.gpu)

    @property
    def state_bytes_per_param(self) -> float:
        """Host bytes of training state per parameter, the one figure flowtrain states: the
        layout's (:data:`~.buffer_sizes.LAYOUT_STATE_BYTES`: 12 staged, 16 full, 14 stream-bf16);
        for LoRA, the frozen base and the adapters' host state as planned, per base parameter."""
        if not self.spec.lora:
            return float(LAYOUT_STATE_BYTES[self.layout])
        copies = self.node_processes  # LoRA's processes each keep their own
        return copies * sum(self.host.get(k, 0) for k in ("base", "adapters")) / self.params

    @property
    def host_state_bytes_per_param(self) -> float:
        """Host bytes of model and optimizer state (runtime excluded) per model parameter."""
        transient = sum(self.host.get(k, 0)
                        for k in ("runtime", "autotune_copy", "checkpoint_load", "data", "reference_logps",
                                  "disk_readback"))
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
            if self.disk_note:  # the state folder took what it could: what memory still holds
                left = sorted(((k, v) for k, v in self.host.items() if v >= GiB // 10), key=lambda kv: -kv[1])
                parts[-1] += (f", {self.disk_note}; left in host memory: "
                              + ", ".join(f"{k} {v / GiB:.1f} GiB" for k, v in left))
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
            "state_bytes_per_param": round(self.state_bytes_per_param, 3),
            "fits": self.fits, "host_fits": self.host_fits, "gpu_fits": self.gpu_fits,
            "max_micro_batch": self.max_micro_batch, "suggestions": self.suggestions,
            "order": self.spec.order, "order_choice": self.order_choice,
            # an older name: the --activations, --layout or --resident that prediction chose
            "placement_choice": self.memory_choice, "save_attention": list(self.spec.save_attention),
            "host_adapters": self.spec.host_adapters,
        } | ({"disk": {k: list(v) for k, v in self.disk.items()}} if self.disk_tier else {})


# ---- limits -------------------------------------------------------------------------------
#: Without ``--host-mem``, the share of this machine's memory left to the system and other
#: programs (at least :data:`HOST_RESERVE_MIN`): see :func:`host_usable`.
HOST_RESERVE = 0.10
HOST_RESERVE_MIN = 2 * GiB


def host_usable() -> int | None:
    """Bytes of this machine's memory a run may plan for without ``--host-mem``: all of it
    (``MemTotal``) less a fixed reserve for the system and other programs, a tenth of it and at
    least 2 GiB; None where the total is unknown.

    Why not what is free now (``MemAvailable``): it moves from one second to the next with the
    page cache and every other program, so consecutive plans of one run disagreed (15.18, 14.95,
    14.56, 14.30 GiB on one machine) and a change one plan suggested did not fit the next. The
    total less a fixed reserve reads the same every time, so ``flowtrain plan`` and the run that
    follows agree; on a machine whose other programs hold more than the reserve, ``--host-mem``
    says how much is the run's."""
    total = host_memory_total()
    if total is None:
        return None
    return total - max(int(total * HOST_RESERVE), HOST_RESERVE_MIN)


def host_memory_note(limit: int | None) -> str:
    """How the usable host memory was read without ``--host-mem``, for ``flowtrain plan``."""
    total = host_memory_total()
    if total is None or limit is None:
        return "host memory: no limit known on this machine (--host-mem GiB plans for one)"
    usable = host_usable()
    assert usable is not None
    return (f"host memory usable: {limit / GiB:.1f} GiB, this machine's {total / GiB:.1f} GiB less a reserve of "
            f"{(total - usable) / GiB:.1f} GiB for the system and other programs ({HOST_RESERVE:.0%}, at least "
            f"{HOST_RESERVE_MIN / GiB:.0f} GiB), {HOST_FILL:.0%} of the rest planned; --host-mem GiB plans for another")


def budget_limits(req: RunRequest, device: torch.device, local_gpu: bool) -> tuple[int | None, int | None]:
    """The usable host and GPU bytes: what the request says, else what is free here; the GPU
    never more than is free on this machine's GPU now, nor more than its card as ``--gpu-mem``
    would count it, unless the plan is for another machine (``local_gpu=False``)."""
    host = int(req.host_mem * GiB) if req.host_mem is not None else host_usable()
    caps = [] if req.gpu_mem is None else [capped_budget(allocator_share(req.gpu_mem))]
    if device.type == "cuda" and local_gpu:
        import torch

        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info(device)
            caps.append(int(free * GPU_FILL))
            # and the card as --gpu-mem counts it: on a small card what CUDA keeps outside the
            # allocator is more than the 8% GPU_FILL leaves (the rule own_plan_card plans by)
            caps.append(capped_budget(allocator_share(total / GiB)))
    gpu = min(caps) if caps else None
    return (None if host is None else int(host * HOST_FILL)), gpu


def gpu_peak(g: dict[str, int]) -> int:
    """Peak device bytes of the GPU items ``g`` (see :attr:`Plan.gpu_total`)."""
    work, loss = g.get("layer_work", 0), g.get("loss_chunks", 0)
    forward, gradients = g.get("offload_in_flight", 0), g.get("layer_gradients", 0)
    adapter_work = g.get("lora_work", 0)  # a layer's, in its forward or backward: never beside the loss
    shared = sum(g.values()) - work - loss - forward - gradients - adapter_work
    return shared + max(forward + adapter_work, gradients + max(work + adapter_work, loss))


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


def capped_budget(share: int) -> int:
    """The bytes a plan may fill of an allocator share of ``share`` bytes (a card's,
    :func:`allocator_share`): :data:`GPU_FILL_CAPPED` of it, and at least
    :data:`CAP_STRANDED_GIB` below it."""
    return min(int(share * GPU_FILL_CAPPED), share - int(CAP_STRANDED_GIB * GiB))


def card_for(allocator_bytes: int) -> float:
    """The ``--gpu-mem`` (card size in GiB) whose plan budget is ``allocator_bytes``: the
    inverse of what :func:`budget_limits` makes of a card (:func:`capped_budget`)."""
    share = max(allocator_bytes / GPU_FILL_CAPPED, allocator_bytes + CAP_STRANDED_GIB * GiB)
    return share / GiB + CUDA_OUTSIDE_ALLOCATOR_GIB + CARD_HEADROOM_GIB


def own_plan_card(gpu_gib: float) -> float:
    """The ``--gpu-mem`` (card size in GiB) whose plan budget is what a machine's own plan takes
    without one: :data:`GPU_FILL` of the memory free on its card of ``gpu_gib`` when training
    starts (taken as the whole card), and never more than the card itself as ``--gpu-mem``
    counts it (on a small card, what CUDA keeps outside the allocator is more than the 8% that
    rule leaves). A plan for another machine without ``--gpu-mem`` (``flowtrain plan|simulate
    --machine``) plans for it, so it places what that machine would."""
    return min(gpu_gib, round(card_for(int(GPU_FILL * gpu_gib * GiB)), 2))


def cap_gpu_memory(device: torch.device, gib: float) -> None:
    """Enforce ``--gpu-mem``: the caching allocator refuses to grow this process past its share
    of a card of ``gib`` GiB (:func:`allocator_share`), so the whole process fits the card."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, allocator_share(gib) / total), index)


# ---- the byte counts ----------------------------------------------------------------------
_LAYOUTS: dict[bytes, tuple] = {}


def unit_flat_maps(cfg: ModelConfig) -> tuple:
    """``model_flat_maps(cfg)``, built once per model: every candidate plan reads them, and for
    100 layers they take ~2 ms to build, three times per candidate, ~50 candidates."""
    key = msgspec.json.encode(cfg)
    if key not in _LAYOUTS:
        if len(_LAYOUTS) >= 8:
            _LAYOUTS.clear()
        _LAYOUTS[key] = tuple(model_flat_maps(cfg))
    return _LAYOUTS[key]


def count_bytes(cfg: ModelConfig, req: RunRequest, device: torch.device, dtype: torch.dtype, layout: str,
                resident: tuple[str, ...], budgets: dict[str, int], chunk_tokens: int) -> tuple[dict, dict]:
    """``(host, gpu)``: the bytes of one candidate plan, by item (the module docstring names
    them): the state placed as ``layout`` and ``resident`` say, slots as ``budgets`` give, loss
    chunks of ``chunk_tokens``, every checkpoint offloaded where ``req.activations`` is
    ``offload`` (the planner brings back what fits)."""
    host = _host_items(cfg, req, device, dtype.itemsize, layout, resident, budgets)
    grouped = runs_grouped(cfg, req, device.type, dtype)
    gpu = _gpu_items(cfg, req, device, dtype.itemsize, layout, resident, budgets, chunk_tokens, grouped)
    if req.activations == "offload":  # all offloaded here; the planner's bring-back returns what fits (auto)
        host["offloaded_activations"] = gpu["checkpoints"]
        gpu.update(offloading_gpu(req, req.micro_batch_size * req.seq_len * cfg.hidden_size * dtype.itemsize))
    return host, gpu


def _host_items(cfg: ModelConfig, req: RunRequest, device: torch.device, cbytes: int, layout: str,
                resident: tuple[str, ...], budgets: dict[str, int]) -> dict[str, int]:
    """Host bytes: the streamed units' state in ``layout`` (with LoRA, the frozen base and the
    adapters), the process, the data, a checkpoint being read and the undo record."""
    layouts, res = unit_flat_maps(cfg), set(resident)
    streamed = [lay for lay in layouts if lay.key not in res]
    streamed_n = sum(lay.numel for lay in streamed)
    stage_n = staging_numel(layouts, resident)
    lora = req.lora_rank > 0  # a frozen base: its weights in the compute dtype, nothing else
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
        if cfg.tie_word_embeddings and "head" not in resident:
            host["tied_gradient"] = 4 * layouts[0].numel
    host["runtime"] = RUNTIME_HOST["cuda" if device.type == "cuda" else "cpu"]
    if inductor_on_cuda(req, device):
        host["autotune_copy"] = autotune_copy_bytes(req.micro_batch_size * req.seq_len * cfg.hidden_size * cbytes)
    host["data"] = data_host_bytes(req)
    if req.reference_rows:
        host["reference_logps"] = reference_host_bytes(req)
    if req.load_bytes:
        host["checkpoint_load"] = req.load_bytes
    if not req.grad_clip and streamed and not lora:
        chunks = grad_chunks(layouts, resident, stage_n) if layout != "full" else {}
        units = [(lay.numel, chunks.get(lay.key, 1)) for lay in streamed]
        # --undo-mem is the node's: processes sharing the state record only the units they own
        host["undo_record"] = undo_arena_bytes(units, stage_n, int(req.undo_mem * GiB) // req.share, touched=not resident)
    return host


def _gpu_items(cfg: ModelConfig, req: RunRequest, device: torch.device, cbytes: int, layout: str,
               resident: tuple[str, ...], budgets: dict[str, int], chunk_tokens: int,
               grouped: bool = False) -> dict[str, int]:
    """GPU bytes, every checkpoint kept: the slots, the resident units, the checkpoints, one
    layer's backward, the loss chunks, and LoRA's adapters and their work (``grouped``: a
    mixture of experts runs the grouped experts)."""
    layouts, res = unit_flat_maps(cfg), set(resident)
    resident_n = sum(lay.numel for lay in layouts if lay.key in res)
    slot_n = slot_numel(list(layouts), resident, cfg.tie_word_embeddings)
    lora = req.lora_rank > 0
    adapter_slot_n = adapter_slot_numel(cfg, req)
    tokens = req.micro_batch_size * req.seq_len
    hidden = tokens * cfg.hidden_size * cbytes
    live_mbs = live_micro_batches(req)
    k = req.checkpoint_every
    compiled = inductor_on_cuda(req, device)
    casting = cbytes != 4 and slot_n > 0 and (host_adapters(req) if lora else layout != "stream-bf16")
    resident_per = cbytes if lora else 16 + (cbytes if cbytes != 4 else 0)
    gpu = {
        "weight_slots": budgets[WEIGHTS] * (slot_n + adapter_slot_n) * cbytes,  # host adapters come with their layer
        "landing": 4 * min(slot_n, LANDING_NUMEL) if casting else 0,
        "grad_slots": budgets[GRADS] * (adapter_slot_n if lora else slot_n) * 4,
        "resident": resident_per * resident_n,
        "checkpoints": math.ceil(cfg.num_layers / k) * live_mbs * hidden,
        "recompute": (k - 1) * live_mbs * hidden,
        # in the backward, each live micro-batch's gradient of the layer output it is at
        "layer_gradients": live_mbs * hidden,
        "layer_work": layer_work_bytes(cfg, tokens, cbytes, compiled, grouped, frozen_base=lora),
        # fp32 logits and their softmax in place, the bf16 gradient, the head's gradient
        # before accumulation, and the micro-batch's hidden-state gradient (the generic path's
        # head runs under autograd: measured, :func:`_generic_head_bytes_per_token`).
        "loss_chunks": min(chunk_tokens, tokens) * (_generic_head_bytes_per_token(cfg, cbytes) if cfg.generic
                                                    else cfg.vocab_size * (8 + cbytes))
        + 2 * hidden
        + (0 if lora else cbytes * cfg.vocab_size * cfg.hidden_size),
    }
    if lora:
        gpu.update(lora_gpu_bytes(cfg, req, tokens, cbytes))
    return gpu


def offloading_gpu(req: RunRequest, hidden: int) -> dict[str, int]:
    """The device items of a step whose checkpoints are offloaded, by phase: the forward's
    checkpoints waiting for their copies (``offload_in_flight``), and in the loss and backward,
    the layer outputs of every live micro-batch before the loss and their gradients between two
    layers' backward (``layer_gradients``) beside the ``acts`` slots the checkpoints come back
    into (``checkpoints``). :attr:`Plan.gpu_total` counts the two phases apart."""
    live = live_micro_batches(req)
    return {"checkpoints": offload_act_slots(req) * hidden, "offload_in_flight": (2 * live + 2) * hidden,
            "layer_gradients": live * hidden}


def layer_work_bytes(cfg: ModelConfig, tokens: int, cbytes: int, compiled: bool, grouped: bool = False,
                     frozen_base: bool = False) -> int:
    """Device bytes of one layer's backward for ``tokens`` tokens: its forward rebuilt under
    autograd (the tensors it saves), the gradients flowing back, the fused attention backward's
    own buffers (an fp32 accumulator for dq and, with grouped KV heads, dk and dv expanded to
    every query head before they are summed), and the weight gradient in the compute dtype
    before it is added to the fp32 accumulator (the whole layer's; a mixture of experts' sparse
    layer, :func:`_moe_mlp_work`, by ``grouped``: it runs the grouped experts, and
    ``frozen_base``: LoRA's, whose base weights take no gradient, keeps the whole layer's count
    as a dense LoRA layer does).

    ``compiled``: the layer runs through inductor in one graph, whose partitioner saves about a
    fifth less than eager autograd (norms, rotary and SwiGLU recomputed in the backward; the
    units are :func:`kept_bytes_per_token`'s). A layer that saves its attention output breaks
    its graph at attention, so its planner counts eager bytes (:mod:`.attention`). On the
    H200 the count is within 10% of the measured peak of every run of the GPU gate
    (docs/bench/history/2026-12-05-gpu-gate-runs.md)."""
    if cfg.generic:
        return _generic_layer_work(cfg, tokens, cbytes)
    h, f = cfg.hidden_size, cfg.intermediate_size
    q = cfg.num_heads * cfg.head_size
    kv = cfg.num_kv_heads * cfg.head_size
    if compiled:
        per_token, mlp_units = 4 * h + 3 * q + 2 * kv + 2 * cfg.head_size, 3 * f
    else:
        per_token, mlp_units = 6 * h + 2 * q + 4 * kv, 4 * f
    layers = [lay for lay in unit_flat_maps(cfg) if lay.unit == "layer"]
    work = tokens * cbytes * per_token
    attention = tokens * (4 * q + (2 * cbytes * (q - kv) if kv < q else 0))  # attention backward's buffers
    grads = cbytes * max((lay.numel for lay in layers), default=0)
    if cfg.moe:  # the larger of a sparse layer's routing and experts and a dense layer's MLP
        return work + attention + _moe_mlp_work(cfg, layers, tokens, cbytes, mlp_units, grouped, frozen_base, compiled)
    if tokens > MLP_CHUNK_TOKENS and not frozen_base:
        return work + grads + max(attention, _piecewise_mlp_backward(cfg, cbytes))
    return work + attention + grads + _dense_mlp_work(cfg, tokens, cbytes, mlp_units)


def _piecewise_mlp_backward(cfg: ModelConfig, cbytes: int) -> int:
    """What the MLP's backward holds beside the layer's saved tensors when it runs in pieces
    (:mod:`flowtrain.model.mlp`): one piece rebuilt under eager autograd, its three saved
    ``tokens x intermediate`` tensors and the three gradients of SwiGLU's backward, the piece's
    input gradient and output, the fp32 sums of the three weight gradients and the piece's own
    three in the compute dtype (and a fourth of that size the down projection's backward
    makes). The attention backward's buffers come later, when the pieces are freed, so a layer
    in pieces counts the larger of the two, not both. On an H100, Qwen2.5-7B's shape at 80,896
    tokens a micro-batch peaked in this backward with exactly these blocks alive
    (``flowtrain bench --gpu-peak-report``; docs/benchmarks.md, "Beside MegaTrain")."""
    h, f, piece = cfg.hidden_size, cfg.intermediate_size, MLP_CHUNK_TOKENS
    return piece * cbytes * (6 * f + 2 * h) + 12 * h * f + 4 * cbytes * h * f


def _generic_layer_work(cfg: ModelConfig, tokens: int, cbytes: int) -> int:
    """A layer on the generic path: the most its largest layer kind holds at once over its
    forward and backward, measured per token on the meta device
    (:mod:`flowtrain.model.generic.activations`), and its weight gradient in the compute dtype."""
    import torch

    from ..model.generic.activations import layer_bytes_per_token

    work = max(b.work for b in layer_bytes_per_token(cfg, torch.bfloat16 if cbytes == 2 else torch.float32).values())
    layers = [lay for lay in unit_flat_maps(cfg) if lay.unit == "layer"]
    return math.ceil(tokens * work) + cbytes * max((lay.numel for lay in layers), default=0)


def _generic_head_bytes_per_token(cfg: ModelConfig, cbytes: int) -> int:
    """The generic head's loss chunk per token: the most its norm, output embedding, logit
    soft-capping where the model has it, cross-entropy and their backward hold at once,
    measured on the meta device (:func:`flowtrain.model.generic.activations.head_bytes_per_token`)."""
    import torch

    from ..model.generic.activations import head_bytes_per_token

    return math.ceil(head_bytes_per_token(cfg, torch.bfloat16 if cbytes == 2 else torch.float32))


def _dense_mlp_work(cfg: ModelConfig, tokens: int, cbytes: int, mlp_units: int) -> int:
    """A dense MLP's intermediates for ``tokens`` tokens, ``mlp_units`` of them per token; past
    ``MLP_CHUNK_TOKENS`` it runs in pieces: one piece's intermediates and fp32 weight gradients."""
    if tokens > MLP_CHUNK_TOKENS:
        return MLP_CHUNK_TOKENS * cbytes * mlp_units + 12 * cfg.hidden_size * cfg.intermediate_size
    return tokens * cbytes * mlp_units


def _moe_mlp_work(cfg: ModelConfig, layers: list[FlatMap], tokens: int, cbytes: int, mlp_units: int,
                  grouped: bool, frozen_base: bool, compiled: bool) -> int:
    """A mixture of experts' MLP work and weight gradient in the layer that needs most: a
    sparse layer's routing and T k expert rows (:mod:`.experts`; never run in pieces) beside
    its weight gradient, or a dense layer's MLP beside its whole gradient.

    A sparse layer's experts are stacked weights (every expert's ``gate`` in one tensor), each
    a leaf whose gradient is added into the fp32 slot and freed as soon as it is ready
    (:func:`flowtrain.train.weight_grads.backward_into`). The grouped experts make each
    stacked weight's gradient in one GEMM, so one is alive at a time and the layer's whole
    gradient never is: on the H200, ``qwen3-moe-12l`` at 8,192 tokens a micro-batch peaked in
    a sparse layer's backward with its rows alive and no weight gradient (``flowtrain bench
    --gpu-peak-report``, docs/bench/history/2026-12-05-mixture-of-experts.md). A ``compiled``
    layer is one backward graph whose outputs are every weight's gradient, handed over
    together when the graph ends: its rows are freed by then, but the whole layer's gradient is
    alive (at 4,096 tokens a micro-batch, the same report caught the graph holding two stacks
    and asking for the third), so its count is the larger of the two moments. The loop differentiates each expert's slice of a
    stacked weight into a zero-filled gradient of the whole stack and sums them; traced on the
    CPU it holds up to five stacks' worth at once (tests/train/test_weight_grads.py), which the
    whole layer's gradient (three stacks and attention) does not cover for every shape: the
    loop's count is the larger of the two. A frozen base (LoRA) keeps the whole layer's count,
    as a dense LoRA layer does."""
    sparse_grads = dense_grads = None  # the largest gradient count of each kind of layer
    whole = 0  # the largest sparse layer's whole gradient, alive at a compiled backward's end
    for lay in layers:
        if lay.layer is not None and cfg.layer_sparse(lay.layer):
            largest = max(e.numel for e in lay.entries)
            if frozen_base:
                n = lay.numel
            else:
                n = largest if grouped else max(lay.numel, LOOP_GRADIENT_STACKS * largest)
            sparse_grads = max(sparse_grads or 0, n)
            whole = max(whole, lay.numel)
        else:
            dense_grads = max(dense_grads or 0, lay.numel)
    sparse = 0 if sparse_grads is None else cbytes * sparse_grads + tokens * expert_bytes_per_token(cfg, cbytes)
    if compiled and grouped and not frozen_base:
        sparse = max(sparse, cbytes * whole)
    dense = 0 if dense_grads is None else cbytes * dense_grads + _dense_mlp_work(cfg, tokens, cbytes, mlp_units)
    return max(dense, sparse)


def offload_in_flight(req: RunRequest, hidden: int) -> int:
    """Device bytes of checkpoints with every one offloaded: the inputs of the layer the forward
    is at and its outputs (the inputs of the next), one output being written and one input
    whose copy to the host is still running (the step graph holds each forward until the
    offload ``StepSpec.offload_lag`` layers below it is issued), and in backward the
    checkpoints back from the host ahead of their backward (the ``acts`` slots of
    :func:`flowtrain.policy.base.budgets`)."""
    return sum(v for k, v in offloading_gpu(req, hidden).items() if k != "layer_gradients")


def offload_act_slots(req: RunRequest) -> int:
    """The ``acts`` budget the built-in policies give an offloading step."""
    from ..policy.base import act_slots

    return act_slots(req.order, req.checkpoint_every, req.batch_size // req.micro_batch_size)




def live_micro_batches(req: RunRequest) -> int:
    """Micro-batches whose activations are alive at once: all of the step's layer-major (each
    layer runs every micro-batch before the next layer), one micro-batch-major."""
    return req.batch_size // req.micro_batch_size if req.order == "layer" else 1


def kept_bytes_per_token_by_layer(cfg: ModelConfig, dtype: torch.dtype, compiled: bool = False,
                                  grouped: bool = False) -> list[int]:
    """:func:`kept_bytes_per_token` of each decoder layer, in order. Native layers all keep the
    same; on the generic path each layer keeps what its own kind saves (a hybrid model's
    linear-attention layers differ from its attention layers, a model that interleaves experts
    with dense layers keeps less in the dense ones)."""
    if cfg.generic:
        from ..model.generic.activations import layer_bytes_per_token

        by_layer = layer_bytes_per_token(cfg, dtype)
        return [math.ceil(by_layer[i].saved) for i in range(cfg.num_layers)]
    return [kept_bytes_per_token(cfg, dtype, compiled, grouped)] * cfg.num_layers


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
    layer took 1.38 GiB at 16,384 tokens (docs/bench/history/2026-12-03-kept-activations.md), this
    formula 1.48.

    ``grouped``: a mixture of experts' layers run the grouped experts, which keep less than the
    loop (:func:`~flowtrain.plan.experts.expert_kept_bytes_per_token`).

    On the generic path: the largest layer kind's saved bytes, measured on the meta device
    (:mod:`flowtrain.model.generic.activations`)."""
    if cfg.generic:
        from ..model.generic.activations import layer_bytes_per_token

        return math.ceil(max(b.saved for b in layer_bytes_per_token(cfg, dtype).values()))
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


def autotune_copy_bytes(layer_input_bytes: int) -> int:
    """Host bytes the compiled layer's first call pins: before Inductor times a kernel's candidate
    configurations on the real arguments, it saves each argument the kernel writes in place, in
    pinned host memory where the GPU's room below the run's peak so far cannot hold it
    (``copy_args_to_cpu_if_needed`` in ``torch._inductor.runtime.triton_heuristics``). The one
    seen is the residual stream a fused add-and-norm writes: a micro-batch's layer input in the
    compute dtype (553 MiB for Qwen2.5-7B at 79 x 1,024), which torch's pinned allocator rounds up
    to a power of two (1 GiB) and keeps cached until the run gives it back after its first step
    (:func:`flowtrain.train.first_step.settle_after_first_step`)."""
    return 1 << max(0, layer_input_bytes - 1).bit_length()


def inductor_on_cuda(req: RunRequest, device: torch.device) -> bool:
    """Whether the run's layer is compiled by Inductor on a GPU: what it saves for backward, and
    the autotuner's host copy, depend on it."""
    return device.type == "cuda" and compile_backend(req.compile, device.type) == "inductor"


def compile_backend(name: str | None, device_type: str) -> str | None:
    """The torch.compile backend ``--compile`` gives the layer on a device of this type, or None
    for eager. ``auto`` compiles on CUDA (fused norms, rotary and SwiGLU: 8% faster than eager
    at W1 on the H200, docs/bench/history/2026-12-02-llama-3b-on-one-h200.md) and stays eager on
    the CPU, where compiling costs more than it saves on small test runs."""
    if name in (None, "none", "eager"):
        return None
    if name == "auto":
        return "inductor" if device_type == "cuda" else None
    return name
