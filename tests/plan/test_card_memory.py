"""``--gpu-mem N`` is a card of N GiB as ``nvidia-smi`` shows it, and a plan keeps within both
the card and host memory, naming the one that binds.

On a real card the CUDA context and the libraries' kernels and workspaces take memory outside
PyTorch's allocator, so the plan and the allocator's cap get the card less that share; and where
host memory is short, residency on a small GPU is no way out: the plan says what host memory
would fit, or what model these budgets hold.
"""

from __future__ import annotations


import pytest
import torch

from flowtrain.cli import main
from flowtrain.errors import ConfigError
from flowtrain.model import preset
from flowtrain.plan.memory import (
    CAP_STRANDED_GIB,
    CARD_HEADROOM_GIB,
    CUDA_OUTSIDE_ALLOCATOR_GIB,
    GPU_FILL_CAPPED,
    GiB,
    RunRequest,
    allocator_share,
    card_for,
)
from flowtrain.plan.planner import plan_run
from flowtrain.train.config.run_config import TrainConfig

CUDA = torch.device("cuda")


def _plan(model: str, **kw):
    fields = {"seq_len": 4096, "batch_size": 16, "micro_batch_size": 2, **kw}
    return plan_run(preset(model), RunRequest(**fields), device=CUDA, dtype=torch.bfloat16)


@pytest.mark.parametrize("card, stranded_binds", [(4.0, True), (8.0, True), (10.0, True), (24.0, True), (139.8, False)])
def test_a_card_leaves_what_cuda_takes_outside_the_allocator(card, stranded_binds):
    """The plan fills a card's allocator share less what the allocator strands in pages it
    keeps mapped (a fixed amount: what binds on small cards), or less 1% where that is more
    (a large card's)."""
    share = allocator_share(card)
    assert share == int((card - CUDA_OUTSIDE_ALLOCATOR_GIB - CARD_HEADROOM_GIB) * GiB)
    plan = _plan("llama-1b", host_mem=64, gpu_mem=card)
    expected = share - int(CAP_STRANDED_GIB * GiB) if stranded_binds else int(share * GPU_FILL_CAPPED)
    assert plan.gpu_limit == expected
    assert card_for(plan.gpu_limit) == pytest.approx(card, abs=1e-6)


def test_a_card_smaller_than_cuda_itself_is_refused_in_one_line(capsys):
    with pytest.raises(ConfigError, match="--gpu-mem 0.5 is smaller than what CUDA itself takes"):
        allocator_share(0.5)
    with pytest.raises(ConfigError, match="--gpu-mem 1.4 is smaller"):
        allocator_share(CUDA_OUTSIDE_ALLOCATOR_GIB + CARD_HEADROOM_GIB)
    assert main(["plan", "--model", "tiny", "--seq-len", "64", "--batch-size", "2", "--micro-batch-size", "1",
                 "--gpu-mem", "0.5", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--gpu-mem 0.5" in err


@pytest.mark.parametrize("model, host", [("llama-8b", 64), ("llama-3b", 32)])
def test_where_host_memory_is_short_the_plan_keeps_the_card_and_says_what_would_fit(model, host):
    """A 10 GB card in a desktop with too little host memory: layers move onto the GPU only as
    far as the card holds them (never the whole model onto a card it overflows), the refusal
    names host memory, and the one change it suggests, LoRA adapters over the frozen base, does
    fit (tests/plan/test_plan_advice.py: what it says where no single change fits)."""
    plan = _plan(model, gpu_mem=10, host_mem=host)
    assert not plan.fits and not plan.host_fits and plan.gpu_fits
    refusal = plan.refusal()
    assert "host memory: needs" in refusal and "GPU memory: needs" not in refusal
    assert plan.suggestions == [s for s in plan.suggestions if s.startswith("use --lora-rank 16 ")]
    assert len(plan.suggestions) == 1 and _plan(model, gpu_mem=10, host_mem=host, lora_rank=16).fits


def test_a_card_size_asks_for_expandable_segments():
    from flowtrain.train.prepare import prefer_expandable_segments

    env: dict[str, str] = {}
    assert prefer_expandable_segments(TrainConfig(seq_len=4096, micro_batch_size=2, gpu_mem=10), env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    mine = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    assert not prefer_expandable_segments(TrainConfig(seq_len=4096, micro_batch_size=2, gpu_mem=10), mine)
