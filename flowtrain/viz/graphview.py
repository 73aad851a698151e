"""Drawing a compiled step graph: a layered SVG for small graphs, a table for large ones.

Tasks are placed in columns by depth (the longest chain of edges from a source), so every edge
points right; within a column they are ordered by the mean row of their producers, which keeps
a layer's fetch next to the work that reads it. The critical path is drawn in violet (red means
an idle gap in a trace) and every task carries its position in the policy's planned order::

    html = graph_section(graph, policy="double_buffer")   # an HTML fragment, no scripts
"""

from __future__ import annotations

import html as _html
from typing import Sequence

import networkx as nx

from ..graph.registry import KindTable
from ..graph.tasks import Task
from ..policy import Policy
from .analysis import critical_path, depths, planned_order
from .load import LANE_KINDS

#: Colours by task kind, shared by the HTML report and the PNG export (one table beside the
#: program's handlers and the simulator's costs: :mod:`flowtrain.graph.registry`). A trace of a
#: kind this build does not know draws it grey (:data:`OTHER_COLOR`).
KIND_COLORS: KindTable[str] = KindTable("the visualizer's colours")
for _kind, _color in {
    "fetch": "#4e79a7",
    "embed": "#9c755f",
    "forward": "#59a14f",
    "loss": "#edc948",
    "recompute": "#a0cbe8",
    "backward": "#f28e2b",
    "embed_backward": "#ffbe7d",
    "zero_grad": "#bab0ac",
    "offload_grad": "#76b7b2",
    # checkpoints out to the host and back: apart from each other and from offload_grad, which
    # shares their lanes (the two used to be nearly the same teal)
    "offload_act": "#0b6e4f",
    "fetch_act": "#003f5c",
    "grad_norm": "#ff9da7",
    "cpu_adam": "#b07aa1",
    "gpu_adam": "#7b4173",
    "grad_sq_norm": "#e7969c",
    "save": "#17becf",
    "read_state": "#8c564b",
    "write_state": "#c49c94",
    "found_inf": "#8c6d31",
    "verify_step": "#637939",
    "eval_loss": "#d4a6c8",
    # data parallel: the gradient all-reduce and the node's barrier
    "reduce_grad": "#86bcb6",
    "sync_step": "#d37295",
}.items():
    KIND_COLORS.add(_kind, _color)
OTHER_COLOR = "#888888"
#: Colours of compute-gap markers by reason (a task kind, or these two).
REASON_COLORS = {"slot": "#d62728", "host": "#999999"}
#: The critical path and chain: violet, so that it never reads as the red of an idle slot gap.
CRITICAL = "#7e22ce"

_SHORT = {"forward": "fwd", "backward": "bwd", "recompute": "rec", "zero_grad": "zero",
          "offload_grad": "offload", "offload_act": "act_out", "fetch_act": "act_in", "cpu_adam": "adam", "embed_backward": "emb_bwd",
          "grad_norm": "norm", "gpu_adam": "gadam", "grad_sq_norm": "sqnorm",
          "found_inf": "inf?", "verify_step": "verify"}

#: Above this many tasks the graph is shown as a table instead of a drawing.
MAX_DRAWN = 400


def color(kind: str) -> str:
    return KIND_COLORS.get(kind, REASON_COLORS.get(kind, OTHER_COLOR))


def short_label(t: Task) -> str:
    """``fwd L3 m1``, ``fwd L3 m1 k`` (kept activations), ``fetch L2 b``, ``adam head s1``,
    ``gadam adapter L3``: fits in a node box."""
    parts = [_SHORT.get(t.kind, t.kind)]
    if t.unit in ("embed", "head", "adapter") and t.unit != t.kind and t.kind != "embed_backward":
        parts.append(t.unit)
    if t.layer is not None:
        parts.append(f"L{t.layer}")
    if t.micro_batch is not None:
        parts.append(f"m{t.micro_batch}")
    if t.phase is not None:
        parts.append(t.phase[0])
    if t.activations is not None:
        parts.append(t.activations[0])
    if t.step:
        parts.append(f"s{t.step}")
    return " ".join(parts)


def positions(graph: nx.DiGraph) -> dict[Task, tuple[int, int]]:
    """(column, row) of every task: column = depth, except that a task with no dependencies
    (a fetch, a zero_grad) sits just left of its first consumer; rows follow the producers."""
    depth = dict(depths(graph))
    for t in graph.nodes:
        succ = [depth[s] for s in graph.successors(t)]
        if graph.in_degree(t) == 0 and succ:
            depth[t] = min(succ) - 1
    index = {t: i for i, t in enumerate(graph.nodes)}
    columns: dict[int, list[Task]] = {}
    for t in graph.nodes:
        columns.setdefault(depth[t], []).append(t)
    row: dict[Task, float] = {}
    for c in sorted(columns):
        col = columns[c]

        def key(t: Task) -> tuple:
            preds = [row[p] for p in graph.predecessors(t) if p in row]
            lane = LANE_KINDS.index(t.lane) if t.lane in LANE_KINDS else len(LANE_KINDS)
            return (sum(preds) / len(preds) if preds else -1.0, lane, index[t])

        col.sort(key=key)
        for r, t in enumerate(col):
            row[t] = r
    return {t: (depth[t], int(row[t])) for t in graph.nodes}


def _esc(s: object) -> str:
    return _html.escape(str(s), quote=True)


def graph_svg(graph: nx.DiGraph, critical: Sequence[Task], order: Sequence[Task]) -> str:
    """The graph as an inline SVG element (tooltips through ``<title>``)."""
    pos = positions(graph)
    w, h, dx, dy, pad = 96, 22, 124, 34, 14
    ncols = max((c for c, _ in pos.values()), default=0) + 1
    nrows = max((r for _, r in pos.values()), default=0) + 1
    width, height = ncols * dx + 2 * pad, nrows * dy + 2 * pad + 8
    crit_nodes = set(critical)
    crit_edges = set(zip(critical, critical[1:]))
    place: dict[Task, tuple[float, float]] = {t: (pad + c * dx, pad + 8 + r * dy) for t, (c, r) in pos.items()}
    number = {t: i for i, t in enumerate(order)}
    out = [f'<svg class="dag" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="10">']
    out.append('<g fill="none">')
    for u, v, d in graph.edges(data=True):
        (x0, y0), (x1, y1) = place[u], place[v]
        x0, y0, y1 = x0 + w, y0 + h / 2, y1 + h / 2
        mid = (x0 + x1) / 2
        crit = (u, v) in crit_edges
        style = f'stroke="{CRITICAL}" stroke-width="2.5"' if crit else 'stroke="#9aa" stroke-width="1"'
        dash = ' stroke-dasharray="4 3"' if d.get("reads") else ""
        reads = " (reads its slot)" if d.get("reads") else ""
        out.append(f'<path d="M{x0:.0f},{y0:.0f} C{mid:.0f},{y0:.0f} {mid:.0f},{y1:.0f} {x1:.0f},{y1:.0f}" '
                   f'{style}{dash}><title>{_esc(u)} -&gt; {_esc(v)}{reads}</title></path>')
    out.append("</g>")
    for t, (x, y) in place.items():
        crit = t in crit_nodes
        stroke = f'stroke="{CRITICAL}" stroke-width="2.5"' if crit else 'stroke="#333" stroke-width="0.5"'
        n = number.get(t)
        tip = (f"{t.label}\nkind {t.kind}, lane {t.lane}"
               + (f", takes a {t.takes} slot" if t.takes else "")
               + (f"\nplanned #{n}" if n is not None else "")
               + ("\non the critical path" if crit else ""))
        out.append(f'<g class="node" data-kind="{_esc(t.kind)}"><title>{_esc(tip)}</title>'
                   f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="3" fill="{color(t.kind)}" {stroke}/>'
                   f'<text x="{x + 4}" y="{y + 15}" fill="#111">{_esc(short_label(t))}</text>')
        if n is not None:
            out.append(f'<text x="{x}" y="{y - 2}" font-size="8" fill="#666">#{n}</text>')
        out.append("</g>")
    out.append("</svg>")
    return "".join(out)


def graph_table(graph: nx.DiGraph, critical: Sequence[Task], order: Sequence[Task]) -> str:
    """Every task in planned order, with its lane, depth, dependencies and criticality."""
    depth = depths(graph)
    crit = set(critical)
    rows = []
    for i, t in enumerate(order):
        preds = ", ".join(short_label(p) for p in graph.predecessors(t))
        mark = "&#9679;" if t in crit else ""
        rows.append(f'<tr{" class=crit" if t in crit else ""}><td>{i}</td>'
                    f'<td><span class="sw" style="background:{color(t.kind)}"></span>{_esc(t.label)}</td>'
                    f"<td>{_esc(t.lane)}</td><td>{depth[t]}</td><td>{_esc(preds)}</td><td>{mark}</td></tr>")
    return ('<table class="tasks"><thead><tr><th>#</th><th>task</th><th>lane</th><th>depth</th>'
            "<th>depends on</th><th>critical</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table>")


def lane_orders(order: Sequence[Task]) -> dict[str, list[Task]]:
    """The planned order split by lane: what each lane issues, first to last."""
    out: dict[str, list[Task]] = {}
    for t in order:
        out.setdefault(t.lane, []).append(t)
    return dict(sorted(out.items(), key=lambda kv: LANE_KINDS.index(kv[0]) if kv[0] in LANE_KINDS else 99))


def graph_section(graph: nx.DiGraph, policy: str | Policy = "double_buffer", title: str = "graph",
                  cost: dict[str, float] | None = None, max_drawn: int = MAX_DRAWN) -> str:
    """An HTML fragment for one graph: facts, the drawing (or table), the planned order."""
    order, budgets = planned_order(graph, policy)
    path, total = critical_path(graph, cost)
    policy_name = policy if isinstance(policy, str) else type(policy).__name__
    unit = "ms (mean task times from the traces)" if cost else "tasks"
    length = f"{total * 1e3:.3f}" if cost else f"{total:.0f}"
    kinds: dict[str, int] = {}
    for t in graph:
        kinds[t.kind] = kinds.get(t.kind, 0) + 1
    facts = (f"<p>{graph.number_of_nodes()} tasks, {graph.number_of_edges()} edges; "
             f"critical path: {len(path)} tasks, length {length} {unit}. "
             f"Policy <b>{_esc(policy_name)}</b> plans budgets "
             + ", ".join(f"{_esc(k)}={v}" for k, v in budgets.items()) + ".</p>")
    spec = graph.graph.get("spec")
    if spec:
        facts += "<p class=small>spec: " + ", ".join(f"{_esc(k)}={_esc(v)}" for k, v in spec.items()) + "</p>"
    if graph.number_of_nodes() <= max_drawn:
        body = ('<p class=small>Columns are depth (longest chain of dependencies); violet: critical path; '
                'dashed edges read the producer\'s slot; #n: position in the planned order.</p>'
                f'<div class="dagbox">{graph_svg(graph, path, order)}</div>'
                f"<details><summary>all tasks in planned order</summary>{graph_table(graph, path, order)}</details>")
    else:
        body = (f"<p class=small>{graph.number_of_nodes()} tasks are too many to draw "
                f"(more than {max_drawn}); the table lists them in planned order.</p>"
                f'<div class="tablebox">{graph_table(graph, path, order)}</div>')
    lanes = "".join(
        f"<tr><th>{_esc(lane)}</th><td>{len(ts)}</td><td class=seq>"
        + " &rarr; ".join(_esc(short_label(t)) for t in ts) + "</td></tr>"
        for lane, ts in lane_orders(order).items())
    planned = (f"<details open><summary>planned issue order per lane ({_esc(policy_name)})</summary>"
               f'<table class="lanes"><tr><th>lane</th><th>tasks</th><th>order</th></tr>{lanes}</table></details>')
    crit = ('<details><summary>critical path</summary><p class=seq>'
            + " &rarr; ".join(_esc(t.label) for t in path) + "</p></details>")
    kinds_txt = ", ".join(f"{_esc(k)} {n}" for k, n in kinds.items())
    return (f'<section class="graph" data-tasks="{graph.number_of_nodes()}"><h2>Graph: {_esc(title)}</h2>'
            f"{facts}<p class=small>{kinds_txt}</p>{body}{planned}{crit}</section>")
