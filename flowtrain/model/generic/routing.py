"""The load-balancing loss of a mixture of experts on the generic path: where its routers are.

transformers adds ``router_aux_loss_coef * load_balancing_loss_func(router_logits, ...)`` to a
sparse causal LM's loss when its config sets ``output_router_logits``, the router logits
recorded from every module of the class its model names for them
(``_can_record_outputs["router_logits"]``, an ``OutputRecorder`` with the index of the logits
in the module's output). A family whose modeling file has no ``load_balancing_loss_func``
(Llama 4, DeepSeek-V3) returns the logits and adds no loss. :func:`load_balance_of` finds, the
way transformers does, whether the loss applies, its numbers, and the layers holding a router;
:func:`routing_of` turns a router's output into what flowtrain's load-balancing loss counts
(:mod:`flowtrain.train.load_balance`): the softmax over all experts in fp32 and the top-k::

    spec = load_balance_of(cfg.hf_json)          # None: trained without the loss
    spec.layers, spec.experts, spec.k, spec.coef
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ...errors import ConfigError
from .skeleton import skeleton

__all__ = ["LoadBalanceSpec", "load_balance_of", "routing_of"]


@dataclass(frozen=True)
class LoadBalanceSpec:
    """What the load-balancing loss of a generic model needs: its weight, the experts and
    experts per token, the layers with a router, and how to find a router's logits."""

    coef: float
    experts: int
    k: int
    layers: tuple[int, ...]
    router: type[nn.Module]
    index: int  # of the logits in the router's output, where that is a tuple


def _int(config: Any, *names: str) -> int | None:
    return next((v for n in names if isinstance(v := getattr(config, n, None), int) and v > 0), None)


@functools.lru_cache(maxsize=8)
def load_balance_of(hf_json: str) -> LoadBalanceSpec | None:
    """The load-balancing loss the model of ``hf_json`` trains with, as transformers adds it
    (None: the config does not ask for it, or the family adds none)."""
    sk = skeleton(hf_json)
    config = sk.model.config
    if not getattr(config, "output_router_logits", False):
        return None
    if not hasattr(sys.modules[type(sk.model).__module__], "load_balancing_loss_func"):
        return None  # transformers returns the logits of this family and adds no loss
    name = type(sk.model).__name__
    recorder = (getattr(type(sk.model), "_can_record_outputs", None) or {}).get("router_logits")
    router = getattr(recorder, "target_class", None)
    experts, k = _int(config, "num_experts", "num_local_experts", "n_routed_experts"), _int(config, "num_experts_per_tok")
    if router is None or experts is None or k is None:
        raise ConfigError(f"config.json of {name} sets output_router_logits, but flowtrain cannot find its routers "
                          "(or their experts and experts per token) as transformers records them: set it to false "
                          "to train without the load-balancing loss")
    layers = tuple(i for i, layer in enumerate(sk.layers) if any(isinstance(m, router) for m in layer.modules()))
    coef = float(getattr(config, "router_aux_loss_coef", 0.001))
    return LoadBalanceSpec(coef, experts, k, layers, router, int(getattr(recorder, "index", 0) or 0))


def routing_of(spec: LoadBalanceSpec, output: Any) -> tuple[Tensor, Tensor]:
    """``(probabilities (tokens, experts) fp32, chosen experts (tokens, k))`` of one router's
    output, as ``load_balancing_loss_func`` derives them from its logits: a softmax over every
    expert, then the top k."""
    logits = output[spec.index] if isinstance(output, (tuple, list)) else output
    probs = torch.softmax(logits.reshape(-1, logits.shape[-1]).float(), dim=-1)
    return probs, torch.topk(probs, spec.k, dim=-1).indices
