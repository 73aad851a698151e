"""One self-contained HTML report for any number of traces and graphs.

Traces are drawn as Gantt charts on one shared time scale (zoom and pan move them together),
with step bands, compute-idle markers, slots in use against each pool's budget, bytes held and
per-slot rows; graphs as a layered DAG or a table. The summaries cover a window of steps (the
steady state by default; a brush in the page picks another), so Python hands the page each
step's additive numbers (:mod:`flowtrain.viz.steps`) and the page sums the window's. The file
needs no network: data, styles and scripts are inline, and a Content-Security-Policy forbids
anything else::

    write_report("report.html", [load_input("seq.json"), load_input("db.json")], steps="1:")
"""

from __future__ import annotations

import html as _html
import json
from pathlib import Path
from typing import Sequence

import msgspec

from ..errors import ConfigError
from ..policy import Policy
from .analysis import (
    Gap,
    SlotUse,
    Wait,
    blockers,
    compute_gaps,
    critical_chain,
    default_min_gap,
    describe_wait,
    gap_patterns,
    inferred_budgets,
    mean_durations,
    occupancy,
    partial_fetches,
    pool_budgets,
    slot_uses,
)
from .assets import CSS, GUARD_JS
from .compute import SLOW_LAYER, ComputeTable, KindTime, compute_table, flops_per_step, kind_steps, step_payload
from .graphview import CRITICAL, KIND_COLORS, REASON_COLORS, color, graph_section
from .load import GraphInput, Trace
from .memory import Memory, caption, memory
from .outliers import FACTOR, LATE, MIN_SAMPLES, Late, Long, late_starts, long_tasks, ready_wait
from .page_js import GANTT_JS
from .steps import (
    StepStats,
    Window,
    WindowSummary,
    brush_scale,
    choose_window,
    default_window,
    parse_steps,
    step_stats,
    window_summary,
)
from .summary_js import SUMMARY_JS
from .tables_js import TABLES_JS
from .verdicts import GapVerdict, gap_verdicts

_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "img-src data:; base-uri 'none'; form-action 'none'")


def _esc(s: object) -> str:
    return _html.escape(str(s), quote=True)


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


class TraceView:
    """A trace with everything the report shows about it, computed once. ``steps`` is the
    ``--steps`` window (``None``: the default steady-state window). With ``fallback``, a trace
    that has none of those steps gets its default window instead, which says why (``missed``);
    without, it is a :class:`ConfigError`."""

    def __init__(self, trace: Trace, min_gap: float | None = None, steps: str | None = None,
                 fallback: bool = False) -> None:
        self.trace = trace
        self.uses: list[SlotUse] = slot_uses(trace)
        self.waits: list[Wait | None] = blockers(trace, self.uses)
        self.min_gap = default_min_gap(trace) if min_gap is None else min_gap
        self.gaps: list[Gap] = compute_gaps(trace, min_gap=self.min_gap, waits=self.waits)
        self.chain: list[int] = critical_chain(trace, self.waits)
        self.budgets = pool_budgets(trace, self.uses)
        self.inferred: list[str] = inferred_budgets(trace, self.budgets)  # pools the trace gives no budget for
        self.rows: list[StepStats] = step_stats(trace, self.gaps, self.uses)
        self.missed = False  # --steps names none of this trace's steps: it shows its default window
        try:
            self.window: Window = choose_window(self.rows, steps, source=trace.path or trace.name)
        except ConfigError:
            if not fallback or steps is None:
                raise
            parse_steps(steps)  # a malformed --steps is an error whatever the trace
            w = default_window(self.rows)
            have = f"{self.rows[0].step}\u2013{self.rows[-1].step}"
            self.window = msgspec.structs.replace(w, why=f"--steps {steps} is not in this trace (it has steps {have}), "
                                                        f"so its {w.why}")
            self.missed = True
        self.summary: WindowSummary = window_summary(self.rows, self.window, self.budgets)
        self.kinds: dict[int, dict[str, KindTime]] = kind_steps(trace)  # compute time by kind, per step
        self.compute: ComputeTable = compute_table(trace, self.kinds, self.window)
        self.memory: Memory = memory(trace, self.uses)
        self.verdicts: list[GapVerdict] = gap_verdicts(trace, self.gaps, self.waits, self.budgets, self.memory)
        self.late: list[Late] = late_starts(trace, self.waits, self.window)  # ready work not started
        self.long: list[Long] = long_tasks(trace, self.window)  # tasks far past their kind's median


def trace_views(traces: Sequence[Trace], min_gap: float | None = None, steps: str | None = None) -> list[TraceView]:
    """One :class:`TraceView` per trace, each on the ``--steps`` window where it has those
    steps, else on its default window (the page says so); an error only when no trace has
    them."""
    views = [TraceView(t, min_gap, steps, fallback=True) for t in traces]
    if views and all(v.missed for v in views):
        choose_window(views[0].rows, steps, source=views[0].trace.path or views[0].trace.name)  # raises
    return views


def _why(view: TraceView, i: int) -> str:
    w = view.waits[i]
    if w is None:
        return ""
    delay = view.trace.tasks[i].start - w.end
    return describe_wait(view.trace, w) + (f" (then {delay * 1e3:.3f} ms until it started)" if delay > 1e-6 else "")


def _ready(view: TraceView, i: int) -> float | None:
    """When task ``i`` could have started (us), as late starts count it
    (:func:`~flowtrain.viz.outliers.ready_wait`); else None."""
    w = ready_wait(view.trace, view.waits, i)
    return None if w is None else _us(w.end)


def _task_columns(view: TraceView, kinds: list[str]) -> dict[str, list]:
    tr = view.trace
    lane_index = {lane: i for i, lane in enumerate(tr.lanes)}
    cols: dict[str, list] = {k: [] for k in ("s", "e", "r", "k", "l", "name", "layer", "mb", "step", "bytes",
                                             "slot", "reads", "deps", "why", "part")}
    part = partial_fetches(tr)
    for t in tr.tasks:
        cols["s"].append(_us(t.start))
        cols["e"].append(_us(t.end))
        cols["r"].append(_ready(view, t.index))
        cols["k"].append(kinds.index(t.kind))
        cols["l"].append(lane_index[t.lane_name])
        cols["name"].append(t.name)
        cols["layer"].append(t.layer)
        cols["mb"].append(t.micro_batch)
        cols["step"].append(t.step)
        cols["bytes"].append(t.bytes)
        cols["slot"].append(f"{t.takes} #{t.slot}" if t.takes is not None and t.slot is not None else None)
        cols["reads"].append(", ".join(f"{p} #{s}" for p, ss in t.reads.items() for s in ss) or None)
        cols["deps"].append(list(tr.dep_indices[t.index]))
        cols["why"].append(_why(view, t.index))
        cols["part"].append(round(part[t.index], 4) if t.index in part else None)
    return cols


def _step_rows(view: TraceView) -> list[dict]:
    """Each step's additive numbers (microseconds): the page sums them over the brushed window.
    ``busy.compute + idle + tail`` is the step's time."""
    return [{"step": r.step, "s": _us(r.start), "e": _us(r.end), "warm": r.warmup, "tasks": r.tasks,
             "busy": {k: _us(v) for k, v in r.busy.items()}, "bytes": r.bytes, "cc": _us(r.compute_copy),
             "co": _us(r.copy), "cu": _us(r.compute_cpu), "cp": _us(r.cpu), "idle": _us(r.idle_compute),
             "tail": _us(r.tail),
             "why": {k: _us(v) for k, v in r.idle_by_reason.items()},
             "area": {k: _us(v) for k, v in r.slot_seconds.items()}, "peak": r.peak_slots,
             "ck": step_payload(view.kinds.get(r.step, {}))}
            for r in view.rows]


def _gap_payload(view: TraceView) -> tuple[list[dict], list[dict], list[dict]]:
    """The gaps, their patterns and their verdicts (each gap names its pattern ``p`` and its
    verdict ``v``, with ``vb`` the verdict's copy lane busy inside the gap, in us)."""
    patterns = gap_patterns(view.gaps)
    which = {id(g): n for n, (_, _, gs) in enumerate(patterns) for g in gs}
    keys = list(dict.fromkeys(v.key for v in view.verdicts))
    first = {v.key: v for v in reversed(view.verdicts)}
    gaps = [{"s": _us(g.start), "e": _us(g.end), "c": color(g.reason), "r": g.reason, "text": g.text,
             "p": which[id(g)], "v": keys.index(v.key), "vb": _us(v.lane_busy)} for g, v in zip(view.gaps, view.verdicts)]
    verdicts = [{"key": k, "text": first[k].text, "lane": first[k].lane} for k in keys]
    return gaps, [{"text": p, "r": r, "c": color(r)} for p, r, _ in patterns], verdicts


def trace_payload(view: TraceView, kinds: list[str]) -> dict:
    """The trace as columns of plain numbers and strings for the page's script (times in us)."""
    tr, tasks = view.trace, view.trace.tasks
    slots: dict[tuple[str, int], list[dict]] = {}
    for u in view.uses:
        slots.setdefault((u.pool, u.slot), []).append({
            "s": _us(u.start), "e": _us(u.end), "c": color(tasks[u.holder].kind), "pool": u.pool,
            "slot": u.slot, "h": u.holder, "n": len(u.readers)})
    gaps, patterns, verdicts = _gap_payload(view)
    mem = view.memory
    w = view.window
    return {
        "label": tr.label,
        "lanes": tr.lanes,
        "t": _task_columns(view, kinds),
        "slots": [{"pool": p, "slot": s, "iv": iv} for (p, s), iv in sorted(slots.items())],
        "gaps": gaps,
        "patterns": patterns,
        "verdicts": verdicts,
        "gapLane": "compute",
        "minGap": _us(view.min_gap),
        "crit": view.chain,
        "steps": _step_rows(view),
        "window": {"first": w.first, "last": w.last, "why": w.why},
        "budgets": view.budgets,
        "inferred": view.inferred,
        "brushMax": _us(brush_scale(view.rows)),
        "occ": {pool: [[_us(t), n] for t, n in pts] for pool, pts in occupancy(tr, view.uses).items()},
        "mem": {where: [[_us(t), b] for t, b in pts] for where, pts in mem.held.items()},
        "memUnknown": list(mem.unknown),
        "memCaption": caption(mem),
        "caps": mem.capacities,
        "flopsPerStep": flops_per_step(tr),
    }


def _panel(n: int, v: TraceView) -> str:
    label = _esc(v.trace.label)
    return (f'<section class=panel id="panel-{n}" data-trace="{label}" data-tasks="{len(v.trace.tasks)}">'
            f'<h2>Trace: {label}</h2>'
            + (f'<div class=mode>trains {_esc(v.trace.mode)}</div>' if v.trace.mode else '') +
            f'<canvas class=gantt aria-label="Gantt chart of {label}"></canvas>'
            '<div class=info>click a task for details; wheel zooms, drag pans, double-click resets</div>'
            '<div class=summary></div></section>')


def _toolbar(views: Sequence[TraceView]) -> str:
    """The sticky toolbar, kept small: one line of controls, then one brush row per trace (its
    steps as bars: drag across them to choose that trace's window). The legend is below it."""
    rows = "".join(
        f'<div class=brushrow data-panel={n}><span class=bl title="{_esc(v.trace.label)}">{_esc(v.trace.label)}</span>'
        f'<canvas class=brush id="ft-brush-{n}" aria-label="steps of {_esc(v.trace.label)}: drag to choose its window">'
        f'</canvas><b class=bw id="ft-window-{n}"></b></div>' for n, v in enumerate(views))
    return ('<div class=toolbar id="ft-toolbar"><div class=controls><button data-act=reset>reset</button>'
            '<button data-act=in>zoom in</button><button data-act=out>zoom out</button> '
            '<label><input type=checkbox data-act=crit> critical chain</label> '
            '<label>align at <select data-act=align><option value="">(time)</option></select></label> '
            '<span class=small title="wheel: zoom; drag or shift+wheel: pan; double-click: reset; click a task for its '
            'dependencies; drag across a trace\'s steps below to choose its window">view <span id="ft-span"></span>'
            '</span></div>' + rows + "</div>")


def _legend(kinds: Sequence[str], reasons: Sequence[str]) -> str:
    items = "".join(f"<span class=item><span class=sw style='background:{color(k)}'></span>{_esc(k)}</span>"
                    for k in kinds)
    extra = [r for r in reasons if r in REASON_COLORS]
    more = "".join(f"<span class=item><span class=sw style='background:{color(r)}'></span>idle: {_esc(r)}</span>"
                   for r in extra)
    crit = (f"<span class=item><span class=sw style='background:#fff;border:2px solid {CRITICAL}'></span>"
            "critical chain</span>")
    return f"<div class=legend>{items}{more}{crit}</div>"


def _json_script(data: object) -> str:
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    # "<" only occurs inside JSON strings, where \u003c means the same: nothing in the data
    # can end the <script> element or open a comment in it.
    return text.replace("<", "\\u003c")


def render_report(inputs: Sequence[Trace | GraphInput], policy: str | Policy = "double_buffer",
                  title: str = "flowtrain schedule report", min_gap: float | None = None,
                  steps: str | None = None, views: Sequence[TraceView] | None = None) -> str:
    """The report as one HTML string; ``steps`` is the first window (``--steps A:B``);
    ``views`` are the traces' :class:`TraceView` when the caller has them already."""
    traces = [x for x in inputs if isinstance(x, Trace)]
    graphs = [x for x in inputs if isinstance(x, GraphInput)]
    views = list(views) if views is not None else trace_views(traces, min_gap, steps)
    known = list(KIND_COLORS)  # legend order: the palette's, then unknown kinds by name
    kinds = sorted({t.kind for tr in traces for t in tr.tasks},
                   key=lambda k: (k not in known, known.index(k) if k in known else 0, k))
    reasons = sorted({g.reason for v in views for g in v.gaps})
    payload = {
        "maxWall": max((_us(t.wall) for t in traces), default=1.0),
        "kinds": kinds,
        "colors": [color(k) for k in kinds],
        "critical": CRITICAL,
        "slowLayer": SLOW_LAYER,
        "late": _us(LATE), "longFactor": FACTOR, "longMin": MIN_SAMPLES,  # flowtrain.viz.outliers
        "traces": [trace_payload(v, kinds) for v in views],
    }
    parts = [f"<h1>{_esc(title)}</h1>",
             "<p class=small>inputs: " + ", ".join(_esc(x.path or x.name) for x in inputs) + "</p>"]
    if views:
        parts.append(_toolbar(views))
        parts.append(_legend(kinds, reasons))
        parts.append('<section id="ft-compare"></section>')
        parts += [_panel(n, v) for n, v in enumerate(views)]
    cost = mean_durations(traces) if traces else None
    for g in graphs:
        gcost = cost if cost and all(t.kind in cost for t in g.graph) else None
        parts.append(graph_section(g.graph, policy, title=g.name, cost=gcost))
    if views:
        scripts = (f'<script type="application/json" id="ft-data">{_json_script(payload)}</script>'
                   f"<script>{GANTT_JS}</script><script>{TABLES_JS}</script><script>{SUMMARY_JS}</script>")
    else:
        scripts = ("<script>document.documentElement.setAttribute('data-ft-render-ms', performance.now().toFixed(1));"
                   "document.documentElement.setAttribute('data-ft-lanes', '[]');"
                   "document.documentElement.setAttribute('data-ft-ready', '1');</script>")
    return ("<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
            f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
            '<meta name=viewport content="width=device-width, initial-scale=1">'
            f"<title>{_esc(title)}</title><style>{CSS}</style><script>{GUARD_JS}</script></head>"
            f'<body><div id="ft-tip"></div>{"".join(parts)}{scripts}</body></html>\n')


def write_report(path: str | Path, inputs: Sequence[Trace | GraphInput], **options) -> Path:
    """Write :func:`render_report` to ``path``; returns the path."""
    p = Path(path)
    p.write_text(render_report(inputs, **options), encoding="utf-8")
    return p
