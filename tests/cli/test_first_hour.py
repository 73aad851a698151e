"""What a new user reads first: ``flowtrain --help``, ``help(flowtrain)``, ``from flowtrain import
TrainConfig, train``, switches' help, and CPU plans that speak of the device, not a GPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from flowtrain.cli import main


def _python(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout


def test_train_and_train_config_import_from_the_package_and_train_runs():
    out = _python("import sys, flowtrain; print('torch' in sys.modules)\n"
                  "from flowtrain import TrainConfig, train\n"
                  "m = train(TrainConfig(model='tiny', steps=2, batch_size=2, seq_len=32, device='cpu', progress=False))\n"
                  "print(len(m), type(m[0]).__name__)\n"
                  "import flowtrain.train.run as run; print(callable(run.train))")
    assert out.split() == ["False", "2", "StepMetrics", "True"]  # import flowtrain stays light


def test_help_of_the_package_starts_with_how_to_use_it():
    import pydoc

    import flowtrain

    text = pydoc.render_doc(flowtrain, renderer=pydoc.plaintext)
    head = "\n".join(text.splitlines()[:20])
    assert "from flowtrain import TrainConfig, train" in head and "train(TrainConfig(" in head


def test_flowtrain_help_is_written_for_users(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    description = out.split("positional arguments")[0]
    assert "dispatcher" not in out and "flowtrain train" in description and "flowtrain plan" in description


def test_a_switch_never_shows_its_internal_default(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: True)" not in out and "(default: lines)" not in out
    assert "--no-shuffle sequences in file order; default: shuffled" in out


def test_list_machines_speaks_to_users(capsys):
    with pytest.raises(SystemExit):
        main(["simulate", "--list-machines"])
    assert "lent" not in capsys.readouterr().out


def test_a_cpu_plan_says_device_not_gpu(capsys):
    assert main(["plan", "--model", "tiny", "--seq-len", "64", "--batch-size", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "resident on the device" in out and "device memory:" in out
    assert not re.search(r"\bGPU\b", out), out
