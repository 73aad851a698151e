"""See what a schedule did: traces and graphs as an HTML report (and a PNG).

Reads files only (Chrome trace JSON and ``flowtrain graph`` JSON); imports nothing from
``flowtrain.runtime``. ``flowtrain viz INPUT... --out report.html`` is the command line.
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
    occupancy,
    overlap,
    planned_order,
    slot_uses,
    summarize,
)
from .html import render_report, write_report
from .load import GraphInput, Trace, TraceTask, load_input, trace_from_json

__all__ = [
    "Gap", "Overlap", "SlotUse", "Summary", "Wait", "blockers", "compute_gaps", "critical_chain",
    "critical_path", "occupancy", "overlap", "planned_order", "slot_uses", "summarize",
    "render_report", "write_report", "GraphInput", "Trace", "TraceTask", "load_input",
    "trace_from_json",
]
