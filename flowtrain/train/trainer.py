"""The training loop: compile steps, feed them to the engine, report, checkpoint, save.

Steps overlap: step ``s + 1`` is handed to the engine before step ``s`` has finished, with
edges from each unit's ``cpu_adam`` in step ``s`` to that unit's fetches in step ``s + 1``. So
the next forward starts as soon as the embedding's and the first layers' Adam are done,
while Adam for the units above still runs on the CPU. At most two steps are in flight::

    cfg = TrainConfig(model="tiny", steps=100, out="trained", save_every=25)
    result = train(cfg)                # returns the per-step metrics

A run has three phases: :func:`prepare` (everything that can fail on bad input, before any
large allocation), the :class:`~flowtrain.train.loop.TrainingLoop` (the engine), and the final
save. With
``save_every``, a step that ends a checkpoint interval gets one ``save`` task per unit
(:mod:`flowtrain.graph.saving`), which writes the unit while the next step computes; the
checkpoint is completed and renamed into place once the step is done
(:mod:`flowtrain.ckpt.checkpoints`). ``resume`` restores a checkpoint's weights, Adam state,
data position and counters, so the run continues exactly as if it had never stopped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import contextlib
import gc
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import msgspec
import torch

from ..ckpt import checkpoints
from ..ckpt.adapter_files import read_adapter, read_spec
from ..ckpt.out_lock import OutLock, check_free
from ..ckpt.output import remove_stale_temp, resolve_out, resolve_save_dtype, save_final_model
from ..ckpt.resume import ContinuedSchedule, check_compatible, restore_rng, resumed_schedule, steps_done
from ..data.source import FromData, Sequences, default_corpus_path, load_sequences
from ..errors import CheckpointError, ConfigError, PlanError
from ..graph.tasks import GRADS, HOST_GRADS, WEIGHTS
from ..model import ModelConfig, read_config
from ..model.attention import attention_backends
from ..model.config import MLP_CHUNK_TOKENS
from ..model.model_dir import check_weight_headers
from ..model.presets import PRESETS
from ..plan.host_layout import check_units_fit
from ..plan.memory import Plan, cap_gpu_memory, run_request
from ..policy import resolve_policy
from ..runtime.executor import use_uvloop
from ..runtime.trace import Instrument, TraceRecorder, lane_busy, write_chrome_trace
from ..sim.choose_plan import plan_and_choose
from .config import defaults
from .config.checks import check_compile_backend, check_fields, check_output_paths, check_with_model
from .config.settings import check_values
from .distributed import World, join, leave, local_share, node_barrier, world_from_env
from .host_state import HostState, return_freed_memory
from .loop import TrainingLoop
from .optimizer import AdamWConfig, LRSchedule
from .out_of_memory import gpu_out_of_memory
from .pinning import unpin_all
from .program import StepProgram
from .reporting import Reporter, StepMetrics
from .config.run_config import TrainConfig, compile_backend, load_model_config, lora_spec, precision_bytes  # noqa: F401 - re-exported
from .shared_state import remove_stale, shared_dir
from .shutdown import Shutdown
from .summary import summary_lines

__all__ = ["TrainConfig", "StepMetrics", "train", "prepare"]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("{device} cuda was asked for, but this machine has no CUDA GPU (use {device} cpu)", named=True)
    if name != "cpu" and not name.startswith("cuda"):
        raise ConfigError(f"{{device}} must be auto, cpu or cuda (got {name!r})", named=True)
    return torch.device(name)


def resolve_dtype(precision: str | None, device: torch.device) -> torch.dtype:
    return torch.float32 if precision_bytes(precision, device.type) == 4 else torch.bfloat16


@dataclass
class Run:
    """Everything :func:`prepare` decided and loaded, ready for the loop."""

    cfg: TrainConfig
    mcfg: ModelConfig
    model_dir: Path | None  # weights to start from, tokenizer files to copy
    device: torch.device
    dtype: torch.dtype
    plan: Plan
    schedule: ContinuedSchedule  # the learning rate of every step, a resumed run's extensions included
    seqs: Sequences
    data_fp: str
    resume_from: Path | None = None
    resume_state: dict = field(default_factory=dict)
    tokenizer_dir: Path | None = None  # whose tokenizer files go with every saved model
    source_dir: Path | None = None  # the pretrained folder whose config.json the final model keeps
    #: LoRA: the base's weights (a model folder; None for a preset's seeded ones), which no
    #: checkpoint of the run holds
    base_dir: Path | None = None
    eval_seqs: Sequences | None = None  # the held-out set of --eval-data
    world: World = field(default_factory=World)  # the data-parallel processes (torchrun)

    @property
    def first_step(self) -> int:
        return self.resume_state.get("step", 0)


def prepare(cfg: TrainConfig, world: World | None = None) -> Run:
    """Check every input and output, read the resumed checkpoint's state, load and tokenise the
    data and plan memory: everything that bad input can make fail, before any large allocation."""
    check_compile_backend(cfg.compile)
    cfg = msgspec.structs.replace(cfg, out=resolve_out(cfg.out))  # a symlink: write in the real folder
    if cfg.out:
        check_free(cfg.out)  # another run writing there: refuse before reading or checking it
    resume_from, resume_state = _find_resume(cfg)
    cfg = _resumed_lora(cfg, resume_state, resume_from)
    check_output_paths(cfg.out, cfg.overwrite, cfg.trace, cfg.metrics, resume=resume_from)
    _check_nothing_replaced(cfg, resume_from, resume_state)
    model = cfg.model or (str(resume_from) if resume_from else "tiny")
    mcfg, model_dir = load_model_config(model)
    base_dir = model_dir
    cfg = resolve_defaults(cfg, pretrained=model_dir is not None, saved=resume_state.get("settings"))
    check_fields(cfg)
    mcfg.validate()
    check_units_fit(mcfg, cfg.host_mem, None if cfg.gpu_mem is None else int(cfg.gpu_mem * 2**30))  # before sizing anything
    if resume_from is not None:
        saved_cfg = read_config(resume_from, weights=not cfg.lora)  # a LoRA checkpoint: the adapters' weights
        if saved_cfg != mcfg:
            raise ConfigError(f"{{resume}} {resume_from}: it holds a different model than {{model}} {cfg.model} "
                              f"(config.json differs); leave out {{model}} to continue the checkpoint's model", named=True)
        model_dir = resume_from  # its tokenizer files travel with every checkpoint
        if cfg.lora and base_dir is not None:  # the base, which the checkpoint does not hold
            check_weight_headers(base_dir, mcfg, require=True)
    elif model_dir is not None:  # a folder without weights, or with a tensor missing: refused before allocating
        check_weight_headers(model_dir, mcfg, require=True)
    check_with_model(cfg, mcfg)
    cfg = _with_lora_spec(cfg, mcfg)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.precision, device)
    adamw_config(cfg).validate()
    assert cfg.lr is not None and cfg.warmup_steps is not None and cfg.lr_schedule is not None  # resolve_defaults'
    schedule = ContinuedSchedule(LRSchedule(lr=cfg.lr, warmup_steps=cfg.warmup_steps, schedule=cfg.lr_schedule,
                                            total_steps=cfg.steps, min_lr=cfg.min_lr).validate())
    resolve_policy(cfg.policy)
    resolve_save_dtype(cfg.save_dtype, model_dir)  # a bad name fails now, not after training
    tokenizer_dir = _tokenizer_dir(cfg, model_dir)
    seqs = _read_data(cfg, mcfg, tokenizer_dir, _data_seq_len(cfg, mcfg, resume_state, tokenizer_dir))
    cfg = _with_data_seq_len(cfg, seqs)
    data_fp = seqs.fingerprint()  # from the data cache's index: no pass over the rows
    eval_seqs = _load_eval(cfg, mcfg, tokenizer_dir)
    if resume_from is not None:
        check_compatible(resume_state, cfg, data=data_fp, where=str(resume_from), total_steps=cfg.steps)
        schedule = resumed_schedule(schedule.base, resume_state, where=str(resume_from))
    world = world or world_from_env()
    device, local = _data_parallel(cfg, world, device)
    plan = plan_and_choose(mcfg, run_request(local, model_dir, world.size, share=world.local_size), device=device,
                           dtype=dtype, policy=resolve_policy(cfg.policy))
    if not plan.fits:
        raise PlanError(plan.refusal())
    return Run(cfg, mcfg, model_dir, device, dtype, plan, schedule, seqs, data_fp, resume_from, resume_state,
               tokenizer_dir=tokenizer_dir, source_dir=_source_dir(model_dir, resume_state), eval_seqs=eval_seqs,
               world=world, base_dir=base_dir)


def _resumed_lora(cfg: TrainConfig, resume_state: dict, resume_from: Path | None) -> TrainConfig:
    """Resuming a LoRA run: its adapters' settings and its base model from the checkpoint's
    settings where not given (the base's weights are not in the checkpoint: the base is the
    model the run started from, ``--model`` to name it where it moved)."""
    saved = resume_state.get("settings", {})
    if resume_from is None or saved.get("lora_rank") is None:
        return cfg
    fill = {k: saved[k] for k in ("lora_rank", "lora_alpha", "lora_targets", "lora_dropout", "lora_gate_up_rank",
                                  "lora_rslora")
            if k in saved and getattr(cfg, k) is None}
    if "lora_targets" in fill:
        fill["lora_targets"] = tuple(fill["lora_targets"])
    if cfg.model is None:  # (a run given no model trained the default preset)
        fill["model"] = saved.get("model") or "tiny"
        if not (fill["model"] in PRESETS or Path(fill["model"]).is_dir()):
            raise ConfigError(f"{{resume}} {resume_from} holds LoRA adapters, not their base model, which was "
                              f"{fill['model']!r} and is not there: name the base with {{model}}", named=True)
    return msgspec.structs.replace(cfg, **fill)


def _with_lora_spec(cfg: TrainConfig, mcfg: ModelConfig) -> TrainConfig:
    """A LoRA run with every adapter setting filled in: from ``--adapter`` that adapter's rank,
    alpha, targets and dropout (a folder that is not a PEFT LoRA adapter flowtrain runs is
    refused here, naming the setting), else the flags' with their defaults."""
    if not cfg.lora:
        return cfg
    spec = read_spec(cfg.adapter, mcfg) if cfg.adapter is not None else lora_spec(cfg)
    assert spec is not None
    return msgspec.structs.replace(cfg, lora_rank=spec.rank, lora_alpha=spec.alpha, lora_targets=spec.targets,
                                   lora_dropout=spec.dropout, lora_gate_up_rank=spec.gate_up_rank,
                                   lora_rslora=spec.rslora)


def _data_parallel(cfg: TrainConfig, world: World, device: torch.device) -> tuple[torch.device, TrainConfig]:
    """This process's device (its own GPU under torchrun) and the run one process plans for
    (:func:`~flowtrain.train.distributed.local_share`)."""
    local = local_share(cfg, world.size)
    if world.parallel and device.type == "cuda":
        device = torch.device("cuda", world.local_rank)
        torch.cuda.set_device(device)
    return device, local


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
                                   save_total_limit=None, trace=trace)


def _load_eval(cfg: TrainConfig, mcfg: ModelConfig, tokenizer_dir: Path | None) -> Sequences | None:
    """The held-out set, read and tokenised exactly like ``--data``. Every evaluation runs the
    model forward over all of it: its cost is that of a forward pass over that many sequences."""
    if cfg.eval_data is None:
        return None
    seqs = _read(cfg.eval_data, cfg, mcfg, tokenizer_dir, cfg.seq_len)
    if len(seqs) == 0 or seqs.num_targets() == 0:
        raise ConfigError(f"{{eval_data}} {cfg.eval_data}: no target tokens to evaluate; give a file with text in it", named=True)
    return seqs


def _read(path: str, cfg: TrainConfig, mcfg: ModelConfig, tokenizer_dir: Path | None, seq_len: int | FromData,
          long_examples: str | None = None) -> Sequences:
    """A data file read as the run reads its data: the model's ids, the run's tokenizer and
    packing, and ``long_examples`` (default: the run's)."""
    return load_sequences(path, seq_len, mcfg.vocab_size, tokenizer_dir=tokenizer_dir, pad_id=mcfg.pad_token_id or 0,
                          eos_id=mcfg.eos_token_id, byte_tokenizer=cfg.byte_tokenizer, packing=cfg.packing,
                          long_examples=long_examples or cfg.long_examples)


def _read_data(cfg: TrainConfig, mcfg: ModelConfig, tokenizer_dir: Path | None, seq_len: int | FromData) -> Sequences:
    """``--data`` (the bundled corpus without it) read as the run reads it."""
    return _read(cfg.data or str(default_corpus_path()), cfg, mcfg, tokenizer_dir, seq_len)


def seq_len_of_data(cfg: TrainConfig, mcfg: ModelConfig, model_dir: Path | None) -> int:
    """The ``seq_len`` a run of ``cfg`` trains at: ``--seq-len`` as given, else the one its data
    chooses (:func:`_data_seq_len`); what ``flowtrain plan --data`` plans for. Reads the data as
    the run would, so data the run would refuse is refused here (through the cache, so the run
    that follows does not tokenise it again)."""
    tokenizer_dir = _tokenizer_dir(cfg, model_dir)
    return int(_read_data(cfg, mcfg, tokenizer_dir, _data_seq_len(cfg, mcfg, {}, tokenizer_dir)).seq_len)


def _data_seq_len(cfg: TrainConfig, mcfg: ModelConfig, resume_state: dict,
                  tokenizer_dir: Path | None) -> int | FromData:
    """The seq_len to read ``--data`` at: ``--seq-len`` as given; without one, a resumed run's
    own, else the data's choice (:class:`~flowtrain.data.source.FromData`, see
    :class:`~flowtrain.train.config.defaults.SeqLenDefault`): the longest example of ``--data`` and of
    ``--eval-data`` both, so that a held-out example longer than every training one is not
    refused as too long for a length nobody chose."""
    if defaults.seq_len_given(cfg.seq_len):
        return cfg.seq_len
    saved = resume_state.get("settings", {}).get("seq_len")
    if isinstance(saved, int) and not isinstance(saved, bool) and saved >= 2:
        return saved
    choice = FromData(stream=int(cfg.seq_len), multiple=defaults.SEQ_LEN_MULTIPLE, most=mcfg.max_position_embeddings)
    if cfg.eval_data is not None:
        held_out = _read(cfg.eval_data, cfg, mcfg, tokenizer_dir, choice, long_examples="truncate")
        if held_out.report.kind == "rows":
            choice = dataclasses.replace(choice, least=int(held_out.seq_len))
    return choice


def _with_data_seq_len(cfg: TrainConfig, seqs: Sequences) -> TrainConfig:
    """``cfg`` with the seq_len the data was read at, a plain ``int`` from here on (the plan, the
    step program and every checkpoint's settings see the number); and, now that the length is
    known, the allocator's choice that ``train`` made before reading the data made again."""
    if defaults.seq_len_given(cfg.seq_len):
        return cfg
    cfg = msgspec.structs.replace(cfg, seq_len=int(seqs.seq_len))
    prefer_expandable_segments(cfg)
    return cfg


def _tokenizer_dir(cfg: TrainConfig, model_dir: Path | None) -> Path | None:
    if cfg.tokenizer is None:
        return model_dir
    if cfg.byte_tokenizer:
        raise ConfigError("{tokenizer} and {byte_tokenizer} contradict each other: give one", named=True)
    path = Path(cfg.tokenizer)
    if not (path / "tokenizer.json").is_file():
        raise ConfigError(f"{{tokenizer}} {cfg.tokenizer}: no tokenizer.json there; give the folder that holds it", named=True)
    return path


def _source_dir(model_dir: Path | None, resume_state: dict) -> Path | None:
    """The pretrained folder the run started from: the model folder, or, resuming, the one the
    checkpoint's run started from (its config.json and generation_config.json are kept)."""
    first = resume_state.get("settings", {}).get("model")
    if resume_state and first and Path(first).is_dir() and (Path(first) / "config.json").is_file():
        return Path(first)
    return model_dir


def resolve_defaults(cfg: TrainConfig, *, pretrained: bool, saved: dict | None) -> TrainConfig:
    """``cfg`` with its unset optimizer fields filled: from the resumed checkpoint's settings,
    else by where the weights come from (:func:`~flowtrain.train.config.defaults.optimizer_defaults`)."""
    fallback = defaults.optimizer_defaults(pretrained, cfg.steps, cfg.lora)
    fill = {}
    for name, value in fallback.items():
        if getattr(cfg, name) is None:
            fill[name] = saved[name] if saved and saved.get(name) is not None else value
    return msgspec.structs.replace(cfg, **fill)


def adamw_config(cfg: TrainConfig) -> AdamWConfig:
    return AdamWConfig(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,  # type: ignore[arg-type]
                       grad_clip=cfg.grad_clip, weight_decay_skip=cfg.weight_decay_skip)  # type: ignore[arg-type]


def _find_resume(cfg: TrainConfig) -> tuple[Path | None, dict]:
    if cfg.resume is None:
        return None, {}
    path = checkpoints.latest_checkpoint(cfg.resume)
    state, path = checkpoints.read_checkpoint(path, verify=True)
    steps_done(state, str(path))
    _check_saved_settings(state["settings"], path)
    return path, state


def _check_nothing_replaced(cfg: TrainConfig, resume_from: Path | None, resume_state: dict) -> None:
    """Resuming from checkpoint-K into a folder that holds checkpoint-N of a run that went
    further, N a step this run saves at (after K, a multiple of --save-every, at most --steps):
    this run's checkpoint-N would replace that one. Refused, naming them, before anything runs."""
    if resume_from is None or cfg.save_every is None or not cfg.out:
        return
    done = resume_state["step"]
    later = [n for n in checkpoints.checkpoint_steps(cfg.out) if done < n <= cfg.steps and n % cfg.save_every == 0]
    if later:
        names = ", ".join(f"checkpoint-{n}" for n in later[:3]) + (", ..." if len(later) > 3 else "")
        raise ConfigError(
            f"{{resume}} {resume_from} is step {done}, and {{out}} {cfg.out} holds {names} of a run that went "
            f"further, which this run's checkpoints would replace; write this run to another {{out}}, or remove "
            "them first", named=True)


def _check_saved_settings(settings: dict, where: Path) -> None:
    """A checkpoint's settings are a ``TrainConfig`` whose values its checks accept (the
    resumed run takes its schedule, optimizer and data order from them)."""
    try:
        check_values(msgspec.convert(settings, TrainConfig))
    except (msgspec.ValidationError, ConfigError) as e:
        raise CheckpointError(f"{where}: trainer_state.json's settings are not a run's settings ({e})") from None


def build_state(run: Run) -> tuple[HostState, StepProgram]:
    """Allocate the host state and the device buffers the plan sized, and fill the weights."""
    cfg, plan = run.cfg, run.plan
    spec = plan.spec
    torch.manual_seed(cfg.seed)
    state = HostState.create(run.mcfg, pin=run.device.type == "cuda", layout=plan.layout, resident=spec.resident,
                             device=run.device, dtype=run.dtype, chunks=spec.grad_chunks,
                             world=run.world if spec.share > 1 else None, lora=lora_spec(cfg),
                             skip_idle=spec.routed, host_adapters=spec.host_adapters)
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
                          chunk_tokens=plan.chunk_tokens, compile_backend=compile_backend(cfg.compile, run.device.type),
                          undo_bytes=int(cfg.undo_mem * 2**30) // spec.share, world=run.world,
                          owned=spec.owned_by(run.world.local_rank), seed=cfg.seed)
    program.reserve_offloaded(spec.offload, spec.micro_batches, cfg.micro_batch_size)
    return state, program


def prefer_expandable_segments(cfg: TrainConfig, environ: dict[str, str] | None = None) -> bool:
    """Long context (more tokens per micro-batch than the MLP takes at once) or a card size
    (``--gpu-mem``): ask torch's CUDA allocator for expandable segments unless
    ``PYTORCH_CUDA_ALLOC_CONF`` says otherwise, before anything touches the GPU. A long step
    allocates and frees tensors of gigabytes in changing sizes; with fixed segments llama-8b at
    262,144 tokens ran out of memory in its second step with 15.5 GiB reserved but unused, and
    llama-8b under a 10 GiB cap reserved 1.75 GiB more than it allocated (docs/benchmarks.md):
    on a small card that is the difference between fitting and not. Returns whether it set it."""
    env = os.environ if environ is None else environ
    long_rows = cfg.seq_len * cfg.micro_batch_size > MLP_CHUNK_TOKENS
    if not (long_rows or cfg.gpu_mem is not None) or "PYTORCH_CUDA_ALLOC_CONF" in env:
        return False
    env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return True


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
        run = prepare(cfg, world)
        if cfg.out:  # held until the final model is in place; taken before the clean-up below
            held.enter_context(OutLock(cfg.out))
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
        gc.freeze()  # the model and torch's objects are long-lived: keep full collections off them
        recorder = TraceRecorder() if cfg.trace else None
        reporter = Reporter(total=cfg.steps, first=run.first_step, metrics=cfg.metrics, progress=cfg.progress,
                            quiet=not world.leader)
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
            loop.abort_checkpoints()
            reporter.close()
            if run.device.type == "cuda":  # the run's copies are over: give the pinned pages back
                unpin_all()
            leave(world)
            if recorder is not None:
                _write_trace(run, recorder)
        if cfg.out:
            shutdown.phase = (f"while writing the final model; --out {cfg.out} holds what it held before"
                              + (f" and {loop.last_saved.name}" if loop.last_saved is not None else ""))
            save_final_model(state, cfg.out, run.tokenizer_dir, source_dir=run.source_dir, save_dtype=cfg.save_dtype,
                             merge=cfg.merge, base_model=cfg.model)
        return metrics


def _write_trace(run: Run, recorder: TraceRecorder) -> None:
    assert run.cfg.trace is not None  # a recorder runs only where --trace names a file
    write_chrome_trace(run.cfg.trace, recorder.records, meta=trace_meta(run.cfg, run.plan, run.device, run.dtype,
                                                                       recorder.records))


def run_mode(cfg: TrainConfig, plan: Plan) -> str:
    """What a run trains, in a few words (the visualizer heads a trace's panel with it)."""
    if cfg.lora:
        where = "streamed from host memory, CPU AdamW" if plan.spec.host_adapters else "resident with their AdamW"
        return f"LoRA rank {cfg.lora_rank} over a frozen base, the adapters {where}"
    return "every parameter" + ("; experts no token reached are not updated" if cfg.skip_idle_experts else "")


def trace_meta(cfg: TrainConfig, plan: Plan, device: torch.device, dtype: torch.dtype, records: Sequence) -> dict:
    """What a trace file records about its run (``flowtrain train --trace`` and ``flowtrain bench
    --trace`` alike): the settings, the plan's slot budgets, the bytes of a slot of each pool
    and where each pool lives, the memory limits, the plan's peaks (``planned``) and, on a GPU,
    the peaks measured so far (``measured``), which the visualizer draws memory against."""
    meta = {
        "policy": cfg.policy, "budgets": plan.budgets, "model": cfg.model or "", "device": str(device),
        "mode": run_mode(cfg, plan),
        "precision": "fp32" if dtype == torch.float32 else "bf16", "steps": cfg.steps,
        "busy_seconds": lane_busy(records), "layout": plan.layout,
        "resident": list(plan.spec.resident), "kept_layers": list(plan.spec.keep),
        # what the visualizer draws memory against: bytes per slot, where each pool lives, limits
        "slot_bytes": {pool: size // max(plan.budgets.get(pool, 1), 1) for pool, size in (
            (WEIGHTS, plan.gpu.get("weight_slots", 0)), (GRADS, plan.gpu.get("grad_slots", 0)),
            (HOST_GRADS, plan.host.get("staging", 0)))},
        "pool_memory": {pool: "pinned" if pool == HOST_GRADS else "gpu" for pool in plan.budgets},
        "capacities": {"gpu": plan.gpu_limit, "host": plan.host_limit},
        "planned": {"gpu": plan.gpu_total, "host": plan.host_total},
    }
    if device.type == "cuda":
        meta["measured"] = {"gpu_peak": torch.cuda.max_memory_allocated(device),
                            "gpu_reserved_peak": torch.cuda.max_memory_reserved(device)}
    return meta
