"""A run never replaces or strands another run's checkpoints: resuming from an older
checkpoint into a folder whose run went further is refused where this run would write a
checkpoint of the same step over it, and a new run (``--overwrite``) is refused beside an
earlier run's checkpoints, which a later ``--resume`` would otherwise continue over its model."""

from __future__ import annotations

import hashlib

from flowtrain.cli import main

TINY = ["train", "--model", "tiny", "--seq-len", "16", "--batch-size", "2", "--micro-batch-size", "1",
        "--device", "cpu", "--no-progress", "--lr-schedule", "constant"]


def digest(folder) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(folder.glob("*.safetensors")))).hexdigest()


def test_a_resume_that_would_write_over_a_later_checkpoint_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*TINY, "--steps", "6", "--save-every", "2", "--out", str(out)]) == 0
    before = {n: digest(out / f"checkpoint-{n}") for n in (2, 4, 6)}
    capsys.readouterr()
    args = [*TINY, "--steps", "4", "--save-every", "2", "--resume", str(out / "checkpoint-2")]
    assert main([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds checkpoint-4 of a run that went further" in err[0], err
    assert {n: digest(out / f"checkpoint-{n}") for n in (2, 4, 6)} == before  # nothing replaced
    # the same resume into its own folder runs, and one that saves at other steps is not refused
    assert main([*args, "--out", str(tmp_path / "branch")]) == 0
    assert main([*TINY, "--steps", "5", "--save-every", "5", "--resume", str(out / "checkpoint-2"),
                 "--out", str(out)]) == 0
    assert {n: digest(out / f"checkpoint-{n}") for n in (2, 4, 6)} == before and (out / "checkpoint-5").is_dir()


def test_a_new_run_beside_an_earlier_runs_checkpoints_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*TINY, "--steps", "2", "--save-every", "1", "--out", str(out)]) == 0
    model = digest(out)
    capsys.readouterr()
    assert main([*TINY, "--steps", "2", "--seed", "5", "--overwrite", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds checkpoints of an earlier run (checkpoint-1, checkpoint-2)" in err[0], err
    assert digest(out) == model
