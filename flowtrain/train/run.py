"""One training run, start to end: prepare it, build its state, run the loop, save the model.

Steps overlap: step ``s + 1`` is handed to the engine before step ``s`` has finished, with
edges from each unit's ``cpu_adam`` in step ``s`` to that unit's fetches in step ``s + 1``. So
the next forward starts as soon as the embedding's and the first layers' Adam are done,
while Adam for the units above still runs on the CPU. At most two steps are in flight::

    cfg = TrainConfig(model="tiny", steps=100, out="trained", save_every=25)
    result = train(cfg)                # returns the per-step metrics

A run has three phases: :func:`~flowtrain.train.prepare.prepare` (everything that can fail on
bad input, before any large allocation), the :class:`~flowtrain.train.loop.TrainingLoop` (the
engine), and the final save. With
``save_every``, a step that ends a checkpoint interval gets one ``save`` task per unit
(:mod:`flowtrain.graph.saving`), which writes the unit while the next step computes; the
checkpoint is completed and renamed into place once the step is done
(:mod:`flowtrain.ckpt.checkpoints`). ``resume`` restores a checkpoint's weights, Adam state,
data position and counters, so the run continues exactly as if it had never stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import msgspec
import torch

from ..ckpt import checkpoints
from ..ckpt.adapter_files import read_adapter
from ..ckpt.out_lock import OutLock
from ..ckpt.output import remove_stale_temp, resolve_out, save_final_model
from ..ckpt.resume import restore_rng, settings_of
from ..graph.tasks import ACTS, GRADS, HOST_GRADS, WEIGHTS
from ..model.attention import attention_backends
from ..model.config import ModelConfig
from ..model.counts import model_flops_per_token
from ..plan.adapters import adapter_active_numel
from ..plan.request import run_request
from ..plan.memory import Plan, cap_gpu_memory
from ..runtime.engine import use_uvloop
from ..runtime.trace import Instrument, TraceRecorder, lane_busy, write_chrome_trace
from .distributed import World, join, leave, node_barrier, world_from_env
from .disk_state import StateStore
from .host_state import HostState, return_freed_memory
from .loop import TrainingLoop
from .metrics_file import MetricsFile
from .out_of_memory import gpu_out_of_memory
from .pinning import unpin_all
from .prepare import Run, adamw_config, prefer_expandable_segments, prepare
from .program import StepProgram
from .reporters import close_trackers, open_trackers
from .reporting import Reporter, StepMetrics
from .config.run_config import TrainConfig, compile_backend, lora_spec
from .shared_state import remove_stale, shared_dir
from .shutdown import Shutdown
from .summary import summary_lines

__all__ = ["TrainConfig", "StepMetrics", "train", "prepare"]


def for_rank(cfg: TrainConfig, world: World) -> TrainConfig:
    """What this process writes: rank 0 everything asked for; the others nothing but their own
    trace (``NAME.rankR.json`` beside rank 0's ``NAME.json``), so that files are written once."""
    if world.leader:
        return cfg
    trace = None
    if cfg.trace:
        p = Path(cfg.trace)
        trace = str(p.with_name(f"{p.stem}.rank{world.rank}{p.suffix or '.json'}"))
    return msgspec.structs.replace(cfg, out=None, metrics=None, progress=False, save_every=None,
                                   save_total_limit=None, trace=trace, report_to=None)


def build_state(run: Run) -> tuple[HostState, StepProgram]:
    """Allocate the host state and the device buffers the plan sized, and fill the weights.
    Where the plan puts state on disk, the state folder's files are made first
    (``state.store``: the caller closes it, which removes them; here if this fails)."""
    cfg, plan = run.cfg, run.plan
    spec = plan.spec
    torch.manual_seed(cfg.seed)
    state = HostState.create(run.mcfg, pin=run.device.type == "cuda", layout=plan.layout, resident=spec.resident,
                             device=run.device, dtype=run.dtype, chunks=spec.grad_chunks,
                             world=run.world if spec.share > 1 else None, lora=lora_spec(cfg),
                             skip_idle=spec.skip_idle_experts, host_adapters=spec.host_adapters, disk=plan.disk)
    if plan.disk:
        assert cfg.state_dir is not None, "a plan puts state on disk only where --state-dir is given"
        state.attach_store(StateStore(Path(cfg.state_dir), state.disk_files()))
    try:
        return _fill_state(run, state)
    except BaseException:
        if state.store is not None:
            state.store.close()
        raise


def _fill_state(run: Run, state: HostState) -> tuple[HostState, StepProgram]:
    cfg, plan = run.cfg, run.plan
    spec = plan.spec
    if run.resume_from is not None:
        if state.lora is not None:  # the base first: the checkpoint holds the adapters
            if run.base_dir is None:
                state.init_random(cfg.seed)
            else:
                state.load_checkpoint(run.base_dir)
        checkpoints.load_training_state(run.resume_from, state)
        restore_rng(run.resume_state)
    elif run.model_dir is None:
        state.init_random(cfg.seed)
    else:
        state.load_checkpoint(run.model_dir)
        state.init_adapters(cfg.seed)
    if cfg.adapter is not None:  # the adapters it starts from
        state.load_adapters(read_adapter(cfg.adapter, run.mcfg)[2])
    if spec.share > 1:
        node_barrier()  # the node's processes filled the shared state alike; none trains before all are done
    program = StepProgram(state, device=run.device, dtype=run.dtype, seq_len=cfg.seq_len,
                          checkpoint_every=cfg.checkpoint_every, budgets=plan.budgets, adamw=adamw_config(cfg),
                          chunk_tokens=plan.chunk_tokens, compile_backend=_layer_compile(cfg, run),
                          undo_bytes=int(cfg.undo_mem * 2**30) // spec.share, world=run.world,
                          owned=spec.owned_by(run.world.local_rank), seed=cfg.seed)
    program.reserve_offloaded(spec.offload, spec.micro_batches, cfg.micro_batch_size)
    return state, program


def train(cfg: TrainConfig, on_step: Callable[[StepMetrics], None] | None = None,
          instruments: Sequence[Instrument] = (), on_plan: Callable | None = None) -> list[StepMetrics]:
    """Run a whole training job as configured; returns the metrics of the steps it ran.
    ``instruments`` see every task the engine runs (e.g. a :class:`TraceRecorder`);
    ``on_plan`` receives the memory plan the run follows.

    Raises :class:`Interrupted` on SIGINT/SIGTERM (in the main thread), :class:`NonFiniteError`
    when too many steps in a row were skipped, :class:`GpuOutOfMemory` when a task ran out of GPU
    memory, :class:`StepFailed` when a task failed otherwise; in each case no final model is
    written and every checkpoint already written stays whole."""
    world = world_from_env()
    prefer_expandable_segments(cfg)
    # Data parallel, every process finishes its steps in flight on a signal (the others need
    # its all-reduces to finish theirs); only rank 0, with --save-every, then saves.
    saves = world.leader and cfg.save_every is not None
    cfg = for_rank(cfg, world)
    cfg = msgspec.structs.replace(cfg, out=resolve_out(cfg.out))  # as prepare does: one real folder
    shutdown = Shutdown(graceful=saves or world.parallel, saves=saves)
    with shutdown, contextlib.ExitStack() as held:
        if world.parallel:  # a process of the node killed while its shared files had names left them to us
            held.callback(remove_stale, shared_dir())
        opened = open_run(cfg, world, held, on_plan)
        run, state, program, reporter, recorder = opened
        shutdown.say = reporter.say
        for line in summary_lines(run):
            reporter.say(line)
        loop = TrainingLoop(run, state, program, reporter, shutdown, on_step,
                            [*instruments, *([recorder] if recorder else [])])
        try:
            use_uvloop()
            with attention_backends(cfg.attention_backend, run.device.type):
                metrics = asyncio.run(loop.main())
            if run.plan.spec.share > 1:
                node_barrier()  # every process is done with the shared state before rank 0 saves it
        finally:
            shutdown.restore_sync_handlers()
            close_run(opened, loop)
        if cfg.out:
            shutdown.phase = (f"while writing the final model; --out {cfg.out} holds what it held before"
                              + (f" and {loop.last_saved.name}" if loop.last_saved is not None else ""))
            save_model(run, state, cfg.out)
        return metrics


class OpenRun(NamedTuple):
    """A run ready for its loop: what :func:`open_run` prepared and built."""

    run: Run
    state: HostState
    program: StepProgram
    reporter: Reporter
    recorder: TraceRecorder | None


def open_run(cfg: TrainConfig, world: World, held: contextlib.ExitStack, on_plan: Callable | None = None, *,
             rows_given: bool = False, resume_check: Callable[[dict, Path], None] | None = None) -> OpenRun:
    """Prepare a run (:func:`prepare`; ``rows_given`` and ``resume_check`` as there), take its
    output folder and metrics file (held by ``held`` until it ends), join the data-parallel
    group, and build its state and reporter: everything before the loop, shared by
    :func:`train` and :class:`~flowtrain.train.policy_session.PolicyTrainer`.
    :func:`close_run` undoes it."""
    run = prepare(cfg, world, rows_given=rows_given, resume_check=resume_check)
    if cfg.out:  # held until the final model is in place; taken before the clean-up below
        held.enter_context(OutLock(cfg.out))
    if cfg.state_dir and run.plan.disk:  # one run per state folder, as per --out
        held.enter_context(OutLock(cfg.state_dir))
    metrics_file = None
    if cfg.metrics:  # held, like --out, until the run ends; a resume's later steps dropped
        metrics_file = held.enter_context(
            MetricsFile(cfg.metrics, resumed_at=run.first_step if run.resume_from is not None else None))
    join(world, run.device.type, cfg.dist_timeout)
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
    try:
        state, program = build_state(run)
    except torch.OutOfMemoryError as e:  # the card holds less than the plan was made for
        raise gpu_out_of_memory("setting up the run's GPU buffers", e, run.plan) from e
    if state.store is not None:  # the state folder's files go when the run ends, however it ends
        held.callback(state.store.close)
    gc.freeze()  # the model and torch's objects are long-lived: keep full collections off them
    recorder = TraceRecorder() if cfg.trace else None
    trackers = open_trackers(cfg.report_to, cfg.logging_dir, settings_of(run.cfg))
    held.callback(close_trackers, trackers)
    reporter = Reporter(total=cfg.steps, first=run.first_step,
                        metrics=metrics_file.file if metrics_file is not None else None, progress=cfg.progress,
                        quiet=not world.leader, trackers=trackers)
    return OpenRun(run, state, program, reporter, recorder)


def close_run(opened: OpenRun, loop: TrainingLoop) -> None:
    """After the loop, however it ended: checkpoints not completed removed, the reporter
    closed, pinned pages given back, the data-parallel group left, the trace written."""
    loop.abort_checkpoints()
    opened.reporter.close()
    if opened.run.device.type == "cuda":  # the run's copies are over: give the pinned pages back
        unpin_all()
    leave(opened.run.world)
    if opened.recorder is not None:
        _write_trace(opened.run, opened.recorder)


def save_model(run: Run, state: HostState, out: str | Path) -> None:
    """The model as it is now, in Hugging Face's format (or LoRA's adapters), into ``out``."""
    cfg = run.cfg
    save_final_model(state, out, run.tokenizer_dir, source_dir=run.source_dir, save_dtype=cfg.save_dtype,
                     merge=cfg.merge, base_model=cfg.model)


def _layer_compile(cfg: TrainConfig, run: Run) -> str | None:
    """The torch.compile backend of the decoder layer: ``--compile``'s, but on the generic layer
    path ``auto`` stays eager (transformers' modules are compiled only where asked for by name)."""
    if run.mcfg.generic and cfg.compile == "auto":
        return None
    return compile_backend(cfg.compile, run.device.type)


def _write_trace(run: Run, recorder: TraceRecorder) -> None:
    assert run.cfg.trace is not None  # a recorder runs only where --trace names a file
    write_chrome_trace(run.cfg.trace, recorder.records, meta=trace_meta(run.cfg, run.plan, run.device, run.dtype,
                                                                       recorder.records, run.mcfg))


def run_mode(cfg: TrainConfig, plan: Plan) -> str:
    """What a run trains, in a few words (the visualizer heads a trace's panel with it)."""
    if cfg.lora:
        where = "streamed from host memory, CPU AdamW" if plan.spec.host_adapters else "resident with their AdamW"
        return f"LoRA rank {cfg.lora_rank} over a frozen base, the adapters {where}"
    return "every parameter" + ("; experts no token reached are not updated" if cfg.skip_idle_experts else "")


def trace_meta(cfg: TrainConfig, plan: Plan, device: torch.device, dtype: torch.dtype, records: Sequence,
               mcfg: ModelConfig) -> dict:
    """What a trace file records about its run (``flowtrain train --trace`` and ``flowtrain bench
    --trace`` alike): the settings, the plan's slot budgets, the bytes of a slot of each pool
    and where each pool lives, the memory limits, the plan's peaks (``planned``) and, on a GPU,
    the peaks measured so far (``measured``), which the visualizer draws memory against; and the
    model FLOPs of a token (:func:`~flowtrain.model.counts.model_flops_per_token`, as MFU counts
    them) and the tokens of a step of this process, from which it reports model FLOP/s."""
    adapters = adapter_active_numel(mcfg, run_request(cfg)) if cfg.lora else None
    meta = {
        "policy": cfg.policy, "budgets": plan.budgets, "model": cfg.model or "", "device": str(device),
        "mode": run_mode(cfg, plan),
        "precision": "fp32" if dtype == torch.float32 else "bf16", "steps": cfg.steps,
        "busy_seconds": lane_busy(records), "layout": plan.layout,
        "resident": list(plan.spec.resident), "kept_layers": list(plan.spec.keep),
        # what the visualizer draws memory against: bytes per slot, where each pool lives, limits
        "slot_bytes": {pool: size // max(plan.budgets.get(pool, 1), 1) for pool, size in (
            (WEIGHTS, plan.gpu.get("weight_slots", 0)), (GRADS, plan.gpu.get("grad_slots", 0)),
            (HOST_GRADS, plan.host.get("staging", 0)))} | _acts_slot_bytes(plan),
        "pool_memory": {pool: "pinned" if pool == HOST_GRADS else "gpu" for pool in plan.budgets},
        "capacities": {"gpu": plan.gpu_limit, "host": plan.host_limit},
        "planned": {"gpu": plan.gpu_total, "host": plan.host_total},
        "model_flops_per_token": model_flops_per_token(mcfg, cfg.seq_len, adapters),
        "tokens_per_step": plan.spec.micro_batches * cfg.micro_batch_size * cfg.seq_len,
    }
    if device.type == "cuda":
        meta["measured"] = {"gpu_peak": torch.cuda.max_memory_allocated(device),
                            "gpu_reserved_peak": torch.cuda.max_memory_reserved(device)}
    return meta


def _acts_slot_bytes(plan: Plan) -> dict[str, int]:
    """The bytes of an ``acts`` slot where the plan offloads checkpoints: one micro-batch's
    checkpoint of one layer (the plan's offloaded bytes over its layers and micro-batches)."""
    offloaded, layers = plan.host.get("offloaded_activations", 0), len(plan.spec.offload)
    if ACTS not in plan.budgets or not offloaded or not layers:
        return {}
    return {ACTS: offloaded // (layers * plan.spec.micro_batches)}
