"""No output of ``flowtrain train`` writes over or into what the run reads: ``--out``,
``--metrics`` and ``--trace`` naming, lying inside or holding ``--data``, ``--model``,
``--adapter``, ``--eval-data``, ``--tokenizer`` or the checkpoint being resumed are refused in one
line before anything is written, and the input is left as it was. ``--resume RUN --out RUN``
(later checkpoints beside the resumed one) still runs."""

from __future__ import annotations

import hashlib
import os

import pytest

from flowtrain.cli import main

TINY = ["train", "--model", "tiny", "--seq-len", "16", "--batch-size", "2", "--micro-batch-size", "1",
        "--device", "cpu", "--no-progress", "--lr-schedule", "constant"]


def files(folder) -> dict[str, str]:
    """Every file below ``folder`` with the sha256 of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def refused(capsys, args, needle):
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("flowtrain: error: ") and needle in err[0], err


@pytest.fixture
def run_with_checkpoint(tmp_path, capsys):
    run = tmp_path / "rc"
    assert main([*TINY, "--steps", "2", "--save-every", "2", "--out", str(run)]) == 0
    capsys.readouterr()
    return run


@pytest.mark.parametrize("resume", ["checkpoint", "run folder"])
def test_a_resume_onto_its_own_checkpoint_is_refused_and_it_still_resumes(run_with_checkpoint, capsys, resume):
    run = run_with_checkpoint
    ckpt = run / "checkpoint-2"
    before = files(run)
    source = str(ckpt if resume == "checkpoint" else run)
    refused(capsys, [*TINY, "--steps", "4", "--resume", source, "--out", str(ckpt)],
            "the checkpoint this run resumes from")
    refused(capsys, [*TINY, "--steps", "4", "--resume", source, "--out", str(ckpt / "sub")], "lies inside")
    refused(capsys, [*TINY, "--steps", "4", "--resume", source, "--metrics", str(ckpt / "trainer_state.json")],
            "lies inside")
    # a relative path through a link names the same folder
    link = run.parent / "link"
    os.symlink(run, link)
    cwd = os.getcwd()
    try:
        os.chdir(run.parent)
        refused(capsys, [*TINY, "--steps", "4", "--resume", source, "--out", "link/checkpoint-2"], "resumes from")
    finally:
        os.chdir(cwd)
    assert files(run) == before  # nothing written, not even a lock file
    # the checkpoint still resumes, into its own run folder as documented
    assert main([*TINY, "--steps", "4", "--resume", str(ckpt), "--out", str(run), "--save-every", "2"]) == 0
    assert (run / "checkpoint-4" / "manifest.json").is_file()
    assert {k: v for k, v in files(run).items() if k.startswith("checkpoint-2/")} == \
        {k: v for k, v in before.items() if k.startswith("checkpoint-2/")}


def test_metrics_or_trace_onto_an_input_is_refused_and_the_input_kept(tmp_path, capsys):
    data = tmp_path / "mydata.jsonl"
    data.write_text("".join(f'{{"text": "row {i}: the quick brown fox jumps over the lazy dog"}}\n' for i in range(40)))
    model = tmp_path / "model"
    assert main([*TINY, "--steps", "1", "--out", str(model)]) == 0
    (model / "tokenizer.json").write_text('{"model": {"type": "BPE"}}\n')  # never read: refused before
    data_before, model_before = data.read_bytes(), files(model)
    common = [*TINY, "--steps", "1", "--byte-tokenizer", "--data", str(data)]
    refused(capsys, [*common, "--metrics", str(data)], f"--metrics {data} is --data {data}, which this run reads")
    refused(capsys, [*common, "--trace", str(data)], "is --data")
    refused(capsys, [*common, "--eval-data", str(data), "--eval-every", "1", "--out", str(tmp_path)],
            f"--out {tmp_path} holds --data")
    args = [a if a != "tiny" else str(model) for a in TINY]
    refused(capsys, [*args, "--steps", "1", "--metrics", str(model / "tokenizer.json")],
            "lies inside --model")
    refused(capsys, [*args, "--steps", "1", "--out", str(model), "--overwrite"], "is --model")
    assert data.read_bytes() == data_before and files(model) == model_before
    # beside its inputs, not on them, the same run writes its metrics
    assert main([*common, "--metrics", str(tmp_path / "m.jsonl")]) == 0
    assert (tmp_path / "m.jsonl").read_text().count("\n") == 1 and data.read_bytes() == data_before
