"""Preparing a run: every input and output checked, the checkpoint to resume read, the data
tokenised and the memory planned, before anything large is allocated.

What bad input can make fail fails here, in one line naming the setting, before a run allocates
its state or touches the GPU; :class:`Run` holds what was decided and loaded, and
:func:`flowtrain.train.run.train` builds the state from it and runs the loop::

    run = prepare(TrainConfig(model="tiny", steps=10))
    run.plan.fits, run.plan.layout, run.seqs.seq_len, run.schedule(0)   # the plan, the data, the rate of step 0
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import msgspec
import torch

from ..ckpt import checkpoints
from ..ckpt.adapter_files import read_spec
from ..ckpt.out_lock import check_free
from ..ckpt.output import resolve_out, resolve_save_dtype
from ..ckpt.resume import POLICY_LOSS, ContinuedSchedule, check_compatible, resumed_schedule, steps_done
from ..data.preference import load_pairs
from ..data.rows import ColumnMap, parse_columns
from ..data.source import FromData, Sequences, default_corpus_path, load_sequences
from ..errors import CheckpointError, ConfigError, PlanError
from ..model import ModelConfig, read_config
from ..model.config import MLP_CHUNK_TOKENS
from ..model.model_dir import check_weight_headers, weights_fingerprint
from ..model.presets import PRESETS
from ..plan.buffer_sizes import check_units_fit
from ..plan.memory import Plan
from ..plan.request import run_request
from ..policy import resolve_policy
from ..sim.choose_plan import plan_and_choose
from .config import defaults
from .config.checks import check_compile_backend, check_fields, check_inputs_kept, check_output_paths, check_with_model
from .config.run_config import TrainConfig, load_model_config, lora_spec, precision_bytes
from .config.settings import check_values
from .distributed import World, local_share, world_from_env
from .metrics_file import check_metrics_free
from .reporters import check_trackers
from .optimizer import AdamWConfig, LRSchedule

__all__ = ["Run", "adamw_config", "check_objective", "data_rows", "prefer_expandable_segments", "prepare",
           "resolve_defaults", "resolve_device", "resolve_dtype"]


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
    #: LoRA over a model folder: its weights' fingerprint, which every checkpoint records
    #: (:func:`~flowtrain.model.model_dir.weights_fingerprint`)
    base_fp: str | None = None
    eval_seqs: Sequences | None = None  # the held-out set of --eval-data
    world: World = field(default_factory=World)  # the data-parallel processes (torchrun)

    @property
    def first_step(self) -> int:
        return self.resume_state.get("step", 0)


def prepare(cfg: TrainConfig, world: World | None = None, *, rows_given: bool = False,
            resume_check: Callable[[dict, Path], None] | None = None) -> Run:
    """Check every input and output, read the resumed checkpoint's state, load and tokenise the
    data and plan memory: everything that bad input can make fail, before any large allocation.
    ``rows_given``: no data is read, each step's rows come from the caller at ``seq_len``
    (:class:`~flowtrain.train.policy_session.PolicyTrainer`). ``resume_check``: called with the
    resumed checkpoint's trainer state and path as soon as they are read, before anything else
    is checked (the session refuses a checkpoint it did not write, or one of other settings)."""
    check_compile_backend(cfg.compile)
    check_trackers(cfg.report_to)  # a tracker's library missing: one line before anything is read
    cfg = msgspec.structs.replace(cfg, out=resolve_out(cfg.out))  # a symlink: write in the real folder
    if cfg.out:
        check_free(cfg.out)  # another run writing there: refuse before reading or checking it
    check_metrics_free(cfg.metrics)  # the same for the --metrics file
    resume_from, resume_state = _find_resume(cfg)
    if resume_from is not None:
        _check_writer(resume_from, resume_state, rows_given)
        if resume_check is not None:
            resume_check(resume_state, resume_from)
    cfg = _resumed_lora(cfg, resume_state, resume_from)
    check_inputs_kept(cfg, resume=resume_from)  # before the rules below, which a resume relaxes for --out
    check_output_paths(cfg.out, cfg.overwrite, cfg.trace, cfg.metrics, resume=resume_from)
    _check_nothing_replaced(cfg, resume_from, resume_state)
    model = cfg.model or (str(resume_from) if resume_from else "tiny")
    mcfg, model_dir = load_model_config(model, cfg.layer_path)
    base_dir = model_dir
    cfg = resolve_defaults(cfg, pretrained=model_dir is not None, saved=resume_state.get("settings"))
    check_fields(cfg)
    check_objective(cfg)
    _check_state_dir(cfg, world)
    mcfg.validate()
    check_units_fit(mcfg, cfg.host_mem, None if cfg.gpu_mem is None else int(cfg.gpu_mem * 2**30))  # before sizing anything
    if resume_from is not None:
        saved_cfg = read_config(resume_from, weights=not cfg.lora, layer_path=cfg.layer_path)  # a LoRA checkpoint: the adapters' weights
        if saved_cfg != mcfg:
            raise ConfigError(f"{{resume}} {resume_from}: it holds a different model than {{model}} {cfg.model} "
                              f"(config.json differs); leave out {{model}} to continue the checkpoint's model", named=True)
        model_dir = resume_from  # its tokenizer files travel with every checkpoint
        if cfg.lora and base_dir is not None:  # the base, which the checkpoint does not hold
            check_weight_headers(base_dir, mcfg, require=True)
    elif model_dir is not None:  # a folder without weights, or with a tensor missing: refused before allocating
        check_weight_headers(model_dir, mcfg, require=True)
    base_fp = _lora_base(cfg, base_dir, resume_from, resume_state)
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
    seqs = (_no_rows(_rows_seq_len(cfg, resume_state)) if rows_given
            else _read_data(cfg, mcfg, tokenizer_dir, _data_seq_len(cfg, mcfg, resume_state, tokenizer_dir)))
    cfg = _with_data_seq_len(cfg, seqs)
    data_fp = seqs.fingerprint()  # from the data cache's index: no pass over the rows
    eval_seqs = _load_eval(cfg, mcfg, tokenizer_dir)
    if resume_from is not None:
        check_compatible(resume_state, cfg, data=data_fp, where=str(resume_from), total_steps=cfg.steps)
        schedule = resumed_schedule(schedule.base, resume_state, where=str(resume_from))
    world = world or world_from_env()
    device, local = _data_parallel(cfg, world, device)
    reference_rows = len(seqs) if cfg.objective == "dpo" else 0  # every process keeps the whole data's
    plan = plan_and_choose(mcfg, run_request(local, model_dir, world.size, share=world.local_size,
                                             reference_rows=reference_rows),
                           device=device, dtype=dtype, policy=resolve_policy(cfg.policy))
    if not plan.fits:
        raise PlanError(plan.refusal())
    return Run(cfg, mcfg, model_dir, device, dtype, plan, schedule, seqs, data_fp, resume_from, resume_state,
               tokenizer_dir=tokenizer_dir, source_dir=_source_dir(model_dir, resume_state), eval_seqs=eval_seqs,
               world=world, base_dir=base_dir, base_fp=base_fp)


def _lora_base(cfg: TrainConfig, base_dir: Path | None, resume_from: Path | None, resume_state: dict) -> str | None:
    """A LoRA run's base weights' fingerprint (None for full training or a preset's seeded
    base); resuming, the checkpoint's adapters must have been trained over the same weights."""
    if not cfg.lora or base_dir is None:
        return None
    fp = weights_fingerprint(base_dir)
    saved = resume_state.get("base", {}).get("fingerprint") if isinstance(resume_state.get("base"), dict) else None
    if resume_from is not None and saved is not None and saved != fp:
        raise ConfigError(f"{{resume}} {resume_from}: its adapters were trained over other base weights than those in "
                          f"{base_dir} (same config.json, different weights); name the base they were trained over "
                          f"with {{model}}", named=True)
    return fp


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
    packing (none for a model whose layers carry state from one packed document into the next:
    :attr:`~flowtrain.model.config.ModelConfig.separates_documents`), and ``long_examples``
    (default: the run's)."""
    packing = cfg.packing and mcfg.separates_documents
    return load_sequences(path, seq_len, mcfg.vocab_size, tokenizer_dir=tokenizer_dir, pad_id=mcfg.pad_token_id or 0,
                          eos_id=mcfg.eos_token_id, byte_tokenizer=cfg.byte_tokenizer, packing=packing,
                          long_examples=long_examples or cfg.long_examples, columns=_columns(cfg.data_columns))


def _columns(value: object) -> ColumnMap | None:
    """``--data-columns`` as the data reads it; the Python API may also give the flag's text or
    a ``{key: column}`` dict."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value
    elif isinstance(value, dict):
        text = ",".join(f"{k}={v}" for k, v in value.items())
    else:
        text = ",".join(f"{k}={v}" for k, v in value)  # type: ignore[attr-defined]
    try:
        return parse_columns(text)
    except ValueError as e:
        raise ConfigError(str(e).replace("--data-columns", "{data_columns}"), named=True) from None


def _check_state_dir(cfg: TrainConfig, world: World | None) -> None:
    """The disk tier holds full training's state of one process: a LoRA run's state is its small
    adapters, and data-parallel processes would each want the whole folder."""
    if cfg.state_dir is None:
        return
    if cfg.lora:
        raise ConfigError("{state_dir} holds full training's optimizer state; a LoRA run keeps only its adapters' "
                          "state, in host memory: leave it out", named=True)
    if world is not None and world.parallel:
        raise ConfigError("{state_dir} is for one training process; data-parallel runs keep their state in host "
                          "memory: leave it out", named=True)
    if Path(cfg.state_dir).exists() and not Path(cfg.state_dir).is_dir():
        raise ConfigError(f"{{state_dir}} {cfg.state_dir} is a file: give a folder on a fast disk (made if it is "
                          "missing)", named=True)


def check_objective(cfg: TrainConfig, *, needs_data: bool = True) -> None:
    """DPO's batches hold whole pairs: two sequences each, in one micro-batch. ``needs_data``:
    refuse a DPO run without ``--data`` (``flowtrain plan`` and ``simulate`` take one, to
    describe the run per pair)."""
    if cfg.objective != "dpo":
        return
    if cfg.data is None and needs_data:
        raise ConfigError("{objective} dpo trains on preference pairs: give them with {data} (a .jsonl of TRL's "
                          "prompt/chosen/rejected rows)", named=True)
    for name, value in (("batch_size", cfg.batch_size), ("micro_batch_size", cfg.micro_batch_size)):
        if value % 2:
            raise ConfigError(f"{{{name}}} {value} counts sequences, and {{objective}} dpo puts the two of each "
                              "preference pair in one micro-batch: give an even number", named=True)
    if cfg.eval_data is not None:
        raise ConfigError("{eval_data} is a held-out cross-entropy, which {objective} dpo does not report yet; "
                          "leave it out", named=True)


def _read_data(cfg: TrainConfig, mcfg: ModelConfig, tokenizer_dir: Path | None, seq_len: int | FromData) -> Sequences:
    """``--data`` (the bundled corpus without it) read as the run reads it: preference pairs
    for ``--objective dpo`` (:mod:`flowtrain.data.preference`)."""
    if cfg.objective == "dpo":
        assert cfg.data is not None  # check_objective's
        return load_pairs(cfg.data, seq_len, mcfg.vocab_size, tokenizer_dir, pad_id=mcfg.pad_token_id or 0,
                          eos_id=mcfg.eos_token_id, byte_tokenizer=cfg.byte_tokenizer)
    return _read(cfg.data or str(default_corpus_path()), cfg, mcfg, tokenizer_dir, seq_len)


def _no_rows(seq_len: int) -> Sequences:
    """The data of a run whose caller hands over each step's rows: none, at ``seq_len``."""
    empty = torch.zeros((0, seq_len), dtype=torch.int64)
    return Sequences(empty, empty.clone())


def _rows_seq_len(cfg: TrainConfig, resume_state: dict) -> int:
    """The seq_len of a run whose caller hands over the rows: ``seq_len`` as given; without
    one, a resumed run's own, else the default."""
    saved = resume_state.get("settings", {}).get("seq_len")
    if not defaults.seq_len_given(cfg.seq_len) and isinstance(saved, int) and not isinstance(saved, bool):
        return saved
    return int(cfg.seq_len)


def data_rows(cfg: TrainConfig, mcfg: ModelConfig, model_dir: Path | None) -> tuple[int, int]:
    """``(seq_len, sequences)`` of a run of ``cfg``: the ``seq_len`` it trains at (``--seq-len``
    as given, else the one its data chooses, :func:`_data_seq_len`) and its data's sequences (for
    ``--objective dpo`` its pairs', two a pair); what ``flowtrain plan --data`` plans for. Reads
    the data as the run would, so data the run would refuse is refused here (through the cache,
    so the run that follows does not tokenise it again)."""
    tokenizer_dir = _tokenizer_dir(cfg, model_dir)
    seqs = _read_data(cfg, mcfg, tokenizer_dir, _data_seq_len(cfg, mcfg, {}, tokenizer_dir))
    return int(seqs.seq_len), len(seqs)


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


def _check_writer(resume_from: Path, resume_state: dict, rows_given: bool) -> None:
    """A PolicyTrainer's checkpoint (its rows came from its caller, its loss is GRPO's) is
    resumed by a PolicyTrainer only; ``train`` resumes the others."""
    if not rows_given and POLICY_LOSS in resume_state:
        raise ConfigError(f"{{resume}} {resume_from} was written by a PolicyTrainer (GRPO steps on rows its caller "
                          "gave), which resumes it; to train on from its weights, give it as {model} (a new "
                          "optimizer state)", named=True)


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


def prefer_expandable_segments(cfg: TrainConfig, environ: dict[str, str] | None = None) -> bool:
    """Long context (more tokens per micro-batch than the MLP takes at once) or a card size
    (``--gpu-mem``): ask torch's CUDA allocator for expandable segments unless
    ``PYTORCH_CUDA_ALLOC_CONF`` says otherwise, before anything touches the GPU. A long step
    allocates and frees tensors of gigabytes in changing sizes; with fixed segments llama-8b at
    262,144 tokens ran out of memory in its second step with 15.5 GiB reserved but unused, and
    llama-8b under a 10 GiB cap reserved 1.75 GiB more than it allocated
    (docs/bench/history/2026-12-03-offloaded-checkpoints-long-context.md):
    on a small card that is the difference between fitting and not. Returns whether it set it."""
    env = os.environ if environ is None else environ
    long_rows = cfg.seq_len * cfg.micro_batch_size > MLP_CHUNK_TOKENS
    if not (long_rows or cfg.gpu_mem is not None) or "PYTORCH_CUDA_ALLOC_CONF" in env:
        return False
    env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return True
