"""``flowtrain train``: flags -> :class:`TrainConfig` -> :func:`train`.

With no arguments it trains the embedded default: the ``tiny`` preset on the corpus shipped
with the package, on the CPU, in well under two minutes, the loss falling clearly.
"""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING

from ..model.config import PRESETS
from ..train import defaults
from ..train.distributed import DEFAULT_TIMEOUT_S as DIST_TIMEOUT_S

if TYPE_CHECKING:  # the trainer imports torch; ``--help`` must not
    from ..train.trainer import TrainConfig


def _betas(text: str) -> tuple[float, float]:
    try:
        b1, b2 = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--betas takes two numbers like 0.9,0.95 (got {text!r})") from None
    return b1, b2


def add_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--model", default=None, help=f"Hugging Face model directory or preset ({', '.join(PRESETS)}); "
                                    "default: tiny, or the resumed checkpoint's model")
    a("--data", default=None, help=".jsonl (rows of text, prompt+completion, messages, or input_ids[+labels]), "
                                   ".txt or .npy; default: the bundled corpus")
    a("--tokenizer", default=None, metavar="DIR",
      help="folder with tokenizer.json (+ tokenizer_config.json with a chat template) for text data; "
           "default: the model folder's")
    a("--byte-tokenizer", action="store_true", help="train text as raw UTF-8 bytes (presets do this anyway)")
    a("--no-packing", action="store_true",
      help="one fine-tuning example (prompt+completion, messages, input_ids row) per sequence, right-padded; "
           "default: short examples are packed into each --seq-len sequence, attention kept within each")
    a("--long-examples", choices=["auto", "error", "drop", "truncate"], default=defaults.LONG_EXAMPLES,
      help="examples (rows of a .jsonl or 2-D .npy) longer than --seq-len: error stops before training, naming how "
           "many and the first; drop leaves them out; truncate cuts them, keeping the start; auto (the default): "
           "error for conversations (messages rows: a cut one trains on a reply without its end, a dropped one is "
           "data you meant to use, so you choose), truncate for other rows, as text is cut into windows. The "
           "start-up block counts the examples cut or dropped and the target tokens they lose")
    a("--steps", type=int, default=defaults.STEPS, help="optimizer steps")
    a("--batch-size", type=int, default=defaults.BATCH_SIZE, help="sequences per optimizer step")
    a("--micro-batch-size", type=int, default=defaults.MICRO_BATCH_SIZE, help="sequences per micro-batch")
    a("--seq-len", type=int, default=defaults.SEQ_LEN,
      help=f"tokens per sequence (default: {defaults.SEQ_LEN}) for text and the bundled corpus; a file of examples "
           "(prompt+completion, messages, input_ids rows, 2-D .npy) takes its longest example, rounded up to a "
           f"multiple of {defaults.SEQ_LEN_MULTIPLE}, at most the model's max_position_embeddings")
    scratch, tune = defaults.FROM_SCRATCH, defaults.FINE_TUNE
    both = "default: {} for a model folder, {} for a preset (random weights); a resumed run keeps its own"
    a("--lr", type=float, default=None, help="peak learning rate; " + both.format(tune["lr"], scratch["lr"]))
    a("--warmup-steps", type=int, default=None, help="linear warm-up steps; " + both.format(
        f"{defaults.WARMUP_FRACTION * 100:.0f}%% of --steps", scratch["warmup_steps"]))
    a("--lr-schedule", choices=["constant", "cosine", "linear"], default=None,
      help="decay after warm-up; " + both.format(tune["lr_schedule"], scratch["lr_schedule"]))
    a("--min-lr", type=float, default=0.0, help="final rate of a cosine or linear schedule (default 0)")
    a("--weight-decay", type=float, default=None, help="AdamW decoupled weight decay; " + both.format(
        tune["weight_decay"], scratch["weight_decay"]))
    a("--weight-decay-skip", choices=["none", "norms-biases"], default=None,
      help="parameters without weight decay: norms-biases (norm weights and biases, as Hugging Face's Trainer) "
           "or none (decay everything, one torch AdamW group); " + both.format(
               tune["weight_decay_skip"], scratch["weight_decay_skip"]))
    a("--betas", type=_betas, default=defaults.BETAS, help="AdamW betas, B1,B2")
    a("--eps", type=float, default=defaults.EPS, help="AdamW eps")
    a("--grad-clip", type=float, default=None, help="clip the global gradient norm to this value (exact)")
    a("--seed", type=int, default=defaults.SEED, help="seed for initialisation and shuffling")
    a("--no-shuffle", action="store_true", help="sequences in file order")
    a("--precision", choices=["fp32", "bf16"], default=None, help="default: bf16 on CUDA, fp32 on CPU")
    a("--device", default="auto", help="auto, cpu or cuda")
    a("--policy", default=defaults.POLICY, help="scheduling policy: sequential, double_buffer, lookahead, or module:Class (your own)")
    a("--order", choices=["auto", "layer", "micro"], default="auto",
      help="micro-batch order: layer (every micro-batch through a layer, then the next: weights cross PCIe once per "
           "pass) or micro (each micro-batch through the whole model: fewer activations wait, more layers kept); "
           "auto: micro where it is predicted faster on this GPU (a shipped machine model), else layer")
    a("--adam-workers", type=int, default=1, help="CPU threads running AdamW tasks concurrently")
    add_memory_arguments(p)
    add_compile_argument(p)
    a("--out", default=None, help="write the trained model here (Hugging Face format), checkpoints in OUT/checkpoint-STEP")
    a("--save-dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
      help="dtype of the final model: auto (the input model's; fp32 for a preset), fp32, bf16, fp16; sharded "
           "above 5 GB with model.safetensors.index.json (checkpoints always keep fp32)")
    a("--overwrite", action="store_true", help="replace the model in a non-empty --out (the old one stays until the new one is in place)")
    g = p.add_argument_group("checkpoints and safety")
    g.add_argument("--save-every", type=int, default=None, metavar="N",
                   help="write OUT/checkpoint-STEP every N steps (weights, Adam state, data position, settings)")
    g.add_argument("--save-total-limit", type=int, default=None, metavar="K", help="keep only the newest K checkpoints")
    g.add_argument("--resume", default=None, metavar="PATH",
                   help="continue from a checkpoint folder, or from an --out folder's newest checkpoint; "
                        "--steps stays the total")
    g.add_argument("--extend-schedule", action="store_true",
                   help="with --resume and a new --steps under a cosine or linear --lr-schedule: decay from the rate "
                        "the checkpoint reached to --min-lr at the new last step (without it such a resume is refused)")
    g.add_argument("--max-skipped", type=int, default=defaults.MAX_SKIPPED, metavar="N",
                   help="stop once more than N steps in a row were skipped because loss or gradients were not finite "
                        f"(default {defaults.MAX_SKIPPED})")
    g.add_argument("--undo-mem", type=float, default=defaults.UNDO_MEM, metavar="GiB",
                   help="host memory for undoing the updates of a step whose gradients turn non-finite late "
                        f"(default {defaults.UNDO_MEM:g})")
    g.add_argument("--task-timeout", type=float, default=None, metavar="S",
                   help="fail the run if one task runs longer than S seconds (default: no limit)")
    g.add_argument("--dist-timeout", type=float, default=DIST_TIMEOUT_S, metavar="S",
                   help="data parallel (torchrun): end the run in one line when another process has not answered "
                        "for S seconds (stopped or hung; one that dies ends it at once)")
    g = p.add_argument_group("held-out loss")
    g.add_argument("--eval-data", default=None, metavar="FILE",
                   help="held-out data, read like --data; its mean loss over every target token is reported "
                        "(progress line and --metrics) every --eval-every steps and after the last; needs --eval-every")
    g.add_argument("--eval-every", type=int, default=None, metavar="N",
                   help="evaluate on --eval-data after every N optimizer steps (a forward pass over the whole set)")
    a("--metrics", default=None, help="write one JSON line per step here (and one per held-out loss)")
    a("--trace", default=None, help="write the executed tasks as Chrome trace JSON here")
    a("--no-progress", action="store_true", help="plain log lines instead of a progress bar")


def add_memory_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The placement and memory options shared by ``train``, ``plan`` and ``bench --model``."""
    a = p.add_argument
    a("--layout", choices=["auto", "staged", "full", "stream-bf16"], default="auto",
      help="host state layout: staged (12 B/param), full (16, needed by --grad-clip), stream-bf16 (14, "
           "half the PCIe bytes); auto: staged, or full with --grad-clip")
    a("--resident", default="auto", metavar="auto|none|UNITS",
      help="units whose state lives on the GPU, Adam there: auto (the planner decides), none, or e.g. embed,head,layer.0")
    a("--gpu-mem", type=float, default=None, metavar="GiB",
      help="the GPU's memory as nvidia-smi shows it (a '10 GB' card: 10); the whole process stays "
           "within it less 0.5 GiB for the display, CUDA's own share included (enforced)")
    a("--host-mem", type=float, default=None, metavar="GiB", help="host memory to plan for (default: what is available)")
    a("--chunk-tokens", type=int, default=None, help="tokens per loss chunk (default: planned)")
    a("--activations", choices=["auto", "keep", "offload", "recompute", "attention"], default="auto",
      help="keep each layer's activations on the GPU for its backward (no recompute), offload its "
           "checkpoint to host memory until its backward, recompute from checkpoints on the GPU, or "
           "recompute but keep each layer's attention output (the rebuild skips attention; checkpoints "
           "offloaded as needed); auto: checkpoints on the GPU as the budget holds (the rest offloaded), "
           "then kept layers, and at long sequences saved attention outputs where they save more "
           "(recompute on the CPU)")
    a("--activation-checkpoint-every", "--checkpoint-every", dest="checkpoint_every", type=int, default=1,
      metavar="K", help="with recompute: keep a layer input every K layers and recompute the layers "
                        "between (--checkpoint-every is the old name)")


def add_compile_argument(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--compile``, shared by ``train`` and ``bench --model``."""
    p.add_argument("--compile", default="auto", metavar="auto|none|BACKEND",
                   help="torch.compile backend for the decoder layer; auto: inductor on CUDA, eager on the CPU")
    p.add_argument("--attention-backend", choices=["auto", "flash"], default="auto",
                   help="fused attention kernel on a GPU: auto (cuDNN's where it runs the call, else "
                        "flash; about 1.6-1.9x flash's rate on an H200) or flash (PyTorch's default)")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    from ..train.trainer import TrainConfig

    return TrainConfig(
        model=args.model, data=args.data, steps=args.steps, batch_size=args.batch_size,
        micro_batch_size=args.micro_batch_size, seq_len=args.seq_len, lr=args.lr,
        weight_decay=args.weight_decay, weight_decay_skip=args.weight_decay_skip, betas=args.betas, eps=args.eps, grad_clip=args.grad_clip,
        warmup_steps=args.warmup_steps, lr_schedule=args.lr_schedule, min_lr=args.min_lr, seed=args.seed,
        shuffle=not args.no_shuffle, precision=args.precision, device=args.device, policy=args.policy,
        checkpoint_every=args.checkpoint_every, activations=args.activations, order=args.order, adam_workers=args.adam_workers,
        out=args.out, overwrite=args.overwrite, metrics=args.metrics, trace=args.trace,
        progress="lines" if args.no_progress else None, layout=args.layout, resident=args.resident,
        gpu_mem=args.gpu_mem, host_mem=args.host_mem, chunk_tokens=args.chunk_tokens, compile=args.compile,
        attention_backend=args.attention_backend,
        tokenizer=args.tokenizer, byte_tokenizer=args.byte_tokenizer, packing=not args.no_packing, save_dtype=args.save_dtype,
        long_examples=args.long_examples,
        save_every=args.save_every, save_total_limit=args.save_total_limit, resume=args.resume,
        extend_schedule=args.extend_schedule,
        max_skipped=args.max_skipped, undo_mem=args.undo_mem, task_timeout=args.task_timeout,
        dist_timeout=args.dist_timeout,
        eval_data=args.eval_data, eval_every=args.eval_every,
    )


def run(args: argparse.Namespace) -> int:
    from ..train.distributed import world_from_env
    from ..train.trainer import train

    cfg = config_from_args(args)
    metrics = train(cfg)
    if not world_from_env().leader:
        return 0  # rank 0 reports for every data-parallel process
    first, last = metrics[0], metrics[-1]
    tail = [m.loss for m in metrics[-max(1, len(metrics) // 10):] if math.isfinite(m.loss)]
    mean_tail = sum(tail) / len(tail) if tail else math.nan
    skipped = sum(m.skipped for m in metrics)
    print(f"done: {len(metrics)} steps, loss {first.loss:.4f} -> {last.loss:.4f} (last-10% mean {mean_tail:.4f})"
          + (f", {skipped} skipped as not finite" if skipped else "")
          + (f", model saved to {cfg.out}" if cfg.out else ""))
    return 0
