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


def choose_order(cfg: Any, req: Any, plan_one: Callable[[Any], Any], *, device_type: str, policy: Any,
                 machine: Any = None, local_gpu: bool = True) -> tuple[Any, str | None, Any]:
    """``(req, why, plan)``: ``req`` with a concrete ``order``; where the choice was not the
    plain default, why ("auto: predicted on h200 ..."; shown by the plan and the run summary);
    and the plan of the chosen request where comparing the orders already made it (else None).
    ``plan_one(req)`` plans one request; ``machine`` (a :class:`~flowtrain.sim.machine.Machine`)
    defaults to the one describing this GPU."""
    if req.order != "auto":
        return req, None, None
    layer = msgspec.structs.replace(req, order="layer")
    if device_type != "cuda" or req.batch_size == req.micro_batch_size or req.processes > 1:
        return layer, None, None
    machine = machine or (_this_gpu() if local_gpu else None)
    if machine is None:
        return layer, "auto: no machine model of this GPU to predict with; `flowtrain plan --machine NAME` compares both", None
    micro = msgspec.structs.replace(req, order="micro")
    p_layer, p_micro = plan_one(layer), plan_one(micro)
    if not p_micro.fits:
        return layer, None, p_layer
    if not p_layer.fits:
        return micro, "auto: layer order does not fit, micro-batch order does", p_micro
    from ..sim.predict import predict

    t_layer = predict(cfg, p_layer, layer, machine, policy).summary.tokens_per_s
    t_micro = predict(cfg, p_micro, micro, machine, policy).summary.tokens_per_s
    why = f"auto: predicted on {machine.name} {t_micro:,.0f} tok/s in micro-batch order, {t_layer:,.0f} in layer order"
    return (micro, why, p_micro) if t_micro >= MARGIN * t_layer else (layer, why, p_layer)


def _this_gpu() -> Any:
    """The shipped machine model of this process's GPU, if any."""
    import torch

    if not torch.cuda.is_available():
        return None
    from ..sim.machine import machine_for_gpu

    return machine_for_gpu(torch.cuda.get_device_name())
