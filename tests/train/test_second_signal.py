"""What the last line says after Ctrl-C is true of the run it ends, on the real command line.

With ``--save-every``, the first Ctrl-C asks for a checkpoint of the last finished step and a
second one stops at once without it. The line once said "use --save-every to keep one" there
too, to a user who had. The first signal's checkpoint is held back deterministically: its
``save`` task hangs (``FLOWTRAIN_FAULT``) and announces it in a file, the event the test waits
for before sending the second signal. Nothing is timed.
"""

from __future__ import annotations

import signal

import pytest
from test_signals import finish, hidden, start, wait_for_lines


@pytest.mark.slow  # a whole run in a subprocess: the slow tier
def test_a_second_ctrl_c_with_save_every_says_why_nothing_was_saved(tmp_path):
    out, metrics, hanging = tmp_path / "out", tmp_path / "m.jsonl", tmp_path / "hanging"
    proc = start("--steps", "100000", "--save-every", "1000", "--out", str(out), "--metrics", str(metrics),
                 announce_hangs=True, env={"FLOWTRAIN_FAULT": "save:hang", "FLOWTRAIN_TEST_HANGING": str(hanging)})
    wait_for_lines(metrics, 1, proc)  # training: far from step 1000, so the only save is the signal's
    proc.send_signal(signal.SIGINT)
    wait_for_lines(hanging, 1, proc)  # the first Ctrl-C's checkpoint is being written, and is stuck
    proc.send_signal(signal.SIGINT)
    stdout, err = finish(proc)
    assert proc.returncode == 130, err
    assert "SIGINT: finishing the steps in flight and saving a checkpoint (send it again to stop at once" in stdout
    lines = [x for x in err.splitlines() if x.startswith("flowtrain:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "use --save-every" not in err, err
    assert "no checkpoint was written (the second signal stopped the run before the checkpoint the first one asked " \
           "for was written, and no --save-every 1000 checkpoint was due yet)" in lines[0], err
    assert "task save" in lines[0] and "abandoned" in lines[0]  # the stuck write is named
    assert not list(out.glob("checkpoint-*")) and not hidden(out)


def test_ctrl_c_without_save_every_still_points_at_it(tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = start("--steps", "100000", "--metrics", str(metrics))
    wait_for_lines(metrics, 1, proc)
    proc.send_signal(signal.SIGINT)
    _, err = finish(proc)
    assert proc.returncode == 130, err
    (line,) = [x for x in err.splitlines() if x.startswith("flowtrain:")]
    assert "no checkpoint was written (use --save-every to keep one)" in line, err
