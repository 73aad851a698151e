"""Golden graphs: the compiler's output for the configurations in docs/graphs.md must match
``graphs/*.json`` byte for byte. The commands are read from the docs, so the docs cannot drift
from the files either."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from flowtrain.cli import main

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "graphs.md"


def documented_commands() -> list[list[str]]:
    blocks = re.findall(r"```sh\n(.*?)```", DOC.read_text(), flags=re.S)
    lines = [line for block in blocks for line in block.splitlines() if line.startswith("flowtrain graph ")]
    return [shlex.split(line) for line in lines]


def out_path(argv: list[str]) -> str:
    return argv[argv.index("--out") + 1]


def test_every_golden_file_has_a_documented_command():
    documented = sorted(out_path(a) for a in documented_commands())
    on_disk = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "graphs").glob("*.json"))
    assert documented == on_disk
    assert len(documented) >= 5


def summary(data: dict) -> tuple[set, set]:
    nodes = {n["id"] for n in data["nodes"]}
    edges = {(e["source"], e["target"], e["reads"]) for e in data["edges"]}
    return nodes, edges


@pytest.mark.parametrize("argv", documented_commands(), ids=out_path)
def test_compiler_output_matches_the_golden_file(argv, tmp_path, capsys):
    golden = ROOT / out_path(argv)
    fresh = tmp_path / golden.name
    args = argv[1:]
    args[args.index("--out") + 1] = str(fresh)
    assert main(args) == 0
    capsys.readouterr()
    if fresh.read_bytes() != golden.read_bytes():
        old, new = summary(json.loads(golden.read_text())), summary(json.loads(fresh.read_text()))
        pytest.fail(
            f"{golden.name} drifted from the compiler: "
            f"{len(new[0] - old[0])} tasks added, {len(old[0] - new[0])} removed, "
            f"{len(new[1] - old[1])} edges added, {len(old[1] - new[1])} removed "
            f"(order or attributes may differ too). If the change is intended, regenerate with "
            f"`{shlex.join(argv)}` (see docs/graphs.md)."
        )


@pytest.mark.parametrize("name", ["layers4-mb2-keep.json", "layers4-mb2-attn.json"])
def test_a_graph_file_of_the_old_spelling_reads_the_same(name):
    """Graph files written before ``activations`` was a field of its own gave a kept layer's
    forward and backward ``keep`` or ``attn`` as their ``phase`` (and no ``activations``)."""
    from flowtrain.graph.export import graph_from_json

    data = json.loads((ROOT / "graphs" / name).read_text())
    old = json.loads(json.dumps(data))
    moved = 0
    for node in old["nodes"]:
        value = node.pop("activations")
        if value is not None:
            node["phase"], moved = value, moved + 1
    assert moved
    new_graph, old_graph = graph_from_json(data), graph_from_json(old)
    assert list(new_graph.nodes) == list(old_graph.nodes)
    assert set(new_graph.edges) == set(old_graph.edges)
