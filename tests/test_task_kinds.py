"""Every task kind has an entry in every table that runs, prices or draws it, and adding a
kind takes one class and one entry per table (docs/concepts.md, "Adding a task kind").

The toy kind here does what the checklist says, end to end: a class, a handler that the real
training program runs inside real training steps (it checksums a unit's fp32 master once the
unit's Adam of the step is done), a cost the simulator charges, and a colour; a run with it
writes the same model as a run without it, and its last checksums are those of the saved
weights.
"""

from __future__ import annotations

from typing import ClassVar

import networkx as nx
import pytest
import torch
from safetensors.torch import load_file

import flowtrain.sim.costs as costs
import flowtrain.train.loop as loop_module
import flowtrain.train.program as program
import flowtrain.viz.graphview as graphview
from flowtrain.graph.registry import TABLES, KindTable, kinds_missing, register_kind, unregister_kind
from flowtrain.graph.tasks import KINDS, CpuAdam, Task, Unit, task_from_dict, task_to_dict
from flowtrain.sim.machine import load_machine
from flowtrain.train import TrainConfig, train
from tests.sim.test_costs import W1

#: the three parts that must know every kind: the program runs it, the simulator prices it, the
#: visualizer colours it
PARTS = {program.HANDLERS.name, costs.COSTS.name, graphview.KIND_COLORS.name}


def test_every_kind_has_a_handler_a_cost_and_a_colour():
    assert PARTS <= set(TABLES), f"a part's table is missing: {PARTS - set(TABLES)}"
    assert kinds_missing() == {}, f"task kinds without an entry: {kinds_missing()}"
    for table in (program.HANDLERS, costs.COSTS, graphview.KIND_COLORS):
        assert set(table) == set(KINDS), table.name


def test_a_table_refuses_an_unknown_kind_and_a_second_entry():
    table: KindTable[int] = KindTable("a test's table")
    try:
        with pytest.raises(ValueError, match="no task kind 'nonsense'"):
            table.add("nonsense", 1)
        table.add("fetch", 1)
        with pytest.raises(ValueError, match="'fetch' is entered twice"):
            table.add("fetch", 2)
        with pytest.raises(KeyError, match="a test's table has no entry for task kind 'forward'"):
            table["forward"]
        assert "forward" in table.missing() and "fetch" not in table.missing()
    finally:
        TABLES.pop("a test's table")


class MasterChecksum(Task, frozen=True, kw_only=True, tag="toy_checksum"):
    """The fp32 sum of one unit's master weights once its Adam of the step is done."""

    unit: Unit
    scope: ClassVar[str] = "unit"
    lane: ClassVar[str] = "cpu"


@pytest.fixture
def toy_kind():
    """The toy kind, known to the graph for the test's duration (and every table's entry
    forgotten after it)."""
    register_kind(MasterChecksum)
    try:
        yield MasterChecksum
    finally:
        unregister_kind("toy_checksum")
    assert "toy_checksum" not in KINDS and kinds_missing() == {}


def _with_checksums(compile_step):
    """``compile_step`` that adds, after every streamed unit's last ``cpu_adam`` of the step,
    a checksum of that unit."""

    def compile_with_checksums(spec, step=0):
        graph: nx.DiGraph = compile_step(spec, step=step)
        adams: dict[tuple[str, int | None], list[Task]] = {}
        for t in graph:
            if isinstance(t, CpuAdam):
                adams.setdefault((t.unit, t.layer), []).append(t)
        for (unit, layer), tasks in adams.items():
            probe = MasterChecksum(step=step, unit=unit, layer=layer)
            graph.add_edges_from((t, probe) for t in tasks)
        return graph

    return compile_with_checksums


def test_a_new_kind_is_a_class_and_an_entry_in_each_table(tmp_path, monkeypatch, toy_kind):
    probe = MasterChecksum(step=1, unit="layer", layer=0)
    assert task_from_dict(task_to_dict(probe)) == probe  # it decodes as the built-in kinds do
    assert kinds_missing() == {name: ["toy_checksum"] for name in TABLES}  # every table says what it lacks

    sums: dict[tuple[int, str, int | None], float] = {}

    @program.HANDLERS.register("toy_checksum")
    def run_checksum(p, task, ctx):
        sums[(task.step, task.unit, task.layer)] = float(p.unit(task).master.double().sum())

    costs.COSTS.register("toy_checksum")(lambda c, task: c.s.unit_numel(task) * 4 / (c.m.d2h_gbps * 1e9))
    graphview.KIND_COLORS.add("toy_checksum", "#123456")
    assert kinds_missing() == {}

    c = costs.CostModel(load_machine("h200"), W1)
    assert c.seconds(probe) == pytest.approx(4 * W1.layer_numel / (c.m.d2h_gbps * 1e9))
    assert graphview.color("toy_checksum") == "#123456"

    cfg = dict(model="tiny", steps=3, batch_size=4, micro_batch_size=2, seq_len=32, device="cpu", progress=False,
               layout="full")
    train(TrainConfig(**cfg, out=str(tmp_path / "plain")))
    monkeypatch.setattr(loop_module, "compile_step", _with_checksums(loop_module.compile_step))
    train(TrainConfig(**cfg, out=str(tmp_path / "probed")))

    plain = load_file(tmp_path / "plain" / "model.safetensors")
    probed = load_file(tmp_path / "probed" / "model.safetensors")
    assert plain.keys() == probed.keys() and all(torch.equal(plain[k], probed[k]) for k in plain)
    steps = {s for s, _, _ in sums}
    assert steps == {0, 1, 2}, sums  # one checksum per unit in every step, after its update
    assert sums[(2, "layer", 0)] != sums[(1, "layer", 0)]
    layer0 = [v for k, v in probed.items() if k.startswith("model.layers.0.")]
    assert sums[(2, "layer", 0)] == pytest.approx(float(sum(t.double().sum() for t in layer0)), rel=1e-9)
