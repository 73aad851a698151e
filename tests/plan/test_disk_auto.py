"""``--disk-state auto``: what the planner moves to the state folder as ``--host-mem`` shrinks.

Nothing while the state fits; then the Adam moments, unit by unit in the order the step's Adam
reaches them (head, layers from the top, embedding); only once every moment is there, masters
(their compute-dtype copy staying); and a limit not met even with everything there is refused in
one line that says what host memory still holds.
"""

from __future__ import annotations

import pytest

from flowtrain.cli import main
from flowtrain.plan.disk import adam_order
from flowtrain.plan.memory import GiB, Precision, Target
from flowtrain.plan.planner import plan_run
from flowtrain.plan.request import run_request
from flowtrain.train.config.run_config import TrainConfig, load_model_config

UNITS = adam_order(["embed", "head", *(f"layer.{i}" for i in range(32))])


def _plan(host_mem: float, mode: str = "auto", state_dir: str | None = "/nvme/state"):
    tc = TrainConfig(model="llama-8b", seq_len=4096, batch_size=4, micro_batch_size=2, gpu_mem=10, host_mem=host_mem,
                     state_dir=state_dir, disk_state=mode, device="cuda")
    cfg, model_dir = load_model_config(tc.model, tc.layer_path)
    return plan_run(cfg, run_request(tc, model_dir), device=Target("cuda"), dtype=Precision(2), local_gpu=False)


def test_adam_order_is_head_layers_from_the_top_embed():
    assert UNITS[:3] == ["head", "layer.31", "layer.30"] and UNITS[-2:] == ["layer.0", "embed"]


@pytest.mark.parametrize("host_mem", [200, 128])
def test_nothing_moves_when_everything_fits(host_mem):
    plan = _plan(host_mem)
    assert plan.fits and plan.disk == {} and plan.disk_tier
    assert plan.host == _plan(host_mem, state_dir=None).host  # the same plan as without a state folder
    assert "host_state" not in plan.budgets


def test_moments_first_then_masters_as_host_memory_shrinks():
    seen = []
    for host_mem in (128, 96, 80, 64, 48, 40, 33):
        plan = _plan(host_mem)
        assert plan.fits and plan.host_node_total <= plan.host_limit, host_mem
        moments = [k for k in UNITS if "exp_avg" in plan.disk.get(k, ())]
        masters = [k for k in UNITS if "master" in plan.disk.get(k, ())]
        assert moments == UNITS[:len(moments)]  # a prefix of the Adam order
        assert masters == UNITS[:len(masters)]
        assert not masters or moments == UNITS  # masters only once every moment is on disk
        seen.append((len(moments), len(masters)))
    assert seen == sorted(seen)  # less memory never puts less on disk
    assert seen[0] == (0, 0) and 0 < seen[1][0] < len(UNITS) and seen[-1][1] > 0
    # a master on disk leaves its bf16 copy for the fetches: 2 bytes of the 4 freed
    plan = _plan(33)
    n = sum(1 for f in plan.disk.values() if "master" in f)
    assert plan.host["streaming_copy"] > 0 and n


def test_each_move_is_what_it_takes():
    """auto stops as soon as the plan fits: one unit fewer on disk would not fit."""
    plan = _plan(80)
    moved = len(plan.disk)
    assert 0 < moved < len(UNITS)
    over = plan.host_node_total - plan.host_limit
    assert over <= 0
    # the last unit moved freed its 8 bytes per parameter; without it the plan was over the limit
    assert plan.host_node_total + 8 * 218_112_000 > plan.host_limit


def test_a_limit_not_met_with_everything_on_disk_is_refused_in_one_line(capsys):
    plan = _plan(16)
    assert not plan.fits and all(f == ("master", "exp_avg", "exp_avg_sq") for f in plan.disk.values())
    assert set(plan.disk) == set(UNITS)
    line = plan.refusal()
    assert "\n" not in line and "all the optimizer state there is to move" in line
    assert "left in host memory: streaming_copy" in line and "disk_staging" in line
    assert "B parameters" not in line  # no model size reckoned at 12 host bytes per parameter
    args = ["--model", "llama-8b", "--seq-len", "4096", "--batch-size", "4", "--micro-batch-size", "2",
            "--gpu-mem", "10", "--host-mem", "16", "--state-dir", "/nvme/state"]
    assert main(["simulate", "--machine", "rtx3080-10gb", *args]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "left in host memory: streaming_copy 15.0 GiB" in err


def test_moments_mode_refused_says_all_would_move_more():
    plan = _plan(32, mode="moments")
    assert not plan.fits
    assert "--disk-state all or auto puts the masters there too" in plan.refusal()


def test_all_and_moments_put_every_streamed_unit_there_whatever_fits():
    every = _plan(200, mode="all")
    assert set(every.disk) == set(UNITS) and every.host["master"] < GiB
    moments = _plan(200, mode="moments")
    assert all(f == ("exp_avg", "exp_avg_sq") for f in moments.disk.values()) and moments.host["adam"] == 0
