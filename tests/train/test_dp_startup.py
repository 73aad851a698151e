"""Data parallel processes that die or stop: one line from the others, no shared files left behind.

The processes of a node share the state through files in ``/dev/shm`` (``flowtrain-NAME-PID-X``,
:mod:`flowtrain.train.shared_state`). A ``kill -9`` during start-up once left them there, and
the survivor died in a traceback from ``node_broadcast``; a ``SIGSTOP``-ped process kept the
others waiting for as long as the backend's own timeout. Here:

- start-up is cut where it hurts, deterministically: a child process sends itself ``SIGKILL``
  at a chosen point (after joining the process group, or after creating the files but before
  handing their names round), and the survivor must raise ``PeerLost`` with every file gone;
- a creator killed with no survivor leaves files that the next start removes (their ``flock``
  is free), and nothing of a live run or anyone else's is touched;
- on the real command line, processes started the way ``torchrun`` starts them (``RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR``... in the environment, without torchrun, which would kill the
  survivor itself) train until ``--metrics`` has lines, then one is killed, or stopped: the
  other ends with exit status 1 and one line, within ``--dist-timeout`` for the stopped one.

Nothing is timed: each test waits on events (a process's exit, a metrics line), and generous
limits only turn a hang into a failure.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowtrain.train.shared_state import create_locked, remove_stale, shared_dir

HANG_GUARD_S = 300

# One process of a two-process node: joins the group and opens the shared state, except that
# the process named by $DIE sends itself SIGKILL at the point $DIE names:
#   "rank1-after-join": rank 1 dies once in the group, before opening the state: the node's
#     first process waits in node_broadcast for it (the traceback once seen);
#   "creator-after-create": rank 0 dies with its files created, before handing their names
#     round: only the survivor can remove them.
OPEN_ARENA = r"""
import os, signal, sys
from flowtrain.train import shared_state
from flowtrain.train.distributed import join, node_barrier, world_from_env

world = world_from_env()
join(world, "cpu", timeout_s=float(os.environ["TIMEOUT_S"]))
node_barrier()  # both are in the group (rank 1 no longer reads the store that rank 0 holds)
die = os.environ["DIE"]
if die == "rank1-after-join" and world.rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
if die == "creator-after-create" and world.rank == 0:
    def broadcast_then_die(obj, world):
        os.kill(os.getpid(), signal.SIGKILL)
    shared_state.node_broadcast = broadcast_then_die
try:
    shared_state.SharedArena.open(world, {"pinned": 1 << 20, "plain": 1 << 20}, pin=False)
except Exception as e:
    print(f"{type(e).__name__}: {e}", file=sys.stderr)
    from flowtrain.train.distributed import exit_after_peer_lost
    exit_after_peer_lost(1)  # as the command line ends on a lost peer
    sys.exit(1)
print("opened")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> list[subprocess.Popen]:
    """Two processes of one node, given the environment torchrun would give them."""
    port = str(free_port())
    procs = []
    for rank in range(2):
        e = {k: v for k, v in os.environ.items() if k not in ("FLOWTRAIN_DEBUG", "FLOWTRAIN_FAULT")}
        e.update(env or {}, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, *argv], env=e, cwd=cwd, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs


def finish(proc: subprocess.Popen) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"hang guard: the process did not end; stderr: {err[-2000:]}") from None


def files_of(*pids: int) -> list[str]:
    """The shared state files that processes ``pids`` created and that still have a name."""
    return sorted(p.name for p in Path(shared_dir()).iterdir()
                  if any(p.name.startswith(f"flowtrain-{n}-{pid}-") for pid in pids for n in ("pinned", "plain")))


@pytest.mark.parametrize("die", ["rank1-after-join", "creator-after-create"])
def test_a_process_killed_during_start_up_ends_the_other_in_one_line_and_leaves_no_file(die):
    procs = start_node(["-c", OPEN_ARENA], env={"DIE": die, "TIMEOUT_S": "120"})
    dead, survivor = (procs[1], procs[0]) if die == "rank1-after-join" else (procs[0], procs[1])
    _, err = finish(survivor)
    finish(dead)
    assert dead.returncode == -signal.SIGKILL
    assert survivor.returncode == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("PeerLost: data parallel: another process is gone"), err
    assert "handing round the shared state's files" in lines[0] or "barrier" in lines[0], err
    assert files_of(procs[0].pid, procs[1].pid) == []


def test_the_files_of_a_killed_creator_are_removed_at_the_next_start_and_nothing_else_is(tmp_path):
    """No survivor: the creator is killed with its files named. They stay until a node's first
    process next opens the shared state (:func:`remove_stale` there), which takes only files
    whose lock is free: not those of a live creator (this test process), not other names."""
    directory = str(tmp_path)  # the same rule as in /dev/shm, without touching other runs' files there
    kill_self = ("import os, signal, sys; from flowtrain.train.shared_state import create_locked; "
                 "print(os.getpid(), create_locked(sys.argv[1], 'pinned', 4096)[0], flush=True); "
                 "os.kill(os.getpid(), signal.SIGKILL)")
    child = subprocess.run([sys.executable, "-c", kill_self, directory], capture_output=True, text=True,
                           timeout=HANG_GUARD_S)
    assert child.returncode == -signal.SIGKILL, child.stderr
    pid, name = child.stdout.split()
    stale = Path(name)
    assert stale.is_file() and stale.name.startswith(f"flowtrain-pinned-{pid}-")
    live, fd = create_locked(directory, "plain", 4096)  # this process's: its lock is held
    other = tmp_path / "flowtrain-notes.txt"
    other.write_text("not a state file")
    try:
        assert remove_stale(directory) == [stale.name]
        assert not stale.exists() and Path(live).exists() and other.exists()
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".flowtrain-")]  # no temporary name left
    finally:
        os.unlink(live)
        os.close(fd)


TRAIN = ["-m", "flowtrain", "train", "--model", "tiny", "--steps", "100000", "--batch-size", "8",
         "--micro-batch-size", "2", "--seq-len", "32", "--device", "cpu", "--no-progress"]


def wait_for_metrics(path: Path, procs: list[subprocess.Popen], n: int = 2) -> None:
    """Until rank 0 reported ``n`` steps; every process must still be running."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not (path.exists() and len(path.read_text().splitlines()) >= n):
        for p in procs:
            if p.poll() is not None:
                for q in procs:
                    q.kill()
                raise AssertionError(f"a process ended before training: {[q.communicate() for q in procs]}")
        if time.monotonic() > deadline:
            for q in procs:
                q.kill()
            raise AssertionError("hang guard: no metrics lines")
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_process_killed_or_stopped_mid_run_ends_the_other_in_one_line(tmp_path, how):
    """``kill -9`` of rank 1: rank 0 sees its connections close and ends at once. ``SIGSTOP``
    of rank 1: rank 0's next collective gives up after ``--dist-timeout``. Either way rank 0
    exits 1 with one line and no traceback, and no shared file of either is left."""
    metrics = tmp_path / "m.jsonl"
    procs = start_node([*TRAIN, "--metrics", str(metrics), "--dist-timeout", "45"], cwd=tmp_path)
    try:
        wait_for_metrics(metrics, procs)
        procs[1].send_signal(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        _, err = finish(procs[0])
    finally:
        procs[1].kill()
        finish(procs[1])
    assert procs[0].returncode == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    if how == "kill":
        assert lines[0].startswith("flowtrain: error: data parallel: another process is gone"), err
    else:
        assert lines[0].startswith("flowtrain: error: data parallel: no answer from another process for 45 s "
                                   "(--dist-timeout)"), err
    assert files_of(procs[0].pid, procs[1].pid) == []


def test_the_timeout_is_a_flag_with_a_default_and_is_checked():
    from flowtrain.cli import build_parser
    from flowtrain.cli.train import config_from_args
    from flowtrain.errors import ConfigError
    from flowtrain.cli.train import flag_of
    from flowtrain.train.config.checks import check_fields
    from flowtrain.train.distributed import DEFAULT_TIMEOUT_S
    from flowtrain.train.config.run_config import TrainConfig

    args = build_parser("train").parse_args(["train"])
    assert config_from_args(args).dist_timeout == DEFAULT_TIMEOUT_S == 1800
    assert config_from_args(build_parser("train").parse_args(["train", "--dist-timeout", "60"])).dist_timeout == 60
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="^dist_timeout must be a finite number > 0") as info:
            check_fields(TrainConfig(dist_timeout=bad))
        assert info.value.spelled(flag_of).startswith("--dist-timeout must be")
