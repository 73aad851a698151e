"""The disk tier in the simulator: ``read_state``/``write_state`` costed from the machine file's
disk rates and queue depth, the model shape knowing whose masters are on disk, and ``flowtrain
simulate --state-dir`` predicting the step with the disk lane."""

from __future__ import annotations

import json

import msgspec
import pytest

from flowtrain.cli import main
from flowtrain.graph.tasks import ReadState, WriteState
from flowtrain.sim.costs import CostModel, Shape
from flowtrain.sim.machine import load_machine

LAYER = 218_112_000  # llama-8b's layer
SHAPE = Shape(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, head_dim=128, vocab=128256,
              seq_len=4096, micro_batch_size=2, layer_numel=LAYER, numel={"embed": 525_336_576, "head": 525_340_672},
              chunk_tokens=512, disk_master=frozenset({"layer.31"}))
#: llama-8b on a 10 GB card: 2 x 4096 fits a 32 GB desktop with the disk tier (4 x 4096 needs
#: 33 GB once the plan counts the field a save reads back)
DESK = ["--machine", "rtx3080-10gb", "--model", "llama-8b", "--seq-len", "4096", "--batch-size", "2",
        "--micro-batch-size", "2", "--gpu-mem", "10"]


def test_masters_on_disk_cost_12_bytes_moments_8():
    m = load_machine("rtx3080-10gb")
    c = CostModel(m, SHAPE)
    lat = m.copy_latency_us * 1e-6
    moments = c.seconds(ReadState(unit="layer", layer=0))
    master = c.seconds(ReadState(unit="layer", layer=31))
    assert moments == pytest.approx(8 * LAYER / (m.disk_read_gbps * 1e9) + lat)
    assert master == pytest.approx(12 * LAYER / (m.disk_read_gbps * 1e9) + lat)
    assert c.seconds(WriteState(unit="layer", layer=31)) == pytest.approx(12 * LAYER / (m.disk_write_gbps * 1e9) + lat)


def test_the_machines_queue_depth_sets_what_the_runs_requests_get():
    m = load_machine("rtx3080-10gb")
    deep = msgspec.structs.replace(m, disk_queue_depth=8)  # the rates need 8 in flight; a run keeps 4
    read = ReadState(unit="layer", layer=0)
    assert CostModel(deep, SHAPE).seconds(read) == pytest.approx(
        2 * CostModel(m, SHAPE).seconds(read) - m.copy_latency_us * 1e-6)
    small = Shape(**{**{f: getattr(SHAPE, f) for f in SHAPE.__struct_fields__}, "layer_numel": 2**20})
    # 8 MiB of moments is one request: a quarter of the depth the machine's rate is for
    assert CostModel(m, small).seconds(read) == pytest.approx(8 * 2**20 / (m.disk_read_gbps / 4 * 1e9)
                                                             + m.copy_latency_us * 1e-6)


def test_shape_knows_whose_masters_are_on_disk():
    from flowtrain.cli.plan import plan_for
    from flowtrain.cli.simulate import SIMULATE_FIELDS
    from flowtrain.cli import build_parser
    from flowtrain.sim.predict import shape_of

    args = build_parser("simulate").parse_args(["simulate", *DESK, "--host-mem", "32", "--state-dir", "/tmp/unused"])
    cfg, req, plan, _, _ = plan_for(args, load_machine("rtx3080-10gb"), fields=SIMULATE_FIELDS)
    shape = shape_of(cfg, plan, req)
    assert shape.disk_master == {k for k, f in plan.disk.items() if "master" in f} and shape.disk_master
    assert set(plan.disk) - shape.disk_master  # the embedding keeps its master in memory


def _simulate(capsys, *argv: str) -> dict:
    assert main(["simulate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_simulate_predicts_the_desktop_step_with_the_disk_lane(tmp_path, capsys):
    state = ["--state-dir", str(tmp_path)]
    tier = _simulate(capsys, *DESK, "--host-mem", "32", *state)
    assert tier["busy_fraction"]["disk"] > 0 and tier["disk_io"]["masters"]
    assert tier["disk_io"]["step_seconds"] == pytest.approx(tier["step_seconds"], rel=1e-3)
    assert tier["plan"]["host_gib"] <= 32
    plain = _simulate(capsys, *DESK, "--host-mem", "128")  # everything in memory
    assert "disk" not in plain["busy_fraction"] and "disk_io" not in plain
    assert tier["step_seconds"] >= plain["step_seconds"]
    # the same memory with and without the tier: the tier costs time, never saves it
    for mode in ("moments", "all"):
        same = _simulate(capsys, *DESK, "--host-mem", "128", *state, "--disk-state", mode)
        assert same["step_seconds"] >= plain["step_seconds"]
    # a slower disk: a longer step, or the same where the disk was hidden
    slow = _simulate(capsys, *DESK, "--host-mem", "32", *state, "--disk-gbs", "2")
    assert slow["step_seconds"] >= tier["step_seconds"]
    assert slow["disk_io"]["read_gbps"] == 2


def test_simulate_text_shows_the_disk_tier(tmp_path, capsys):
    assert main(["simulate", *DESK, "--host-mem", "32", "--state-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "disk " in out.split("busy fraction:")[1].splitlines()[0]
    assert "disk tier (--state-dir" in out and "rtx3080-10gb's disk gives 5 GB/s read, 4 GB/s write" in out


def test_sixteen_sequences_need_more_than_32_gb_even_with_the_tier(tmp_path, capsys):
    # layer order offloads every micro-batch's checkpoints to host memory: 16 x 4096 tokens of
    # llama-8b are 16 GiB of them, which no disk placement of the optimizer state makes room for
    big = [*DESK[:7], "16", *DESK[8:], "--state-dir", str(tmp_path)]
    assert main(["simulate", *big, "--host-mem", "32"]) != 0
    assert "does not fit (host memory" in capsys.readouterr().err
    out = _simulate(capsys, *big, "--host-mem", "64")
    assert out["disk_io"]["moments"] and out["busy_fraction"]["disk"] > 0
