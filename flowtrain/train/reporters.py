"""Experiment trackers: ``--report-to tensorboard,wandb,trackio,mlflow`` and ``--logging-dir``.

Each tracker is written through its library's own API, imported only when a run asks for it
(``pip install 'flowtrain[tensorboard]'``, ``[wandb]``, ``[trackio]``, ``[mlflow]``), and is fed
from where the ``--metrics`` lines are written
(:class:`~flowtrain.train.reporting.Reporter`), so the two always hold the same numbers::

    trackers = open_trackers(("tensorboard",), "runs/first", settings=settings_of(cfg))
    for t in trackers:
        t.log(7, {"train/loss": 2.31, "train/learning_rate": 3e-4, ...})   # once per step
    close_trackers(trackers)

Per optimizer step (numbered from 1, as the progress lines, ``--metrics`` and ``checkpoint-N``
count): ``train/loss``, ``train/learning_rate``, ``train/grad_norm``, ``train/tokens_per_s``,
``train/skipped`` (1 for a step skipped because its loss or gradients were not finite, else 0)
and ``train/skipped_steps`` (skipped so far in this run); after an evaluation ``eval/loss``. The
run's settings (every ``TrainConfig`` field) are recorded once, as the tracker keeps
configurations: TensorBoard as a text summary ``settings`` (JSON), wandb and trackio as the
run's config, MLflow as its parameters.

Where each writes: TensorBoard its event files into ``--logging-dir`` (default
``runs/DATE_TIME_HOST``, as Hugging Face's Trainer names it); MLflow into ``--logging-dir``
as a file store unless ``MLFLOW_TRACKING_URI`` names a server; wandb and trackio where their own
settings say (``WANDB_PROJECT``, ``WANDB_MODE=offline``, ...; project ``flowtrain`` by default),
wandb's local files under ``--logging-dir``. A library that is not installed is refused before
the run loads anything, in one line naming the ``pip install`` that adds it
(:func:`check_trackers`).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import socket
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from ..errors import ConfigError

__all__ = ["TRACKERS", "Tracker", "check_trackers", "close_trackers", "default_logging_dir", "open_trackers",
           "parse_report_to", "step_values", "tracker_names"]

#: the trackers ``--report-to`` names, and the module each needs (tensorboard: either)
TRACKERS = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",), "trackio": ("trackio",),
            "mlflow": ("mlflow",)}


def parse_report_to(text: str) -> tuple[str, ...]:
    """``"tensorboard,wandb"`` -> ``("tensorboard", "wandb")``; ``"none"`` -> ``()``."""
    names = tuple(dict.fromkeys(n.strip().lower() for n in text.split(",") if n.strip()))
    bad = [n for n in names if n not in (*TRACKERS, "none")]
    if bad or not names:
        raise ValueError(f"--report-to takes tensorboard, wandb, trackio, mlflow or none, comma-separated "
                         f"(got {text!r})")
    if "none" in names and len(names) > 1:
        raise ValueError(f"--report-to none reports nowhere; it cannot go with {', '.join(n for n in names if n != 'none')}")
    return tuple(n for n in names if n != "none")


def _module(name: str) -> Any:
    """The library a tracker writes through (tensorboard: torch's SummaryWriter, else tensorboardX)."""
    if name == "tensorboard":
        try:
            importlib.import_module("tensorboard")
            from torch.utils.tensorboard import SummaryWriter
            return SummaryWriter
        except ImportError:
            return importlib.import_module("tensorboardX").SummaryWriter
    return importlib.import_module(name)


def tracker_names(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """``report_to`` as given to :class:`TrainConfig` (the flag's text through the Python API
    too) as tracker names."""
    if value is None:
        return ()
    if isinstance(value, str):
        try:
            return parse_report_to(value)
        except ValueError as e:
            raise ConfigError(str(e).replace("--report-to", "{report_to}"), named=True) from None
    return tuple(n for n in value if n != "none")


def check_trackers(value: str | Sequence[str] | None) -> None:
    """Refuse, in one line, a tracker whose library is not installed: before the run loads
    anything, rather than after its first step."""
    for name in tracker_names(value):
        if name not in TRACKERS:
            raise ConfigError(f"{{report_to}} names {name!r}; it takes {', '.join(TRACKERS)} or none", named=True)
        try:
            _module(name)
        except ImportError:
            raise ConfigError(f"{{report_to}} {name} needs the {TRACKERS[name][0]} package, which is not installed; "
                              f"pip install 'flowtrain[{name}]'", named=True) from None


def default_logging_dir() -> str:
    """``runs/DATE_TIME_HOST``, as Hugging Face's Trainer names its logging folders."""
    return os.path.join("runs", datetime.now().strftime("%b%d_%H-%M-%S") + "_" + socket.gethostname())


class Tracker(Protocol):
    """One experiment tracker: the run's settings once, numbers per step, closed at the end."""

    def log(self, step: int, values: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def step_values(loss: float, lr: float, grad_norm: float, tokens_per_s: float, skipped: bool,
                skipped_steps: int) -> dict[str, float]:
    """A step's numbers as the trackers name them."""
    return {"train/loss": loss, "train/learning_rate": lr, "train/grad_norm": grad_norm,
            "train/tokens_per_s": tokens_per_s, "train/skipped": float(skipped),
            "train/skipped_steps": float(skipped_steps)}


def open_trackers(names: str | Sequence[str] | None, logging_dir: str | None, settings: Mapping[str, Any],
                  run_name: str | None = None) -> list[Tracker]:
    """Start each tracker in ``names`` and record ``settings`` with it."""
    folder = logging_dir or default_logging_dir()
    opened: list[Tracker] = []
    try:
        for name in tracker_names(names):
            opened.append(_OPEN[name](_module(name), folder, dict(settings), run_name))
    except BaseException:
        close_trackers(opened)
        raise
    return opened


def close_trackers(trackers: Sequence[Tracker]) -> None:
    for t in trackers:
        t.close()


class _TensorBoard:
    def __init__(self, writer_class: Any, folder: str, settings: dict, run_name: str | None) -> None:
        self.writer = writer_class(log_dir=folder)
        self.writer.add_text("settings", "```\n" + json.dumps(settings, indent=1, default=str) + "\n```", 0)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()  # a step's numbers are on disk for TensorBoard as soon as the step is over

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, wandb: Any, folder: str, settings: dict, run_name: str | None) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "flowtrain"), dir=folder, config=settings,
                              name=run_name)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def close(self) -> None:
        self.run.finish()


class _Trackio:
    def __init__(self, trackio: Any, folder: str, settings: dict, run_name: str | None) -> None:
        self.trackio = trackio
        trackio.init(project=os.environ.get("TRACKIO_PROJECT", "flowtrain"), name=run_name, config=settings)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.trackio.log(dict(values), step=step)

    def close(self) -> None:
        self.trackio.finish()


class _MLflow:
    def __init__(self, mlflow: Any, folder: str, settings: dict, run_name: str | None) -> None:
        self.mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            mlflow.set_tracking_uri(Path(folder).absolute().as_uri())
        mlflow.start_run(run_name=run_name)
        # MLflow keeps parameters as strings of limited length (500 characters in older servers)
        mlflow.log_params({k: json.dumps(v, default=str)[:500] for k, v in settings.items()})

    def log(self, step: int, values: Mapping[str, float]) -> None:
        # MLflow refuses NaN on some stores: a skipped step's loss is left out (train/skipped says it)
        self.mlflow.log_metrics({k: v for k, v in values.items() if math.isfinite(v)}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


_OPEN: dict[str, Any] = {"tensorboard": _TensorBoard, "wandb": _Wandb, "trackio": _Trackio, "mlflow": _MLflow}
