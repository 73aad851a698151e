"""A user's own policy trains a real model, through the Python API and the command line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from flowtrain.errors import ConfigError
from flowtrain.policy import resolve_policy
from flowtrain.train.run import TrainConfig, train

ZIGZAG = textwrap.dedent('''
    from flowtrain.policy import Proposal, natural_order

    class ZigZag:
        """Layer-major backward, micro-batches of every other layer reversed (docs/concepts.md)."""

        def __init__(self, weights=2):
            self.weights = weights

        def propose(self, graph):
            order = natural_order(graph)
            top = max(t.layer for t in graph if t.kind == "backward")
            for layer in range(top - 1, -1, -2):
                at = [k for k, t in enumerate(order) if t.kind == "backward" and t.layer == layer]
                for k, t in zip(at, reversed([order[k] for k in at])):
                    order[k] = t
            return Proposal(order, {"weights": self.weights, "grads": 2})
''')

CFG = dict(model="tiny", steps=3, batch_size=4, micro_batch_size=2, seq_len=32, device="cpu", progress=False)


@pytest.fixture
def zigzag_module(tmp_path, monkeypatch):
    (tmp_path / "my_schedules.py").write_text(ZIGZAG)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_a_user_policy_without_staging_budgets_trains_the_same_weights(tmp_path, zigzag_module):
    """The policy budgets only weights and grads; the staged layout also needs host staging
    slots, which the plan adds (this failed with SlotError: pool 'host_grads' has no budget)."""
    train(TrainConfig(**CFG, out=str(tmp_path / "builtin")))
    train(TrainConfig(**CFG, policy="my_schedules:ZigZag", out=str(tmp_path / "user")))
    a, b = load_file(tmp_path / "builtin" / "model.safetensors"), load_file(tmp_path / "user" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:  # same math, another order: equal up to float summation order
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_policy_module_class_on_the_command_line(tmp_path, zigzag_module):
    proc = subprocess.run([sys.executable, "-m", "flowtrain.cli", "train", "--model", "tiny", "--steps", "2",
                           "--batch-size", "4", "--micro-batch-size", "2", "--seq-len", "32", "--device", "cpu",
                           "--no-progress", "--policy", "my_schedules:ZigZag"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(zigzag_module)},
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "done: 2 steps" in proc.stdout


@pytest.mark.parametrize("spec, needle", [
    ("no_such_module_xyz:Thing", "cannot import module"),
    ("flowtrain.policy:NoSuchPolicy", "has no 'NoSuchPolicy'"),
    ("flowtrain.errors:ConfigError", "is not a policy"),
    ("os:system", "os.system is a builtin_function_or_method, not a class"),  # never called
    ("os:sep", "os.sep is a str, not a class"),
    (":x", "give module:Class"),
    ("json:JSONDecodeError", "json.JSONDecodeError() failed: TypeError"),  # its constructor needs arguments
])
def test_bad_policy_specs_are_one_line(spec, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        resolve_policy(spec)
