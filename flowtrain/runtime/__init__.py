"""Running task graphs: the pure scheduler, lanes, the asyncio engine and the reference."""

from .executor import Engine, Program, TaskContext, run_graph, use_uvloop
from .reference import run_reference
from .scheduler import Launch, Scheduler
from .trace import Instrument, TaskRecord, TraceRecorder, chrome_trace, lane_busy, write_chrome_trace

__all__ = [
    "Engine",
    "Program",
    "TaskContext",
    "run_graph",
    "use_uvloop",
    "run_reference",
    "Launch",
    "Scheduler",
    "Instrument",
    "TaskRecord",
    "TraceRecorder",
    "chrome_trace",
    "lane_busy",
    "write_chrome_trace",
]
