"""Task kinds: frozen, tagged, hashable structs that know their lane and the pool they take."""

from __future__ import annotations

import msgspec
import pytest

from flowtrain.graph import (
    DEVICE_LANES,
    GRADS,
    HOST_GRADS,
    KINDS,
    LANES,
    WEIGHTS,
    AnyTask,
    Backward,
    CpuAdam,
    Embed,
    EmbedBackward,
    EvalLoss,
    Fetch,
    Forward,
    FoundInf,
    GpuAdam,
    GradNorm,
    GradSqNorm,
    Loss,
    OffloadGrad,
    Recompute,
    SaveUnit,
    VerifyStep,
    ZeroGrad,
)
from flowtrain.graph.tasks import (ACTS, HOST_STATE, FetchAct, OffloadAct, ReadState, ReduceGrad, SyncStep, WriteState,
                                   task_from_dict, task_to_dict)

#: kind -> (class, lane, pool it takes a slot from)
CARD = {
    "fetch": (Fetch, "h2d", WEIGHTS),
    "forward": (Forward, "compute", None),
    "recompute": (Recompute, "compute", None),
    "backward": (Backward, "compute", None),
    "offload_grad": (OffloadGrad, "d2h", None),
    "cpu_adam": (CpuAdam, "cpu", None),
    "embed": (Embed, "compute", None),
    "loss": (Loss, "compute", None),
    "embed_backward": (EmbedBackward, "compute", None),
    "zero_grad": (ZeroGrad, "compute", GRADS),
    "grad_norm": (GradNorm, "cpu", None),
    "grad_sq_norm": (GradSqNorm, "compute", None),
    "gpu_adam": (GpuAdam, "compute", None),
    "found_inf": (FoundInf, "compute", None),
    "verify_step": (VerifyStep, "sync", None),
    "save": (SaveUnit, "io", None),
    "eval_loss": (EvalLoss, "compute", None),
    "offload_act": (OffloadAct, "d2h", None),
    "fetch_act": (FetchAct, "h2d", ACTS),
    "reduce_grad": (ReduceGrad, "net", None),
    "sync_step": (SyncStep, "sync", None),
    "read_state": (ReadState, "disk", HOST_STATE),
    "write_state": (WriteState, "disk", None),
}


def test_a_staged_offload_takes_a_host_staging_slot():
    """``chunk`` marks the staged layout: that offload fills a host staging slot."""
    assert OffloadGrad(unit="layer", layer=1, chunk=0).takes == HOST_GRADS
    assert OffloadGrad(unit="layer", layer=1).takes is None
    assert OffloadGrad(unit="layer", layer=1, chunk=2).label == "offload_grad L1 c2"
    t = OffloadGrad(unit="embed", chunk=1, step=3)
    assert task_from_dict(task_to_dict(t)) == t


def _unit(cls) -> str:
    """A unit a task of ``cls`` may name: its own where its kind has one, else a layer."""
    return {"embed_micro_batch": "embed", "head_micro_batch": "head"}.get(cls.scope, "layer")


def test_every_kind_is_on_the_card():
    assert set(KINDS) == set(CARD)


@pytest.mark.parametrize("kind", sorted(CARD))
def test_kind_lane_and_pool(kind):
    cls, lane, takes = CARD[kind]
    task = cls(unit=_unit(cls), layer=2, micro_batch=1)
    assert KINDS[kind] is cls
    assert (task.kind, task.lane, task.takes) == (kind, lane, takes)
    assert lane in LANES
    assert (lane in DEVICE_LANES) == (lane not in ("cpu", "io", "disk", "sync"))


@pytest.mark.parametrize("kind", sorted(CARD))
def test_json_round_trip_through_the_tagged_union(kind):
    phase = max(KINDS[kind].phases, key=str)  # a pass the kind may serve (None where none)
    activations = max(KINDS[kind].activation_values, key=str)  # what it may keep (None where nothing)
    task = KINDS[kind](step=3, unit=_unit(KINDS[kind]), layer=5, micro_batch=2, phase=phase, activations=activations)
    raw = msgspec.json.encode(task)
    assert msgspec.json.decode(raw)["kind"] == kind
    assert msgspec.json.decode(raw, type=AnyTask) == task
    data = task_to_dict(task)
    assert data["lane"] == task.lane and data["takes"] == task.takes
    assert task_from_dict(data) == task


def test_tasks_are_frozen_hashable_values():
    a, b = Forward(layer=1, micro_batch=0), Forward(layer=1, micro_batch=0)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert Forward(layer=1, micro_batch=0) != Backward(layer=1, micro_batch=0)  # the kind is part of the identity
    assert Forward(layer=1, micro_batch=0, step=0) != Forward(layer=1, micro_batch=0, step=1)
    with pytest.raises(AttributeError):
        a.layer = 2  # type: ignore[misc]


def test_from_dict_fills_defaults_and_ignores_extras():
    t = task_from_dict({"kind": "cpu_adam", "unit": "head", "lane": "cpu", "id": "x", "step": None})
    assert t == CpuAdam(unit="head", step=0)


@pytest.mark.parametrize(
    "task, label",
    [
        (Forward(unit="layer", layer=3, micro_batch=1), "forward L3 m1"),
        (Fetch(unit="head", phase="backward"), "fetch head (backward)"),
        (Fetch(unit="layer", layer=0, phase="recompute", step=2), "fetch L0 (recompute) s2"),
        (Backward(unit="layer", layer=2, micro_batch=0, activations="attn"), "backward L2 m0 (attn)"),
        (Forward(unit="layer", layer=1, micro_batch=1, phase="eval"), "forward L1 m1 (eval)"),
        (Embed(unit="embed", micro_batch=0), "embed m0"),
        (ZeroGrad(unit="embed"), "zero_grad embed"),
        (GradNorm(), "grad_norm"),
    ],
)
def test_labels(task, label):
    assert task.label == label == str(task)
