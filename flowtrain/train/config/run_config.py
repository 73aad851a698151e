"""What a run is asked to do (:class:`TrainConfig`), declared once, and the model it names.

The first stop of :mod:`flowtrain.train.config`: each field of ``TrainConfig`` carries its
:class:`~.settings.Setting`, from which come its ``--help`` text and flag
(``flowtrain/cli/flags.py``) and the check of its value (:func:`~.checks.check_fields`); the
numbers behind its defaults are :mod:`.defaults`'. Beside it are what the run derives from the
settings without torch: the model (:func:`load_model_config`), the LoRA adapters
(:func:`lora_spec`) and the compute dtype's size (:func:`precision_bytes`), which
``flowtrain plan`` and ``flowtrain simulate`` read too. :mod:`flowtrain.train.run`
re-exports ``TrainConfig``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import msgspec

from ...errors import CheckpointError, ConfigError
from ...data.rows import parse_columns
from ...model.adapters import DEFAULT_TARGETS, LoraSpec
from ...model.config import ModelConfig
from ...model.hf_config import from_hf, to_hf
from ...model.model_dir import read_config
from ...model.presets import HF_PRESETS, PRESETS, preset
from ...plan.buffer_sizes import state_bytes_text
from ...plan.memory import compile_backend  # noqa: F401 - re-exported: what --compile runs
from ..distributed import DEFAULT_TIMEOUT_S as DIST_TIMEOUT_S
from ..reporters import parse_report_to
from . import defaults
from .settings import Setting


#: the groups of ``flowtrain train --help``, in the order shown (None: the first, untitled)
DATA, OPTIMIZER, SCHEDULE, MEMORY, KERNELS, OUTPUT, SAFETY, EVAL, LORA, PREFERENCE = (
    "data and batches", "optimizer", "run and schedule", "memory and placement", "kernels",
    "output", "checkpoints and safety", "held-out loss", "LoRA adapters", "preference training")
_BOTH = "default: {} for a model folder, {} for a preset (random weights); a resumed run keeps its own"
_SCRATCH, _TUNE = defaults.FROM_SCRATCH, defaults.FINE_TUNE


def _state(layout: str) -> str:
    """A layout's host bytes per parameter, as ``--help`` says it (the one figure: %% for argparse)."""
    return state_bytes_text(layout)


def _betas(text: str) -> tuple[float, float]:
    """``--betas 0.9,0.95`` -> ``(0.9, 0.95)``."""
    try:
        b1, b2 = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--betas takes two numbers like 0.9,0.95 (got {text!r})") from None
    return b1, b2


def _targets(text: str) -> tuple[str, ...]:
    """``--lora-targets q_proj,v_proj`` -> ``("q_proj", "v_proj")``; ``all-linear`` (PEFT's name
    for it) -> every map, as the default."""
    if text.strip().lower() == "all-linear":
        return DEFAULT_TARGETS
    return tuple(t.strip() for t in text.split(",") if t.strip())


class TrainConfig(msgspec.Struct, kw_only=True):
    """Everything ``flowtrain train`` takes, declared once.

    Each field carries its :class:`Setting`: the text of its ``--help``, its bounds, and how the
    command line spells it. The command line's flags are generated from these
    (``flowtrain.cli.flags``), and so are the checks of their values
    (:func:`flowtrain.train.config.checks.check_fields`); a check names the field, and each command
    spells it as its own flag. Fields left ``None`` are decided by the run (the optimizer's by
    where the weights come from, ``flowtrain.train.config.defaults.optimizer_defaults``, or by the
    resumed checkpoint).
    """

    model: Annotated[str | None, Setting(
        f"Hugging Face model directory or preset ({', '.join([*PRESETS, *HF_PRESETS])}); default: tiny, or the resumed "
        "checkpoint's model")] = None
    data: Annotated[str | None, Setting(
        ".jsonl of rows (text, prompt+completion, messages, alpaca instruction+input+output, ShareGPT "
        "conversations, or input_ids[+labels]), the same rows as .parquet, .arrow or a datasets folder "
        "(save_to_disk; needs pip install 'flowtrain[data]'), .txt or .npy; default: the bundled corpus",
        group=DATA)] = None
    data_columns: Annotated[tuple[tuple[str, str], ...] | None, Setting(
        "read the rows from columns of other names, KEY=COLUMN,... (e.g. instruction=question,output=answer; a KEY "
        "alone keeps the column of that name); each row is then read from exactly these columns, others ignored",
        parse=parse_columns, metavar="KEY=COLUMN,...", group=DATA)] = None
    tokenizer: Annotated[str | None, Setting(
        "folder with tokenizer.json (+ tokenizer_config.json with a chat template) for text data; default: the model "
        "folder's", metavar="DIR", group=DATA)] = None
    byte_tokenizer: Annotated[bool, Setting(
        "train text as raw UTF-8 bytes (presets do this anyway)", group=DATA)] = False
    packing: Annotated[bool, Setting(
        "one fine-tuning example (prompt+completion, messages, input_ids row) per sequence, right-padded; default: "
        "short examples are packed into each --seq-len sequence, attention kept within each",
        flag="--no-packing", const=False, group=DATA)] = True
    long_examples: Annotated[Literal["auto", "error", "drop", "truncate"], Setting(
        "examples (rows of a .jsonl or 2-D .npy) longer than --seq-len: error stops before training, naming how many "
        "and the first; drop leaves them out; truncate cuts them, keeping the start; auto (the default): error for "
        "conversations (messages rows: a cut one trains on a reply without its end, a dropped one is data you meant "
        "to use, so you choose), truncate for other rows, as text is cut into windows. The start-up block counts the "
        "examples cut or dropped and the target tokens they lose", group=DATA)] = defaults.LONG_EXAMPLES
    #: the default (``defaults.SeqLenDefault``) lets the data decide: 128 for a token stream, the
    #: longest example rounded up for fine-tuning rows; the trainer puts the number in
    seq_len: Annotated[int, Setting(
        f"tokens per sequence (default: {defaults.SEQ_LEN}) for text and the bundled corpus; a file of examples "
        "(prompt+completion, messages, input_ids rows, 2-D .npy) takes its longest example, rounded up to a multiple "
        f"of {defaults.SEQ_LEN_MULTIPLE}, at most the model's max_position_embeddings",
        ge=2, group=DATA)] = defaults.SEQ_LEN
    batch_size: Annotated[int, Setting("sequences per optimizer step", ge=1, group=DATA)] = defaults.BATCH_SIZE
    micro_batch_size: Annotated[int, Setting(
        f"sequences per micro-batch (default {defaults.MICRO_BATCH_SIZE}, or the largest number below it that "
        "divides --batch-size)", ge=1, group=DATA)] = defaults.MICRO_BATCH_SIZE
    shuffle: Annotated[bool, Setting(
        "sequences in file order; default: shuffled, in a new order each epoch drawn from --seed", flag="--no-shuffle",
        const=False, group=DATA)] = True
    seed: Annotated[int, Setting("seed for initialisation and shuffling", group=DATA)] = defaults.SEED

    steps: Annotated[int, Setting("optimizer steps", ge=1, group=SCHEDULE)] = defaults.STEPS
    lr: Annotated[float | None, Setting(
        "peak learning rate; " + _BOTH.format(_TUNE["lr"], _SCRATCH["lr"])
        + f"; LoRA over a model folder: {defaults.LORA['lr']:g}", ge=0.0, group=SCHEDULE)] = None
    warmup_steps: Annotated[int | None, Setting(
        "linear warm-up steps; " + _BOTH.format(f"{defaults.WARMUP_FRACTION * 100:.0f}%% of --steps",
                                                _SCRATCH["warmup_steps"]), ge=0, group=SCHEDULE)] = None
    lr_schedule: Annotated[Literal["constant", "cosine", "linear"] | None, Setting(
        "decay after warm-up; " + _BOTH.format(_TUNE["lr_schedule"], _SCRATCH["lr_schedule"]), group=SCHEDULE)] = None
    min_lr: Annotated[float, Setting(
        "final rate of a cosine or linear schedule (default 0)", ge=0.0, group=SCHEDULE)] = 0.0

    weight_decay: Annotated[float | None, Setting(
        "AdamW decoupled weight decay; " + _BOTH.format(_TUNE["weight_decay"], _SCRATCH["weight_decay"]),
        ge=0.0, group=OPTIMIZER)] = None
    #: "none" or "norms-biases" (no decay on norm weights and biases)
    weight_decay_skip: Annotated[Literal["none", "norms-biases"] | None, Setting(
        "parameters without weight decay: norms-biases (norm weights and biases, as Hugging Face's Trainer) or none "
        "(decay everything, one torch AdamW group); " + _BOTH.format(_TUNE["weight_decay_skip"],
                                                                    _SCRATCH["weight_decay_skip"]),
        group=OPTIMIZER)] = None
    betas: Annotated[tuple[float, float], Setting(
        "AdamW betas, B1,B2", parse=_betas, group=OPTIMIZER)] = defaults.BETAS
    eps: Annotated[float, Setting("AdamW eps", ge=0.0, group=OPTIMIZER)] = defaults.EPS  # torch accepts 0
    grad_clip: Annotated[float | None, Setting(
        "clip the global gradient norm to this value (exact)", gt=0.0, group=OPTIMIZER)] = None
    skip_idle_experts: Annotated[bool, Setting(
        "mixture of experts: an expert no token of a step is routed to gets no gradient and no update, as torch AdamW "
        "skips a parameter without one (its step count stays too), and is not copied to the GPU again for the "
        "backward; default: every expert is updated every step, an idle one with a zero gradient, as transformers' "
        "stacked experts are", group=OPTIMIZER)] = False
    adam_workers: Annotated[int, Setting(
        "CPU threads running AdamW tasks concurrently", ge=1, group=OPTIMIZER)] = 1

    precision: Annotated[Literal["fp32", "bf16"] | None, Setting(
        "default: bf16 on CUDA, fp32 on CPU", group=KERNELS)] = None
    device: Annotated[str, Setting("auto, cpu or cuda", group=KERNELS)] = "auto"
    #: torch.compile backend for the decoder layer: "auto" (inductor on CUDA, eager on the CPU),
    #: "none" (eager), or a backend name ("inductor", "aot_eager", ...)
    compile: Annotated[str | None, Setting(
        "torch.compile backend for the decoder layer; auto: inductor on CUDA, eager on the CPU",
        metavar="auto|none|BACKEND", group=KERNELS)] = "auto"
    attention_backend: Annotated[Literal["auto", "flash"], Setting(
        "fused attention kernel on a GPU: auto (cuDNN's where it runs the call, else flash; about 1.6-1.9x flash's "
        "rate on an H200) or flash (PyTorch's default)", group=KERNELS)] = "auto"
    layer_path: Annotated[Literal["auto", "native", "generic"], Setting(
        "the layer math: native (flowtrain's own, the fast path for the families it has), generic (transformers' own "
        "modules over the streamed weights: any decoder-only model transformers builds); auto: native where the "
        "family has it, else generic", group=KERNELS)] = "auto"
    policy: Annotated[str, Setting(
        "scheduling policy: sequential, double_buffer, lookahead, or module:Class (your own)",
        group=KERNELS)] = defaults.POLICY
    #: micro-batch order: "layer", "micro" or "auto" (micro where the planner predicts it faster
    #: on this GPU's machine model, flowtrain.sim.order_choice; else layer)
    order: Annotated[Literal["auto", "layer", "micro"], Setting(
        "micro-batch order: layer (every micro-batch through a layer, then the next: weights cross PCIe once per "
        "pass) or micro (each micro-batch through the whole model: fewer activations wait, more layers kept); auto: "
        "micro where it is predicted faster on this GPU (a shipped machine model), else layer", group=KERNELS)] = "auto"

    #: host state layout: "auto" (staged, or full with --grad-clip), "staged", "full", "stream-bf16"
    layout: Annotated[Literal["auto", "staged", "full", "stream-bf16"], Setting(
        f"host state layout: staged ({_state('staged')}), full ({_state('full')}; needed by --grad-clip), "
        f"stream-bf16 ({_state('stream-bf16')}; half the bytes over PCIe); auto: staged, or full with --grad-clip",
        group=MEMORY)] = "auto"
    #: units kept on the device with their Adam there: "auto" (the planner decides), "none",
    #: or comma-separated unit keys ("embed,head,layer.0")
    resident: Annotated[str, Setting(
        "units whose state lives on the GPU, Adam there: auto (the planner decides), none, or e.g. "
        "embed,head,layer.0", metavar="auto|none|UNITS", group=MEMORY)] = "auto"
    gpu_mem: Annotated[float | None, Setting(
        "the GPU's memory as nvidia-smi shows it (a '10 GB' card: 10); the whole process stays within it less 0.5 "
        "GiB for the display, CUDA's own share included (enforced)", gt=0.0, metavar="GiB", group=MEMORY)] = None
    host_mem: Annotated[float | None, Setting(
        "host memory to plan for (default: this machine's less a reserve for the system and other programs, a tenth "
        "of it and at least 2 GiB)", gt=0.0, metavar="GiB", group=MEMORY)] = None
    chunk_tokens: Annotated[int | None, Setting(
        "tokens per loss chunk (default: planned)", ge=1, group=MEMORY)] = None
    state_dir: Annotated[str | None, Setting(
        "a folder on a fast disk for the optimizer state host memory cannot hold (Adam moments first, then the fp32 "
        "master; --disk-state says what); read and written each step beside the GPU's work, locked while the run "
        "holds it, emptied when it ends (checkpoints hold the whole state)", metavar="DIR", group=MEMORY)] = None
    disk_state: Annotated[Literal["auto", "moments", "all", "none"], Setting(
        "with --state-dir, what lives there: moments (every streamed unit's Adam m and v, 8 bytes per parameter), all "
        "(their fp32 master too, 12; a compute-dtype copy stays in host memory), none; auto (the default): only what "
        "--host-mem cannot hold, moments first", group=MEMORY)] = "auto"
    disk_gbs: Annotated[float | None, Setting(
        "the state folder's disk rate in GB/s, read and write alike, for the disk check of plan and simulate "
        "(default: --machine's, as flowtrain probe measures it)", gt=0.0, metavar="GB/s", group=MEMORY)] = None
    #: what a layer keeps for its backward (--activations): "keep" (a layer's backward reuses its forward's activations, held
    #: on the GPU), "recompute" (backward runs the forward again from checkpoints on the GPU),
    #: "offload" (recompute, from checkpoints that wait in host memory), "attention" (recompute,
    #: but each layer's forward keeps its attention output, which the rebuild takes instead of
    #: running attention again) or "auto" (on a GPU: checkpoints on the GPU as the budget holds,
    #: the rest offloaded, then kept layers; at long sequences saved attention outputs where
    #: they save more, flowtrain.plan.attention; recompute on the CPU)
    activations: Annotated[Literal["auto", "keep", "offload", "recompute", "attention"], Setting(
        "keep each layer's activations on the GPU for its backward (no recompute), offload its checkpoint to host "
        "memory until its backward, recompute from checkpoints on the GPU, or recompute but keep each layer's "
        "attention output (the rebuild skips attention; checkpoints offloaded as needed); auto: checkpoints on the "
        "GPU as the budget holds (the rest offloaded), then kept layers, and at long sequences saved attention "
        "outputs where they save more (recompute on the CPU)", group=MEMORY)] = "auto"
    checkpoint_every: Annotated[int, Setting(
        "with recompute: keep a layer input every K layers and recompute the layers between (--checkpoint-every is "
        "the old name)", ge=1, flag="--activation-checkpoint-every", aliases=("--checkpoint-every",), metavar="K",
        group=MEMORY)] = 1

    out: Annotated[str | None, Setting(
        "write the trained model here (Hugging Face format), checkpoints in OUT/checkpoint-STEP",
        group=OUTPUT)] = None
    #: dtype of the final model: "auto" (the input model's), "fp32", "bf16", "fp16"
    save_dtype: Annotated[Literal["auto", "fp32", "bf16", "fp16"], Setting(
        "dtype of the final model: auto (the input model's; fp32 for a preset), fp32, bf16, fp16; sharded above 5 GB "
        "with model.safetensors.index.json (checkpoints always keep fp32)", group=OUTPUT)] = "auto"
    overwrite: Annotated[bool, Setting(
        "replace the model in a non-empty --out (the old one stays until the new one is in place)",
        group=OUTPUT)] = False
    metrics: Annotated[str | None, Setting(
        "write one JSON line per step here (and one per held-out loss)", group=OUTPUT)] = None
    trace: Annotated[str | None, Setting(
        "write the executed tasks as Chrome trace JSON here", group=OUTPUT)] = None
    report_to: Annotated[tuple[str, ...] | None, Setting(
        "also log each step (loss, learning rate, grad norm, tokens/s, skipped steps, held-out loss) and the run's "
        "settings to these experiment trackers, comma-separated: tensorboard, wandb, trackio, mlflow, or none (the "
        "default); each needs its library: pip install 'flowtrain[tensorboard]' (or [wandb], ...)",
        parse=parse_report_to, metavar="TRACKERS", group=OUTPUT)] = None
    logging_dir: Annotated[str | None, Setting(
        "where --report-to tensorboard writes its event files (and mlflow its runs, wandb its local files); "
        "default: runs/DATE_TIME_HOST", metavar="DIR", group=OUTPUT)] = None
    #: None: a progress bar on a terminal, plain lines otherwise; True: the bar; "lines": plain
    #: lines (``--no-progress``); False: nothing printed while the run trains (the returned
    #: metrics, ``on_step`` and ``metrics`` still get every step)
    progress: Annotated[bool | str | None, Setting(
        "plain log lines instead of a progress bar", flag="--no-progress", const="lines", group=OUTPUT)] = None

    save_every: Annotated[int | None, Setting(
        "write OUT/checkpoint-STEP every N steps (weights, Adam state, data position, settings)", ge=1, metavar="N",
        group=SAFETY)] = None
    save_total_limit: Annotated[int | None, Setting(
        "keep only the newest K checkpoints", ge=1, metavar="K", group=SAFETY)] = None
    resume: Annotated[str | None, Setting(
        "continue from a checkpoint folder, or from an --out folder's newest checkpoint; --steps stays the total",
        metavar="PATH", group=SAFETY)] = None
    extend_schedule: Annotated[bool, Setting(
        "with --resume and a new --steps under a cosine or linear --lr-schedule: decay from the rate the checkpoint "
        "reached to --min-lr at the new last step (without it such a resume is refused)", group=SAFETY)] = False
    max_skipped: Annotated[int, Setting(
        f"stop once more than N steps in a row were skipped because loss or gradients were not finite "
        f"(default {defaults.MAX_SKIPPED})", ge=0, metavar="N", group=SAFETY)] = defaults.MAX_SKIPPED
    undo_mem: Annotated[float, Setting(
        "host memory for undoing the updates of a step whose gradients turn non-finite late "
        f"(default {defaults.UNDO_MEM:g})", ge=0.0, metavar="GiB", group=SAFETY)] = defaults.UNDO_MEM
    task_timeout: Annotated[float | None, Setting(
        "fail the run if one task runs longer than S seconds (default: no limit)", gt=0.0, metavar="S",
        group=SAFETY)] = None
    dist_timeout: Annotated[float, Setting(
        "data parallel (torchrun): end the run in one line when another process has not answered for S seconds "
        "(stopped or hung; one that dies ends it at once)", gt=0.0, metavar="S", group=SAFETY)] = DIST_TIMEOUT_S

    eval_data: Annotated[str | None, Setting(
        "held-out data, read like --data; its mean loss over every target token is reported (progress line and "
        "--metrics) every --eval-every steps and after the last; needs --eval-every", metavar="FILE",
        group=EVAL)] = None
    eval_every: Annotated[int | None, Setting(
        "evaluate on --eval-data after every N optimizer steps (a forward pass over the whole set)", ge=1,
        metavar="N", group=EVAL)] = None

    lora_rank: Annotated[int | None, Setting(
        "train LoRA adapters of rank R over a frozen base instead of the whole model: the base stays in host memory "
        "in the compute dtype (2 bytes per parameter in bf16; no master copy, Adam state or gradient) and streams "
        "through the GPU, the adapters and their AdamW (fp32) live on the GPU; --out then holds a PEFT adapter",
        ge=1, metavar="R", group=LORA)] = None
    lora_alpha: Annotated[float | None, Setting(
        "the adapters' update is scaled by ALPHA / R (default: 2 R, a scale of 2)", gt=0.0, metavar="ALPHA",
        group=LORA)] = None
    lora_targets: Annotated[tuple[str, ...] | None, Setting(
        f"the linear maps that get adapters, comma-separated (default: all of them, {','.join(DEFAULT_TARGETS)}, "
        "which all-linear, PEFT's name, also says); in "
        "a mixture of experts gate_proj,up_proj and down_proj adapt each expert's weights, and router its router",
        parse=_targets, metavar="MAPS", group=LORA)] = None
    lora_gate_up_rank: Annotated[int | None, Setting(
        "rank of a mixture of experts' stacked gate-and-up adapters, one per expert (default 2 R with alpha 2 ALPHA, "
        "the same scale, as PEFT makes it from gate_proj and up_proj)", ge=1, metavar="R", group=LORA)] = None
    lora_dropout: Annotated[float | None, Setting(
        "dropout on the adapters' input in training (default 0)", ge=0.0, metavar="P", group=LORA)] = None
    lora_rslora: Annotated[bool | None, Setting(
        "scale the adapters' update by ALPHA / sqrt(R) instead of ALPHA / R (rank-stabilised LoRA, PEFT's "
        "use_rslora)", const=True, group=LORA)] = None
    adapter: Annotated[str | None, Setting(
        "start from this PEFT adapter folder (adapter_config.json + adapter_model.safetensors): its rank, alpha, "
        "scaling, targets and dropout are the run's", metavar="DIR", group=LORA)] = None
    lora_state: Annotated[Literal["auto", "gpu", "host"], Setting(
        "where the adapters' fp32 weights and AdamW state live: gpu (beside the work, with a GPU AdamW), or host "
        "(in host memory, copied to the GPU with their layer and updated by CPU AdamW, like the layers of full "
        "training: 16 bytes per adapter parameter the GPU need not hold); auto: gpu where the plan fits, else host",
        group=LORA)] = "auto"
    merge: Annotated[bool, Setting(
        "with LoRA: write the merged model (base + adapters, in --save-dtype) to --out instead of the adapter",
        group=LORA)] = False

    objective: Annotated[Literal["sft", "dpo"], Setting(
        "what the run minimises: sft (next-token cross-entropy over the target tokens) or dpo (direct preference "
        "optimisation over --data's preference pairs, TRL's rows: prompt/chosen/rejected as strings or messages, or "
        "prompt_input_ids/chosen_input_ids/rejected_input_ids; --batch-size and --micro-batch-size then count "
        "sequences, two per pair, and must be even; the reference is the initial weights, or under LoRA the base "
        "without adapters, whose log-probabilities are computed once before the first step)",
        group=PREFERENCE)] = "sft"
    dpo_beta: Annotated[float, Setting(
        "DPO's beta: how far the policy may move from the reference (TRL's default 0.1)", gt=0.0,
        group=PREFERENCE)] = 0.1
    dpo_loss: Annotated[Literal["sigmoid", "ipo"], Setting(
        "DPO's loss, as TRL's loss_type: sigmoid (-log sigmoid(beta * margin), log-probabilities summed over each "
        "completion) or ipo ((margin - 1 / (2 beta))^2, log-probabilities averaged over each completion's tokens)",
        group=PREFERENCE)] = "sigmoid"

    def __post_init__(self) -> None:
        """The default micro-batch resolved against the batch, as a plain ``int`` from here on."""
        if isinstance(self.batch_size, int) and isinstance(self.micro_batch_size, int) and self.batch_size > 0:
            self.micro_batch_size = int(defaults.micro_batch_for(self.batch_size, self.micro_batch_size))

    @property
    def lora(self) -> bool:
        """Whether the run trains LoRA adapters (``--lora-rank`` or ``--adapter``)."""
        return self.lora_rank is not None or self.adapter is not None


def precision_bytes(precision: str | None, device_type: str) -> int:
    """Bytes per element of the compute dtype ``--precision`` gives on a device of this type
    (bf16 on CUDA, fp32 on the CPU by default); ``prepare.resolve_dtype`` makes it a dtype."""
    precision = precision or ("bf16" if device_type == "cuda" else "fp32")
    if precision not in ("fp32", "bf16"):
        raise ConfigError(f"{{precision}} must be fp32 or bf16 (got {precision!r})", named=True)
    return 4 if precision == "fp32" else 2


def load_model_config(model: str, layer_path: str = "auto") -> tuple[ModelConfig, Path | None]:
    """A preset name or a Hugging Face model directory, on the layer path ``layer_path``
    (:data:`flowtrain.model.hf_config.LAYER_PATHS`)."""
    path = Path(model)
    if model in HF_PRESETS and not path.is_dir():
        return from_hf(HF_PRESETS[model], "generic" if layer_path == "auto" else layer_path), None
    if model in PRESETS and not path.is_dir():
        cfg = preset(model)
        return (from_hf(to_hf(cfg), layer_path) if layer_path != "auto" else cfg), None
    if not path.exists():
        raise CheckpointError(
            f"--model {model!r} is neither a directory nor a preset (presets: {', '.join(sorted([*PRESETS, *HF_PRESETS]))})"
        )
    if not path.is_dir():
        raise CheckpointError(f"--model {model!r} is a file; give the model's directory (config.json + safetensors)")
    return read_config(path, layer_path=layer_path), path


def lora_spec(cfg: TrainConfig) -> LoraSpec | None:
    """The adapters of a LoRA run from its flags (None: the whole model trains); a run started
    from ``--adapter`` has its spec from that folder (:func:`flowtrain.ckpt.adapter_files.read_spec`)."""
    if cfg.lora_rank is None:
        return None
    alpha = cfg.lora_alpha if cfg.lora_alpha is not None else 2.0 * cfg.lora_rank
    spec = LoraSpec(cfg.lora_rank, alpha, cfg.lora_targets or DEFAULT_TARGETS, cfg.lora_dropout or 0.0,
                    cfg.lora_gate_up_rank, rslora=bool(cfg.lora_rslora))
    try:
        spec.validate()
    except ValueError as e:
        raise ConfigError(str(e).replace("LoRA target", "{lora_targets}"), named=True) from None
    return spec
