"""Each task kind names what it should: its ``phase`` (the pass it serves: a fetch's pass, a
held-out loss) and its ``activations`` (what a layer's forward and backward keep) only from the
values its kind allows, and, from the step compiler, exactly the unit, layer, micro-batch and
chunk its scope says."""

from __future__ import annotations

import itertools

import msgspec
import pytest

from flowtrain.graph import StepSpec, compile_steps
from flowtrain.graph.evaluation import compile_eval
from flowtrain.graph.saving import add_saves
from flowtrain.graph.tasks import (
    KINDS,
    AnyTask,
    Backward,
    CpuAdam,
    Embed,
    Fetch,
    Forward,
    GradNorm,
    Loss,
    OffloadGrad,
    Recompute,
    check_shape,
    task_from_dict,
    task_to_dict,
)

SPECS = [
    StepSpec(layers=4, micro_batches=mb, checkpoint_every=k, order=order, tied=tied, grad_clip=clip, resident=res,
             staged=staged, grad_chunks={"layer.0": 2} if staged else {}, keep=keep, offload=off, reduce=reduce)
    for mb, k, order, tied, clip, res, staged, keep, off, reduce in itertools.product(
        [1, 2], [1, 2], ["layer", "micro"], [False, True], [False, True], [(), ("embed", "head", "layer.1")],
        [False, True], [(), (1, 2)], [(), (0,)], [False, True])
    if not (keep and k != 1) and not (off and set(off) & set(keep)) and not (staged and clip)
]


@pytest.mark.parametrize("spec", SPECS[::7], ids=lambda s: f"{s.micro_batches}mb-k{s.checkpoint_every}-{s.order}")
def test_every_compiled_task_has_its_kinds_shape(spec):
    graph = compile_steps(spec, 2)
    add_saves(graph, spec, 1)
    evaluation = compile_eval(spec, 0, 2)
    for task in [*graph.nodes, *evaluation.nodes]:
        check_shape(task)
        assert task.phase in type(task).phases
        assert task.activations in type(task).activation_values
    kinds = {t.kind for t in graph} | {t.kind for t in evaluation}
    assert {"fetch", "forward", "backward", "loss", "save", "eval_loss"} <= kinds


@pytest.mark.parametrize("cls, phase", [(Fetch, "NoneType"), (Forward, "backward"), (Backward, "eval"),
                                        (Embed, "recompute"), (Loss, "forward"), (CpuAdam, "eval"),
                                        (Fetch, "keep"), (Forward, "keep"), (Backward, "attn")])
def test_a_phase_outside_its_kinds_meaning_is_refused(cls, phase):
    phase = None if phase == "NoneType" else phase
    if phase is None:  # a fetch without a pass: allowed to make by hand, refused by the compiler's check
        with pytest.raises(ValueError, match="no phase"):
            check_shape(Fetch(unit="layer", layer=0))
        return
    fields = _named(cls)
    with pytest.raises(ValueError, match=f"a {cls.__struct_config__.tag} task's phase is one of"):
        cls(**fields, phase=phase)
    cls(**fields)  # the same task without the phase is fine, so the phase is what was refused
    data = msgspec.json.encode({"kind": cls.__struct_config__.tag, **fields, "phase": phase})
    with pytest.raises(msgspec.ValidationError, match="phase is one of|Invalid enum value"):  # keep: no pass at all
        msgspec.json.decode(data, type=AnyTask)


@pytest.mark.parametrize("cls, activations", [(Fetch, "keep"), (Embed, "attn"), (Recompute, "keep"),
                                              (Loss, "attn"), (Forward, "eval"), (Backward, "forward")])
def test_activations_outside_their_kinds_are_refused(cls, activations):
    fields = _named(cls)
    with pytest.raises(ValueError, match=f"a {cls.__struct_config__.tag} task's activations are one of"):
        cls(**fields, activations=activations)
    data = msgspec.json.encode({"kind": cls.__struct_config__.tag, **fields, "activations": activations})
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(data, type=AnyTask)


@pytest.mark.parametrize("cls, value", [(Forward, "keep"), (Forward, "attn"), (Backward, "keep"), (Backward, "attn")])
def test_a_legacy_keep_or_attn_phase_reads_as_activations(cls, value):
    """Graph and trace files written before ``activations`` was a field of its own gave a kept
    layer's forward and backward that value as their ``phase``: they still load."""
    fields = _named(cls)
    old = {"kind": cls.__struct_config__.tag, **fields, "phase": value, "lane": "compute"}
    assert task_from_dict(old) == cls(**fields, activations=value)
    with pytest.raises(msgspec.ValidationError):  # on a kind that keeps nothing it is still refused
        task_from_dict({"kind": "recompute", **fields, "phase": value})


def _named(cls) -> dict:
    """What a task of ``cls`` names by its scope: its unit, layer and micro-batch."""
    return {"layer_micro_batch": {"unit": "layer", "layer": 0, "micro_batch": 0},
            "embed_micro_batch": {"unit": "embed", "micro_batch": 0},
            "head_micro_batch": {"unit": "head", "micro_batch": 0},
            "unit": {"unit": "layer", "layer": 0}, "step": {}}[cls.scope]


def test_a_phase_that_means_nothing_is_refused_on_decode():
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"kind": "forward", "layer": 0, "micro_batch": 0, "phase": "later"}', type=AnyTask)


def test_each_kind_requires_what_it_names_and_types_it():
    assert Forward(layer=0, micro_batch=1).unit == "layer" and Loss(micro_batch=0).unit == "head"
    for make in (lambda: Forward(unit="layer", micro_batch=0), lambda: Forward(unit="layer", layer=1),
                 lambda: Embed(), lambda: CpuAdam(layer=1)):  # type: ignore[call-arg]
        with pytest.raises(TypeError, match="Missing required argument"):
            make()
    for bad in ({"kind": "forward", "layer": 0}, {"kind": "forward", "layer": 0, "micro_batch": 0, "unit": "head"},
                {"kind": "forward", "layer": "0", "micro_batch": 0}, {"kind": "cpu_adam", "unit": "lm_head"}):
        with pytest.raises(msgspec.ValidationError):
            msgspec.json.decode(msgspec.json.encode(bad), type=AnyTask)
        with pytest.raises(msgspec.ValidationError):
            task_from_dict(bad)


@pytest.mark.parametrize("task, why", [
    (CpuAdam(unit="embed", layer=3), "layer 3 (only a decoder layer's tasks name one)"),
    (CpuAdam(unit="layer", layer=3, micro_batch=1), "micro_batch 1 (its kind names none)"),
    (OffloadGrad(unit="layer", layer=1, chunk=0), None),
    (Forward(unit="layer", layer=1, micro_batch=0, chunk=2), "chunk 2 (only offload_grad, cpu_adam, read_state and write_state name one)"),
    (GradNorm(unit="head"), "unit 'head' (a step-wide task names none)"),
    (Loss(unit="head", micro_batch=0), None),
    (Fetch(unit="head", phase="backward", micro_batch=1), None),
])
def test_check_shape_names_what_is_wrong(task, why):
    if why is None:
        check_shape(task)
        return
    with pytest.raises(ValueError, match=f"task {task.label}: .*{why.replace('(', '[(]').replace(')', '[)]')}"):
        check_shape(task)


def test_every_kind_declares_its_scope_and_round_trips():
    for kind, cls in KINDS.items():
        assert cls.scope in ("unit", "layer_micro_batch", "embed_micro_batch", "head_micro_batch", "step"), kind
        assert None in cls.phases  # a kind made by hand (a custom schedule) may leave phase unset
        assert None in cls.activation_values
    task = Forward(unit="layer", layer=2, micro_batch=1, activations="keep", step=3)
    assert task_from_dict(task_to_dict(task)) == task
    assert task.label == "forward L2 m1 (keep) s3"
