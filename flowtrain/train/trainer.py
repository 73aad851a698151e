"""The training loop: compile steps, feed them to the engine, report, save.

Steps overlap: step ``s + 1`` is handed to the engine before step ``s`` has finished, with
edges from each unit's ``cpu_adam`` in step ``s`` to that unit's fetches in step ``s + 1``. So
the next forward starts as soon as the embedding's and the first layers' Adam are done,
while Adam for the units above still runs on the CPU. At most two steps are in flight::

    cfg = TrainConfig(model="tiny", steps=100)
    result = train(cfg)                # returns the per-step metrics
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Callable, Sequence

import msgspec
import torch

from ..errors import CheckpointError, ConfigError, PlanError
from ..graph.compiler import StepSpec, compile_step, cross_step_edges
from ..policy import WithBudgets, resolve_policy
from ..runtime.executor import Engine, use_uvloop
from ..runtime.trace import Instrument, TraceRecorder, lane_busy, write_chrome_trace
from .data import Sequences, default_corpus_path, load_sequences, step_batches, tokenizer_files
from .host_state import HostState, return_freed_memory
from .model import ModelConfig, PRESETS, preset, read_config
from .optimizer import AdamWConfig, LRSchedule
from .plan import cap_gpu_memory, plan_run, run_request
from .program import StepProgram


class TrainConfig(msgspec.Struct, kw_only=True):
    """Everything ``flowtrain train`` takes; see ``flowtrain train --help`` for each field."""

    model: str = "tiny"
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


class StepMetrics(msgspec.Struct):
    step: int
    loss: float
    tokens: int
    seconds: float
    tokens_per_s: float
    lr: float
    grad_norm: float


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
    if cfg.out:
        check_out(Path(cfg.out), cfg.overwrite)


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse to replace a non-empty ``--out`` unless ``overwrite``."""
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ConfigError(f"--out {out} exists and is not empty; choose another directory or add --overwrite")


class _Reporter:
    """Progress on a terminal (tqdm), plain lines otherwise, and the --metrics JSON lines."""

    def __init__(self, cfg: TrainConfig, total: int) -> None:
        interactive = cfg.progress if cfg.progress is not None else sys.stderr.isatty()
        self.bar = None
        if interactive:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="step", dynamic_ncols=True)
        self.metrics = open(cfg.metrics, "w") if cfg.metrics else None
        self.every = max(1, total // 20)
        self.total = total

    def step(self, m: StepMetrics) -> None:
        if self.metrics:
            self.metrics.write(json.dumps(msgspec.to_builtins(m)) + "\n")
            self.metrics.flush()
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{m.loss:.4f}", tok_s=f"{m.tokens_per_s:,.0f}")
            self.bar.update(1)
        elif m.step % self.every == 0 or m.step == self.total - 1:
            print(
                f"step {m.step + 1}/{self.total}  loss {m.loss:.4f}  grad_norm {m.grad_norm:.3f}  "
                f"{m.tokens_per_s:,.0f} tok/s  lr {m.lr:.3g}",
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.metrics:
            self.metrics.close()


def train(cfg: TrainConfig, on_step: Callable[[StepMetrics], None] | None = None,
          instruments: Sequence[Instrument] = (), on_plan: Callable | None = None) -> list[StepMetrics]:
    """Run a whole training job as configured; returns the metrics of every step.
    ``instruments`` see every task the engine runs (e.g. a :class:`TraceRecorder`);
    ``on_plan`` receives the memory plan the run follows."""
    mcfg, model_dir = load_model_config(cfg.model)
    mcfg.validate()
    validate(cfg, mcfg)
    return_freed_memory()
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.precision, device)
    adamw = AdamWConfig(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                        grad_clip=cfg.grad_clip).validate()
    schedule = LRSchedule(lr=cfg.lr, warmup_steps=cfg.warmup_steps, schedule=cfg.lr_schedule,
                          total_steps=cfg.steps, min_lr=cfg.min_lr).validate()
    policy = resolve_policy(cfg.policy)
    data_path = cfg.data or str(default_corpus_path())
    seqs = load_sequences(data_path, cfg.seq_len, mcfg.vocab_size, tokenizer_dir=model_dir,
                          pad_id=mcfg.pad_token_id or 0, eos_id=mcfg.eos_token_id)
    plan = plan_run(mcfg, run_request(cfg, model_dir), device=device, dtype=dtype, policy=policy)
    if not plan.fits:
        raise PlanError(plan.refusal())
    if on_plan:
        on_plan(plan)
    spec = plan.spec
    budgets = plan.budgets
    policy = WithBudgets(policy, budgets)  # the engine enforces the budgets the plan sized buffers for
    if device.type == "cuda":
        if cfg.gpu_mem is not None:
            cap_gpu_memory(device, cfg.gpu_mem)
        # CPU Adam's threads leave cores to the lane launchers, waiters and the event loop.
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 3))

    torch.manual_seed(cfg.seed)
    state = HostState.create(mcfg, pin=device.type == "cuda", layout=plan.layout, resident=spec.resident,
                             device=device, dtype=dtype, chunks=spec.grad_chunks)
    if model_dir is None:
        state.init_random(cfg.seed)
    else:
        state.load_checkpoint(model_dir)
    program = StepProgram(state, device=device, dtype=dtype, seq_len=cfg.seq_len,
                          checkpoint_every=cfg.checkpoint_every, budgets=budgets, adamw=adamw,
                          chunk_tokens=plan.chunk_tokens, compile_backend=resolve_compile(cfg.compile, device))
    gc.freeze()  # the model and torch's objects are long-lived: keep full collections off them
    recorder = TraceRecorder() if cfg.trace else None
    reporter = _Reporter(cfg, cfg.steps)
    try:
        use_uvloop()
        hooks = [*instruments, *([recorder] if recorder else [])]
        metrics = asyncio.run(_run(cfg, spec, policy, program, seqs, schedule, device, hooks, reporter, on_step))
    finally:
        reporter.close()
    if recorder is not None:
        write_chrome_trace(cfg.trace, recorder.records, meta={
            "policy": cfg.policy, "budgets": budgets, "model": cfg.model, "device": str(device),
            "precision": "fp32" if dtype == torch.float32 else "bf16", "steps": cfg.steps,
            "busy_seconds": lane_busy(recorder.records), "layout": plan.layout,
            "resident": list(spec.resident),
        })
    if cfg.out:
        save_output(state, cfg.out, model_dir, cfg.overwrite)
    return metrics


async def _run(cfg, spec, policy, program, seqs: Sequences, schedule, device, hooks, reporter, on_step):
    batches = step_batches(seqs, cfg.batch_size, shuffle=cfg.shuffle, seed=cfg.seed)
    engine = Engine(program, policy, device=str(device), cpu_workers=cfg.adam_workers,
                    instruments=hooks)
    metrics: list[StepMetrics] = []
    in_flight: deque = deque()
    async with engine:
        try:
            prev = None
            t_last = time.perf_counter()
            for s in range(cfg.steps):
                batch = next(batches)
                mbs = batch.micro_batches(cfg.micro_batch_size)
                program.begin_step(s, [mb.input_ids for mb in mbs], [mb.targets for mb in mbs], schedule(s))
                graph = compile_step(spec, step=s)
                engine.add(graph, cross_step_edges(prev, graph, spec) if prev is not None else ())
                prev = list(graph)
                in_flight.append((s, graph, batch.num_targets(), int(batch.input_ids.numel())))
                if len(in_flight) == 2:
                    t_last = await _finish(engine, program, in_flight.popleft(), schedule, t_last, metrics, reporter, on_step)
            while in_flight:
                t_last = await _finish(engine, program, in_flight.popleft(), schedule, t_last, metrics, reporter, on_step)
        except BaseException:
            await engine.drain()
            raise
    return metrics


async def _finish(engine, program, item, schedule, t_last, metrics, reporter, on_step) -> float:
    s, graph, _, tokens = item
    await engine.wait(graph)
    loss, grad_norm = program.end_step(s)
    now = time.perf_counter()
    seconds = now - t_last
    m = StepMetrics(step=s, loss=loss, tokens=tokens, seconds=seconds,
                    tokens_per_s=tokens / seconds if seconds > 0 else 0.0, lr=schedule(s), grad_norm=grad_norm)
    metrics.append(m)
    reporter.step(m)
    if on_step:
        on_step(m)
    return now


def save_output(state: HostState, out: str, model_dir: Path | None, overwrite: bool) -> None:
    """Write the model in Hugging Face format (+ tokenizer files) atomically: into a temporary
    directory beside ``out``, renamed into place only once complete."""
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_path.name}.", dir=out_path.parent))
    try:
        state.save(tmp)
        for f in tokenizer_files(model_dir):
            shutil.copy2(f, tmp / f.name)
        if out_path.exists():
            check_out(out_path, overwrite)  # again: it may have appeared while we trained
            shutil.rmtree(out_path)
        os.replace(tmp, out_path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
