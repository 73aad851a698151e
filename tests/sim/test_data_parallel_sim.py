"""``flowtrain plan`` and ``flowtrain simulate`` for data-parallel runs (``--nproc-per-node``,
``--nnodes``): one process's plan with its share of the batch, a ``reduce_grad`` per unit, and a
prediction for all the processes together."""

from __future__ import annotations

import json

import pytest

from flowtrain.cli import main
from flowtrain.graph.tasks import ReduceGrad
from flowtrain.sim.costs import CostModel, Shape
from flowtrain.sim.machine import load_machine

RUN = ["--model", "llama-8b", "--seq-len", "4096", "--micro-batch-size", "4", "--host-mem", "256",
       "--resident", "none", "--machine", "h200", "--json"]


def _simulate(capsys, n, batch, *extra):
    assert main(["simulate", *RUN, "--batch-size", str(batch), "--nproc-per-node", str(n), *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_two_processes_predict_about_twice_the_tokens_and_one_copy_of_the_state(capsys, tmp_path):
    one = _simulate(capsys, 1, 16)
    two = _simulate(capsys, 2, 32, "--trace", str(tmp_path / "two.json"))
    assert two["processes"] == 2 and "net" in two["busy_fraction"]
    assert 1.6 < two["tokens_per_s"] / one["tokens_per_s"] <= 2.0
    # the node holds the state once and each process's own buffers twice
    per_node, each = two["plan"]["host_gib_per_node"], two["plan"]["host_gib"]
    assert 0.95 * one["plan"]["host_gib"] < each <= one["plan"]["host_gib"]  # half the node's undo budget each
    assert each < per_node < 1.1 * each
    trace = json.loads((tmp_path / "two.json").read_text())
    names = [e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert "reduce_grad L0" in names and "sync_step" in names and "net" not in one["busy_fraction"]
    # the simulated process (the node's first) runs Adam on the units it owns: embed, L1, L3, ...
    adam = {e["name"]: e["dur"] for e in trace["traceEvents"] if e.get("ph") == "X" and e["name"].startswith("cpu_adam L")}
    assert adam["cpu_adam L1 c0"] > 100 * adam["cpu_adam L0 c0"]


def test_a_batch_the_processes_cannot_share_is_refused(capsys):
    assert main(["simulate", *RUN, "--batch-size", "20", "--nproc-per-node", "2"]) == 2
    assert "does not split into 2 processes" in capsys.readouterr().err


def test_plan_gives_one_process_its_share(capsys):
    argv = ["plan", "--model", "llama-8b", "--seq-len", "4096", "--micro-batch-size", "4", "--host-mem", "256",
            "--gpu-mem", "80", "--device", "cuda", "--json"]
    assert main([*argv, "--batch-size", "16"]) in (0, 1)
    alone = json.loads(capsys.readouterr().out)
    assert main([*argv, "--batch-size", "32", "--nproc-per-node", "2"]) in (0, 1)
    shared = json.loads(capsys.readouterr().out)
    assert shared["host_limit"] == alone["host_limit"]  # the node's memory, which the plan counts for the node
    assert shared["processes_sharing_host"] == 2
    mine = shared["host_total"] - shared["host"]["master"] - shared["host"]["adam"]
    assert shared["host_node_total"] == shared["host_total"] + mine


def test_a_ring_all_reduce_moves_2_n_minus_1_over_n_of_the_gradient():
    m = load_machine("h200")
    base = dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=100, seq_len=64,
                micro_batch_size=1, layer_numel=10**9)
    task = ReduceGrad(unit="layer", layer=0)
    assert CostModel(m, Shape(**base)).seconds(task) < 1e-4  # one process: nothing to reduce
    t2 = CostModel(m, Shape(**base, world=2)).seconds(task)
    t8 = CostModel(m, Shape(**base, world=8)).seconds(task)
    assert t2 == pytest.approx(4e9 / (m.gpu_link_gbps * 1e9), rel=0.01)  # 2 * 1/2 of 4 GB
    assert t8 == pytest.approx(2 * 7 / 8 * 4e9 / (m.gpu_link_gbps * 1e9), rel=0.01)
    across = CostModel(m, Shape(**base, world=4, nodes=2)).seconds(task)
    assert across == pytest.approx(2 * 3 / 4 * 4e9 / (m.network_gbps * 1e9), rel=0.01)
