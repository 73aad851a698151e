"""Graphs as JSON: ``networkx.node_link_data`` with one plain dict per task.

Every node carries ``kind``, ``layer``, ``micro_batch``, ``lane`` (and ``step``, ``unit``,
``phase``, ``activations``, ``chunk``, ``takes``, ``id``); every edge carries ``reads`` (the consumer
reads the producer's slot). :func:`graph_from_json` rebuilds the typed graph (a file written
before ``activations`` was a field of its own too: :func:`~.tasks.task_from_dict`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import networkx as nx

from .tasks import Task, task_from_dict, task_to_dict


def _node_id(data: dict[str, Any]) -> str:
    base = "{kind}:{unit}:{layer}:{micro_batch}:{phase}:{step}".format(**data)
    return base if data.get("chunk") is None else f"{base}:c{data['chunk']}"


def graph_to_json(graph: nx.DiGraph) -> dict[str, Any]:
    """The graph as node-link data with string node ids and task fields as attributes."""
    plain = nx.DiGraph(**graph.graph)
    ids: dict[Task, str] = {}
    for t in graph:
        data = task_to_dict(t)
        ids[t] = _node_id(data)
        plain.add_node(ids[t], **data)
    for u, v, d in graph.edges(data=True):
        plain.add_edge(ids[u], ids[v], reads=bool(d.get("reads", False)))
    linked: dict[str, Any] = nx.node_link_data(plain, edges="edges")
    return linked


def graph_from_json(data: dict[str, Any]) -> nx.DiGraph:
    """Inverse of :func:`graph_to_json`."""
    plain = nx.node_link_graph(data, edges="edges")
    graph = nx.DiGraph(**plain.graph)
    tasks = {n: task_from_dict(d) for n, d in plain.nodes(data=True)}
    graph.add_nodes_from(tasks[n] for n in plain.nodes)
    for u, v, d in plain.edges(data=True):
        graph.add_edge(tasks[u], tasks[v], reads=bool(d.get("reads", False)))
    return graph


def write_graph(path: str | Path, graph: nx.DiGraph) -> None:
    Path(path).write_text(json.dumps(graph_to_json(graph), indent=1, sort_keys=True) + "\n")


def read_graph(path: str | Path) -> nx.DiGraph:
    return graph_from_json(json.loads(Path(path).read_text()))
