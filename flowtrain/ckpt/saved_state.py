"""What a checkpoint reads and fills of a run's state and schedule, declared as protocols.

The state (each unit's fp32 master weights, Adam moments and step counts) and the learning-rate
schedule are training's (:class:`flowtrain.train.host_state.HostState`,
:class:`flowtrain.train.optimizer.LRSchedule`). ``ckpt/`` sits below training and imports
nothing of it: it names here exactly what it reads and fills of them, and training's classes
satisfy these protocols by their shape (mypy checks it wherever training passes them in)::

    writer.write_unit(i, unit)                 # SavedUnit: its layout, master, moments, step counts
    load_training_state(path, state)           # RestorableState: its trained units, filled in place
    save_final_model(state, "trained", ...)    # SavableModel: writes itself as a Hugging Face model
    resumed_schedule(schedule, trainer_state, where=...)  # Schedule: the rates a resume goes on with
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol, Self, TypeVar

import torch

from ..model.flat_map import FlatMap

__all__ = ["RestorableState", "SavableModel", "SavedUnit", "Schedule"]


class SavedUnit(Protocol):
    """One trained unit (the embedding, a decoder layer, the head, or a layer's adapters) as a
    checkpoint writes it and fills it back in place. Its tensors stay where the run keeps them
    (host memory, or the device for a resident unit); a checkpoint copies in and out of them and
    never replaces one. A checkpoint asks for each of ``master``, ``exp_avg`` and ``exp_avg_sq``
    once, as its turn to be written comes, and lets it go before asking for the next: a stand-in
    for a unit whose state is on disk reads the field back when it is asked for."""

    @property
    def flat_map(self) -> FlatMap:
        """The unit's key (``"embed"``, ``"layer.3"``, ``"adapter.3"``, ...), its ``numel`` and
        the Hugging Face names of its tensors."""
        ...

    @property
    def master(self) -> torch.Tensor:  # (numel,) fp32
        ...

    @property
    def exp_avg(self) -> torch.Tensor:  # (at least numel,) fp32; the first numel are the unit's
        ...

    @property
    def exp_avg_sq(self) -> torch.Tensor:  # (at least numel,) fp32
        ...

    @property
    def steps(self) -> Sequence[torch.Tensor]:
        """Adam's step count, one () fp32 tensor per gradient chunk; equal between steps."""
        ...

    @property
    def expert_steps(self) -> torch.Tensor | None:
        """A sparse layer that skips idle experts: each expert's own step count, (experts,)
        fp32; None elsewhere."""
        ...


U = TypeVar("U", bound=SavedUnit)


class RestorableState(Protocol[U]):
    """A run's state as :func:`~flowtrain.ckpt.checkpoints.load_training_state` fills it: the
    masters through the state's own loader (which refuses weights that are not finite), then
    each unit's moments and step counts, then the compute and streaming copies."""

    @property
    def trained(self) -> list[U]:
        """The units the optimizer updates, in checkpoint order: the model's, or with LoRA the
        adapters."""
        ...

    def load_checkpoint(self, model_dir: str | Path, units: list[U]) -> None:
        """Fill the masters of ``units`` from the weight files of the folder ``model_dir``."""
        ...

    def refresh_copies(self) -> None:
        """Bring every compute or streaming copy of a master up to date."""
        ...

    def filling(self, unit: U, field: str) -> AbstractContextManager[torch.Tensor]:
        """The unit's ``exp_avg`` or ``exp_avg_sq`` (``field``) as a checkpoint fills it in place,
        every element: the unit's own tensor, or where it lives elsewhere (on disk), a buffer of
        that one field, which goes back there when the block ends (one field in memory)."""
        ...


class SavableModel(Protocol):
    """A run's model as :func:`~flowtrain.ckpt.output.save_final_model` writes it: the state
    writes its own Hugging Face folder (or PEFT adapter folder) into the temporary folder the
    output then puts in place."""

    def save(self, out_dir: str | Path, dtype: torch.dtype, *, max_shard_bytes: int | None,
             source_config: dict | None, merge: bool, base_model: str | None) -> None:
        ...


class Schedule(Protocol):
    """A learning-rate schedule as a resume continues it (:mod:`~flowtrain.ckpt.resume`): the
    rate of each step, and the fields that say how a decay goes on past a changed ``--steps``."""

    @property
    def warmup_steps(self) -> int:
        ...

    @property
    def schedule(self) -> str:
        """``"constant"``, ``"cosine"`` or ``"linear"``."""
        ...

    @property
    def total_steps(self) -> int:
        ...

    @property
    def min_lr(self) -> float:
        ...

    def __call__(self, step: int) -> float:
        """The rate of the 0-based ``step``."""
        ...

    def with_total_steps(self, total_steps: int) -> Self:
        """The same schedule laid over ``total_steps`` steps."""
        ...
