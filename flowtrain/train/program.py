"""The training program: what each task kind does to tensors.

The engine decides *when* a task runs and which slot it gets; this module decides *what* it
does. :class:`StepProgram` is the callable the engine runs for every task::

    program = StepProgram(cfg, state, device="cpu", dtype=torch.float32, ...)
    program.begin_step(step, batch, lr)      # host data for one optimizer step
    ... engine runs the step's tasks: program(task, ctx) ...
    loss, grad_norm = program.end_step(step)

Device buffers, allocated once:

- weight slots: ``budgets["weights"]`` flat fp32 buffers that ``fetch`` fills from the pinned
  fp32 masters, plus (in bf16) a compute-dtype twin that the fetch casts into on its own lane,
- gradient slots: ``budgets["grads"]`` flat fp32 accumulators,
- activations: a dict keyed ``(step, layer, micro_batch)``; the input of layer ``i`` is kept
  from the forward pass when ``i % checkpoint_every == 0`` and rebuilt by ``recompute``
  otherwise.

A layer's backward re-runs it under autograd from its saved input and takes the gradient with
respect to the input and to the *flat* weight leaf, which is one contiguous tensor ready to be
accumulated and offloaded in a single copy. With tied embeddings the head's slot holds the
final norm followed by the embedding matrix, and its gradient slot likewise; the embedding's
Adam adds the head's part of the tied gradient before stepping.
"""

from __future__ import annotations

import math
import threading

import torch

from ..errors import ConfigError
from ..graph.tasks import (
    GRADS,
    WEIGHTS,
    Backward,
    CpuAdam,
    Embed,
    EmbedBackward,
    Fetch,
    Forward,
    GradNorm,
    Loss,
    OffloadGrad,
    Recompute,
    Task,
    ZeroGrad,
)
from ..runtime.executor import TaskContext
from .host_state import HostState, UnitState, pinned_zeros
from .model import bind, decoder_layer, embed, head_loss_and_grads, rope_tables
from .optimizer import AdamWConfig, adamw_step, clip_coefficient


class _StepData:
    """Host-side inputs and per-step accumulators of one optimizer step."""

    def __init__(self, ids: list[torch.Tensor], targets: list[torch.Tensor], n_targets: int, lr: float) -> None:
        self.ids = ids
        self.targets = targets
        self.n_targets = n_targets
        self.lr = lr
        self.loss: torch.Tensor | None = None
        self.sq_norms: dict[str, torch.Tensor] = {}  # unit key -> squared grad norm (device)
        self.clip: torch.Tensor | None = None  # clip coefficient, once known
        self.total_norm: float | None = None
        self.tied_summed = False


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
    ) -> None:
        self.state = state
        self.cfg = state.cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.k = checkpoint_every
        self.adamw = adamw
        self.chunk_tokens = chunk_tokens
        self.tied = self.cfg.tie_word_embeddings
        self.head_n = state.head.layout.numel
        embed_n = state.embed.layout.numel
        slot_n = max(u.layout.numel for u in state.units)
        if self.tied:
            slot_n = max(slot_n, self.head_n + embed_n)
            self.tied_grad = pinned_zeros(embed_n, self._pin)
        on_gpu = self.device.type == "cuda"
        self.weight_f32 = [torch.empty(slot_n, dtype=torch.float32, device=self.device) for _ in range(budgets[WEIGHTS])]
        if dtype == torch.float32:
            self.weight_c = self.weight_f32
        else:
            self.weight_c = [torch.empty(slot_n, dtype=dtype, device=self.device) for _ in range(budgets[WEIGHTS])]
        self.grad_slots = [torch.empty(slot_n, dtype=torch.float32, device=self.device) for _ in range(budgets[GRADS])]
        self.cos, self.sin = rope_tables(self.cfg, seq_len, self.device, dtype)
        self.acts: dict[tuple[int, int, int], torch.Tensor] = {}
        self.dacts: dict[tuple[int, int, int], torch.Tensor] = {}
        self.dev_ids: dict[tuple[int, int], torch.Tensor] = {}
        self.dev_targets: dict[tuple[int, int], torch.Tensor] = {}
        self.steps: dict[int, _StepData] = {}
        self._lock = threading.Lock()
        self._non_blocking = on_gpu

    @property
    def _pin(self) -> bool:
        return self.device.type == "cuda"

    # ---- step boundaries -----------------------------------------------------------------
    def begin_step(self, step: int, micro_ids: list[torch.Tensor], micro_targets: list[torch.Tensor], lr: float) -> None:
        """Hand over one step's micro-batches (CPU int64 tensors, (b, seq) each)."""
        n_targets = int(sum(int((t != -100).sum()) for t in micro_targets))
        if n_targets == 0:
            raise ConfigError("a step has no target tokens: every position is padding")
        if self._pin:
            micro_ids = [t.pin_memory() for t in micro_ids]
            micro_targets = [t.pin_memory() for t in micro_targets]
        self.steps[step] = _StepData(micro_ids, micro_targets, n_targets, lr)

    def end_step(self, step: int) -> tuple[float, float]:
        """``(mean loss, global grad norm)`` of a finished step; frees its bookkeeping."""
        data = self.steps.pop(step)
        loss = float(data.loss) / data.n_targets if data.loss is not None else math.nan
        norm = data.total_norm if data.total_norm is not None else self._total_norm(data)
        return loss, norm

    # ---- dispatch ---------------------------------------------------------------------------
    def __call__(self, task: Task, ctx: TaskContext) -> int | None:
        match task:
            case Fetch():
                return self._fetch(task, ctx.slot)  # type: ignore[arg-type]
            case Embed():
                return self._embed(task, ctx.read(WEIGHTS))
            case Forward():
                return self._forward(task, ctx.read(WEIGHTS))
            case Loss():
                return self._loss(task, ctx.read(WEIGHTS), ctx.read(GRADS))
            case Recompute():
                return self._recompute(task, ctx.read(WEIGHTS))
            case Backward():
                return self._backward(task, ctx.read(WEIGHTS), ctx.read(GRADS))
            case EmbedBackward():
                return self._embed_backward(task, ctx.read(GRADS))
            case ZeroGrad():
                self.grad_slots[ctx.slot][: self._unit(task).layout.numel + self._tied_extra(task)].zero_()  # type: ignore[index]
                return None
            case OffloadGrad():
                return self._offload(task, ctx.read(GRADS))
            case GradNorm():
                return self._grad_norm(task)
            case CpuAdam():
                return self._adam(task)
        raise ConfigError(f"the training program cannot run task kind {task.kind!r}")

    # ---- helpers --------------------------------------------------------------------------
    def _unit(self, task: Task) -> UnitState:
        return self.state.unit(task.unit, task.layer)  # type: ignore[arg-type]

    def _tied_extra(self, task: Task) -> int:
        return self.state.embed.layout.numel if (self.tied and task.unit == "head") else 0

    def _weights(self, slot: int, unit: UnitState) -> dict[str, torch.Tensor]:
        return bind(self.weight_c[slot], unit.layout)

    def _tied_matrix(self, buf: torch.Tensor) -> torch.Tensor:
        e = self.state.embed.layout.entries[0]
        return buf[self.head_n + e.offset : self.head_n + e.offset + e.numel].view(e.shape)

    # ---- task bodies ----------------------------------------------------------------------
    def _fetch(self, task: Fetch, slot: int) -> int:
        unit = self._unit(task)
        n = unit.layout.numel
        dst = self.weight_f32[slot]
        dst[:n].copy_(unit.master, non_blocking=self._non_blocking)
        if self.tied and task.unit == "head":
            m = self.state.embed.layout.numel
            dst[n : n + m].copy_(self.state.embed.master, non_blocking=self._non_blocking)
            n += m
        if self.weight_c is not self.weight_f32:
            self.weight_c[slot][:n].copy_(dst[:n])  # cast on the device, on this lane
        return 4 * n

    def _embed(self, task: Embed, slot: int) -> None:
        s, m = task.step, task.micro_batch
        data = self.steps[s]
        ids = data.ids[m].to(self.device, non_blocking=self._non_blocking)  # type: ignore[index]
        self.dev_ids[(s, m)] = ids  # type: ignore[index]
        w = self._weights(slot, self.state.embed)["embed_tokens"]
        self.acts[(s, 0, m)] = embed(ids, w)  # type: ignore[index]

    def _layer_input(self, s: int, i: int, m: int, keep: bool) -> torch.Tensor:
        return self.acts[(s, i, m)] if keep else self.acts.pop((s, i, m))

    @torch.no_grad()
    def _forward(self, task: Forward, slot: int) -> None:
        s, i, m = task.step, task.layer, task.micro_batch
        x = self._layer_input(s, i, m, keep=i % self.k == 0)  # type: ignore[operator, arg-type]
        w = self._weights(slot, self.state.unit("layer", i))
        self.acts[(s, i + 1, m)] = decoder_layer(x, w, self.cos, self.sin, self.cfg)  # type: ignore[operator, index]

    @torch.no_grad()
    def _recompute(self, task: Recompute, slot: int) -> None:
        s, j, m = task.step, task.layer, task.micro_batch
        w = self._weights(slot, self.state.unit("layer", j))
        self.acts[(s, j + 1, m)] = decoder_layer(self.acts[(s, j, m)], w, self.cos, self.sin, self.cfg)  # type: ignore[operator, index]

    def _loss(self, task: Loss, slot: int, gslot: int) -> None:
        s, m = task.step, task.micro_batch
        data = self.steps[s]
        L = self.cfg.num_layers
        h = self.acts.pop((s, L, m))  # type: ignore[arg-type]
        targets = data.targets[m].to(self.device, non_blocking=self._non_blocking)  # type: ignore[index]
        head = self.state.head
        w = self._weights(slot, head)
        g = bind(self.grad_slots[gslot], head.layout)
        if self.tied:
            head_w, head_g = self._tied_matrix(self.weight_c[slot]), self._tied_matrix(self.grad_slots[gslot])
        else:
            head_w, head_g = w["lm_head"], g["lm_head"]
        loss_sum, d_h, d_norm, d_head = head_loss_and_grads(
            h, w["norm"], head_w, targets, self.cfg.rms_norm_eps, 1.0 / data.n_targets, self.chunk_tokens
        )
        g["norm"].add_(d_norm)
        head_g.add_(d_head)
        with self._lock:
            data.loss = loss_sum if data.loss is None else data.loss + loss_sum
        self.dacts[(s, L - 1, m)] = d_h  # type: ignore[index]

    def _backward(self, task: Backward, slot: int, gslot: int) -> None:
        s, i, m = task.step, task.layer, task.micro_batch
        unit = self.state.unit("layer", i)
        n = unit.layout.numel
        x = self.acts.pop((s, i, m))  # type: ignore[arg-type]
        dy = self.dacts.pop((s, i, m))  # type: ignore[arg-type]
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            flat = self.weight_c[slot][:n].detach().requires_grad_(True)
            y = decoder_layer(x, bind(flat, unit.layout), self.cos, self.sin, self.cfg)
            dx, dw = torch.autograd.grad(y, (x, flat), dy)
        self.grad_slots[gslot][:n].add_(dw)
        self.dacts[(s, i - 1, m)] = dx  # type: ignore[operator, index]

    def _embed_backward(self, task: EmbedBackward, gslot: int) -> None:
        s, m = task.step, task.micro_batch
        dx = self.dacts.pop((s, -1, m))  # type: ignore[arg-type]
        ids = self.dev_ids.pop((s, m))  # type: ignore[arg-type]
        g = bind(self.grad_slots[gslot], self.state.embed.layout)["embed_tokens"]
        g.index_add_(0, ids.reshape(-1), dx.reshape(-1, dx.shape[-1]).float())

    def _offload(self, task: OffloadGrad, gslot: int) -> int:
        unit = self._unit(task)
        n = unit.layout.numel
        src = self.grad_slots[gslot]
        data = self.steps[task.step]
        key = unit.layout.key
        if self.tied and task.unit == "head":
            m = self.state.embed.layout.numel
            self.tied_grad.copy_(src[n : n + m], non_blocking=self._non_blocking)
            data.sq_norms[key] = src[:n].square().sum()
            unit.grad.copy_(src[:n], non_blocking=self._non_blocking)
            return 4 * (n + m)
        if not (self.tied and task.unit == "embed"):  # the tied sum's norm is taken on the host
            data.sq_norms[key] = src[:n].square().sum()
        unit.grad.copy_(src[:n], non_blocking=self._non_blocking)
        return 4 * n

    def _sum_tied(self, data: _StepData) -> None:
        """Add the head's part of the tied embedding gradient, once per step."""
        with self._lock:
            if self.tied and not data.tied_summed:
                g = self.state.embed.grad
                g.add_(self.tied_grad)
                data.sq_norms[self.state.embed.layout.key] = g.square().sum()
                data.tied_summed = True

    def _total_norm(self, data: _StepData) -> float:
        self._sum_tied(data)
        total = sum(float(v) for v in data.sq_norms.values())
        data.total_norm = math.sqrt(total)
        return data.total_norm

    def _grad_norm(self, task: GradNorm) -> None:
        data = self.steps[task.step]
        data.clip = clip_coefficient(self._total_norm(data), self.adamw.grad_clip)

    def _adam(self, task: CpuAdam) -> None:
        data = self.steps[task.step]
        unit = self._unit(task)
        if task.unit == "embed":
            self._sum_tied(data)
        if data.clip is not None:
            unit.grad.mul_(data.clip)
        adamw_step(unit.master, unit.grad, unit.exp_avg, unit.exp_avg_sq, unit.step, self.adamw, data.lr)

