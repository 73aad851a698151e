"""Predicting a training step's time: a cost model, machine files and a virtual-clock simulator.

The simulator runs the *real* scheduler and policy over the same compiled DAG as the trainer,
but every task takes the time the cost model gives for one machine, on a clock that jumps from
event to event, so a 100-layer step is predicted in well under a second::

    m = load_machine("h200")                        # flowtrain/sim/machines/h200.json
    sim = VirtualRun(CostModel(m, shape), "double_buffer")
    steps = sim.run_steps(spec, steps=4)            # TaskRecords, as the engine writes them

- :mod:`.machine`: machine files (rates, each with its source), shipped or written by
  ``flowtrain probe`` (:mod:`.probe`).
- :mod:`.costs`: seconds per task kind from FLOPs, bytes and parameters.
- :mod:`.clock`: the virtual lanes around :class:`~flowtrain.runtime.scheduler.Scheduler`.
- :mod:`.report`: step time, tokens/s, busy lanes, the critical chain.
- :mod:`.predict`: from a memory plan to a prediction; :mod:`.choose`: the fastest plan that fits.
- :mod:`.cli`: ``flowtrain simulate``.

Nothing here imports torch at import time; :mod:`.predict` and :mod:`.probe` do where they run.
"""

from .clock import VirtualRun
from .costs import SOFTWARE, CostModel, Shape
from .machine import Machine, load_machine, machine_names
from .report import Summary, critical_chain, summarize

__all__ = ["VirtualRun", "SOFTWARE", "CostModel", "Shape", "Machine", "load_machine", "machine_names", "Summary",
           "critical_chain", "summarize"]
