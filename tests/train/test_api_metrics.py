"""What ``train()`` hands back and prints, and how every report numbers the steps.

- The held-out loss (``eval_data``, ``eval_every``) is on the evaluated step's ``StepMetrics``,
  in the returned list and already when ``on_step`` sees it, equal to the ``--metrics`` line.
- ``progress=False`` prints nothing at all; ``--no-progress`` (``progress="lines"``) prints plain
  lines.
- The console, the ``--metrics`` lines, ``StepMetrics.step``, ``checkpoint-N`` and its
  ``trainer_state.json`` all count optimizer steps from 1, and a resumed run goes on from the
  checkpoint's number.
"""

from __future__ import annotations

import json

import pytest

from flowtrain.cli import main
from flowtrain.data.source import default_corpus_path
from flowtrain.train import TrainConfig, train

RUN = dict(model="tiny", batch_size=4, micro_batch_size=2, seq_len=16, device="cpu")
CLI = ["--model", "tiny", "--batch-size", "4", "--micro-batch-size", "2", "--seq-len", "16", "--device", "cpu",
       "--no-progress"]


@pytest.fixture(scope="module")
def eval_text(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval") / "eval.txt"
    path.write_text(default_corpus_path().read_text(encoding="utf-8")[:300], encoding="utf-8")
    return path


def rows(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_the_held_out_loss_reaches_the_returned_metrics_and_on_step(tmp_path, eval_text, capsys):
    seen = []
    metrics = train(TrainConfig(steps=5, eval_data=str(eval_text), eval_every=2, progress=False,
                                metrics=str(tmp_path / "m.jsonl"), **RUN),
                    on_step=lambda m: seen.append((m.step, m.eval_loss, m.eval_tokens)))
    assert capsys.readouterr() == ("", "")  # progress=False: nothing printed
    assert seen == [(m.step, m.eval_loss, m.eval_tokens) for m in metrics]  # filled before on_step saw them
    evaluated = {m.step: (m.eval_loss, m.eval_tokens) for m in metrics if m.eval_loss is not None}
    assert sorted(evaluated) == [2, 4, 5]  # every 2 steps of 5, and after the last
    assert all(m.eval_tokens is None for m in metrics if m.step not in evaluated)
    lines = rows(tmp_path / "m.jsonl")
    assert {r["step"]: (r["eval_loss"], r["eval_tokens"]) for r in lines if "eval_loss" in r} == evaluated
    assert all(loss > 0 and tokens > 0 for loss, tokens in evaluated.values())
    assert [r["step"] for r in lines if "loss" in r] == [1, 2, 3, 4, 5]
    assert not any("eval_loss" in r for r in lines if "loss" in r)  # the held-out loss has lines of its own


def test_progress_false_prints_nothing_and_lines_prints_lines(tmp_path, capsys):
    train(TrainConfig(steps=2, progress=False, **RUN))
    assert capsys.readouterr() == ("", "")
    train(TrainConfig(steps=2, progress="lines", **RUN))
    out = capsys.readouterr().out
    assert "step 1/2  loss" in out and "step 2/2  loss" in out


def test_console_metrics_and_checkpoints_count_steps_alike(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["train", *CLI, "--steps", "4", "--save-every", "2", "--out", str(out),
                 "--metrics", str(tmp_path / "a.jsonl")]) == 0
    printed = capsys.readouterr().out
    lines = rows(tmp_path / "a.jsonl")
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    for r in lines:
        assert f"step {r['step']}/4  loss {r['loss']:.4f}" in printed
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["last_loss"] == lines[1]["loss"]  # checkpoint-2: after the line of step 2
    assert main(["train", *CLI, "--steps", "4", "--resume", str(out / "checkpoint-2"), "--out", str(tmp_path / "b"),
                 "--metrics", str(tmp_path / "b.jsonl")]) == 0
    assert [r["step"] for r in rows(tmp_path / "b.jsonl")] == [3, 4]
    assert "step 3/4  loss" in capsys.readouterr().out
