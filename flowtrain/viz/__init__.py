"""See what a schedule did: traces and graphs as an HTML report (and a PNG).

Reads files only (Chrome trace JSON and ``flowtrain graph`` JSON); imports nothing from
``flowtrain.runtime`` and no torch. ``flowtrain viz INPUT... --out report.html`` is the command
line. ``load`` reads, ``analysis`` explains waits and gaps, ``outliers`` finds what the
schedule does not explain (late starts, long tasks), ``steps`` cuts time at step ends and sums
windows of steps, ``memory`` counts slots and bytes held, ``html``/``page_js`` and ``png`` draw.
"""

from .analysis import (
    Gap,
    Overlap,
    SlotUse,
    Summary,
    Wait,
    blockers,
    compute_gaps,
    critical_chain,
    critical_path,
    gap_patterns,
    occupancy,
    overlap,
    planned_order,
    slot_uses,
    summarize,
)
from .html import render_report, write_report
from .load import GraphInput, Trace, TraceTask, load_input, trace_from_json
from .memory import Memory, memory
from .steps import (
    StepStats,
    Window,
    WindowSummary,
    choose_window,
    step_stats,
    window_summary,
)

__all__ = [
    "Gap", "Overlap", "SlotUse", "Summary", "Wait", "blockers", "compute_gaps", "critical_chain",
    "critical_path", "occupancy", "overlap", "planned_order", "slot_uses", "summarize",
    "render_report", "write_report", "GraphInput", "Trace", "TraceTask", "load_input",
    "trace_from_json", "gap_patterns", "Memory", "memory", "StepStats", "Window", "WindowSummary",
    "choose_window", "step_stats", "window_summary",
]
