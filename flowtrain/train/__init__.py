"""Training: the model, its state, the optimizer, data, and the run that ties them together.

The Python entry point (imported on first use, so ``import flowtrain`` stays light)::

    from flowtrain.train import TrainConfig, train
    metrics = train(TrainConfig(model="path/to/model", data="chats.jsonl", steps=100, out="tuned"))

and for RL loops, one optimizer step a call (:mod:`flowtrain.train.policy_session`)::

    with PolicyTrainer(TrainConfig(model="path/to/model", batch_size=8, steps=100)) as session:
        out = session.step(input_ids, completion_mask, advantages)
"""

from __future__ import annotations

import sys
import types
from typing import Any

__all__ = ["TrainConfig", "StepMetrics", "train", "PolicyTrainer", "PolicyStep"]


class _Callable(types.ModuleType):
    """This package, callable as :func:`flowtrain.train.run.train`: ``flowtrain.train`` is both
    this package and, for ``from flowtrain import TrainConfig, train``, the function (a package
    attribute of the same name as a subpackage is the subpackage once it is imported)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from .run import train

        return train(*args, **kwargs)


sys.modules[__name__].__class__ = _Callable


def __getattr__(name: str):
    if name in ("PolicyTrainer", "PolicyStep"):  # RL loops: one step a call
        from . import policy_session

        return getattr(policy_session, name)
    if name in __all__:
        from . import run

        return getattr(run, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
