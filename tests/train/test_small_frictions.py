"""What a new user reads first says true things: parameter counts of small models, a one-sequence
step, and a policy module in the working directory found as the docs' example expects."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from flowtrain.cli import main
from flowtrain.policy import resolve_policy

POLICY = textwrap.dedent('''
    from flowtrain.policy import Proposal, natural_order

    class Plain:
        def propose(self, graph):
            return Proposal(natural_order(graph), {"weights": 1, "grads": 1})
''')


def test_plan_counts_a_small_model_in_millions(capsys):
    assert main(["plan", "--model", "tiny", "--seq-len", "64", "--batch-size", "2", "--micro-batch-size", "1",
                 "--device", "cpu"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert " M parameters" in first and "0.00 B" not in first, first


def test_the_start_up_block_speaks_of_one_sequence_in_the_singular(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "flowtrain.cli", "train", "--model", "tiny", "--steps", "1",
                           "--batch-size", "1", "--micro-batch-size", "1", "--seq-len", "32", "--device", "cpu",
                           "--no-progress"], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr
    steps = next(line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("steps "))
    assert "1 of 1 sequence (32 tokens, 1 micro-batch of 1)" in steps, steps


def test_a_policy_module_in_the_working_directory_is_found_and_the_path_left_as_it_was(tmp_path, monkeypatch):
    (tmp_path / "my_plain_policy.py").write_text(POLICY)
    monkeypatch.chdir(tmp_path)
    before = list(sys.path)
    policy = resolve_policy("my_plain_policy:Plain")
    assert type(policy).__name__ == "Plain"
    assert sys.path == before


def test_help_and_the_readme_name_every_preset_and_help_shows_defaults(capsys):
    import re
    from pathlib import Path

    import pytest

    from flowtrain.model.presets import HF_PRESETS, PRESETS

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    listed = re.search(r"named by a preset \(([^)]*)\)", readme).group(1)
    assert re.findall(r"`([^`]+)`", listed) == [*PRESETS, *HF_PRESETS]
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(name in text for name in [*PRESETS, *HF_PRESETS])
    assert "optimizer steps (default: 200)" in text and "tokens per sequence (default: 128)" in text
