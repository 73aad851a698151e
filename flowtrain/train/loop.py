"""The asynchronous part of a run: steps through the engine, checkpoints, skipped steps, signals.

Two steps are in flight at a time: step ``s + 1`` is added to the engine (with the edges that
let it overlap step ``s``) before step ``s`` is waited for and reported
(:class:`~flowtrain.graph.stream.StepStream`, which the simulator's clock runs too). Around that:

- a step that ends a checkpoint interval gets a ``save`` task per unit; once the step is done
  its checkpoint is completed and renamed into place (or, if the step was skipped, written at
  the next step instead: its saves may hold updates that were then undone);
- once the run's first step is over, what building the compiled layer left is settled
  (:mod:`.first_step`: frozen out of full garbage collections, torch's cached pinned blocks
  given back);
- skipped steps are counted, and more than ``max_skipped`` in a row end the run with
  :class:`~flowtrain.errors.NonFiniteError`;
- with ``--eval-data`` and ``--eval-every N``, after every N-th step (and after the last) the
  steps in flight are finished, then a held-out loss graph (:mod:`flowtrain.graph.evaluation`)
  runs behind that step's Adam of every unit and is *waited for* before the next step is added,
  so no Adam changes weights it still reads: the step overlap pauses once per evaluation, and
  its time is not counted in any step's tokens/s
  (:meth:`~flowtrain.train.reporting.Reporter.eval` reports it, and the step's
  :class:`~flowtrain.train.reporting.StepMetrics` carries it to ``on_step`` and the returned list);
- a signal (:mod:`flowtrain.train.shutdown`) stops adding steps, or cancels the engine, and the
  run ends with :class:`~flowtrain.errors.Interrupted` saying what was saved::

    loop = TrainingLoop(run, state, program, reporter, shutdown, on_step=None, hooks=[])
    metrics = asyncio.run(loop.main())
"""

from __future__ import annotations

import asyncio
import base64
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, NoReturn

import networkx as nx
import torch

from ..ckpt import checkpoints
from ..ckpt.adapter_files import adapter_config_text
from ..ckpt.output import read_source_config
from ..ckpt.resume import trainer_state
from ..data.source import step_batches, tokenizer_files
from ..errors import Interrupted, NonFiniteError, StepFailed
from ..graph.compiler import StepSpec, compile_step
from ..graph.evaluation import compile_eval
from ..graph.saving import add_saves, save_edges
from ..graph.stream import OpenStep, StepStream
from ..policy import WithBudgets, resolve_policy
from ..runtime.engine import Engine
from ..runtime.faults import from_env as faults_from_env
from ..runtime.trace import Instrument
from .distributed import PeerLost, agree_to_stop
from .first_step import settle_after_first_step
from .host_state import HostState
from .out_of_memory import gpu_out_of_memory
from .program import StepProgram
from .reporting import Reporter, StepMetrics
from .shutdown import Shutdown, signal_name

if TYPE_CHECKING:
    from .prepare import Run


@dataclass(frozen=True)
class _Added:
    """What the loop keeps with a step in flight: its save tasks (the next step's Adam waits
    for them) and its tokens (for its metrics)."""

    saves: list
    tokens: int


class TrainingLoop:
    """The asynchronous part of a run: steps through the engine, checkpoints, skipped steps,
    signals. One instance per run."""

    def __init__(self, run: "Run", state: HostState, program: StepProgram, reporter: Reporter,
                 shutdown: Shutdown, on_step, hooks: list[Instrument], keep: dict | None = None) -> None:
        self.run, self.cfg, self.state, self.program = run, run.cfg, state, program
        #: what every checkpoint's trainer_state.json keeps beside the run's own (a
        #: PolicyTrainer's loss settings, which are not the config's)
        self.keep = dict(keep or {})
        self.spec: StepSpec = run.plan.spec
        self.reporter, self.shutdown, self.on_step, self.hooks = reporter, shutdown, on_step, hooks
        self.metrics: list[StepMetrics] = []
        self.writers: dict[int, checkpoints.CheckpointWriter] = {}
        rs = run.resume_state
        self.skipped = rs.get("skipped_steps", 0)
        self.consecutive = rs.get("consecutive_skipped", 0)
        self.last_saved: Path | None = run.resume_from
        self.last_saved_step = run.first_step if run.resume_from is not None else None
        # which checkpoints are this run's line: pruning and `--resume OUT` go by it
        self.lineage = checkpoints.Lineage.start(rs if run.resume_from is not None else None, run.resume_from)
        self.save_pending = False  # a checkpoint step was skipped: save at the next step
        #: the config.json every checkpoint keeps (that of the model the run started from)
        self.source_config = read_source_config(run.source_dir)
        self.t_last = 0.0
        #: the step being waited for, taken from the stream already (for after a failure)
        self.waiting: OpenStep | None = None
        #: the held-out micro-batches (ids, targets)
        self.eval_batches = _eval_micro_batches(run.eval_seqs, self.cfg.micro_batch_size)
        #: DPO: the reference's summed completion log-probability of every row of the data
        #: ((rows,) fp32), computed before the first step or read back from the resumed checkpoint
        self.reference: torch.Tensor | None = None
        if self.cfg.objective == "dpo":
            program.preference = (self.cfg.dpo_beta, self.cfg.dpo_loss)
            self.reference = read_reference(rs, len(run.seqs)) if run.resume_from is not None else None

    # ---- the loop -------------------------------------------------------------------------
    def engine(self) -> Engine:
        """The run's engine, over its program, under its policy and the plan's budgets."""
        cfg, run = self.cfg, self.run
        policy = WithBudgets(resolve_policy(cfg.policy), run.plan.budgets)
        return Engine(faults_from_env(self.program), policy, device=str(run.device), cpu_workers=cfg.adam_workers,
                      instruments=self.hooks, task_timeout=cfg.task_timeout)

    def stream(self) -> StepStream:
        """Two steps in flight; a step's saves hold back the next step's Adam of their unit."""
        return StepStream(self.spec, in_flight=2, link=lambda prev, graph: save_edges(prev.data.saves, graph))

    async def main(self) -> list[StepMetrics]:
        cfg, run = self.cfg, self.run
        engine = self.engine()
        self.shutdown.attach(asyncio.get_running_loop(), asyncio.current_task())  # type: ignore[arg-type]
        batches = step_batches(run.seqs, cfg.batch_size, shuffle=cfg.shuffle, seed=cfg.seed, start_step=run.first_step,
                               pairs=cfg.objective == "dpo")
        stream = self.stream()
        try:
            async with engine:
                if cfg.objective == "dpo" and self.reference is None:
                    await self._reference_pass(engine)
                self.t_last = time.perf_counter()
                for s in range(run.first_step, cfg.steps):
                    if await self._stop_agreed():
                        break
                    self._add_step(engine, stream, s, next(batches))
                    if self._evaluates_after(s):  # steps done first, so their times stay their own
                        for done in stream.drain():  # all done: the next step needs no edges
                            await self._finish(engine, done)
                        await self._evaluate(engine, s)
                    for done in stream.due():
                        await self._finish(engine, done)
                for done in stream.drain():
                    await self._finish(engine, done)
                if self.shutdown.requested:
                    await self._save_on_signal(engine)
        except asyncio.CancelledError:
            if not self.shutdown.cancelled:
                raise
            raise self._interrupted(saved=False, stuck=engine.stuck) from None
        except StepFailed as e:
            self._failed(e, engine, stream)
        finally:
            self.shutdown.detach()
        if self.shutdown.requested:
            raise self._interrupted(saved=True, stuck=[])
        return self.metrics

    def _failed(self, e: StepFailed, engine: Engine, stream: StepStream) -> NoReturn:
        """A task failed: close the steps that had finished whole, and raise what to tell."""
        if isinstance(e.__cause__, PeerLost):  # not the task's fault: say what happened to the peer
            raise e.__cause__ from None
        self._close_finished(engine, [*([self.waiting] if self.waiting else []), *stream.open])
        if isinstance(e.__cause__, torch.OutOfMemoryError):  # the plan did not hold: say by how much, what to change
            raise gpu_out_of_memory(f"task {e.task}", e.__cause__, self.run.plan) from e
        raise e

    async def one_step(self, engine: Engine, stream: StepStream, s: int, begin: Callable[[], None],
                       tokens: int) -> StepMetrics:
        """Step ``s`` alone, start to end, its data handed to the program by ``begin`` (a
        caller that needs each step's result before it makes the next, as an RL loop does):
        added like every step of :meth:`main`, then waited for, checkpointed and reported. Its
        time (and tokens/s) counts from this call: what the caller did in between is not in it."""
        self.t_last = time.perf_counter()
        try:
            begin()
            self._add_graph(engine, stream, s, tokens)
            for done in stream.drain():
                await self._finish(engine, done)
        except StepFailed as e:
            self._failed(e, engine, stream)
        return self.metrics[-1]

    async def _stop_agreed(self) -> bool:
        """Stop before the next step: this process was signalled, or, data parallel, any was
        (all of them decide together at each step boundary, so they stop after the same step
        and no process waits in an all-reduce that the others will never join)."""
        if not self.run.world.parallel:
            return self.shutdown.requested
        if not await asyncio.to_thread(agree_to_stop, self.shutdown.requested, self.run.device):
            return False
        self.shutdown.request_from_peer()
        return True

    def _add_step(self, engine: Engine, stream: StepStream, s: int, batch) -> None:
        cfg = self.cfg
        # this process's share of the step (all of it on one process); the loss is averaged
        # over the whole step's targets either way
        mbs = self.run.world.share(batch.micro_batches(cfg.micro_batch_size))
        if self.reference is not None:  # DPO: the loss is the mean over the step's pairs
            self.program.begin_step(s, [mb.input_ids for mb in mbs], [mb.targets for mb in mbs], self.run.schedule(s),
                                    n_targets=len(batch) // 2,
                                    reference=[self.reference[mb.rows] for mb in mbs])  # type: ignore[index]
        else:
            self.program.begin_step(s, [mb.input_ids for mb in mbs], [mb.targets for mb in mbs], self.run.schedule(s),
                                    [mb.positions for mb in mbs], n_targets=batch.num_targets())
        self._add_graph(engine, stream, s, int(batch.input_ids.numel()))

    def _add_graph(self, engine: Engine, stream: StepStream, s: int, tokens: int) -> None:
        """Step ``s``'s graph (its data handed to the program already), with its saves where a
        checkpoint is due, into the engine behind the steps in flight."""
        graph = compile_step(self.spec, step=s)
        saves = []
        if self._saves_after(s):
            saves = add_saves(graph, self.spec)
            self._open_checkpoint(s)
        engine.add(graph, stream.push(s, graph, _Added(saves, tokens)))

    # ---- DPO's reference ----------------------------------------------------------------------
    async def _reference_pass(self, engine: Engine) -> None:
        """Every row's reference log-probability, before the first step changes a weight: the
        forward-only graph of an evaluation (:mod:`flowtrain.graph.evaluation`) over the data, a
        step's rows at a time, with the initial weights (under LoRA the base without its
        adapters, which no step changes). Its time is not counted in any step's tokens/s."""
        seqs, rows = self.run.seqs, self.cfg.batch_size
        mbs, s = self.cfg.micro_batch_size, self.run.first_step
        started = time.perf_counter()
        parts = []
        for start in range(0, len(seqs), rows):
            ids, targets = seqs.input_ids[start:start + rows], seqs.targets[start:start + rows]
            cut = range(0, len(ids), mbs)
            parts.append(await self.forward_only(engine, s, [ids[i:i + mbs] for i in cut],
                                                 [targets[i:i + mbs] for i in cut], reference=True))
        self.reference = torch.cat(parts)
        self.reporter.say(f"reference log-probabilities of {len(seqs) // 2:,} pairs computed in "
                          f"{time.perf_counter() - started:.1f} s")

    async def forward_only(self, engine: Engine, s: int, micro_ids: list[torch.Tensor],
                           micro_targets: list[torch.Tensor], *, per_token: bool = False,
                           reference: bool = False) -> torch.Tensor:
        """The targets' log-probabilities with the weights after step ``s - 1`` (every step in
        flight finished), forward only, through the evaluation graph: each row's sum, or with
        ``per_token`` each token's ((rows, seq)); ``reference``: under LoRA without the adapters."""
        self.program.begin_eval(s, micro_ids, micro_targets, reference=reference, per_token=per_token)
        graph = compile_eval(self.spec, s, len(micro_ids))
        engine.add(graph)
        await engine.wait(graph)
        return self.program.end_token_logprobs(s) if per_token else self.program.end_reference(s)

    # ---- held-out loss ----------------------------------------------------------------------
    def _evaluates_after(self, s: int) -> bool:
        every = self.cfg.eval_every
        return every is not None and ((s + 1) % every == 0 or s == self.cfg.steps - 1)

    async def _evaluate(self, engine: Engine, s: int) -> None:
        """The held-out loss with the weights after step ``s`` (finished, every Adam of it done):
        a forward-only graph, waited for here, before step ``s + 1`` may change them."""
        ids, targets, positions = self.eval_batches
        self.program.begin_eval(s, ids, targets, positions)
        graph = compile_eval(self.spec, s, len(ids))
        engine.add(graph)
        await engine.wait(graph)
        m = self.metrics[-1]  # step s's: every step in flight was finished first
        m.eval_loss, m.eval_tokens = self.program.end_eval(s)
        self.reporter.eval(m)
        if self.on_step:  # held back by _finish until the evaluation was in
            self.on_step(m)
        self.t_last = time.perf_counter()  # tok/s counts training time only

    def _saves_after(self, s: int) -> bool:
        every = self.cfg.save_every
        if every is None:
            return False
        due = (s + 1) % every == 0 or self.save_pending
        self.save_pending = False
        return due

    async def _finish(self, engine: Engine, done: OpenStep) -> None:
        self.waiting = done
        await engine.wait(done.graph)
        self.waiting = None
        self._close_step(done)

    def _close_finished(self, engine: Engine, steps: list[OpenStep]) -> None:
        """After a task failed: close the open steps, oldest first, that had finished whole
        before it (every task, the checkpoint's saves included), as if they had been waited for,
        so a checkpoint such a step wrote is completed; stop at the first that had not. The
        failure is raised after: nothing that goes wrong here may hide it."""
        for done in steps:
            if not engine.finished(done.graph):
                return
            try:
                self._close_step(done)
            except Exception:  # the task's failure is the one to report
                return

    def _close_step(self, done: OpenStep) -> None:
        """A step whose tasks have all finished: its metrics, checkpoint and report."""
        s, tokens = done.step, done.data.tokens
        loss, grad_norm, skipped = self.program.end_step(s)
        now = time.perf_counter()
        seconds, self.t_last = now - self.t_last, now
        m = StepMetrics(step=s + 1, loss=loss, tokens=tokens, seconds=seconds,
                        tokens_per_s=tokens / seconds if seconds > 0 else 0.0, lr=self.run.schedule(s),
                        grad_norm=grad_norm, skipped=skipped, experts_unfetched=self.program.unfetched.pop(s, None),
                        rewards=self.program.rewards.pop(s, None), policy=self.program.policy_metrics.pop(s, None))
        self.metrics.append(m)
        if len(self.metrics) == 1:  # the compiled layer is built: see first_step
            settle_after_first_step(self.run.device.type)
        self._count_skipped(m)
        if s in self.writers:
            if skipped:  # its saves may hold updates that were then undone: write it again
                self.writers.pop(s).abort()
                self.program.checkpoints.pop(s, None)
                self.save_pending = True
            else:
                self._complete_checkpoint(s, m)
        self.reporter.step(m)
        if self.on_step and not self._evaluates_after(s):  # else _evaluate calls it, with the held-out loss
            self.on_step(m)
        self._check_skipped(s)

    # ---- skipped steps ----------------------------------------------------------------------
    def _count_skipped(self, m: StepMetrics) -> None:
        if m.skipped:
            self.skipped += 1
            self.consecutive += 1
        else:
            self.consecutive = 0

    def _check_skipped(self, s: int) -> None:
        if self.consecutive <= self.cfg.max_skipped:
            return
        first = s - self.consecutive + 1
        where = (f"resume from {self.last_saved}" if self.last_saved is not None
                 else "no checkpoint was written (--save-every keeps them)")
        raise NonFiniteError(
            f"steps {first + 1}-{s + 1}: {self.consecutive} steps in a row had a loss or gradients that were not "
            f"finite and were skipped (more than --max-skipped {self.cfg.max_skipped}); the weights are still those "
            f"after step {first} and no model was written; {where}; try a lower --lr or --grad-clip"
        )

    # ---- checkpoints -----------------------------------------------------------------------
    def _open_checkpoint(self, s: int) -> None:
        lora = self.state.lora  # a LoRA checkpoint holds the adapters (the base is the model's own)
        writer = checkpoints.CheckpointWriter(self.cfg.out, s + 1, self.state.cfg,  # type: ignore[arg-type]
                                              [u.flat_map for u in self.state.trained], source_config=self.source_config,
                                              adapter_config=adapter_config_text(lora, [u.flat_map for u in self.state.trained],
                                                                                 self.cfg.model) if lora else None)
        self.writers[s] = writer
        self.program.checkpoints[s] = writer

    def _complete_checkpoint(self, s: int, m: StepMetrics) -> None:
        writer = self.writers.pop(s)
        self.program.checkpoints.pop(s, None)
        ts = trainer_state(self.cfg, steps_done=s + 1, skipped=self.skipped, consecutive=self.consecutive,
                           data=self.run.data_fp, last_loss=m.loss, lineage=self.lineage.to_json(),
                           schedule=self.run.schedule.record(), base=self.run.base_fp) | self.keep
        if self.reference is not None:  # DPO: the reference is the initial weights, which no checkpoint holds
            ts["reference_logps"] = base64.b64encode(self.reference.numpy().astype("<f4").tobytes()).decode()
        self.last_saved = writer.finish(ts, extra_files=tokenizer_files(self.run.tokenizer_dir))
        self.last_saved_step = s + 1
        if self.cfg.save_total_limit:  # this run's line only: another run's checkpoints are not ours
            checkpoints.prune(self.cfg.out, self.cfg.save_total_limit, lineage=self.lineage,  # type: ignore[arg-type]
                              protect=self.last_saved)

    async def _save_on_signal(self, engine: Engine) -> None:
        """After a graceful stop: every step in flight has finished; save the last one unless it
        was just saved."""
        if self.cfg.save_every is None or not self.metrics or self.last_saved_step == self.metrics[-1].step:
            return  # nothing to save (a data-parallel process other than rank 0 saves nothing)
        s = self.metrics[-1].step - 1  # the task graph's step: 0-based
        graph = nx.DiGraph()
        add_saves(graph, self.spec, step=s)
        self._open_checkpoint(s)
        engine.add(graph)
        await engine.wait(graph)
        self._complete_checkpoint(s, self.metrics[-1])

    def abort_checkpoints(self) -> None:
        """Remove the temporary folders of checkpoints that were not completed."""
        for writer in self.writers.values():
            writer.abort()
        self.writers.clear()

    def _interrupted(self, *, saved: bool, stuck) -> Interrupted:
        signum = self.shutdown.signum or 2
        done = self.metrics[-1].step if self.metrics else self.run.first_step
        if saved and self.last_saved is not None:
            what = f"checkpoint of step {self.last_saved_step} saved to {self.last_saved}"
        elif self.last_saved is not None:
            what = f"nothing saved since {self.last_saved} (step {self.last_saved_step})"
        elif self.cfg.save_every is None:
            what = "no checkpoint was written (use --save-every to keep one)"
        elif saved:  # a graceful stop before any step of this run finished: nothing new to save
            what = "no checkpoint was written (no step had finished)"
        else:  # with --save-every only a second signal cancels the run
            what = ("no checkpoint was written (the second signal stopped the run before the checkpoint the first "
                    f"one asked for was written, and no --save-every {self.cfg.save_every} checkpoint was due yet)")
        tail = f"; task {stuck[0]} was still running and was abandoned" if stuck else ""
        return Interrupted(signum, f"stopped by {signal_name(signum)} after step {done}: {what}{tail}")


def read_reference(state: dict, rows: int) -> torch.Tensor:
    """A DPO checkpoint's reference log-probabilities, one per row of the data."""
    import numpy as np

    from ..errors import CheckpointError

    text = state.get("reference_logps")
    try:
        values = np.frombuffer(base64.b64decode(text, validate=True), dtype="<f4") if isinstance(text, str) else None
    except (ValueError, TypeError):
        values = None
    if values is None or len(values) != rows:
        raise CheckpointError("the checkpoint holds no reference log-probabilities for the data's "
                              f"{rows // 2:,} pairs (trainer_state.json's reference_logps); it was not written by a "
                              "DPO run on this data")
    return torch.from_numpy(values.astype(np.float32))


def _eval_micro_batches(seqs, micro_batch_size: int) -> tuple[list, list, list]:
    """The held-out set cut into consecutive micro-batches (the last one may be smaller):
    their ids, targets and positions (None where rows are not packed)."""
    if seqs is None:
        return [], [], []
    rows = range(0, len(seqs), micro_batch_size)
    pos = seqs.positions
    return ([seqs.input_ids[i : i + micro_batch_size] for i in rows],
            [seqs.targets[i : i + micro_batch_size] for i in rows],
            [None if pos is None else pos[i : i + micro_batch_size] for i in rows])
