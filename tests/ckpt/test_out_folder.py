"""The ``--out`` folder on the real command line: lineage, symbolic links, and one run at a time.

- ``--save-total-limit`` prunes only the run's own line of training, and ``--resume OUT`` refuses
  a folder whose runs went separate ways instead of silently continuing the newest number.
- ``--out`` may be a symbolic link (to an empty folder, dangling, on another file system); the
  run writes next to the real folder, and ``--overwrite`` replaces the model's files as a set.
- A second run on a folder a run holds is refused at once, naming the holder's pid, and touches
  nothing. The tests that race two processes wait on events (a lock held by the test itself, a
  line in ``--metrics``), never on guessed durations.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from flowtrain.ckpt.checkpoints import Lineage, latest_checkpoint, prune
from flowtrain.ckpt.out_lock import LOCK_NAME, OutLock, check_free
from flowtrain.errors import CheckpointError, ConfigError

TINY = ["--model", "tiny", "--batch-size", "4", "--micro-batch-size", "2", "--seq-len", "32", "--device", "cpu",
        "--no-progress"]


def _env(extra=None):
    e = {k: v for k, v in os.environ.items() if k not in ("FLOWTRAIN_DEBUG", "FLOWTRAIN_FAULT")}
    e.update(extra or {})
    return e


def train(*args, env=None):
    return subprocess.run([sys.executable, "-m", "flowtrain.cli", "train", *TINY, *args], env=_env(env),
                          capture_output=True, text=True, timeout=300)


def start(*args, env=None):
    return subprocess.Popen([sys.executable, "-m", "flowtrain.cli", "train", *TINY, *args], env=_env(env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def ok(proc):
    assert proc.returncode == 0, proc.stderr
    return proc


def refused(proc, needle, status=2):
    assert proc.returncode == status, proc.stderr
    assert needle in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob(".*"))


def lineage(ckpt: Path) -> dict:
    return json.loads((ckpt / "trainer_state.json").read_text())["lineage"]


# ---------------------------------------------------------------------- lineage


@pytest.mark.slow  # a whole run in a subprocess: the slow tier
def test_save_total_limit_prunes_only_the_resumed_runs_own_line(tmp_path):
    """The reported case: a resume from checkpoint-2 with --save-total-limit 1 used to delete
    its own checkpoint-3 (keeping the higher-numbered checkpoint-4 of the first run), after
    which --resume OUT silently continued that other run."""
    p = tmp_path / "p"
    ok(train("--steps", "4", "--save-every", "2", "--out", str(p)))
    first = lineage(p / "checkpoint-4")["run"]
    ok(train("--steps", "3", "--save-every", "1", "--save-total-limit", "1", "--out", str(p),
             "--resume", str(p / "checkpoint-2")))
    # checkpoint-3 is the run's own and just written; checkpoint-2, its ancestor, went to make
    # room; checkpoint-4 is the first run's line, not this run's to delete
    assert [n for n in names(p) if n.startswith("checkpoint-")] == ["checkpoint-3", "checkpoint-4"]
    line = lineage(p / "checkpoint-3")
    assert line["ancestors"] == [[first, 2]] and line["run"] != first
    assert line["parent"] == str(p / "checkpoint-2")
    # --resume OUT must not pick checkpoint-4 because its number is higher: one line, both named
    proc = train("--steps", "5", "--out", str(p), "--resume", str(p))
    refused(proc, "went separate ways")
    assert "checkpoint-4" in proc.stderr and "checkpoint-3 (resumed from checkpoint-2)" in proc.stderr
    assert f"'{p / 'checkpoint-3'}'" in proc.stderr  # how to pick explicitly
    # picked explicitly, it continues
    ok(train("--steps", "4", "--out", str(p), "--resume", str(p / "checkpoint-3")))


@pytest.mark.slow
def test_a_resumed_line_prunes_its_ancestors_and_resume_out_follows_it(tmp_path):
    """The everyday case: a run is stopped and resumed from its --out; the limit holds over the
    whole line, and --resume OUT keeps finding the newest checkpoint."""
    p = tmp_path / "p"
    ok(train("--steps", "2", "--save-every", "1", "--save-total-limit", "2", "--out", str(p)))
    ok(train("--steps", "4", "--save-every", "1", "--save-total-limit", "2", "--out", str(p), "--resume", str(p)))
    assert [n for n in names(p) if n.startswith("checkpoint-")] == ["checkpoint-3", "checkpoint-4"]
    assert latest_checkpoint(p) == p / "checkpoint-4"


def _strip_lineage(ckpt: Path) -> None:
    """Make ``ckpt`` look written before lineage existed (and keep its manifest true)."""
    state = json.loads((ckpt / "trainer_state.json").read_text())
    del state["lineage"]
    data = (json.dumps(state, indent=2) + "\n").encode()
    (ckpt / "trainer_state.json").write_bytes(data)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["trainer_state.json"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.slow
def test_checkpoints_without_lineage_still_resume(tmp_path):
    p = tmp_path / "p"
    ok(train("--steps", "2", "--save-every", "1", "--out", str(p)))
    for c in ("checkpoint-1", "checkpoint-2"):
        _strip_lineage(p / c)
    ok(train("--steps", "3", "--save-every", "1", "--save-total-limit", "2", "--out", str(p), "--resume", str(p)))
    # an old run counts as one line by step number: checkpoint-1 was its ancestor, and pruned
    assert [n for n in names(p) if n.startswith("checkpoint-")] == ["checkpoint-2", "checkpoint-3"]
    assert lineage(p / "checkpoint-3")["ancestors"] == [[None, 2]]
    assert latest_checkpoint(p) == p / "checkpoint-3"


def fake(root: Path, step: int, line: Lineage | None) -> Path:
    """A folder that looks like a finished checkpoint of ``line`` (None: without lineage)."""
    c = root / f"checkpoint-{step}"
    c.mkdir(parents=True)
    (c / "manifest.json").write_text("{}")
    (c / "trainer_state.json").write_text(json.dumps({"step": step, **({"lineage": line.to_json()} if line else {})}))
    return c


def test_prune_and_latest_go_by_lineage(tmp_path):
    a = Lineage.start()
    for s in (1, 2, 3, 4):
        fake(tmp_path, s, a)
    b = Lineage.start({"step": 2, "lineage": a.to_json()}, tmp_path / "checkpoint-2")
    assert b.owns(a.run, 2) and b.owns(a.run, 1) and not b.owns(a.run, 3) and b.owns(b.run, 99)
    fake(tmp_path, 5, b)
    assert Lineage.of(json.loads((tmp_path / "checkpoint-5" / "trainer_state.json").read_text())) == b
    removed = prune(tmp_path, 2, lineage=b, protect=tmp_path / "checkpoint-5")
    assert [p.name for p in removed] == ["checkpoint-1"]  # b's line is 1, 2, 5: a's 3 and 4 are not b's
    assert names(tmp_path) == ["checkpoint-2", "checkpoint-3", "checkpoint-4", "checkpoint-5"]
    assert prune(tmp_path, 0, lineage=b, protect=tmp_path / "checkpoint-5") == [tmp_path / "checkpoint-2"]
    assert (tmp_path / "checkpoint-5").is_dir()  # the checkpoint just written is never deleted
    with pytest.raises(CheckpointError, match=r"checkpoint-5 \(resumed from checkpoint-2\) and checkpoint-4 are "
                                              r"not on one line.*pass the checkpoint to continue"):
        latest_checkpoint(tmp_path)
    assert latest_checkpoint(tmp_path / "checkpoint-4") == tmp_path / "checkpoint-4"
    shutil.rmtree(tmp_path / "checkpoint-3")
    shutil.rmtree(tmp_path / "checkpoint-4")
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-5"
    # a newer run from scratch in the same folder is another line too
    fake(tmp_path, 1, Lineage.start())
    with pytest.raises(CheckpointError, match="went separate ways"):
        latest_checkpoint(tmp_path)


# ---------------------------------------------------------------------- symbolic links


@pytest.mark.parametrize("saves", [[], ["--save-every", "1"]])
def test_out_as_a_link_to_an_empty_folder(tmp_path, saves):
    target, link = tmp_path / "target", tmp_path / "link"
    target.mkdir()
    link.symlink_to(target)
    ok(train("--steps", "2", "--out", str(link), *saves))
    assert link.is_symlink() and os.readlink(link) == str(target)
    made = ["checkpoint-1", "checkpoint-2"] if saves else []
    assert names(target) == [*made, "config.json", "model.safetensors"]
    assert not hidden(tmp_path)


@pytest.mark.slow
def test_out_as_a_dangling_link(tmp_path):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "made")  # its folder exists: the target is created
    ok(train("--steps", "1", "--out", str(link)))
    assert link.is_symlink() and names(tmp_path / "made") == ["config.json", "model.safetensors"]
    link.unlink()
    link.symlink_to(tmp_path / "nowhere" / "x")  # its folder does not: refused before training
    refused(train("--steps", "1", "--out", str(link)), f"{tmp_path / 'nowhere'} does not exist")
    assert names(tmp_path) == ["link", "made"]
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    refused(train("--steps", "1", "--out", str(loop)), "cannot follow its symbolic link")


def _other_file_system(tmp_path: Path) -> Path | None:
    for root in ("/dev/shm", tempfile.gettempdir()):
        if os.path.isdir(root) and os.access(root, os.W_OK) and os.stat(root).st_dev != os.stat(tmp_path).st_dev:
            return Path(tempfile.mkdtemp(prefix="flowtrain-out-", dir=root))
    return None


@pytest.mark.slow
def test_out_as_a_link_to_another_file_system(tmp_path):
    target = _other_file_system(tmp_path)
    if target is None:
        pytest.skip("no writable folder on another file system")
    try:
        link = tmp_path / "link"
        link.symlink_to(target)
        ok(train("--steps", "2", "--save-every", "2", "--out", str(link)))
        assert names(target) == ["checkpoint-2", "config.json", "model.safetensors"]
        assert not hidden(tmp_path) and not hidden(target)
        assert not [p for p in target.parent.iterdir() if p.name.startswith(f".{target.name}.tmp-")]
    finally:
        shutil.rmtree(target, ignore_errors=True)


@pytest.mark.slow
def test_overwrite_through_a_link_replaces_the_model_as_a_whole(tmp_path):
    target, link = tmp_path / "target", tmp_path / "link"
    ok(train("--steps", "1", "--out", str(target)))
    # the old model came with a tokenizer; the new one (a preset, bytes) has none
    (target / "tokenizer.json").write_text("{}")
    (target / "tokenizer_config.json").write_text("{}")
    (target / "notes.txt").write_text("mine")
    link.symlink_to(target)
    ok(train("--steps", "2", "--seed", "1", "--out", str(link), "--overwrite"))
    assert link.is_symlink()
    assert names(target) == ["config.json", "model.safetensors", "notes.txt"]
    assert not hidden(tmp_path)


# ---------------------------------------------------------------------- one run per folder


@pytest.mark.slow  # a whole run in a subprocess: the slow tier
def test_a_second_run_is_refused_while_the_folder_is_held(tmp_path):
    """The test holds the lock itself (as a running run would): no timing involved."""
    out = tmp_path / "out"
    (out / ".checkpoint-2.tmp-abcd").mkdir(parents=True)  # the holder's save in progress
    (out / ".checkpoint-2.tmp-abcd" / "model-00001-of-00004.safetensors").write_bytes(b"half")
    (tmp_path / ".out.tmp-efgh").mkdir()  # the holder's final model being written
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    with OutLock(out):
        with pytest.raises(ConfigError, match=rf"in use by another flowtrain run \(pid {os.getpid()}\)"):
            check_free(out)
        for args in (["--overwrite"], ["--overwrite", "--save-every", "1"]):
            refused(train("--steps", "1", "--out", str(out), *args), f"in use by another flowtrain run (pid {os.getpid()})")
        link = tmp_path / "link"
        link.symlink_to(out)  # the same folder by another name is the same lock
        refused(train("--steps", "1", "--out", str(link), "--overwrite"), f"(pid {os.getpid()})")
        link.unlink()
        assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [*before, f"out/{LOCK_NAME}"]
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before  # released: lock file gone
    ok(train("--steps", "1", "--out", str(out), "--overwrite"))  # free again: its leftovers are cleaned up
    assert names(out) == ["config.json", "model.safetensors"] and not hidden(tmp_path)


def wait_for(condition, proc, what, timeout=120.0):
    """Poll for an event the run signals by writing a file; fail at once if it died."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.02)


@pytest.mark.slow
def test_two_real_runs_on_one_folder(tmp_path):
    """A real first run blocks in step 2's Adam (an injected hang) with checkpoint-2 half
    written; a second run is refused without touching it; once the first dies by SIGKILL the
    kernel has released the lock and a third run may take the folder."""
    out, metrics = tmp_path / "out", tmp_path / "m.jsonl"
    first = start("--steps", "50", "--save-every", "2", "--out", str(out), "--metrics", str(metrics),
                  env={"FLOWTRAIN_FAULT": "cpu_adam@step=1:hang"})
    try:
        # step 1 (the one that saves) is added to the engine before step 0 is reported, so the
        # metrics line means checkpoint-2's temporary folder exists
        wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 1, first, "step 1 reported")
        (tmp,) = [p for p in out.iterdir() if p.name.startswith(".checkpoint-2.tmp-")]
        second = train("--steps", "3", "--out", str(out), "--overwrite", "--save-every", "1")
        refused(second, f"in use by another flowtrain run (pid {first.pid})")
        assert tmp.is_dir() and first.poll() is None
    finally:
        first.kill()
        first.communicate()
    ok(train("--steps", "1", "--out", str(out), "--overwrite"))
    assert not tmp.exists() and names(out) == ["config.json", "model.safetensors"]


def test_the_lock_cleans_up_after_itself(tmp_path):
    out = tmp_path / "a" / "b"
    with OutLock(out) as lock:
        assert (out / LOCK_NAME).read_text().split()[0] == str(os.getpid())
        with pytest.raises(ConfigError, match="in use"):
            OutLock(out)
    assert names(tmp_path) == []  # the folders it made, still empty, are gone again
    lock.release()  # twice is fine
    out.mkdir(parents=True)
    (out / LOCK_NAME).write_text("999999999 elsewhere\n")  # a dead run's file: nobody holds it
    check_free(out)
    assert names(out) == []


def test_a_crashed_saves_leftovers_do_not_make_out_non_empty(tmp_path):
    """A run killed (SIGKILL) while writing checkpoint-2 leaves only its unfinished save (and its
    lock file, which nobody holds) in --out: a new run there without --overwrite is not refused
    as "not empty", and removes them; a folder holding anything else still is refused."""
    out, metrics = tmp_path / "out", tmp_path / "m.jsonl"
    first = start("--steps", "50", "--save-every", "2", "--out", str(out), "--metrics", str(metrics),
                  env={"FLOWTRAIN_FAULT": "cpu_adam@step=1:hang"})
    try:
        # step 1 is reported once step 2 (which saves) is in the engine: its save has begun
        wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 1, first, "step 1 reported")
    finally:
        first.kill()
        first.communicate()
    left = [n for n in names(out) if n != LOCK_NAME]
    assert len(left) == 1 and left[0].startswith(".checkpoint-2.tmp-"), names(out)
    (out / left[0] / "note.txt").write_text("x")  # what is inside an unfinished save does not matter
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / ".checkpoint-2.tmp-abc").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    refused(train("--steps", "1", "--out", str(tmp_path / "busy")), "exists and is not empty")
    ok(train("--steps", "2", "--save-every", "2", "--out", str(out)))
    assert names(out) == ["checkpoint-2", "config.json", "model.safetensors"]
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
