"""The step program: the callable the engine runs for every task, composed of parts.

:class:`StepProgram` owns one run's buffers and parts and hands each task to the handler its
kind is registered with (:data:`~.registry.HANDLERS`)::

    program = StepProgram(state, device="cpu", dtype=torch.float32, ...)
    program.begin_step(step, batch, lr)      # host data for one optimizer step
    ... engine runs the step's tasks: program(task, ctx) -> HANDLERS[task.kind](program, task, ctx)
    loss, grad_norm, skipped = program.end_step(step)

The parts, each chosen once per run: :class:`~.slots.Slots` (the slot pools' buffers),
:mod:`.training` (the whole model, or LoRA's adapters), :mod:`.tied` (the head's own matrix
or the embedding's), :class:`~.experts.Experts` (the load-balancing loss, idle experts),
:class:`~.finiteness.Finiteness` (non-finite steps), :class:`~.layer_runner.LayerRunner` (the layer
path's math: rotary tables, documents and the layer function, or transformers' modules) and :class:`~.slots.OffloadedActivations`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable

import torch

from ...ckpt.checkpoints import CheckpointWriter
from ...errors import ConfigError, NonFiniteError
from ...graph.compiler import checkpoint_layers
from ...graph.tasks import Task
from ...runtime.engine import TaskContext
from ..activations import ActivationStore
from ..distributed import World, all_reduce_sum
from ..host_state import HostState, UnitState
from ..nonfinite import Injection
from ..optimizer import AdamWConfig, no_decay_ranges
from .disk_part import DiskPart
from .experts import Experts
from .finiteness import Finiteness
from .layer_runner import layer_runner
from .registry import HANDLERS
from .slots import OffloadedActivations, Slots
from .step_data import EvalData, PolicyBatch, StepData, documents
from .tied import head_part
from .training import trained_part


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
        self.cfg = state.cfg
        #: the streamed units whose ``cpu_adam`` updates them in this process, where the
        #: processes of a node share the state (each unit has one owner); None: every unit
        self.owned = owned
        #: the data-parallel processes (``reduce_grad`` sums over them); one by default
        self.world = world or World()
        self.device = torch.device(device)
        self.dtype = dtype
        self.seq_len = seq_len
        self.chunk_tokens = chunk_tokens
        #: layers whose input stays from the forward for the backward (the compiler's segments)
        self.checkpointed = checkpoint_layers(self.cfg.num_layers, checkpoint_every)
        self.adamw = adamw
        #: per unit, the element ranges that get no weight decay (``--weight-decay-skip``)
        self.no_decay = {u.flat_map.key: no_decay_ranges(u.flat_map.entries, adamw.weight_decay_skip)
                         for u in state.trained}
        # ---- the parts
        self.slots = Slots(state, budgets, device=self.device, dtype=dtype, lora=state.lora is not None)
        self.training = trained_part(state, self.slots, seed=seed)
        self.head = head_part(state, self.slots, trains=self.training.head_trains)
        self.layers = layer_runner(self.cfg, seq_len, self.device, dtype, compile_backend,
                                   [a.flat_map for a in state.adapters] if state.lora is not None else None)
        self.acts = OffloadedActivations(self.device)
        self.disk = DiskPart(state, budgets)
        self.finite = Finiteness(state, self.slots, self.head, undo_bytes=undo_bytes, inject=inject_nonfinite)
        self.experts = Experts(state, self.device)
        if self.experts.idle:  # an idle expert's part of a slot is never copied: never uninitialised memory
            for w in self.slots.weight_c:
                w.zero_()
        #: the undo budget and the NaN injection of the finiteness part (tests read them here)
        self.undo, self.inject = self.finite.undo, self.finite.inject
        # ---- what tasks leave for each other
        #: a layer's input, an output gradient, a kept forward, a saved attention output; empty
        #: of a step once it ends: see flowtrain.train.activations
        self.store = ActivationStore()
        self.steps: dict[int, StepData] = {}
        #: held-out loss evaluations by the step whose weights they read
        self.evals: dict[int, EvalData] = {}
        #: open checkpoint writers by the step they save (``save`` tasks write into them)
        self.checkpoints: dict[int, CheckpointWriter] = {}
        #: per finished step, the fraction of the sparse layers' expert weights its fetches left
        #: in host memory (the caller pops it: flowtrain.train.loop)
        self.unfetched: dict[int, float] = {}
        #: DPO's ``(beta, loss type)`` (flowtrain.train.objectives); None: next-token cross-entropy
        self.preference: tuple[float, str] | None = None
        #: per finished DPO step, its mean rewards by TRL's names (the caller pops it)
        self.rewards: dict[int, dict[str, float]] = {}
        #: a policy loss's ``(beta, epsilon_low, epsilon_high)`` (flowtrain.train.objectives)
        self.policy_loss: tuple[float, float, float | None] = (0.0, 0.2, None)
        #: per finished policy step, its KL and clip ratio by TRL's names, and each target
        #: token's log-probability before the update ((rows, seq) fp32); the caller pops them
        self.policy_metrics: dict[int, dict[str, float]] = {}
        self.token_logps: dict[int, torch.Tensor] = {}
        self.lock = threading.Lock()

    # ---- the engine's entry point ----------------------------------------------------------
    def __call__(self, task: Task, ctx: TaskContext) -> int | None:
        """Run ``task``: the handler its kind is registered with (bytes moved, or None)."""
        try:
            handler = HANDLERS[task.kind]
        except KeyError as e:
            raise ConfigError(f"the training program cannot run task kind {task.kind!r}") from e
        result: int | None = handler(self, task, ctx)
        return result

    def unit(self, task: Task) -> UnitState:
        """The unit ``task`` works on."""
        return self.state.unit(task.unit, task.layer)  # type: ignore[arg-type]

    # ---- step boundaries -----------------------------------------------------------------
    def begin_step(self, step: int, micro_ids: list[torch.Tensor], micro_targets: list[torch.Tensor], lr: float,
                   micro_positions: list[torch.Tensor | None] | None = None, n_targets: int | None = None,
                   reference: list[torch.Tensor] | None = None, policy: list[PolicyBatch] | None = None) -> None:
        """Hand over one step's micro-batches (CPU int64 tensors, (b, seq) each), and where rows
        are packed, each token's position inside its document (0 where one starts).
        ``n_targets``: the target tokens the loss is averaged over, where these micro-batches are
        this process's share of a larger step (data parallel); by default theirs.
        ``reference`` (DPO, :attr:`preference` set): per micro-batch, the reference's summed
        completion log-probability of each row ((rows,) fp32), pairs in consecutive rows; the
        loss is then averaged over ``n_targets`` pairs (by default the micro-batches').
        ``policy`` (a policy step): per micro-batch its tokens' weights, advantages and old and
        reference log-probabilities; the weights already average the loss (``n_targets`` 1)."""
        if policy is not None:
            n_targets = 1
        if reference is not None and n_targets is None:
            n_targets = sum(len(t) for t in micro_targets) // 2
        if n_targets is None:
            n_targets = int(sum(int((t != -100).sum()) for t in micro_targets))
        if n_targets == 0:
            raise ConfigError("a step has no target tokens: every position is padding")
        if self.slots.pin:
            micro_ids = [t.pin_memory() for t in micro_ids]
            micro_targets = [t.pin_memory() for t in micro_targets]
        docs = documents(micro_positions, len(micro_ids))
        self.steps[step] = StepData(micro_ids, micro_targets, n_targets, lr, self.finite.new_check(step), docs)
        self.steps[step].reference = reference
        self.steps[step].policy = policy
        self.experts.begin(step, micro_targets, self.device, len(micro_ids) * self.world.size)

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
        if data.rewards is not None:  # DPO: the step's mean rewards, over every process's pairs
            sums = data.rewards.detach().clone()
            if self.world.parallel:
                all_reduce_sum(sums, metrics=True)
            values = (sums.cpu() / data.n_targets).tolist()
            self.rewards[step] = dict(zip(("rewards/chosen", "rewards/rejected", "rewards/margins",
                                           "rewards/accuracies"), values))
        if data.policy is not None:
            self._end_policy(step, data)
        norm = data.total_norm if data.total_norm is not None else self.total_norm(data)
        self.finite.settle(data)  # a no-op where verify_step or grad_norm has settled the step
        unfetched = self.experts.end(step)
        if unfetched is not None:
            self.unfetched[step] = unfetched
        self.store.check_empty(step)  # every hand-off of the step taken: no device memory left behind
        self.layers.check_empty(step)  # and every micro-batch's ids, documents and layer arguments dropped
        if data.check.error is not None:
            raise NonFiniteError(data.check.error)
        return loss, norm, data.check.skipped

    def _end_policy(self, step: int, data: StepData) -> None:
        """A policy step's mean KL and clip ratio over its completion tokens, and its tokens'
        log-probabilities in row order (one process: the session refuses data parallel)."""
        assert data.policy is not None
        tokens = sum(float((b.weights != 0).sum()) for b in data.policy)
        sums = data.policy_sums.cpu() if data.policy_sums is not None else torch.zeros(2)
        self.policy_metrics[step] = {"kl": float(sums[0]) / max(tokens, 1.0),
                                     "clip_ratio/region_mean": float(sums[1]) / max(tokens, 1.0)}
        if len(data.logps) == len(data.ids):
            self.token_logps[step] = torch.cat([data.logps[m] for m in range(len(data.ids))])

    def total_norm(self, data: StepData) -> float:
        """The step's global gradient norm from every piece's squared norm (a tied embedding's
        summed first)."""
        self.head.sum_whole(data)
        total = sum(float(v) for v in data.sq_norms.values())
        data.total_norm = math.sqrt(total)
        return data.total_norm

    def _step_loss(self, data: StepData) -> torch.Tensor:
        """The step's summed loss: this process's, or with several, all of theirs (summed over
        the processes on a group of its own, apart from the ``net`` lane's gradients)."""
        if not self.world.parallel:
            return data.loss  # type: ignore[return-value]
        total = data.loss.detach().clone()  # type: ignore[union-attr]
        all_reduce_sum(total, metrics=True)
        return total

    def begin_eval(self, step: int, micro_ids: list[torch.Tensor], micro_targets: list[torch.Tensor],
                   micro_positions: list[torch.Tensor | None] | None = None, reference: bool = False,
                   per_token: bool = False) -> None:
        """Hand over the held-out micro-batches (CPU int64 tensors, (b, seq) each) of the
        evaluation that reads the weights after ``step`` (positions as in :meth:`begin_step`).
        ``reference``: a reference pass (DPO) instead, whose result :meth:`end_reference` reads:
        each row's summed target log-probability, under LoRA without the adapters.
        ``per_token``: each target token's log-probability instead (:meth:`end_token_logprobs`),
        with the adapters unless ``reference``."""
        n_targets = int(sum(int((t != -100).sum()) for t in micro_targets))
        if self.slots.pin:
            micro_ids = [t.pin_memory() for t in micro_ids]
            micro_targets = [t.pin_memory() for t in micro_targets]
        self.evals[step] = EvalData(micro_ids, micro_targets, n_targets, documents(micro_positions, len(micro_ids)),
                                    reference=reference, per_token=per_token)

    def end_eval(self, step: int) -> tuple[float, int]:
        """``(mean CE over every held-out target token, number of those tokens)`` of a finished
        evaluation: the micro-batches' fp32 sums added in micro-batch order, then divided."""
        data = self.evals.pop(step)
        self.store.check_empty(step, evaluation=True)
        self.layers.check_empty(step, evaluation=True)
        total = torch.zeros((), dtype=torch.float32)
        for m in sorted(data.sums):
            total += data.sums[m].cpu()
        return float(total) / data.n_targets, data.n_targets

    def end_reference(self, step: int) -> torch.Tensor:
        """A finished reference pass's summed log-probability of each row, in row order
        (``(rows,)`` fp32 on the CPU)."""
        data = self.evals.pop(step)
        self.store.check_empty(step, evaluation=True)
        self.layers.check_empty(step, evaluation=True)
        return torch.cat([data.sums[m].cpu() for m in range(len(data.ids))])

    def end_token_logprobs(self, step: int) -> torch.Tensor:
        """A finished ``per_token`` pass's log-probability of each target token, ``(rows,
        seq)`` fp32 on the CPU, 0 where a target is ignored."""
        return self.end_reference(step)

    def reserve_offloaded(self, layers: Iterable[int], micro_batches: int, rows: int) -> None:
        """Allocate, before the first step, the host buffer of every checkpoint the step graph
        offloads (layer ``i``'s input of each micro-batch, ``rows`` sequences of ``seq_len``).
        Allocated and page-locked inside the first step's ``offload_act`` tasks, they held the
        d2h lane up while the forward ran on; and host memory that is short now fails here,
        before anything trains."""
        self.acts.reserve(layers, micro_batches, (rows, self.seq_len, self.cfg.hidden_size), self.dtype)
