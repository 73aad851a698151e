"""``--order auto``: which micro-batch order a run takes, decided by predicted step time.

With several micro-batches per step there are two orders (docs/training.md): ``layer`` runs
every micro-batch through a layer before the next layer, so each layer's weights cross PCIe once
per pass, but every micro-batch's activations of a layer wait for its backward at once;
``micro`` runs each micro-batch through the whole model, so one micro-batch's activations are
all that wait (more layers kept, less recompute) but the weights cross once per micro-batch.
Which is faster depends on the machine's PCIe and compute rates, so the planner asks the
simulator (:mod:`flowtrain.sim`), with the machine model of the run's GPU::

    req, why = choose_order(cfg, req, plan_one, machine=None)   # the GPU here, by its name

It keeps ``layer`` (what runs without a choice) unless ``micro`` fits and is predicted at least
2% faster, closer than the model can tell apart otherwise. Without a GPU, with one micro-batch
per step, with several processes, or on a GPU no shipped machine describes (the plan says so),
the order is ``layer`` and nothing is simulated.
"""

from __future__ import annotations

from typing import Any, Callable

import msgspec

#: the values of ``--order``
ORDERS = ("auto", "layer", "micro")
#: how much faster ``micro`` must be predicted to be taken
MARGIN = 1.02
#: simulated steps per comparison, as `flowtrain simulate` runs them (so the numbers agree)
STEPS = 3


class Predictions:
    """Predictions of plans, each simulated once: the order choice and the memory choice of
    one ``plan_run`` compare some of the same plans, and ``flowtrain simulate`` then predicts the
    chosen one again."""

    def __init__(self, cfg: Any, policy: Any) -> None:
        self.cfg, self.policy = cfg, policy
        #: by the identities of plan and machine and the settings: the prediction, with the plan
        #: and machine kept alive (so that their ids are not reused)
        self._done: dict[tuple, tuple[Any, Any, Any]] = {}

    def prediction(self, req: Any, plan: Any, machine: Any, *, adam_workers: int = 1, steps: int = STEPS,
                   world: int = 1, nodes: int = 1) -> Any:
        """:func:`~flowtrain.sim.predict.predict` of ``plan`` (for ``req``) on ``machine``."""
        key = (id(plan), id(machine), adam_workers, steps, world, nodes)
        if key not in self._done:
            from .predict import predict

            pred = predict(self.cfg, plan, req, machine, self.policy, adam_workers=adam_workers, steps=steps,
                           world=world, nodes=nodes)
            self._done[key] = (plan, machine, pred)
        return self._done[key][2]

    def __call__(self, req: Any, plan: Any, machine: Any) -> Any:
        """The :class:`~flowtrain.sim.report.Summary` of ``plan``'s prediction."""
        return self.prediction(req, plan, machine).summary


def choose_order(cfg: Any, req: Any, plan_one: Callable[[Any], Any], *, device_type: str, policy: Any,
                 machine: Any = None, local_gpu: bool = True,
                 predictions: Predictions | None = None) -> tuple[Any, str | None, Any]:
    """``(req, why, plan)``: ``req`` with a concrete ``order``; where the choice was not the
    plain default, why ("auto: predicted on h200 ..."; shown by the plan and the run summary);
    and the plan of the chosen request where comparing the orders already made it (else None).
    ``plan_one(req)`` plans one request; ``machine`` (a :class:`~flowtrain.sim.machine.Machine`)
    defaults to the one describing this GPU; ``predictions`` keeps what was simulated, for the
    memory choice that follows."""
    if req.order != "auto":
        return req, None, None
    layer = msgspec.structs.replace(req, order="layer")
    if device_type != "cuda" or req.batch_size == req.micro_batch_size or req.processes > 1:
        return layer, None, None
    machine = machine or (this_gpu_machine() if local_gpu else None)
    if machine is None:
        return layer, "auto: no machine model of this GPU to predict with; `flowtrain plan --machine NAME` compares both", None
    micro = msgspec.structs.replace(req, order="micro")
    p_layer, p_micro = plan_one(layer), plan_one(micro)
    if not p_micro.fits:
        return layer, None, p_layer
    if not p_layer.fits:
        return micro, "auto: layer order does not fit, micro-batch order does", p_micro
    predictions = predictions or Predictions(cfg, policy)
    t_layer = predictions(layer, p_layer, machine).tokens_per_s
    t_micro = predictions(micro, p_micro, machine).tokens_per_s
    why = f"auto: predicted on {machine.name} {t_micro:,.0f} tok/s in micro-batch order, {t_layer:,.0f} in layer order"
    return (micro, why, p_micro) if t_micro >= MARGIN * t_layer else (layer, why, p_layer)


def this_gpu_machine() -> Any:
    """The shipped machine model of this process's GPU, if any."""
    import torch

    if not torch.cuda.is_available():
        return None
    from .machine import machine_for_gpu

    return machine_for_gpu(torch.cuda.get_device_name())
