"""``flowtrain graph``: the JSON it writes, checked as a consumer would read it (plain
networkx, no flowtrain types), including the issue's "done when" properties for
``flowtrain graph --layers 4 --micro-batches 2 --out g.json``."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import networkx as nx
import pytest

from flowtrain.cli import main

L, M = 4, 2


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The graph exactly as the installed console script writes it."""
    out = tmp_path_factory.mktemp("graph") / "g.json"
    args = ["graph", "--layers", str(L), "--micro-batches", str(M), "--out", str(out)]
    script = shutil.which("flowtrain")
    cmd = [script, *args] if script else [sys.executable, "-m", "flowtrain.cli", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"wrote {out}: 51 tasks, 90 edges"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def g(written) -> nx.DiGraph:
    return nx.node_link_graph(written, edges="edges")


def nodes(g, kind, **fields):
    return [n for n, d in g.nodes(data=True) if d["kind"] == kind and all(d[k] == v for k, v in fields.items())]


def the(g, kind, **fields):
    found = nodes(g, kind, **fields)
    assert len(found) == 1, (kind, fields, found)
    return found[0]


def test_every_node_has_kind_layer_micro_batch_and_lane(written, g):
    lanes = {"fetch": "h2d", "forward": "compute", "recompute": "compute", "backward": "compute",
             "offload_grad": "d2h", "cpu_adam": "cpu"}
    for d in written["nodes"]:
        assert {"kind", "layer", "micro_batch", "lane"} <= d.keys()
        if d["kind"] in lanes:
            assert d["lane"] == lanes[d["kind"]]
        per_layer = d["unit"] == "layer"
        assert (d["layer"] is not None) == per_layer
        assert (d["micro_batch"] is not None) == (d["kind"] in ("embed", "forward", "loss", "recompute", "backward", "embed_backward"))
    assert written["graph"]["spec"]["layers"] == L
    assert all(isinstance(e["reads"], bool) for e in written["edges"])


def test_graph_is_acyclic(g):
    assert nx.is_directed_acyclic_graph(g)


def test_each_forward_depends_on_a_fetch_of_its_layer(g):
    forwards = nodes(g, "forward")
    assert len(forwards) == L * M
    for f in forwards:
        layer = g.nodes[f]["layer"]
        fetches = [p for p in g.predecessors(f) if g.nodes[p]["kind"] == "fetch" and g.nodes[p]["layer"] == layer]
        assert fetches and all(g.edges[p, f]["reads"] for p in fetches)


def test_each_backward_depends_on_the_backward_above(g):
    for i in range(L - 1):
        for m in range(M):
            assert g.has_edge(the(g, "backward", layer=i + 1, micro_batch=m), the(g, "backward", layer=i, micro_batch=m))


def test_adam_of_a_layer_follows_its_backwards_through_its_offload_and_no_lower_backward(g):
    for i in range(L):
        adam = the(g, "cpu_adam", layer=i)
        offloads = set(nodes(g, "offload_grad", layer=i))
        assert offloads
        cut = g.subgraph(set(g) - offloads)
        for m in range(M):
            bwd = the(g, "backward", layer=i, micro_batch=m)
            assert nx.has_path(g, bwd, adam)
            assert not nx.has_path(cut, bwd, adam), "every path to Adam goes through the layer's offload_grad"
        lower = [n for n in nx.ancestors(g, adam) if g.nodes[n]["kind"] == "backward" and g.nodes[n]["layer"] < i]
        assert lower == [], f"cpu_adam L{i} waits for backward of lower layers"


def test_steps_are_linked_by_adam_before_the_next_fetch(tmp_path, capsys):
    out = tmp_path / "two.json"
    assert main(["graph", "--layers", "2", "--steps", "2", "--tied", "--out", str(out)]) == 0
    g = nx.node_link_graph(json.loads(out.read_text()), edges="edges")
    assert nx.is_directed_acyclic_graph(g)
    for f in nodes(g, "fetch", step=1):
        unit, layer = g.nodes[f]["unit"], g.nodes[f]["layer"]
        adams = [p for p in g.predecessors(f) if g.nodes[p]["kind"] == "cpu_adam"]
        assert {(g.nodes[p]["unit"], g.nodes[p]["layer"], g.nodes[p]["step"]) for p in adams} >= {(unit, layer, 0)}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--layers", "0"], "--layers must be at least 1 (got 0)"),
        (["--layers", "2", "--checkpoint-every", "0"], "--checkpoint-every must be at least 1 (got 0)"),
        (["--layers", "2", "--steps", "0"], "steps must be at least 1 (got 0)"),
    ],
)
def test_bad_flags_are_one_line_errors(argv, message, tmp_path, capsys):
    assert main(["graph", *argv, "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert err == f"flowtrain: error: {message}\n"
    assert not (tmp_path / "x.json").exists()
