"""``flowtrain train``: flags -> :class:`TrainConfig` -> :func:`train`.

With no arguments it trains the embedded default: the ``tiny`` preset on the corpus shipped
with the package, on the CPU, in well under two minutes, the loss falling clearly.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import TYPE_CHECKING

from .flags import add_config_flags, config_values
from .flags import flag_of as config_flag

if TYPE_CHECKING:
    from ..train.config.run_config import TrainConfig

__all__ = ["MEMORY_FIELDS", "KERNEL_FIELDS", "add_arguments", "config_from_args", "flag_of", "run"]

#: the placement and memory fields that ``plan`` and ``bench --model`` take as ``train`` does
MEMORY_FIELDS = ("layout", "resident", "gpu_mem", "host_mem", "chunk_tokens", "activations", "checkpoint_every")
#: the kernel choices ``bench --model`` takes as ``train`` does
KERNEL_FIELDS = ("compile", "attention_backend", "layer_path")


#: settings below ``TrainConfig`` that an error can name (the step graph's, the planner's), as
#: ``train`` spells what leads to them
_BELOW = {"staged": "--layout staged", "full_layout": "--layout full", "keep": "--activations keep", "offload": "--activations offload",
          "save_attention": "--activations attention", "layers": "the model's num_hidden_layers",
          "micro_batches": "--batch-size / --micro-batch-size", "share": "--nproc-per-node",
          "host_adapters": "--lora-state host", "lora": "--lora-rank"}


def flag_of(field: str) -> str | None:
    """How ``train`` (and ``plan``, ``simulate``, ``bench``) spell a field an error names; None
    for a name that is none of theirs."""
    return _BELOW.get(field) or config_flag(field)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every field of ``TrainConfig`` as a flag, in its group (``flowtrain train --help``)."""
    add_config_flags(p)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    from ..train.config.run_config import TrainConfig

    return TrainConfig(**config_values(args))


def run(args: argparse.Namespace) -> int:
    from ..train.distributed import world_from_env
    from ..train.run import train

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
          + (f", {_saved(cfg.out)} saved to {cfg.out}" if cfg.out else ""))
    return 0


def _saved(out: str) -> str:
    """What a run left in ``out``: a LoRA run's PEFT adapter (resumed or not), else a model."""
    folder = Path(out)
    adapter = (folder / "adapter_model.safetensors").is_file() and not any(folder.glob("model*.safetensors"))
    return "adapter" if adapter else "model"
