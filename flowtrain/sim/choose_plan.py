"""The memory plan with its predicted choices: ``--order auto`` and the memory rules checked
against their alternatives, each by the simulator's prediction on the run's machine.

The planner (:mod:`flowtrain.plan`) counts bytes and never predicts time; where a setting is
``auto`` and the right value depends on the machine's rates, it hands the choice up to here
(its ``choose`` hook)::

    plan = plan_and_choose(cfg, req, device=device, dtype=dtype, machine=None)  # this GPU's model

First the order (:func:`~flowtrain.sim.order_choice.choose_order`), then the memory settings
(:func:`~flowtrain.sim.memory_choice.choose_memory`), sharing what they simulated
(``predictions``, which ``flowtrain simulate`` reuses for the chosen plan).
"""

from __future__ import annotations

from typing import Any

from ..plan.memory import Plan
from ..plan.planner import plan_run
from ..plan.request import RunRequest
from .order_choice import Predictions, choose_order
from .memory_choice import choose_memory

__all__ = ["plan_and_choose"]


def plan_and_choose(cfg: Any, req: RunRequest, *, device: Any, dtype: Any, policy: Any = "double_buffer",
                    local_gpu: bool = True, machine: Any = None, predictions: Predictions | None = None) -> Plan:
    """:func:`~flowtrain.plan.planner.plan_run` of ``req``, with the order and the placement
    chosen by predicted time on ``machine`` (by default, with ``local_gpu``, the model of this
    GPU); ``predictions`` keeps what was simulated."""
    predictions = predictions or Predictions(cfg, policy)

    def choose(r: RunRequest, plan_one: Any) -> tuple[RunRequest, Plan, str | None, str | None]:
        r, why_order, plan = choose_order(cfg, r, plan_one, device_type=device.type, policy=policy,
                                          machine=machine, local_gpu=local_gpu, predictions=predictions)
        r, plan, why_memory = choose_memory(cfg, r, plan or plan_one(r), plan_one, policy=policy,
                                                  machine=machine, local_gpu=local_gpu, predictions=predictions)
        return r, plan, why_order, why_memory

    return plan_run(cfg, req, device=device, dtype=dtype, policy=policy, local_gpu=local_gpu, choose=choose)
