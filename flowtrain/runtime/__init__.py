"""Running task graphs: the pure scheduler, lanes, the asyncio engine, the reference, and fault
injection for tests."""

from .engine import Engine, Program, TaskContext, run_graph, use_uvloop
from .faults import Fault, FaultInjector, FaultSpec, InjectedFault
from .reference import run_reference
from .scheduler import Launch, Scheduler
from .trace import Instrument, TaskRecord, TraceRecorder, chrome_trace, lane_busy, write_chrome_trace

__all__ = [
    "Engine",
    "Program",
    "TaskContext",
    "run_graph",
    "use_uvloop",
    "Fault",
    "FaultInjector",
    "FaultSpec",
    "InjectedFault",
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
