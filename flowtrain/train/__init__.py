"""Training: the model, its state, the optimizer, data, and the run that ties them together.

The Python entry point (imported on first use, so ``import flowtrain`` stays light)::

    from flowtrain.train import TrainConfig, train
    metrics = train(TrainConfig(model="path/to/model", data="chats.jsonl", steps=100, out="tuned"))
"""

from __future__ import annotations

__all__ = ["TrainConfig", "StepMetrics", "train"]


def __getattr__(name: str):
    if name in __all__:
        from . import run

        return getattr(run, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
