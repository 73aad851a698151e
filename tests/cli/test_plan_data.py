"""``flowtrain plan`` speaks of the run ``flowtrain train`` would make: with train's defaults
for what it is not told, and, given ``--data``, at the length train takes from that data."""

from __future__ import annotations

import json

import pytest

from flowtrain.cli import main


@pytest.fixture(autouse=True)
def _data_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWTRAIN_CACHE", str(tmp_path / "cache"))


def rows(tmp_path, lengths):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": "q" * 10, "completion": "a" * k}) + "\n" for k in lengths))
    return path


@pytest.mark.parametrize("lengths, seq_len", [((5, 50, 150), 192), ((5, 20), 64)])
def test_plan_takes_the_length_train_takes_from_the_data(tmp_path, capsys, lengths, seq_len):
    data = rows(tmp_path, lengths)
    assert main(["plan", "--model", "tiny", "--data", str(data), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["seq_len"] == seq_len
    assert main(["train", "--model", "tiny", "--data", str(data), "--steps", "1", "--batch-size", "2",
                 "--micro-batch-size", "1", "--device", "cpu", "--no-progress"]) == 0
    data_line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("data "))
    assert f"sequences of {seq_len} tokens" in data_line or f"sequence of {seq_len} tokens" in data_line, data_line


def test_plan_with_no_run_flags_plans_trains_defaults(capsys):
    assert main(["plan", "--model", "tiny", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["seq_len"] == 128
    assert main(["plan", "--model", "tiny", "--data", "x.jsonl", "--seq-len", "64", "--json"]) == 2  # no such file
    assert "x.jsonl does not exist" in capsys.readouterr().err


def test_a_given_seq_len_is_planned_as_given_and_said_plainly(tmp_path, capsys):
    data = rows(tmp_path, (5, 150))
    assert main(["plan", "--model", "tiny", "--data", str(data), "--seq-len", "96", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["seq_len"] == 96
    assert main(["plan", "--model", "tiny", "--data", str(data)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"seq-len 192, as train takes it from {data}"
