"""``--report-to``: experiment trackers fed the numbers of the ``--metrics`` lines.

TensorBoard is read back with its own ``EventAccumulator``: its ``train/loss`` scalars must be
the metrics file's losses, step by step. wandb, trackio and MLflow are replaced by modules that
record the calls made to them (which tests flowtrain's wiring: what it calls, with what). A
missing library is one line before the run loads anything.
"""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest

from flowtrain.cli import main
from flowtrain.train.reporters import parse_report_to

STEPS = 4


def train_args(tmp_path, *extra: str) -> list[str]:
    return ["train", "--model", "tiny", "--steps", str(STEPS), "--batch-size", "2", "--seq-len", "32",
            "--device", "cpu", "--no-progress", "--metrics", str(tmp_path / "m.jsonl"), *extra]


def metrics(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]


@pytest.fixture(autouse=True)
def _data_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWTRAIN_CACHE", str(tmp_path / "cache"))


def test_tensorboard_scalars_equal_the_metrics_file_step_by_step(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    corpus = tmp_path / "eval.txt"
    corpus.write_text("a held-out text to take the loss of, long enough for a sequence or two. " * 4)
    assert main(train_args(tmp_path, "--report-to", "tensorboard", "--logging-dir", str(tmp_path / "tb"),
                           "--eval-data", str(corpus), "--eval-every", "2")) == 0
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    lines = metrics(tmp_path)
    steps = [m for m in lines if "loss" in m]
    evals = [m for m in lines if "eval_loss" in m]
    assert len(steps) == STEPS and len(evals) == 2
    for tag, rows, key in [("train/loss", steps, "loss"), ("train/learning_rate", steps, "lr"),
                           ("train/grad_norm", steps, "grad_norm"), ("train/tokens_per_s", steps, "tokens_per_s"),
                           ("eval/loss", evals, "eval_loss")]:
        scalars = events.Scalars(tag)
        assert [s.step for s in scalars] == [m["step"] for m in rows], tag
        assert [s.value for s in scalars] == [float(np.float32(m[key])) for m in rows], tag  # kept as float32
    assert [s.value for s in events.Scalars("train/skipped")] == [0.0] * STEPS
    settings = events.Tensors("settings/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"steps": 4' in settings and '"report_to": [\n  "tensorboard"\n ]' in settings


class Recorder(types.ModuleType):
    """A stand-in for a tracker's module: records every call made to it, and to what it returns."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.calls: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)

        def call(*args, **kwargs):
            self.calls.append((attr, args, kwargs))
            return self  # wandb.init() returns a run: the same recorder, whose calls are recorded too
        return call

    def named(self, attr: str) -> list[tuple[tuple, dict]]:
        return [(a, k) for name, a, k in self.calls if name == attr]


@pytest.mark.parametrize("name, start, log, end", [
    ("wandb", "init", "log", "finish"),
    ("trackio", "init", "log", "finish"),
    ("mlflow", "start_run", "log_metrics", "end_run"),
])
def test_wandb_trackio_and_mlflow_get_the_settings_once_every_step_and_the_end(tmp_path, monkeypatch, name, start,
                                                                                log, end):
    fake = Recorder(name)
    monkeypatch.setitem(sys.modules, name, fake)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(train_args(tmp_path, "--report-to", name, "--logging-dir", str(tmp_path / "logs"))) == 0
    assert len(fake.named(start)) == 1 and len(fake.named(end)) == 1
    assert [c[0] for c in fake.calls].index(start) < [c[0] for c in fake.calls].index(log)
    if name == "mlflow":
        (params,), _ = fake.named("log_params")[0]
        assert params["steps"] == "4" and params["report_to"] == '["mlflow"]'
        assert fake.named("set_tracking_uri")[0][0][0] == (tmp_path / "logs").as_uri()
    else:
        settings = fake.named("init")[0][1]["config"]
        assert settings["steps"] == STEPS and list(settings["report_to"]) == [name]
    logged = fake.named(log)
    assert [k["step"] for _, k in logged] == [1, 2, 3, 4]
    assert [a[0]["train/loss"] for a, _ in logged] == [m["loss"] for m in metrics(tmp_path)]
    assert set(logged[0][0][0]) == {"train/loss", "train/learning_rate", "train/grad_norm", "train/tokens_per_s",
                                    "train/skipped", "train/skipped_steps"}


@pytest.mark.parametrize("name", ["tensorboard", "wandb", "trackio", "mlflow"])
def test_a_missing_library_is_one_line_before_the_run_starts(tmp_path, monkeypatch, capsys, name):
    for module in ("tensorboard", "tensorboardX") if name == "tensorboard" else (name,):
        monkeypatch.setitem(sys.modules, module, None)  # import fails as if it were not installed
    assert main(train_args(tmp_path, "--report-to", name)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"flowtrain: error: --report-to {name} needs the {name} "
                   f"package, which is not installed; pip install 'flowtrain[{name}]'"]
    assert not (tmp_path / "m.jsonl").exists()  # nothing ran


@pytest.mark.parametrize("text, expected", [
    ("tensorboard", ("tensorboard",)), ("tensorboard,wandb", ("tensorboard", "wandb")),
    ("none", ()), (" MLflow , trackio ", ("mlflow", "trackio")), ("tensorboard,tensorboard", ("tensorboard",)),
])
def test_parse_report_to(text, expected):
    assert parse_report_to(text) == expected


@pytest.mark.parametrize("text", ["comet", "", "none,wandb"])
def test_parse_report_to_refuses(text):
    with pytest.raises(ValueError, match="--report-to"):
        parse_report_to(text)
