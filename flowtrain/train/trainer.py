"""The training loop: compile steps, feed them to the engine, report, checkpoint, save.

Steps overlap: step ``s + 1`` is handed to the engine before step ``s`` has finished, with
edges from each unit's ``cpu_adam`` in step ``s`` to that unit's fetches in step ``s + 1``. So
the next forward starts as soon as the embedding's and the first layers' Adam are done,
while Adam for the units above still runs on the CPU. At most two steps are in flight::

    cfg = TrainConfig(model="tiny", steps=100, out="trained", save_every=25)
    result = train(cfg)                # returns the per-step metrics

A run has three phases, one function each: :func:`prepare` (everything that can fail on bad
input, before any large allocation), :func:`_loop` (the engine), and the final save. With
``save_every``, a step that ends a checkpoint interval gets one ``save`` task per unit
(:mod:`flowtrain.graph.saving`), which writes the unit while the next step computes; the
checkpoint is completed and renamed into place once the step is done
(:mod:`flowtrain.train.checkpoints`). ``resume`` restores a checkpoint's weights, Adam state,
data position and counters, so the run continues exactly as if it had never stopped.
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import msgspec
import networkx as nx
import torch

from ..errors import CheckpointError, ConfigError, Interrupted, NonFiniteError, PlanError
from ..graph.compiler import StepSpec, compile_step, cross_step_edges, units
from ..graph.saving import add_saves, save_edges
from ..graph.tasks import SaveUnit
from ..policy import WithBudgets, resolve_policy
from ..runtime.executor import Engine, use_uvloop
from ..runtime.faults import from_env as faults_from_env
from ..runtime.trace import Instrument, TraceRecorder, lane_busy, write_chrome_trace
from . import checkpoints
from .checks import check_compile_backend, check_output_paths, validate_numbers
from .data import Sequences, default_corpus_path, load_sequences, step_batches, tokenizer_files
from .host_state import HostState, return_freed_memory
from .model import ModelConfig, PRESETS, preset, read_config
from .optimizer import AdamWConfig, LRSchedule
from .output import remove_stale_temp, save_final_model
from .plan import Plan, cap_gpu_memory, plan_run, run_request
from .program import StepProgram
from .reporting import Reporter, StepMetrics
from .resume import check_compatible, data_fingerprint, restore_rng, steps_done, trainer_state
from .shutdown import Shutdown, signal_name

__all__ = ["TrainConfig", "StepMetrics", "train", "prepare"]


class TrainConfig(msgspec.Struct, kw_only=True):
    """Everything ``flowtrain train`` takes; see ``flowtrain train --help`` for each field."""

    model: str | None = None  # None: the resumed checkpoint's model, else "tiny"
    data: str | None = None
    steps: int = 200
    batch_size: int = 16
    micro_batch_size: int = 8
    seq_len: int = 128
    lr: float = 3e-3
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float | None = None
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    min_lr: float = 0.0
    seed: int = 0
    shuffle: bool = True
    precision: str | None = None
    device: str = "auto"
    policy: str = "double_buffer"
    checkpoint_every: int = 1
    order: str = "layer"
    adam_workers: int = 1
    out: str | None = None
    overwrite: bool = False
    metrics: str | None = None
    trace: str | None = None
    progress: bool | None = None  # None: a bar on a terminal, plain lines otherwise
    chunk_tokens: int | None = None
    #: host state layout: "auto" (staged, or full with --grad-clip), "staged", "full", "stream-bf16"
    layout: str = "auto"
    #: units kept on the device with their Adam there: "auto" (the planner decides), "none",
    #: or comma-separated unit keys ("embed,head,layer.0")
    resident: str = "auto"
    #: torch.compile backend for the decoder layer: "auto" (inductor on CUDA, eager on the CPU),
    #: "none" (eager), or a backend name ("inductor", "aot_eager", ...)
    compile: str | None = "auto"
    gpu_mem: float | None = None  # GiB flowtrain may take on the GPU (enforced)
    host_mem: float | None = None  # GiB of host memory to plan for (default: what is available)
    #: write ``out/checkpoint-STEP`` every this many steps (needs ``out``)
    save_every: int | None = None
    #: keep only the newest this many checkpoints
    save_total_limit: int | None = None
    #: a checkpoint folder, or an ``out`` folder meaning its newest checkpoint
    resume: str | None = None
    #: stop once more than this many steps in a row were skipped as not finite
    max_skipped: int = 3
    #: host memory (GiB) for undo records of a step whose gradients turn non-finite late
    undo_mem: float = 1.0
    #: fail a task that runs longer than this many seconds (None: no limit)
    task_timeout: float | None = None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for, but this machine has no CUDA GPU (use --device cpu)")
    if name != "cpu" and not name.startswith("cuda"):
        raise ConfigError(f"--device must be auto, cpu or cuda (got {name!r})")
    return torch.device(name)


def resolve_dtype(precision: str | None, device: torch.device) -> torch.dtype:
    precision = precision or ("bf16" if device.type == "cuda" else "fp32")
    if precision not in ("fp32", "bf16"):
        raise ConfigError(f"--precision must be fp32 or bf16 (got {precision!r})")
    return torch.float32 if precision == "fp32" else torch.bfloat16


def resolve_compile(name: str | None, device: torch.device) -> str | None:
    """The torch.compile backend for the layer, or None for eager. ``auto`` compiles on CUDA
    (fused norms, rotary and SwiGLU: 8% faster than eager at W1 on the H200, docs/benchmarks.md)
    and stays eager on the CPU, where compiling costs more than it saves on small test runs."""
    if name in (None, "none", "eager"):
        return None
    if name == "auto":
        return "inductor" if device.type == "cuda" else None
    return name


def load_model_config(model: str) -> tuple[ModelConfig, Path | None]:
    """A preset name or a Hugging Face model directory."""
    path = Path(model)
    if model in PRESETS and not path.is_dir():
        return preset(model), None
    if not path.exists():
        raise CheckpointError(
            f"--model {model!r} is neither a directory nor a preset (presets: {', '.join(sorted(PRESETS))})"
        )
    if not path.is_dir():
        raise CheckpointError(f"--model {model!r} is a file; give the model's directory (config.json + safetensors)")
    return read_config(path), path


def validate(cfg: TrainConfig, mcfg: ModelConfig) -> None:
    if cfg.steps < 1:
        raise ConfigError(f"--steps must be at least 1 (got {cfg.steps})")
    if cfg.batch_size < 1 or cfg.micro_batch_size < 1:
        raise ConfigError("--batch-size and --micro-batch-size must be at least 1")
    if cfg.batch_size % cfg.micro_batch_size:
        raise ConfigError(f"--micro-batch-size {cfg.micro_batch_size} does not divide --batch-size {cfg.batch_size}")
    if cfg.seq_len < 2:
        raise ConfigError(f"--seq-len must be at least 2 (got {cfg.seq_len})")
    if cfg.seq_len > mcfg.max_position_embeddings:
        raise ConfigError(
            f"--seq-len {cfg.seq_len} is beyond the model's {mcfg.max_position_embeddings} positions "
            f"(max_position_embeddings); use --seq-len {mcfg.max_position_embeddings} or less"
        )
    if cfg.adam_workers < 1:
        raise ConfigError("--adam-workers must be at least 1")
    if cfg.save_every is not None and not cfg.out:
        raise ConfigError("--save-every writes OUT/checkpoint-STEP folders: give --out OUT")
    if cfg.save_every is not None and cfg.resume is None and cfg.out and Path(cfg.out).is_dir():
        old = sorted(p.name for p in Path(cfg.out).glob("checkpoint-*"))
        if old:
            raise ConfigError(
                f"--out {cfg.out} holds checkpoints of an earlier run ({', '.join(old[-3:])}); continue it with "
                f"--resume {cfg.out}, or write this run's checkpoints to another --out"
            )


@dataclass
class Run:
    """Everything :func:`prepare` decided and loaded, ready for the loop."""

    cfg: TrainConfig
    mcfg: ModelConfig
    model_dir: Path | None  # weights to start from, tokenizer files to copy
    device: torch.device
    dtype: torch.dtype
    plan: Plan
    schedule: LRSchedule
    seqs: Sequences
    data_fp: str
    resume_from: Path | None = None
    resume_state: dict = field(default_factory=dict)

    @property
    def first_step(self) -> int:
        return self.resume_state.get("step", 0)


def prepare(cfg: TrainConfig) -> Run:
    """Check every input and output, read the resumed checkpoint's state, load and tokenise the
    data and plan memory: everything that bad input can make fail, before any large allocation."""
    validate_numbers(cfg)
    check_compile_backend(cfg.compile)
    resume_from, resume_state = _find_resume(cfg)
    check_output_paths(cfg.out, cfg.overwrite, cfg.trace, cfg.metrics, resume=resume_from)
    model = cfg.model or (str(resume_from) if resume_from else "tiny")
    mcfg, model_dir = load_model_config(model)
    mcfg.validate()
    if resume_from is not None:
        saved_cfg = read_config(resume_from)
        if saved_cfg != mcfg:
            raise ConfigError(f"--resume {resume_from}: it holds a different model than --model {cfg.model} "
                              f"(config.json differs); leave out --model to continue the checkpoint's model")
        model_dir = resume_from  # its tokenizer files travel with every checkpoint
    validate(cfg, mcfg)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.precision, device)
    AdamWConfig(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                grad_clip=cfg.grad_clip).validate()
    schedule = LRSchedule(lr=cfg.lr, warmup_steps=cfg.warmup_steps, schedule=cfg.lr_schedule,
                          total_steps=cfg.steps, min_lr=cfg.min_lr).validate()
    resolve_policy(cfg.policy)
    seqs = load_sequences(cfg.data or str(default_corpus_path()), cfg.seq_len, mcfg.vocab_size,
                          tokenizer_dir=model_dir, pad_id=mcfg.pad_token_id or 0, eos_id=mcfg.eos_token_id)
    data_fp = data_fingerprint(seqs.input_ids, seqs.targets)
    if resume_from is not None:
        check_compatible(resume_state, cfg, data=data_fp, where=str(resume_from), total_steps=cfg.steps)
    plan = plan_run(mcfg, run_request(cfg, model_dir), device=device, dtype=dtype, policy=resolve_policy(cfg.policy))
    if not plan.fits:
        raise PlanError(plan.refusal())
    return Run(cfg, mcfg, model_dir, device, dtype, plan, schedule, seqs, data_fp, resume_from, resume_state)


def _find_resume(cfg: TrainConfig) -> tuple[Path | None, dict]:
    if cfg.resume is None:
        return None, {}
    path = checkpoints.latest_checkpoint(cfg.resume)
    state, path = checkpoints.read_checkpoint(path, verify=True)
    steps_done(state, str(path))
    return path, state


def build_state(run: Run) -> tuple[HostState, StepProgram]:
    """Allocate the host state and the device buffers the plan sized, and fill the weights."""
    cfg, plan = run.cfg, run.plan
    spec = plan.spec
    torch.manual_seed(cfg.seed)
    state = HostState.create(run.mcfg, pin=run.device.type == "cuda", layout=plan.layout, resident=spec.resident,
                             device=run.device, dtype=run.dtype, chunks=spec.grad_chunks)
    if run.resume_from is not None:
        checkpoints.load_training_state(run.resume_from, state)
        restore_rng(run.resume_state)
    elif run.model_dir is None:
        state.init_random(cfg.seed)
    else:
        state.load_checkpoint(run.model_dir)
    adamw = AdamWConfig(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                        grad_clip=cfg.grad_clip)
    program = StepProgram(state, device=run.device, dtype=run.dtype, seq_len=cfg.seq_len,
                          checkpoint_every=cfg.checkpoint_every, budgets=plan.budgets, adamw=adamw,
                          chunk_tokens=plan.chunk_tokens, compile_backend=resolve_compile(cfg.compile, run.device),
                          undo_bytes=int(cfg.undo_mem * 2**30))
    return state, program


def train(cfg: TrainConfig, on_step: Callable[[StepMetrics], None] | None = None,
          instruments: Sequence[Instrument] = (), on_plan: Callable | None = None) -> list[StepMetrics]:
    """Run a whole training job as configured; returns the metrics of the steps it ran.
    ``instruments`` see every task the engine runs (e.g. a :class:`TraceRecorder`);
    ``on_plan`` receives the memory plan the run follows.

    Raises :class:`Interrupted` on SIGINT/SIGTERM (in the main thread), :class:`NonFiniteError`
    when too many steps in a row were skipped, :class:`StepFailed` when a task failed; in
    each case no final model is written and every checkpoint already written stays whole."""
    shutdown = Shutdown(graceful=cfg.save_every is not None)
    with shutdown:
        run = prepare(cfg)
        if on_plan:
            on_plan(run.plan)
        if cfg.out:
            remove_stale_temp(cfg.out)
            checkpoints.remove_stale(cfg.out)
        return_freed_memory()
        if run.device.type == "cuda":
            if cfg.gpu_mem is not None:
                cap_gpu_memory(run.device, cfg.gpu_mem)
            # CPU Adam's threads leave cores to the lane launchers, waiters and the event loop.
            torch.set_num_threads(max(1, (os.cpu_count() or 2) - 3))
        state, program = build_state(run)
        gc.freeze()  # the model and torch's objects are long-lived: keep full collections off them
        recorder = TraceRecorder() if cfg.trace else None
        reporter = Reporter(total=cfg.steps, first=run.first_step, metrics=cfg.metrics, progress=cfg.progress)
        shutdown.say = reporter.say
        loop = _Loop(run, state, program, reporter, shutdown, on_step,
                     [*instruments, *([recorder] if recorder else [])])
        try:
            use_uvloop()
            metrics = asyncio.run(loop.main())
        finally:
            shutdown.restore_sync_handlers()
            loop.abort_checkpoints()
            reporter.close()
            if recorder is not None:
                _write_trace(run, recorder)
        if cfg.out:
            shutdown.phase = (f"while writing the final model; --out {cfg.out} holds what it held before"
                              + (f" and {loop.last_saved.name}" if loop.last_saved is not None else ""))
            save_final_model(state, cfg.out, run.model_dir)
        return metrics


def _write_trace(run: Run, recorder: TraceRecorder) -> None:
    cfg, plan = run.cfg, run.plan
    write_chrome_trace(cfg.trace, recorder.records, meta={
        "policy": cfg.policy, "budgets": plan.budgets, "model": cfg.model or "", "device": str(run.device),
        "precision": "fp32" if run.dtype == torch.float32 else "bf16", "steps": cfg.steps,
        "busy_seconds": lane_busy(recorder.records), "layout": plan.layout,
        "resident": list(plan.spec.resident),
    })


class _Loop:
    """The asynchronous part of a run: steps through the engine, checkpoints, skipped steps,
    signals. One instance per run."""

    def __init__(self, run: Run, state: HostState, program: StepProgram, reporter: Reporter,
                 shutdown: Shutdown, on_step, hooks: list[Instrument]) -> None:
        self.run, self.cfg, self.state, self.program = run, run.cfg, state, program
        self.spec: StepSpec = run.plan.spec
        self.reporter, self.shutdown, self.on_step, self.hooks = reporter, shutdown, on_step, hooks
        self.metrics: list[StepMetrics] = []
        self.writers: dict[int, checkpoints.CheckpointWriter] = {}
        rs = run.resume_state
        self.skipped = rs.get("skipped_steps", 0)
        self.consecutive = rs.get("consecutive_skipped", 0)
        self.last_saved: Path | None = run.resume_from
        self.last_saved_step = run.first_step if run.resume_from is not None else None
        self.save_pending = False  # a checkpoint step was skipped: save at the next step
        self.t_last = 0.0

    # ---- the loop -------------------------------------------------------------------------
    async def main(self) -> list[StepMetrics]:
        cfg, run = self.cfg, self.run
        policy = WithBudgets(resolve_policy(cfg.policy), run.plan.budgets)
        program = faults_from_env(self.program)
        engine = Engine(program, policy, device=str(run.device), cpu_workers=cfg.adam_workers,
                        instruments=self.hooks, task_timeout=cfg.task_timeout)
        self.shutdown.attach(asyncio.get_running_loop(), asyncio.current_task())  # type: ignore[arg-type]
        batches = step_batches(run.seqs, cfg.batch_size, shuffle=cfg.shuffle, seed=cfg.seed, start_step=run.first_step)
        in_flight: deque = deque()
        try:
            async with engine:
                self.t_last = time.perf_counter()
                prev, prev_saves = None, []
                for s in range(run.first_step, cfg.steps):
                    if self.shutdown.requested:
                        break
                    batch = next(batches)
                    graph, saves = self._add_step(engine, s, batch, prev, prev_saves)
                    prev, prev_saves = list(graph), saves
                    in_flight.append((s, graph, int(batch.input_ids.numel())))
                    if len(in_flight) == 2:
                        await self._finish(engine, *in_flight.popleft())
                while in_flight:
                    await self._finish(engine, *in_flight.popleft())
                if self.shutdown.requested:
                    await self._save_on_signal(engine)
        except asyncio.CancelledError:
            if not self.shutdown.cancelled:
                raise
            raise self._interrupted(saved=False, stuck=engine.stuck) from None
        finally:
            self.shutdown.detach()
        if self.shutdown.requested:
            raise self._interrupted(saved=True, stuck=[])
        return self.metrics

    def _add_step(self, engine: Engine, s: int, batch, prev, prev_saves):
        cfg = self.cfg
        mbs = batch.micro_batches(cfg.micro_batch_size)
        self.program.begin_step(s, [mb.input_ids for mb in mbs], [mb.targets for mb in mbs], self.run.schedule(s))
        graph = compile_step(self.spec, step=s)
        saves = []
        if self._saves_after(s):
            saves = add_saves(graph, self.spec)
            self._open_checkpoint(s)
        edges = []
        if prev is not None:
            edges = cross_step_edges(prev, graph, self.spec) + save_edges(prev_saves, graph)
        engine.add(graph, edges)
        return graph, saves

    def _saves_after(self, s: int) -> bool:
        every = self.cfg.save_every
        if every is None:
            return False
        due = (s + 1) % every == 0 or self.save_pending
        self.save_pending = False
        return due

    async def _finish(self, engine: Engine, s: int, graph, tokens: int) -> None:
        await engine.wait(graph)
        loss, grad_norm, skipped = self.program.end_step(s)
        now = time.perf_counter()
        seconds, self.t_last = now - self.t_last, now
        m = StepMetrics(step=s, loss=loss, tokens=tokens, seconds=seconds,
                        tokens_per_s=tokens / seconds if seconds > 0 else 0.0, lr=self.run.schedule(s),
                        grad_norm=grad_norm, skipped=skipped)
        self.metrics.append(m)
        self._count_skipped(m)
        if s in self.writers:
            if skipped:  # its saves may hold updates that were then undone: write it again
                self.writers.pop(s).abort()
                self.program.checkpoints.pop(s, None)
                self.save_pending = True
            else:
                self._complete_checkpoint(s, m)
        self.reporter.step(m)
        if self.on_step:
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
                 else "no checkpoint was written (use --save-every)")
        raise NonFiniteError(
            f"steps {first + 1}-{s + 1}: {self.consecutive} steps in a row had a loss or gradients that were not "
            f"finite and were skipped (more than --max-skipped {self.cfg.max_skipped}); the weights are those after "
            f"step {first}, nothing more was saved; {where}, with a lower --lr or --grad-clip"
        )

    # ---- checkpoints -----------------------------------------------------------------------
    def _open_checkpoint(self, s: int) -> None:
        writer = checkpoints.CheckpointWriter(self.cfg.out, s + 1, self.state.cfg, self.state.layouts)  # type: ignore[arg-type]
        self.writers[s] = writer
        self.program.checkpoints[s] = writer

    def _complete_checkpoint(self, s: int, m: StepMetrics) -> None:
        writer = self.writers.pop(s)
        self.program.checkpoints.pop(s, None)
        ts = trainer_state(self.cfg, steps_done=s + 1, skipped=self.skipped, consecutive=self.consecutive,
                           data=self.run.data_fp, last_loss=m.loss)
        self.last_saved = writer.finish(ts, extra_files=tokenizer_files(self.run.model_dir))
        self.last_saved_step = s + 1
        if self.cfg.save_total_limit:
            checkpoints.prune(self.cfg.out, self.cfg.save_total_limit)  # type: ignore[arg-type]

    async def _save_on_signal(self, engine: Engine) -> None:
        """After a graceful stop: every step in flight has finished; save the last one unless it
        was just saved."""
        if not self.metrics or self.last_saved_step == self.metrics[-1].step + 1:
            return
        s = self.metrics[-1].step
        graph = nx.DiGraph()
        graph.add_nodes_from(SaveUnit(step=s, unit=unit, layer=layer) for unit, layer in units(self.spec))
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
        done = self.metrics[-1].step + 1 if self.metrics else self.run.first_step
        if saved and self.last_saved is not None:
            what = f"checkpoint of step {self.last_saved_step} saved to {self.last_saved}"
        elif self.last_saved is not None:
            what = f"nothing saved since {self.last_saved} (step {self.last_saved_step})"
        else:
            what = "no checkpoint was written (use --save-every to keep one)"
        tail = f"; task {stuck[0]} was still running and was abandoned" if stuck else ""
        return Interrupted(signum, f"stopped by {signal_name(signum)} after step {done}: {what}{tail}")


