"""``flowtrain plan``'s advice: the one change that fits first (LoRA where full training cannot
fit the host), arithmetic a reader can check, only current flag names, and host memory read the
same way every time."""

from __future__ import annotations

import re

import pytest
import torch

from flowtrain.cli import main
from flowtrain.model.presets import preset
from flowtrain.plan.buffer_sizes import host_memory_total
from flowtrain.plan.memory import GiB, HOST_FILL, budget_limits, host_usable
from flowtrain.plan.planner import plan_run
from flowtrain.plan.request import RunRequest

CUDA = torch.device("cuda")


def _plan(model: str, **kw):
    fields = {"seq_len": 4096, "batch_size": 16, "micro_batch_size": 2, "gpu_mem": 10.0, **kw}
    return plan_run(preset(model), RunRequest(**fields), device=CUDA, dtype=torch.bfloat16)


def test_a_10_gb_card_in_a_64_gb_desktop_is_told_lora(capsys):
    argv = ["plan", "--model", "llama-8b", "--seq-len", "4096", "--batch-size", "16", "--micro-batch-size", "2",
            "--gpu-mem", "10", "--host-mem", "64", "--device", "cuda"]
    assert main(argv) == 1
    advice = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(r"to make it fit: use --lora-rank 16 \(LoRA adapters over the frozen base instead of training "
                        r"every weight: host [\d.]+ GiB of 60.8 usable\)", advice), advice
    assert main([*argv, "--lora-rank", "16"]) == 0  # and it does fit
    capsys.readouterr()


def test_the_advice_is_one_change_never_a_list():
    """llama-1b on an 8 GB card recomputing from checkpoints on the GPU, where nine single
    changes would each fit (offloading the checkpoints, five batch sizes, three checkpoint
    spacings): the first in order is the answer, and it fits."""
    kw = dict(micro_batch_size=1, gpu_mem=8.0, host_mem=118.0, activations="recompute")
    p = _plan("llama-1b", **kw)
    assert not p.fits and p.suggestions == ["use --activations offload"]
    assert _plan("llama-1b", **{**kw, "activations": "offload"}).fits


def test_a_policy_that_fits_the_same_step_comes_before_a_smaller_batch(tmp_path, capsys):
    """llama-8b, 4 x 4,096 on a 10 GB card in a 32 GB desktop with its state on disk: under double
    buffering the offloaded checkpoints do not fit the host, under lookahead (one gradient slot,
    more checkpoints kept on the card) they do; the advice keeps the batch and names the policy,
    and the plan under it fits."""
    argv = ["plan", "--model", "llama-8b", "--seq-len", "4096", "--batch-size", "4", "--micro-batch-size", "2",
            "--gpu-mem", "10", "--host-mem", "32", "--state-dir", str(tmp_path), "--device", "cuda"]
    assert main(argv) == 1
    assert "to make it fit: use --policy lookahead\n" in capsys.readouterr().out
    assert main([*argv, "--policy", "lookahead"]) == 0
    capsys.readouterr()


def test_the_largest_model_is_arithmetic_a_reader_can_check():
    """Where no single change fits: the usable memory less the rest of the run, in GB, over the
    bytes per parameter, is the number of parameters shown."""
    p = _plan("qwen-14b", seq_len=1024, batch_size=2, micro_batch_size=1, host_mem=24.0, lora_rank=16)
    assert not p.fits
    text = "; ".join(p.suggestions)
    m = re.search(r"a model of at most about ([\d.]+) B parameters \(([\d.]+) GiB usable less ([\d.]+) GiB for the "
                  r"rest of the run leaves ([\d.]+) GiB = ([\d.]+) GB, at ([\d.]+) host bytes of state per parameter\)",
                  text)
    assert m, text
    params, usable, rest, leaves, gb, per_param = (float(g) for g in m.groups())
    assert leaves == pytest.approx(usable - rest, abs=0.11)
    assert gb == pytest.approx(leaves * GiB / 1e9, abs=0.11)
    assert params == pytest.approx(gb / per_param, abs=0.06)
    more = int(re.search(r"--host-mem (\d+)", text).group(1))
    assert _plan("qwen-14b", seq_len=1024, batch_size=2, micro_batch_size=1, host_mem=float(more), lora_rank=16).fits


@pytest.mark.parametrize("host", [8.0, 20.0])
def test_never_a_model_of_zero_parameters(host):
    """Where the rest of the run alone fills the host, the plan says so instead of suggesting a
    model of "about 0.0 B parameters"."""
    p = _plan("llama-8b", host_mem=host, lora_rank=16 if host == 8.0 else 0)
    text = "; ".join(p.suggestions)
    assert not p.fits and "0.0 B" not in text
    assert re.search(r"a model of at most about [1-9][\d.]* B|no model fits until it shrinks", text), text


def test_advice_names_only_current_flags(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    flags = set(re.findall(r"--[a-z][a-z0-9-]+", capsys.readouterr().out))
    from flowtrain.plan.suggest import _changes

    kw = dict(seq_len=4096, batch_size=16, micro_batch_size=1, activations="recompute", host_mem=118.0, gpu_mem=8.0,
              grad_clip=True, layout="full")
    p = _plan("llama-1b", **kw)
    changes = [text for text, _, _ in _changes(p, RunRequest(**kw), "double_buffer")]
    plans = [_plan("llama-8b", host_mem=64.0), _plan("llama-8b", host_mem=20.0), p]
    named = {f for s in [*changes, *(s for p in plans for s in p.suggestions)]
             for f in re.findall(r"--[a-z][a-z0-9-]+", s)}
    assert {"--activations", "--batch-size", "--activation-checkpoint-every", "--layout", "--grad-clip",
            "--policy", "--host-mem"} <= named
    assert named and named <= flags, named - flags
    assert "--checkpoint-every" not in named


def test_host_memory_is_read_the_same_way_every_time():
    """Without --host-mem the plan takes this machine's memory less a fixed reserve, which two
    reads (and two plans) agree on, unlike what is free at the moment."""
    first, second = host_usable(), host_usable()
    assert first == second
    total = host_memory_total()
    assert total is not None and first == total - max(total // 10, 2 * GiB)
    req = RunRequest(seq_len=4096, batch_size=16, micro_batch_size=2)
    assert budget_limits(req, torch.device("cpu"), True)[0] == int(first * HOST_FILL)
    assert _plan("llama-1b").host_limit == _plan("llama-1b").host_limit == int(first * HOST_FILL)


def test_the_plan_says_how_it_read_host_memory(capsys):
    assert main(["plan", "--model", "tiny", "--seq-len", "64", "--batch-size", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"host memory usable: [\d.]+ GiB, this machine's [\d.]+ GiB less a reserve of [\d.]+ GiB for the "
                     r"system and other programs", out), out
