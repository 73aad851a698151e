"""The training program: what each task kind does to tensors.

The engine decides *when* a task runs and which slot it gets; this module decides *what* it
does. :class:`StepProgram` is the callable the engine runs for every task::

    program = StepProgram(cfg, state, device="cpu", dtype=torch.float32, ...)
    program.begin_step(step, batch, lr)      # host data for one optimizer step
    ... engine runs the step's tasks: program(task, ctx) ...
    loss, grad_norm, skipped = program.end_step(step)

Device buffers, allocated once:

- weight slots: ``budgets["weights"]`` flat compute-dtype buffers. ``fetch`` fills one from the
  unit's host copy: the pinned bf16 streaming copy where the layout keeps one, otherwise the
  pinned fp32 master, piece by piece through a small fp32 landing buffer and cast on the
  device, on the fetch's own lane (so a slot costs 2 bytes per parameter in bf16, not 6),
- gradient slots: ``budgets["grads"]`` flat fp32 accumulators,
- activations: an :class:`~flowtrain.train.activations.ActivationStore`, tables keyed
  ``(step, layer, micro_batch)``; the input of layer ``i`` is kept from the forward pass where
  it starts a checkpoint segment (:func:`~flowtrain.graph.compiler.checkpoint_layers`, as the
  compiler cuts them) and rebuilt by ``recompute`` otherwise. An offloaded checkpoint
  (``offload_act``) waits in a pinned host buffer kept per ``(layer, micro_batch)`` and
  reused every step; ``fetch_act`` brings it back into one of
  ``budgets["acts"]`` device buffers (a slot: the engine makes the next copy into it wait for
  the backward tasks that read it), so no copy back allocates device memory. A layer whose
  forward and backward carry phase ``"attn"`` also keeps its attention output and log-sum-exp
  (the store's ``attention`` table) for its rebuild, which then runs no attention forward
  (:mod:`flowtrain.model.saved_attention`).

Host buffers: in the staged layouts, ``budgets["host_grads"]`` pinned staging slots, each the
size of the largest streamed layer; ``offload_grad`` of chunk ``c`` copies that piece of the
unit's gradient into one, and ``cpu_adam`` of the same chunk updates the matching piece of the
master from it.

A resident unit (``state.unit(...).resident``) has no slots: its tasks read its own device
copies, its backward accumulates into its own device gradient, and ``gpu_adam`` updates it.

A layer's backward re-runs it under autograd from its saved input and takes the gradient with
respect to the input and to the *flat* weight leaf, which is one contiguous tensor ready to be
accumulated and offloaded in a single copy. With tied embeddings the head's slot holds the
final norm followed by the embedding matrix, and its gradient slot likewise; the embedding's
Adam adds the head's part of the tied gradient before stepping. (Resident and tied, the head
reads the embedding's own copy and adds into the embedding's own gradient.)

With LoRA (``state.lora``) the model's units are frozen: they are fetched as they are (in the
compute dtype), read, and never written. Each layer's adapters (``state.adapters``) are
resident, fp32, and bound with the layer's weights (:func:`~flowtrain.model.lora.adapted`); a
layer's backward takes the gradient with respect to its input and its adapters only, into the
adapters' own accumulator, and ``gpu_adam`` updates them. The loss computes the gradient of the
last hidden state only, and layer 0's backward hands its input gradient to nobody.

A held-out loss (``--eval-data``) is a forward-only graph of its own
(:mod:`flowtrain.graph.evaluation`): :meth:`StepProgram.begin_eval` hands over its micro-batches,
its ``fetch``, ``embed`` and ``forward`` tasks (phase ``"eval"``) run as in training but keep
their activations apart (the store's ``eval_inputs``), ``eval_loss`` adds each micro-batch's fp32 CE sum, and
:meth:`StepProgram.end_eval` returns the mean over every target token.

A step whose loss or any gradient is not finite changes no weight (``skipped``): each piece is
flagged on the device on its way, ``cpu_adam`` skips once anything is known bad and records what
it changes until the step is verified, ``verify_step`` puts that back if the step turns out
bad, and ``gpu_adam`` passes the step's ``found_inf`` flag to the fused kernel. How, and why
without a host sync per layer: :mod:`flowtrain.train.nonfinite`.
"""

from __future__ import annotations

import functools
import math
import threading
import warnings
from collections.abc import Iterable

import torch

from ..ckpt.checkpoints import CheckpointWriter
from ..errors import ConfigError, NonFiniteError
from ..graph.compiler import checkpoint_layers
from ..graph.tasks import (
    GRADS,
    HOST_GRADS,
    WEIGHTS,
    Backward,
    CpuAdam,
    Embed,
    EmbedBackward,
    EvalLoss,
    Fetch,
    FetchAct,
    Forward,
    FoundInf,
    GpuAdam,
    GradNorm,
    GradSqNorm,
    Loss,
    OffloadAct,
    OffloadGrad,
    Recompute,
    ReduceGrad,
    SaveUnit,
    SyncStep,
    Task,
    VerifyStep,
    ZeroGrad,
)
from ..model import bind, decoder_layer, embed, head_loss, head_loss_and_grads, rope_tables
from ..model.attention import Documents, rotary_for
from ..model.gemma import embed_multiplier
from ..model.lora import adapted, dropout_masks
from ..model.moe import RouterTap
from ..model.saved_attention import AttentionRecord, recording, replaying
from ..plan.host_layout import LANDING_NUMEL, chunk_range, slot_numel, staging_numel
from ..runtime.executor import TaskContext
from .distributed import World, all_reduce_sum, node_barrier
from .host_state import HostState, UnitState, pinned_zeros
from .activations import ActivationStore
from .kept import backward_kept, forward_kept
from .idle_experts import IdleExperts
from .load_balance import LoadBalance
from .nonfinite import SKIP, Injection, Saved, StepCheck, UndoBudget, injection_from_env, nonfinite, undo_arena_bytes
from .weight_grads import backward_into, weight_leaves
from .optimizer import AdamWConfig, adamw_experts, adamw_pieces, adamw_step, clip_coefficient, no_decay_ranges


def _layer_function(compile_backend: str | None):  # noqa: ANN202 - the layer, or torch.compile's wrapper of it
    """The decoder layer the program runs: as it is (eager), or compiled by ``torch.compile``
    with ``compile_backend`` (e.g. "inductor": norms, rotary and SwiGLU fuse)."""
    if compile_backend is None:
        return decoder_layer
    # Dynamo inspects .grad of the weights while tracing; where a weight is a view that is not a
    # leaf, torch warns about that access, harmlessly.
    warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
    return torch.compile(decoder_layer, backend=compile_backend, dynamic=False)


class _StepData:
    """Host-side inputs and per-step accumulators of one optimizer step."""

    def __init__(self, ids: list[torch.Tensor], targets: list[torch.Tensor], n_targets: int, lr: float,
                 check: StepCheck, docs: list[Documents | None]) -> None:
        self.ids = ids
        self.targets = targets
        self.docs = docs  # per micro-batch: its packed documents, None for one per row
        self.n_targets = n_targets
        self.lr = lr
        self.loss: torch.Tensor | None = None
        #: a mixture of experts' load-balancing loss, already weighted (flowtrain.train.load_balance)
        self.aux_loss: torch.Tensor | None = None
        self.sq_norms: dict[tuple[str, int | None], torch.Tensor] = {}  # (unit key, chunk) -> squared grad norm
        self.clip: torch.Tensor | None = None  # clip coefficient, once known
        self.total_norm: float | None = None
        self.tied_summed = False
        self.check = check  # is the step finite: see flowtrain.train.nonfinite


class _EvalData:
    """Host-side inputs and per-micro-batch CE sums of one held-out loss evaluation."""

    def __init__(self, ids: list[torch.Tensor], targets: list[torch.Tensor], n_targets: int,
                 docs: list[Documents | None]) -> None:
        self.ids = ids
        self.targets = targets
        self.docs = docs
        self.n_targets = n_targets
        self.sums: dict[int, torch.Tensor] = {}  # micro-batch -> fp32 CE sum (device scalar)


class StepProgram:
    """Runs tasks on tensors for one model; see the module docstring."""

    def __init__(
        self,
        state: HostState,
        *,
        device: torch.device | str,
        dtype: torch.dtype,
        seq_len: int,
        checkpoint_every: int,
        budgets: dict[str, int],
        adamw: AdamWConfig,
        chunk_tokens: int | None = None,
        compile_backend: str | None = None,
        undo_bytes: int = 1 << 30,
        inject_nonfinite: Injection | None = None,
        world: World | None = None,
        owned: frozenset[str] | None = None,
        seed: int = 0,
    ) -> None:
        self.state = state
        #: the streamed units whose ``cpu_adam`` updates them in this process, where the
        #: processes of a node share the state (each unit has one owner); None: every unit
        self.owned = owned
        self.cfg = state.cfg
        #: the data-parallel processes (``reduce_grad`` sums over them); one by default
        self.world = world or World()
        self.device = torch.device(device)
        self.dtype = dtype
        self.seq_len = seq_len
        #: layers whose input stays from the forward for the backward (the compiler's segments)
        self.checkpointed = checkpoint_layers(self.cfg.num_layers, checkpoint_every)
        self.adamw = adamw
        #: per unit, the element ranges that get no weight decay (``--weight-decay-skip``)
        self.no_decay = {u.layout.key: no_decay_ranges(u.layout.entries, adamw.weight_decay_skip)
                         for u in state.trained}
        #: LoRA's adapters (None: the whole model trains), and the run's seed, which with the step,
        #: layer and micro-batch seeds the adapters' dropout masks
        self.lora = state.lora
        self.seed = seed
        #: LoRA's scale and dropout rescale, made on the device once (see flowtrain.model.lora.adapted)
        self.lora_consts = {} if state.lora is None else {
            "lora_scale": torch.tensor(state.lora.scale, device=self.device),
            "lora_rescale": torch.tensor(1.0 / (1.0 - state.lora.dropout), device=self.device)}
        self.chunk_tokens = chunk_tokens
        self.tied = self.cfg.tie_word_embeddings
        self.head_n = state.head.layout.numel
        self._make_slots(budgets)
        #: rotary (cos, sin) tables by "is this a Gemma 3 sliding layer" (its own base)
        self.rope = {local: rope_tables(self.cfg, seq_len, self.device, dtype, local)
                     for local in {False, any(map(self.cfg.layer_rope_local, range(self.cfg.num_layers)))}}
        self.embed_multiplier = embed_multiplier(self.cfg)
        #: what a task leaves for another (a layer's input, an output gradient, a kept forward,
        #: a saved attention output), empty of a step once it ends: see flowtrain.train.activations
        self.store = ActivationStore()
        #: offloaded checkpoints' pinned host buffers by (layer, micro_batch), reused every step
        self.act_host: dict[tuple[int, int], torch.Tensor] = {}
        #: device buffers that fetch_act copies checkpoints back into, by acts slot, made at
        #: the first copy into each, once the checkpoint's shape is known
        self.act_slots: dict[int, torch.Tensor] = {}
        self.dev_ids: dict[tuple[int, int], torch.Tensor] = {}
        self.dev_targets: dict[tuple[int, int], torch.Tensor] = {}
        #: packed micro-batches' documents and their gathered rotary tables, by (phase, step, mb)
        self.dev_docs: dict[tuple[str, int, int], tuple[Documents, dict]] = {}
        self.steps: dict[int, _StepData] = {}
        #: held-out loss evaluations by the step whose weights they read, and their activations
        self.evals: dict[int, _EvalData] = {}
        #: open checkpoint writers by the step they save (``save`` tasks write into them)
        self.checkpoints: dict[int, CheckpointWriter] = {}
        self._lock = threading.Lock()
        self._non_blocking = self.device.type == "cuda"
        #: the decoder layer, compiled by torch.compile (``compile_backend``, e.g. "inductor")
        #: so norms, rotary and SwiGLU fuse; forward, recompute and backward share it.
        self.layer_fn = _layer_function(compile_backend)
        #: host bytes the undo records of not yet verified steps may hold (see nonfinite.py)
        streamed = [(u.layout.numel, len(u.steps)) for u in state.trained if not u.resident]
        self.undo = UndoBudget(undo_bytes, most=undo_arena_bytes(streamed, self.stage_n, undo_bytes))
        #: a value written into one gradient or loss, for tests (else $FLOWTRAIN_INJECT_NAN)
        self.inject = inject_nonfinite or injection_from_env(self.cfg.num_layers)
        self._checks = self._checks_per_step()
        #: a mixture of experts trained with its load-balancing loss (output_router_logits)
        self.balance = (LoadBalance(self.cfg) if self.cfg.moe and self.cfg.output_router_logits
                        and self.cfg.sparse_layers() else None)
        #: the sparse layers that skip idle experts, and what each step's routing tells them
        self.idle = IdleExperts(state, self.device)
        if self.idle:  # an idle expert's part of a slot is never copied: never uninitialised memory
            for w in self.weight_c:
                w.zero_()
        #: per finished step, the fraction of those layers' expert weights its fetches left in
        #: host memory (the caller pops it: flowtrain.train.loop)
        self.unfetched: dict[int, float] = {}

    @property
    def _pin(self) -> bool:
        return self.device.type == "cuda"

    def _make_slots(self, budgets: dict[str, int]) -> None:
        """The buffers the slot budgets allow, made once: ``weights`` device slots in the compute
        dtype, each as large as the largest streamed unit (the landing buffer beside them where
        a fetch casts fp32 pieces on the device), ``grads`` fp32 gradient accumulators,
        ``host_grads`` pinned host staging slots, and a tied embedding's host gradient where the
        head streams. With LoRA's adapters in host memory, each layer's slot holds its adapters
        after its weights, and the gradient slots are the adapters' only."""
        state, dtype = self.state, self.dtype
        adapter_n = max((a.layout.numel for a in state.adapters if not a.resident), default=0)
        slot_n = slot_numel(state.layouts, state.resident, self.tied) + adapter_n
        grad_n = adapter_n if self.lora is not None else slot_n
        if self.tied and not state.head.resident and self.lora is None:
            self.tied_grad = pinned_zeros(state.embed.layout.numel, self._pin)
        self.weight_c = [torch.empty(slot_n, dtype=dtype, device=self.device) for _ in range(budgets[WEIGHTS])]
        needs_landing = any(u.stream is None and u.master.dtype != dtype
                            for u in state.units + state.adapters if not u.resident)
        self.landing = torch.empty(min(slot_n, LANDING_NUMEL) if needs_landing else 0, dtype=torch.float32,
                                   device=self.device)
        self.grad_slots = [torch.empty(grad_n, dtype=torch.float32, device=self.device) for _ in range(budgets[GRADS])]
        self.stage_n = staging_numel(state.layouts, state.resident)
        self.staging = [pinned_zeros(self.stage_n, self._pin) for _ in range(budgets.get(HOST_GRADS, 0))]

    def _checks_per_step(self) -> int:
        """Host checks that verify a step: a flag per offloaded gradient piece (one per staging
        chunk), one for the head's part of a tied embedding, and, tied, one per embedding chunk
        once the two parts are summed on the host."""
        streamed = [u for u in self.state.trained if not u.resident]
        n = sum(len(u.steps) for u in streamed)
        if self.tied and not self.state.embed.resident and self.lora is None:
            n += 1 + len(self.state.embed.steps)
        return n

    # ---- step boundaries -----------------------------------------------------------------
    def begin_step(self, step: int, micro_ids: list[torch.Tensor], micro_targets: list[torch.Tensor], lr: float,
                   micro_positions: list[torch.Tensor | None] | None = None, n_targets: int | None = None) -> None:
        """Hand over one step's micro-batches (CPU int64 tensors, (b, seq) each), and where rows
        are packed, each token's position inside its document (0 where one starts).
        ``n_targets``: the target tokens the loss is averaged over, where these micro-batches are
        this process's share of a larger step (data parallel); by default theirs."""
        if n_targets is None:
            n_targets = int(sum(int((t != -100).sum()) for t in micro_targets))
        if n_targets == 0:
            raise ConfigError("a step has no target tokens: every position is padding")
        if self._pin:
            micro_ids = [t.pin_memory() for t in micro_ids]
            micro_targets = [t.pin_memory() for t in micro_targets]
        check = StepCheck(step, self._checks, bool(self.state.resident), self.undo)
        docs = _documents(micro_positions, len(micro_ids))
        self.steps[step] = _StepData(micro_ids, micro_targets, n_targets, lr, check, docs)
        if self.balance is not None:  # each process's micro-batches are its share of the step's
            self.balance.begin(step, micro_targets, self.device, len(micro_ids) * self.world.size)

    def end_step(self, step: int) -> tuple[float, float, bool]:
        """``(mean loss, global grad norm, skipped)`` of a finished step; frees its bookkeeping.
        ``skipped``: the loss or a gradient was not finite, so no weight, Adam moment or step
        count changed (the loss and norm are reported as computed, NaN or inf). Raises
        :class:`~flowtrain.errors.NonFiniteError` if the step was not finite and some update
        could not be put back."""
        data = self.steps.pop(step)
        loss = float(self._step_loss(data)) / data.n_targets if data.loss is not None else math.nan
        if data.aux_loss is not None:
            aux = data.aux_loss
            if self.world.parallel:  # every process's micro-batches' terms
                aux = aux.detach().clone()
                all_reduce_sum(aux, metrics=True)
            loss += float(aux)
        if self.balance is not None:
            self.balance.end(step)
        norm = data.total_norm if data.total_norm is not None else self._total_norm(data)
        self._settle(data)  # a no-op where verify_step or grad_norm has settled the step
        unfetched = self.idle.end_step(step)
        if unfetched is not None:
            self.unfetched[step] = unfetched
        self.store.check_empty(step)  # every hand-off of the step taken: no device memory left behind
        if data.check.error is not None:
            raise NonFiniteError(data.check.error)
        return loss, norm, data.check.skipped

    def _step_loss(self, data: _StepData) -> torch.Tensor:
        """The step's summed loss: this process's, or with several, all of theirs (summed over
        the processes on a group of its own, apart from the ``net`` lane's gradients)."""
        if not self.world.parallel:
            return data.loss  # type: ignore[return-value]
        total = data.loss.detach().clone()  # type: ignore[union-attr]
        all_reduce_sum(total, metrics=True)
        return total

    def begin_eval(self, step: int, micro_ids: list[torch.Tensor], micro_targets: list[torch.Tensor],
                   micro_positions: list[torch.Tensor | None] | None = None) -> None:
        """Hand over the held-out micro-batches (CPU int64 tensors, (b, seq) each) of the
        evaluation that reads the weights after ``step`` (positions as in :meth:`begin_step`)."""
        n_targets = int(sum(int((t != -100).sum()) for t in micro_targets))
        if self._pin:
            micro_ids = [t.pin_memory() for t in micro_ids]
            micro_targets = [t.pin_memory() for t in micro_targets]
        self.evals[step] = _EvalData(micro_ids, micro_targets, n_targets,
                                     _documents(micro_positions, len(micro_ids)))

    def end_eval(self, step: int) -> tuple[float, int]:
        """``(mean CE over every held-out target token, number of those tokens)`` of a finished
        evaluation: the micro-batches' fp32 sums added in micro-batch order, then divided."""
        data = self.evals.pop(step)
        self.store.check_empty(step, evaluation=True)
        total = torch.zeros((), dtype=torch.float32)
        for m in sorted(data.sums):
            total += data.sums[m].cpu()
        return float(total) / data.n_targets, data.n_targets

    # ---- dispatch ---------------------------------------------------------------------------
    def __call__(self, task: Task, ctx: TaskContext) -> int | None:
        match task:
            case Fetch():
                return self._fetch(task, ctx.slot)  # type: ignore[arg-type]
            case Embed():
                self._embed(task, ctx)
                return None
            case Forward() | Recompute():
                self._forward(task, ctx)
                return None
            case Loss():
                self._loss(task, ctx)
                return None
            case EvalLoss():
                self._eval_loss(task, ctx)
                return None
            case Backward():
                self._backward(task, ctx)
                return None
            case EmbedBackward():
                self._embed_backward(task, ctx)
                return None
            case ZeroGrad():
                self.grad_slots[ctx.slot][: self._unit(task).layout.numel + self._tied_extra(task)].zero_()  # type: ignore[index]
                return None
            case OffloadGrad():
                return self._offload(task, ctx)
            case ReduceGrad():
                unit = self._unit(task)
                if (i := self._skipping(task)) is not None:
                    # the experts each process's routing reached, summed as the gradient is: an
                    # expert is idle only where no process's micro-batch reached it
                    counts = self.idle.step_counts(task.step, i, range(len(self.steps[task.step].ids)))
                    all_reduce_sum(counts)
                    self.idle.set_summed(task.step, i, counts)
                if unit.resident:  # its own accumulator (a tied head's matrix part is the embedding's)
                    all_reduce_sum(unit.own_grad()[: unit.layout.numel])
                else:
                    all_reduce_sum(self.grad_slots[ctx.read(GRADS)][: unit.layout.numel + self._tied_extra(task)])
                return None
            case OffloadAct():
                return self._offload_act(task)
            case FetchAct():
                return self._fetch_act(task, ctx.slot)  # type: ignore[arg-type]
            case GradSqNorm():
                self._resident_sq_norm(self.steps[task.step], self._unit(task))
                return None
            case GradNorm():
                self._grad_norm(task)
                return None
            case CpuAdam():
                self._cpu_adam(task, ctx)
                return None
            case FoundInf():
                self._found_inf(task)
                return None
            case GpuAdam():
                self._gpu_adam(task)
                return None
            case VerifyStep():
                self._settle(self.steps[task.step])
                return None
            case SaveUnit():
                return self._save(task)
            case SyncStep():
                node_barrier()
                return None
        raise ConfigError(f"the training program cannot run task kind {task.kind!r}")

    # ---- helpers --------------------------------------------------------------------------
    def _unit(self, task: Task) -> UnitState:
        return self.state.unit(task.unit, task.layer)  # type: ignore[arg-type]

    def _skipping(self, task: Task) -> int | None:
        """The layer a task of a sparse layer that skips idle experts works on; None for any other
        task (another unit's, or a layer's that updates every expert)."""
        return task.layer if task.unit == "layer" and task.layer in self.idle else None

    def _tied_extra(self, task: Task) -> int:
        return self.state.embed.layout.numel if (self.tied and task.unit == "head") else 0

    def _weights(self, unit: UnitState, ctx: TaskContext) -> torch.Tensor:
        """The flat compute-dtype weights a task reads: the unit's own copy if resident, else
        the weight slot it was given."""
        return unit.compute if unit.resident else self.weight_c[ctx.read(WEIGHTS)]  # type: ignore[return-value]

    def _grads(self, unit: UnitState, ctx: TaskContext) -> torch.Tensor:
        """The flat fp32 gradient accumulator a task adds into (own if resident, else its slot)."""
        return unit.own_grad() if unit.resident else self.grad_slots[ctx.read(GRADS)]

    def _tied_matrix(self, buf: torch.Tensor) -> torch.Tensor:
        e = self.state.embed.layout.entries[0]
        return buf[self.head_n + e.offset : self.head_n + e.offset + e.numel].view(e.shape)

    # ---- task bodies ----------------------------------------------------------------------
    def _fetch(self, task: Fetch, slot: int) -> int:
        dst = self.weight_c[slot]
        if (i := self._skipping(task)) is not None and task.phase != "eval":
            # a layer that skips idle experts: before its recompute and backward, only the experts
            # the forwards of the micro-batches this fetch serves routed to (the rest of the slot
            # keeps what it held: no token reads it)
            mbs = range(len(self.steps[task.step].ids)) if task.micro_batch is None else [task.micro_batch]
            unit = self.state.unit("layer", i)
            return self._stream_in(unit, dst, self.idle.fetch_ranges(task.step, i, task.phase, mbs))
        units = [self._unit(task)] + ([self.state.embed] if self.tied and task.unit == "head" else [])
        if task.unit == "layer" and self.lora is not None and not self.state.adapters[task.layer].resident:  # type: ignore[index]
            units.append(self.state.adapters[task.layer])  # type: ignore[index]  # its adapters, from host memory
        moved = off = 0
        for unit in units:
            n = unit.layout.numel
            moved += self._stream_in(unit, dst[off : off + n], [(0, n)])
            off += n
        return moved

    def _stream_in(self, unit: UnitState, dst: torch.Tensor, ranges: list[tuple[int, int]]) -> int:
        """Copy ``ranges`` of a streamed unit's weights from host memory into the same places of
        ``dst`` (compute dtype, on the device); returns the bytes that crossed PCIe."""
        nb = self._non_blocking
        moved = 0
        for lo, hi in ranges:
            if unit.stream is not None:
                dst[lo:hi].copy_(unit.stream[lo:hi], non_blocking=nb)
                moved += (hi - lo) * unit.stream.element_size()
            elif dst.dtype == unit.master.dtype:  # an fp32 run's master, or a frozen LoRA base
                dst[lo:hi].copy_(unit.master[lo:hi], non_blocking=nb)
                moved += (hi - lo) * dst.element_size()
            else:  # fp32 pieces through the landing buffer, cast on the device, all on this lane
                piece = self.landing.numel()
                for a in range(lo, hi, piece):
                    b = min(hi, a + piece)
                    land = self.landing[: b - a]
                    land.copy_(unit.master[a:b], non_blocking=nb)
                    dst[a:b].copy_(land)
                moved += 4 * (hi - lo)
        return moved

    def _embed(self, task: Embed, ctx: TaskContext) -> None:
        s, m = task.step, task.micro_batch
        evaluating = task.phase == "eval"
        data = self.evals[s] if evaluating else self.steps[s]
        ids = data.ids[m].to(self.device, non_blocking=self._non_blocking)
        if not evaluating:
            self.dev_ids[(s, m)] = ids
        self._place_documents("eval" if evaluating else "train", s, m, data.docs[m])
        embed_state = self.state.embed
        w = bind(self._weights(embed_state, ctx), embed_state.layout)["embed_tokens"]
        inputs = self.store.eval_inputs if evaluating else self.store.inputs
        inputs.put((s, 0, m), embed(ids, w, self.embed_multiplier))

    def _place_documents(self, phase: str, s: int, m: int, docs: Documents | None) -> None:
        """Move a packed micro-batch's documents to the device with its rotary tables gathered
        at each token's position; every layer of the micro-batch reads them (:meth:`_layer`)."""
        if docs is not None:
            dev = docs.to(self.device, non_blocking=self._non_blocking)
            self.dev_docs[(phase, s, m)] = (dev, {k: rotary_for(cos, sin, dev) for k, (cos, sin) in self.rope.items()})

    def _layer(self, phase: str, s: int, i: int, m: int, x: torch.Tensor, w,  # noqa: ANN001
               router: RouterTap | None = None) -> torch.Tensor:
        """Decoder layer ``i`` of micro-batch ``m``: its documents, rotary tables and window
        (and, for a mixture of experts' load-balancing loss, the tap its routing goes to)."""
        docs, rope = self.dev_docs.get((phase, s, m), (None, self.rope))
        cos, sin = rope[self.cfg.layer_rope_local(i)]
        if router is not None:
            return self.layer_fn(x, w, cos, sin, self.cfg, docs, self.cfg.layer_window(i), router)
        return self.layer_fn(x, w, cos, sin, self.cfg, docs, self.cfg.layer_window(i))

    def _layer_weights(self, i: int, ctx: TaskContext, adapters: dict[str, torch.Tensor] | None = None,
                       dropout: tuple[int, int, tuple[int, ...]] | None = None) -> dict:
        """Layer ``i``'s weights as its math reads them: bound from its slot (or its own copy),
        with LoRA joined by its adapters (``adapters``: the leaves a backward differentiates) and,
        in training (``dropout``: the step, the micro-batch and its rows' shape), the keep masks
        of the adapters' dropout, drawn alike by the forward and the recompute."""
        unit = self.state.unit("layer", i)
        w = bind(self._weights(unit, ctx)[: unit.layout.numel], unit.layout)
        if self.lora is None:
            return w
        a = self.state.adapters[i]
        out = adapted(w, adapters if adapters is not None else bind(self._adapters(i, ctx), a.layout),
                      self.lora_consts["lora_scale"])
        if dropout is not None and self.lora.dropout > 0:
            s, m, rows = dropout
            seed = hash((self.seed, s, i, m))  # ints hash to themselves: the same in every process
            out.update(dropout_masks(out, rows, self.lora.dropout, seed, self.device),
                       lora_rescale=self.lora_consts["lora_rescale"])
        return out

    def _adapters(self, i: int, ctx: TaskContext) -> torch.Tensor:
        """Layer ``i``'s flat adapters as its math reads them: their own fp32 masters where
        resident, else their copy in the compute dtype that came with the layer into its slot."""
        a = self.state.adapters[i]
        if a.resident:
            return a.master
        n = self.state.unit("layer", i).layout.numel
        return self.weight_c[ctx.read(WEIGHTS)][n : n + a.layout.numel]

    def _counting(self, s: int, i: int, m: int) -> RouterTap | None:
        """The router tap of layer ``i``'s forward in training: what the load-balancing loss
        counts, and where the layer skips idle experts, its real tokens per expert (None:
        neither)."""
        taps = []
        if self.balance is not None and self.cfg.layer_sparse(i):
            taps.append(self.balance.counting(s, i, m))
        if i in self.idle:
            taps.append(self.idle.tap(s, i, m, self.steps[s].targets[m]))
        if len(taps) < 2:
            return taps[0] if taps else None

        def both(probs: torch.Tensor, experts: torch.Tensor) -> None:
            for tap in taps:
                tap(probs, experts)
        return both

    def _layer_input(self, s: int, i: int, m: int, keep: bool) -> torch.Tensor:
        return self.store.inputs.peek((s, i, m)) if keep else self.store.inputs.take((s, i, m))

    def _offload_act(self, task: OffloadAct) -> int:
        """An offloaded checkpoint to its pinned host buffer, on the d2h lane (after the layer's
        forward has read it); the device copy is freed once the copy has run."""
        key = (task.step, task.layer, task.micro_batch)
        x = self.store.inputs.take(key)
        buf = self.act_host.get(key[1:])
        if buf is None or buf.shape != x.shape or buf.dtype != x.dtype:  # not reserved ahead
            buf = self.act_host[key[1:]] = self._checkpoint_buffer(x.shape, x.dtype)
        buf.copy_(x, non_blocking=self._non_blocking)
        if self.device.type == "cuda":
            x.record_stream(torch.cuda.current_stream(self.device))
        return buf.numel() * buf.element_size()

    def reserve_offloaded(self, layers: Iterable[int], micro_batches: int, rows: int) -> None:
        """Allocate, before the first step, the host buffer of every checkpoint the step graph
        offloads (layer ``i``'s input of each micro-batch, ``rows`` sequences of ``seq_len``).
        Allocated and page-locked inside the first step's ``offload_act`` tasks, they held the
        d2h lane up while the forward ran on; and host memory that is short now fails here,
        before anything trains."""
        shape = (rows, self.seq_len, self.cfg.hidden_size)
        for i in layers:
            for m in range(micro_batches):
                if (i, m) not in self.act_host:
                    self.act_host[(i, m)] = self._checkpoint_buffer(shape, self.dtype)

    def _checkpoint_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # page-locked in place: torch's pinned allocator would round a 3 GiB checkpoint up to
        # 4 GiB (a power of two), host memory the plan does not have
        return pinned_zeros(math.prod(shape), self._pin, dtype).view(shape)

    def _fetch_act(self, task: FetchAct, slot: int) -> int:
        """An offloaded checkpoint back onto the device, on the h2d lane, before its backward.
        The next step's ``offload_act`` of the same checkpoint cannot overwrite the host buffer
        before this copy has run: it follows that step's forward of the layer, which follows
        (through the layer's Adam) this step's backward of it, which waits for this copy."""
        key = (task.step, task.layer, task.micro_batch)
        buf = self.act_host[key[1:]]
        x = self.act_slots.get(slot)
        if x is None or x.shape != buf.shape:
            x = self.act_slots[slot] = torch.empty(buf.shape, dtype=buf.dtype, device=self.device)
        x.copy_(buf, non_blocking=self._non_blocking)
        self.store.inputs.put(key, x)
        return buf.numel() * buf.element_size()

    @torch.no_grad()
    def _forward(self, task: Forward | Recompute, ctx: TaskContext) -> None:
        """A layer's forward pass; as ``recompute`` (in backward) its input is always kept."""
        s, i, m = task.step, task.layer, task.micro_batch
        unit = self.state.unit("layer", i)
        if task.phase == "eval":  # nothing is kept for a backward, and no dropout
            w = self._layer_weights(i, ctx)
            x = self.store.eval_inputs.take((s, i, m))
            self.store.eval_inputs.put((s, i + 1, m), self._layer("eval", s, i, m, x, w))
            return
        if task.phase == "keep":  # the graph stays for the backward: see flowtrain.train.kept
            x = self.store.inputs.take((s, i, m))
            tap = self._counting(s, i, m)
            flat = self._weights(unit, ctx)[: unit.layout.numel]
            if self.lora is None:
                y, kept = forward_kept(lambda x, w: self._layer("train", s, i, m, x, w, tap), x, flat, unit.layout)
            else:  # the adapters are the leaves; the base's views are kept by place
                a = self.state.adapters[i]
                y, kept = forward_kept(
                    lambda x, leaves: self._layer("train", s, i, m, x,
                                                  self._layer_weights(i, ctx, leaves, (s, m, tuple(x.shape[:-1]))), tap),
                    x, flat, unit.layout, trained=(self._adapters(i, ctx), a.layout))
            self.store.kept.put((s, i, m), kept)
            self.store.inputs.put((s, i + 1, m), y)
            return
        keep = isinstance(task, Recompute) or i in self.checkpointed  # a checkpoint stays for the backward
        x = self._layer_input(s, i, m, keep=keep)
        record = None
        if task.phase == "attn":  # its attention output waits for the rebuild: saved_attention
            record = AttentionRecord()
            self.store.attention.put((s, i, m), record)
        tap = None if isinstance(task, Recompute) else self._counting(s, i, m)
        w = self._layer_weights(i, ctx, dropout=(s, m, tuple(x.shape[:-1])))
        with recording(record):
            self.store.inputs.put((s, i + 1, m), self._layer("train", s, i, m, x, w, tap))

    def _head_grads(self, ctx: TaskContext) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm_grad, head_grad)``: the views a loss adds the head's gradient into, laid out
        as :meth:`_head_weights` reads the weights."""
        head = self.state.head
        gbuf = self._grads(head, ctx)
        norm_g = bind(gbuf, head.layout)["norm"]
        if not self.tied:
            return norm_g, bind(gbuf, head.layout)["lm_head"]
        if head.resident:  # the embedding is resident too: its own gradient
            emb = self.state.embed
            return norm_g, bind(emb.own_grad(), emb.layout)[emb.layout.entries[0].key]
        return norm_g, self._tied_matrix(gbuf)

    def _head_weights(self, ctx: TaskContext) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm_w, head_w)``: the final norm and output matrix a loss reads."""
        head = self.state.head
        wbuf = self._weights(head, ctx)
        norm_w = bind(wbuf, head.layout)["norm"]
        if not self.tied:
            return norm_w, bind(wbuf, head.layout)["lm_head"]
        if head.resident:  # the embedding is resident too: its own copy
            emb = self.state.embed
            return norm_w, bind(emb.compute, emb.layout)[emb.layout.entries[0].key]  # type: ignore[arg-type]
        return norm_w, self._tied_matrix(wbuf)

    def _loss(self, task: Loss, ctx: TaskContext) -> None:
        s, m = task.step, task.micro_batch
        data = self.steps[s]
        L = self.cfg.num_layers
        h = self.store.inputs.take((s, L, m))
        targets = data.targets[m].to(self.device, non_blocking=self._non_blocking)
        frozen = self.lora is not None  # the head takes no gradient: only the hidden state's
        norm_w, head_w = self._head_weights(ctx)
        loss_sum, d_h, d_norm, d_head = head_loss_and_grads(
            h, norm_w, head_w, targets, self.cfg.rms_norm_eps, 1.0 / data.n_targets, self.chunk_tokens,
            plus_one=self.cfg.family.gemma, weight_grads=not frozen,
        )
        loss_sum = self._poison(loss_sum, s, "loss", m)
        if not frozen:
            assert d_norm is not None and d_head is not None
            norm_g, head_g = self._head_grads(ctx)
            norm_g.add_(self._poison(d_norm, s, "head", m))
            head_g.add_(d_head)
        aux = self.balance.loss(s, m) if self.balance is not None else None
        with self._lock:
            data.loss = loss_sum if data.loss is None else data.loss + loss_sum
            data.check.loss_host = self._host_copy(data.loss)  # read by cpu_adam, on the host
            if aux is not None:
                data.aux_loss = aux if data.aux_loss is None else data.aux_loss + aux
        self.store.grads.put((s, L - 1, m), d_h)

    def _eval_loss(self, task: EvalLoss, ctx: TaskContext) -> None:
        """Forward only: final norm, head and the summed CE of one held-out micro-batch (fp32)."""
        s, m = task.step, task.micro_batch
        data = self.evals[s]
        h = self.store.eval_inputs.take((s, self.cfg.num_layers, m))
        targets = data.targets[m].to(self.device, non_blocking=self._non_blocking)
        norm_w, head_w = self._head_weights(ctx)
        loss_sum = head_loss(h, norm_w, head_w, targets, self.cfg.rms_norm_eps, self.chunk_tokens,
                             plus_one=self.cfg.family.gemma)
        self.dev_docs.pop(("eval", s, m), None)
        with self._lock:
            data.sums[m] = loss_sum

    def _backward(self, task: Backward, ctx: TaskContext) -> None:
        s, i, m = task.step, task.layer, task.micro_batch
        unit = self.state.unit("layer", i)
        n = unit.layout.numel
        dy = self.store.grads.take((s, i, m))
        balance = self.balance if self.cfg.layer_sparse(i) else None  # the load-balancing loss, if any
        trained = unit if self.lora is None else self.state.adapters[i]  # whose gradient this is
        grads = self._grads(trained, ctx)
        first = functools.partial(self._poison, step=s, where=f"layer.{i}", micro_batch=m)
        if task.phase == "keep":
            extra = balance.kept_term(s, i, m) if balance is not None else None
            dx = backward_kept(self.store.kept.take((s, i, m)), self._weights(unit, ctx)[:n], dy, grads,
                               extra, first)
        else:
            x = self.store.inputs.take((s, i, m))
            record = self.store.attention.take((s, i, m)) if task.phase == "attn" else None
            terms: list[torch.Tensor] = []  # the load-balancing loss's share of this layer
            tap = balance.gradient(s, m, terms) if balance is not None else None
            with torch.enable_grad(), replaying(record):
                x = x.detach().requires_grad_(True)
                if self.lora is None:
                    leaves = weight_leaves(self._weights(unit, ctx)[:n], unit.layout)
                    w = leaves
                else:  # the adapters are the leaves; the base's weights take no gradient
                    leaves = weight_leaves(self._adapters(i, ctx), trained.layout)
                    w = self._layer_weights(i, ctx, leaves, (s, m, tuple(x.shape[:-1])))
                y = self._layer("train", s, i, m, x, w, tap)
                outputs, grad_outputs = ((y, terms[0]), (dy, torch.ones_like(terms[0]))) if terms else (y, dy)
                dx = backward_into(outputs, grad_outputs, x, leaves, trained.layout, grads, first)
        if i > 0 or self.lora is None:  # a frozen embedding has no backward to take it
            self.store.grads.put((s, i - 1, m), dx)

    def _embed_backward(self, task: EmbedBackward, ctx: TaskContext) -> None:
        s, m = task.step, task.micro_batch
        dx = self.store.grads.take((s, -1, m))
        ids = self.dev_ids.pop((s, m))
        self.dev_docs.pop(("train", s, m), None)
        emb = self.state.embed
        g = bind(self._grads(emb, ctx), emb.layout)["embed_tokens"]
        if self.embed_multiplier is not None:  # the multiplier, rounded as the forward used it
            dx = dx * torch.tensor(self.embed_multiplier, dtype=dx.dtype, device=dx.device)
        if self.cfg.pad_token_id is not None:
            # transformers' nn.Embedding(padding_idx=pad_token_id): looking up the padding
            # token's row adds nothing to its gradient (a tied head's part still does).
            dx = dx.masked_fill((ids == self.cfg.pad_token_id)[..., None], 0)
        g.index_add_(0, ids.reshape(-1), dx.reshape(-1, dx.shape[-1]).float())
        self._poison(g, s, "embed", m)

    def _poison(self, t: torch.Tensor, step: int, where: str, micro_batch: int) -> torch.Tensor:
        """``t`` with the injected value in its first element where the test hook says so."""
        if self.inject is not None and self.inject.hits(step, where, micro_batch):
            return self.inject.apply(t)
        return t

    def _host_copy(self, t: torch.Tensor) -> torch.Tensor:
        """A device scalar as host memory the CPU may read once the work so far on this lane is
        done: a pinned copy queued on the lane's stream (no sync); on the CPU, ``t`` itself."""
        if self.device.type != "cuda":
            return t
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t, non_blocking=True)
        return out

    def _offload(self, task: OffloadGrad, ctx: TaskContext) -> int:
        """Device gradient -> host: the whole unit into its own buffer (``full`` layout), or one
        chunk into the staging slot this task took. Each piece's squared norm is taken on the
        device on the way (for a tied embedding, on the host once the head's part is added)."""
        unit = self._unit(task)
        src = self.grad_slots[ctx.read(GRADS)]
        nb = self._non_blocking
        moved = 0
        if self.tied and task.unit == "head" and task.chunk in (None, 0):
            n, m = unit.layout.numel, self.state.embed.layout.numel
            self.tied_grad.copy_(src[n : n + m], non_blocking=nb)
            moved += 4 * m
        lo, hi = chunk_range(unit.layout.numel, self.stage_n, task.chunk)
        dst = unit.own_grad() if task.chunk is None else self.staging[ctx.slot][: hi - lo]  # type: ignore[index]
        self._flag_pieces(task, unit, src, lo, hi)
        ranges = [(lo, hi)]
        if (i := self._skipping(task)) is not None:  # an idle expert's gradient stays behind
            ranges = self.idle.trained_ranges(task.step, i, len(self.steps[task.step].ids), lo, hi)
        for a, b in ranges:
            dst[a - lo : b - lo].copy_(src[a:b], non_blocking=nb)
            moved += 4 * (b - a)
        return moved

    def _flag_pieces(self, task: OffloadGrad, unit: UnitState, src: torch.Tensor, lo: int, hi: int) -> None:
        """Squared norm and non-finite flag of the piece ``src[lo:hi]`` an offload copies (a tied
        embedding's norm waits for the host sum, its flag does not), and of the head's part of a
        tied embedding; each flag also goes to the host, on this lane."""
        data = self.steps[task.step]
        key = unit.layout.key
        piece = src[lo:hi]
        if self.tied and task.unit == "embed":
            flags = [(key, nonfinite(piece))]
        else:
            sq = data.sq_norms[(key, task.chunk)] = torch.dot(piece, piece)  # no temporary the piece's size
            flags = [(key, nonfinite(piece, sq))]
        if self.tied and task.unit == "head" and task.chunk in (None, 0):
            n, m = unit.layout.numel, self.state.embed.layout.numel
            flags.append((self.state.embed.layout.key, nonfinite(src[n : n + m])))
        data.check.add_pieces((key, task.chunk), [(name, f, self._host_copy(f)) for name, f in flags])

    def _sum_tied(self, data: _StepData) -> None:
        """Full layout: add the head's part of the tied embedding gradient, once per step."""
        with self._lock:
            emb = self.state.embed
            if self.tied and not emb.resident and emb.grad is not None and not data.tied_summed:
                emb.grad.add_(self.tied_grad)
                sq = data.sq_norms[(emb.layout.key, None)] = torch.dot(emb.grad, emb.grad)
                data.check.host_checked(emb.layout.key, bool(nonfinite(emb.grad, sq)))
                data.tied_summed = True

    def _total_norm(self, data: _StepData) -> float:
        self._sum_tied(data)
        total = sum(float(v) for v in data.sq_norms.values())
        data.total_norm = math.sqrt(total)
        return data.total_norm

    def _grad_norm(self, task: GradNorm) -> None:
        """With clipping every gradient is in before any Adam: the step is settled here, so its
        Adam tasks either all skip or all update, and nothing needs an undo record."""
        data = self.steps[task.step]
        data.clip = clip_coefficient(self._total_norm(data), self.adamw.grad_clip)
        self._settle(data)

    def _settle(self, data: _StepData) -> None:
        """The step's verdict once every flag is on the host (``verify_step``, ``grad_norm`` or
        ``end_step``): put back what its ``cpu_adam`` tasks changed if it was not finite."""
        for saved in data.check.settle():
            saved.restore()
        data.check.release()

    def _cpu_adam(self, task: CpuAdam, ctx: TaskContext) -> None:
        data = self.steps[task.step]
        unit = self._unit(task)
        lo, hi = chunk_range(unit.layout.numel, self.stage_n, task.chunk)
        if task.chunk is None:  # full layout: the unit's own host gradient
            if task.unit == "embed":
                self._sum_tied(data)
            grad = unit.own_grad()
        else:
            grad = self.staging[ctx.read(HOST_GRADS)][: hi - lo]
            if self.tied and task.unit == "embed":
                grad.add_(self.tied_grad[lo:hi])
                sq = data.sq_norms[(unit.layout.key, task.chunk)] = torch.dot(grad, grad)
                data.check.host_checked(unit.layout.key, bool(nonfinite(grad, sq)))
        if self.owned is not None and unit.layout.key not in self.owned:
            return  # another process of the node updates the shared copy
        key = (unit.layout.key, task.chunk)
        verdict = data.check.admit(key, unit.layout.key if task.chunk is None else f"{key[0]} c{task.chunk}", hi - lo)
        if isinstance(verdict, str) and verdict == SKIP:
            return  # the step is known not finite
        try:
            if isinstance(verdict, torch.Tensor):  # not verified yet: keep what it was first
                data.check.keep(Saved(unit, lo, hi, task.chunk or 0, verdict))
            if data.clip is not None:
                grad.mul_(data.clip)
            if (i := self._skipping(task)) is not None:  # each expert on its own step count
                assert (lo, hi) == (0, unit.layout.numel), "a layer that skips idle experts is one staging chunk"
                pieces = self.idle.adam_pieces(task.step, i, len(data.ids), unit, task.chunk)
                adamw_pieces(unit.master, grad, unit.exp_avg, unit.exp_avg_sq, pieces, self.adamw, data.lr,
                             no_decay=self.no_decay[unit.layout.key])
            else:
                adamw_step(unit.master[lo:hi], grad, unit.exp_avg[lo:hi], unit.exp_avg_sq[lo:hi],
                           unit.steps[task.chunk or 0], self.adamw, data.lr,
                           no_decay=[(a - lo, b - lo) for a, b in self.no_decay[unit.layout.key]])
            unit.refresh_copies(lo, hi)
        finally:
            data.check.updated()

    def _resident_sq_norm(self, data: _StepData, unit: UnitState) -> None:
        """Squared norm and non-finite flag (on the device) of a resident unit's gradient."""
        grad = unit.own_grad()[: unit.layout.numel]
        sq = data.sq_norms[(unit.layout.key, None)] = torch.dot(grad, grad)
        data.check.resident.append((unit.layout.key, nonfinite(grad, sq)))

    def _found_inf(self, task: FoundInf) -> None:
        """Once every gradient of the step is in: 1.0 on the device if the loss or any of them is
        not finite, else 0.0, for every ``gpu_adam`` (and a host copy for ``verify_step``)."""
        data = self.steps[task.step]
        for unit in self.state.trained:
            if unit.resident:
                self._resident_sq_norm(data, unit)
        check = data.check
        flags = [~torch.isfinite(data.loss), *(f for _, f, _ in check.pieces), *(f for _, f in check.resident)]  # type: ignore[arg-type]
        check.found_inf = torch.stack(flags).any().float()
        check.found_inf_host = self._host_copy(check.found_inf)

    def _gpu_adam(self, task: GpuAdam) -> None:
        """AdamW of a resident unit on the device (torch's fused CUDA kernel on a GPU), then a
        fresh compute copy and a zeroed accumulator for the next step. The kernel leaves the
        unit as it was where the step's ``found_inf`` flag is set (no host sync)."""
        data = self.steps[task.step]
        unit = self._unit(task)
        grad = unit.own_grad()
        if not data.check.skipped:  # known on the host already: with clipping, or a bad loss
            if data.clip is not None:
                grad.mul_(data.clip.to(grad.device))
            if (i := self._skipping(task)) is not None:  # idle experts skipped on the device
                sl = self.idle.slices[i]
                assert unit.expert_steps is not None
                adamw_experts(unit.master, grad, unit.exp_avg, unit.exp_avg_sq, sl.shared, unit.steps[0],
                              sl.experts, unit.expert_steps,
                              self.idle.idle_on_device(task.step, i, len(data.ids)), self.adamw, data.lr,
                              found_inf=data.check.found_inf, no_decay=self.no_decay[unit.layout.key])
            else:
                adamw_step(unit.master, grad, unit.exp_avg, unit.exp_avg_sq, unit.steps[0], self.adamw, data.lr,
                           found_inf=data.check.found_inf, no_decay=self.no_decay[unit.layout.key])
            data.check.gpu_updated.append(unit.layout.key)
            unit.refresh_copies()
        grad.zero_()

    def _save(self, task: SaveUnit) -> int:
        """Write one unit into its step's checkpoint (after this step's Adam of the unit, before
        the next step's); returns the bytes written."""
        unit = self._unit(task)
        self.checkpoints[task.step].write_unit(self.state.trained.index(unit), unit)
        return 12 * unit.layout.numel


def _documents(positions: list[torch.Tensor | None] | None, n: int) -> list[Documents | None]:
    """Per micro-batch, its documents where some row holds several (else None: one per row,
    the plain causal kernel and the shared rotary tables)."""
    out: list[Documents | None] = [None] * n
    for m, pos in enumerate(positions or []):
        if pos is not None:
            docs = Documents.from_positions(pos)
            out[m] = docs if docs.packed else None
    return out
