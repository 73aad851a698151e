"""A model's config.json is bounded when it is read, before anything is sized from it.

``vocab_size`` 10**12 once reached 24 GB in the graph compiler before it failed, 10**6 layers ran
for minutes, and 10**4 layers allocated 5.8 GB of host state before the missing weights were
noticed. Now every size has a bound far above any real model, the parameter count is bounded
(10**13: more than a machine's host memory), and a model folder's safetensors headers are
checked against the config: each ends in one line naming the field, the value and the bound,
exit status 2.

The command-line tests run ``flowtrain train`` and ``flowtrain plan`` in a child whose address
space is capped at 3 GiB (``RLIMIT_AS``; importing torch fits): a refusal that came after a
large allocation would die of a MemoryError instead of printing its line. Nothing is timed; the
child's CPU-time limit and the subprocess timeout only guard against a hang.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest

from flowtrain.errors import ConfigError
from flowtrain.model.config import MAX_PARAMETERS, SIZE_BOUNDS
from flowtrain.model.presets import preset
from flowtrain.model.hf_config import from_hf, to_hf

ADDRESS_SPACE = 3 << 30
HANG_GUARD_S = 300


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))
    resource.setrlimit(resource.RLIMIT_CPU, (HANG_GUARD_S, HANG_GUARD_S))


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """``flowtrain ARGS`` in a child with a 3 GiB address space and 2 threads."""
    env = {k: v for k, v in os.environ.items() if k != "FLOWTRAIN_DEBUG"}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "flowtrain", *args], capture_output=True, text=True,
                          env=env, preexec_fn=_limited, timeout=HANG_GUARD_S)


def one_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return lines[0]


def hf(**changes) -> dict:
    return {**to_hf(preset("tiny")), **changes}


def model_dir(tmp_path, name="model", **changes):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf(**changes)))
    return folder


PLAN = ("--seq-len", "16", "--batch-size", "1", "--micro-batch-size", "1")


# ---------------------------------------------------------------------- through the command line


@pytest.mark.parametrize("key, value, bound", [
    ("vocab_size", 10**12, "16,777,216"),
    ("num_hidden_layers", 10**6, "4,096"),
    ("num_hidden_layers", 10**4, "4,096"),
])
def test_train_refuses_an_absurd_size_in_one_line(tmp_path, key, value, bound):
    folder = model_dir(tmp_path, **{key: value})
    line = one_line(run_cli("train", "--no-progress", "--model", str(folder), "--byte-tokenizer"))
    assert f"config.json: {key} {value} is above the bound {bound}" in line


@pytest.mark.parametrize("key, value", [("vocab_size", 10**12), ("num_hidden_layers", 10**6)])
def test_plan_refuses_an_absurd_size_in_one_line(tmp_path, key, value):
    folder = model_dir(tmp_path, **{key: value})
    line = one_line(run_cli("plan", "--model", str(folder), *PLAN))
    assert f"{key} {value} is above the bound" in line


def test_plan_refuses_more_parameters_than_any_machine_holds(tmp_path):
    # Every size within its bound, but 1.7e15 parameters together.
    folder = model_dir(tmp_path, hidden_size=1 << 16, intermediate_size=1 << 21, num_hidden_layers=4096,
                       num_attention_heads=512, num_key_value_heads=8, head_dim=128)
    line = one_line(run_cli("plan", "--model", str(folder), *PLAN))
    assert "1.72e+15 parameters is above the bound 1e+13" in line and "num_layers 4096" in line


def test_weights_that_do_not_match_the_config_are_refused_before_any_allocation(tmp_path):
    """config.json says 1,000 wide layers (17G parameters, far more than 3 GiB); the weights hold
    two tiny ones. The safetensors header says so before host state for 1,000 is allocated."""
    import torch

    from flowtrain.ckpt.hf import save_hf
    from flowtrain.model import model_flat_maps

    cfg = preset("tiny")
    folder = tmp_path / "model"
    save_hf(folder, cfg, model_flat_maps(cfg), [torch.zeros(lay.numel) for lay in model_flat_maps(cfg)])
    d = json.loads((folder / "config.json").read_text())
    d.update(num_hidden_layers=1000, hidden_size=1024, intermediate_size=4096)
    (folder / "config.json").write_text(json.dumps(d))
    line = one_line(run_cli("train", "--no-progress", "--model", str(folder), "--byte-tokenizer"))
    assert "tensor 'model.embed_tokens.weight'" in line and "has shape (256, 64)" in line
    assert "(256, 1024)" in line


# ---------------------------------------------------------------------- the reader itself


@pytest.mark.parametrize("field", list(SIZE_BOUNDS))
def test_each_size_has_a_bound_named_with_its_value(field):
    key, bound = SIZE_BOUNDS[field]
    with pytest.raises(ConfigError) as info:
        from_hf(hf(**{key: bound + 1}))
    assert str(info.value).startswith(f"config.json: {key} {bound + 1} is above the bound {bound:,};")


@pytest.mark.parametrize("field", list(SIZE_BOUNDS))
def test_a_config_built_in_python_is_bounded_too(field):
    import msgspec

    bound = SIZE_BOUNDS[field][1]
    with pytest.raises(ConfigError, match=f"model config: {field} {bound + 1} is above the bound"):
        msgspec.structs.replace(preset("tiny"), **{field: bound + 1}).validate()


def test_a_huge_integer_is_named_not_printed():
    with pytest.raises(ConfigError) as info:
        from_hf(hf(vocab_size=10**400))
    assert "an integer of 1329 bits is above the bound" in str(info.value) and len(str(info.value)) < 200


def test_every_preset_is_within_the_bounds():
    from flowtrain.model.presets import PRESETS

    for cfg in PRESETS.values():
        assert cfg.validate().num_parameters() <= MAX_PARAMETERS


def test_a_gemma_config_is_bounded_before_its_layer_types_are_built():
    d = {**to_hf(preset("gemma3-1b")), "num_hidden_layers": 10**9}
    d.pop("layer_types")
    with pytest.raises(ConfigError, match="num_hidden_layers 1000000000 is above the bound"):
        from_hf(d)
