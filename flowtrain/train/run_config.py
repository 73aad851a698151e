"""What a run is asked to do (``TrainConfig``), the model it names, and the checks that need
no torch: the part of a run that ``flowtrain plan`` and ``flowtrain simulate`` read too, so
they can answer without importing torch. :mod:`flowtrain.train.trainer` re-exports these.
"""

from __future__ import annotations

import math
from pathlib import Path

import msgspec

from ..errors import CheckpointError, ConfigError
from ..model.config import PRESETS, ModelConfig, preset, read_config
from ..plan.memory import compile_backend  # noqa: F401 - re-exported: what --compile runs
from . import defaults
from .distributed import DEFAULT_TIMEOUT_S as DIST_TIMEOUT_S


class TrainConfig(msgspec.Struct, kw_only=True):
    """Everything ``flowtrain train`` takes; see ``flowtrain train --help`` for each field."""

    model: str | None = None  # None: the resumed checkpoint's model, else "tiny"
    data: str | None = None
    steps: int = defaults.STEPS
    batch_size: int = defaults.BATCH_SIZE
    micro_batch_size: int = defaults.MICRO_BATCH_SIZE
    #: the default (``defaults.SeqLenDefault``) lets the data decide: 128 for a token stream, the
    #: longest example rounded up for fine-tuning rows; the trainer puts the number in
    seq_len: int = defaults.SEQ_LEN
    #: the optimizer fields left None take defaults by where the weights come from
    #: (``flowtrain.train.defaults.optimizer_defaults``) or, resuming, the checkpoint's settings
    lr: float | None = None
    weight_decay: float | None = None
    #: "none" or "norms-biases" (no decay on norm weights and biases)
    weight_decay_skip: str | None = None
    betas: tuple[float, float] = defaults.BETAS
    eps: float = defaults.EPS
    grad_clip: float | None = None
    warmup_steps: int | None = None
    lr_schedule: str | None = None
    min_lr: float = 0.0
    seed: int = defaults.SEED
    shuffle: bool = True
    precision: str | None = None
    device: str = "auto"
    policy: str = defaults.POLICY
    checkpoint_every: int = 1
    #: activation placement: "keep" (a layer's backward reuses its forward's activations, held
    #: on the GPU), "recompute" (backward runs the forward again from checkpoints on the GPU),
    #: "offload" (recompute, from checkpoints that wait in host memory), "attention" (recompute,
    #: but each layer's forward keeps its attention output, which the rebuild takes instead of
    #: running attention again) or "auto" (on a GPU: checkpoints on the GPU as the budget holds,
    #: the rest offloaded, then kept layers; at long sequences saved attention outputs where
    #: they save more, flowtrain.plan.attention; recompute on the CPU)
    activations: str = "auto"
    #: micro-batch order: "layer", "micro" or "auto" (micro where the planner predicts it faster
    #: on this GPU's machine model, flowtrain.sim.order_choice; else layer)
    order: str = "auto"
    adam_workers: int = 1
    out: str | None = None
    overwrite: bool = False
    metrics: str | None = None
    trace: str | None = None
    #: None: a progress bar on a terminal, plain lines otherwise; True: the bar; "lines": plain
    #: lines (``--no-progress``); False: nothing printed while the run trains (the returned
    #: metrics, ``on_step`` and ``metrics`` still get every step)
    progress: bool | str | None = None
    chunk_tokens: int | None = None
    #: host state layout: "auto" (staged, or full with --grad-clip), "staged", "full", "stream-bf16"
    layout: str = "auto"
    #: units kept on the device with their Adam there: "auto" (the planner decides), "none",
    #: or comma-separated unit keys ("embed,head,layer.0")
    resident: str = "auto"
    #: torch.compile backend for the decoder layer: "auto" (inductor on CUDA, eager on the CPU),
    #: "none" (eager), or a backend name ("inductor", "aot_eager", ...)
    compile: str | None = "auto"
    #: fused attention kernel on CUDA: "auto" (cuDNN's where it can run, else flash) or "flash"
    attention_backend: str = "auto"
    gpu_mem: float | None = None  # GiB flowtrain may take on the GPU (enforced)
    host_mem: float | None = None  # GiB of host memory to plan for (default: what is available)
    #: a folder with tokenizer.json (+ tokenizer_config.json, chat template) for text data;
    #: None: the model folder's
    tokenizer: str | None = None
    #: train text as raw UTF-8 bytes even with a model folder (presets do so anyway)
    byte_tokenizer: bool = False
    #: pack short fine-tuning examples into each sequence (``positions`` restart per example);
    #: False (``--no-packing``): one example per sequence, right-padded
    packing: bool = True
    #: examples longer than seq_len: "error" (stop before training, naming them), "drop", "truncate",
    #: or "auto" (error for conversations, truncate for other rows)
    long_examples: str = defaults.LONG_EXAMPLES
    #: dtype of the final model: "auto" (the input model's), "fp32", "bf16", "fp16"
    save_dtype: str = "auto"
    #: write ``out/checkpoint-STEP`` every this many steps (needs ``out``)
    save_every: int | None = None
    #: keep only the newest this many checkpoints
    save_total_limit: int | None = None
    #: a checkpoint folder, or an ``out`` folder meaning its newest checkpoint
    resume: str | None = None
    #: resuming with another ``steps`` under a cosine or linear schedule: decay from the rate
    #: the checkpoint reached to ``min_lr`` at the new last step (else such a resume is refused)
    extend_schedule: bool = False
    #: stop once more than this many steps in a row were skipped as not finite
    max_skipped: int = defaults.MAX_SKIPPED
    #: host memory (GiB) for undo records of a step whose gradients turn non-finite late
    undo_mem: float = defaults.UNDO_MEM
    #: fail a task that runs longer than this many seconds (None: no limit)
    task_timeout: float | None = None
    #: data parallel (torchrun): seconds any collective waits for the other processes before
    #: the run ends (a process that stopped or hung); a dead process ends it at once
    dist_timeout: float = DIST_TIMEOUT_S
    #: held-out data (read like ``data``) whose mean loss is reported every ``eval_every`` steps
    #: and after the last; both or neither
    eval_data: str | None = None
    eval_every: int | None = None


def precision_bytes(precision: str | None, device_type: str) -> int:
    """Bytes per element of the compute dtype ``--precision`` gives on a device of this type
    (bf16 on CUDA, fp32 on the CPU by default); ``trainer.resolve_dtype`` makes it a dtype."""
    precision = precision or ("bf16" if device_type == "cuda" else "fp32")
    if precision not in ("fp32", "bf16"):
        raise ConfigError(f"--precision must be fp32 or bf16 (got {precision!r})")
    return 4 if precision == "fp32" else 2


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
    if defaults.seq_len_given(cfg.seq_len):  # else the data decides, within the model's positions
        mcfg.check_seq_len(cfg.seq_len)
    if cfg.long_examples not in ("auto", "error", "drop", "truncate"):
        raise ConfigError(f"--long-examples must be auto, error, drop or truncate (got {cfg.long_examples!r})")
    if cfg.attention_backend not in ("auto", "flash"):
        raise ConfigError(f"--attention-backend must be auto or flash (got {cfg.attention_backend!r})")
    if cfg.adam_workers < 1:
        raise ConfigError("--adam-workers must be at least 1")
    if not (isinstance(cfg.dist_timeout, (int, float)) and math.isfinite(cfg.dist_timeout) and cfg.dist_timeout > 0):
        raise ConfigError(f"--dist-timeout must be a finite number of seconds > 0 (got {cfg.dist_timeout!r})")
    if cfg.progress not in (None, True, False, "lines"):
        raise ConfigError(f"progress must be None, True, False or 'lines' (got {cfg.progress!r})")
    if (cfg.eval_data is None) != (cfg.eval_every is None):
        given, missing = ("--eval-data", "--eval-every N") if cfg.eval_data is not None else ("--eval-every", "--eval-data FILE")
        raise ConfigError(f"{given} needs {missing}: give both (held-out loss every N steps) or neither")
    if cfg.eval_every is not None and cfg.eval_every < 1:
        raise ConfigError(f"--eval-every must be at least 1 (got {cfg.eval_every})")
    if cfg.save_every is not None and not cfg.out:
        raise ConfigError("--save-every writes OUT/checkpoint-STEP folders: give --out OUT")
    if cfg.save_every is not None and cfg.resume is None and cfg.out and Path(cfg.out).is_dir():
        old = sorted(p.name for p in Path(cfg.out).glob("checkpoint-*"))
        if old:
            raise ConfigError(
                f"--out {cfg.out} holds checkpoints of an earlier run ({', '.join(old[-3:])}); continue it with "
                f"--resume {cfg.out}, or write this run's checkpoints to another --out"
            )
