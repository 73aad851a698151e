"""The compiler: the structure of a training step's DAG for every option of :class:`StepSpec`."""

from __future__ import annotations

import itertools
import re

import msgspec
import networkx as nx
import pytest

from flowtrain.errors import ConfigError
from flowtrain.graph import (
    Backward,
    CpuAdam,
    Embed,
    EmbedBackward,
    Fetch,
    Forward,
    FoundInf,
    GpuAdam,
    GradNorm,
    GradSqNorm,
    Loss,
    OffloadGrad,
    Recompute,
    StepSpec,
    VerifyStep,
    ZeroGrad,
    compile_step,
    compile_steps,
    cross_step_edges,
    graph_from_json,
    graph_to_json,
    units,
)

SPECS = [
    StepSpec(layers=L, micro_batches=M, checkpoint_every=k, order=o, tied=t, grad_clip=c)
    for L, M, k, o, t, c in itertools.product(
        [1, 4, 5], [1, 3], [1, 2, 3], ["layer", "micro"], [False, True], [False, True]
    )
]


def spec_id(s: StepSpec) -> str:
    return f"L{s.layers}-M{s.micro_batches}-k{s.checkpoint_every}-{s.order}" + "-tied" * s.tied + "-clip" * s.grad_clip


def of(graph, cls, **fields):
    return [t for t in graph if type(t) is cls and all(getattr(t, k) == v for k, v in fields.items())]


def one(graph, cls, **fields):
    found = of(graph, cls, **fields)
    assert len(found) == 1, f"{cls.__name__} {fields}: {found}"
    return found[0]


def segments(spec):
    return [(c, min(c + spec.checkpoint_every, spec.layers)) for c in range(0, spec.layers, spec.checkpoint_every)]


@pytest.mark.parametrize(
    "fields, flag",
    [
        (dict(layers=0), "--layers"),
        (dict(layers=2, micro_batches=0), "--micro-batches"),
        (dict(layers=2, checkpoint_every=0), "--checkpoint-every"),
        (dict(layers=2, order="random"), "--order"),
    ],
)
def test_spec_errors_name_the_flag(fields, flag):
    """``flowtrain graph`` names its own flag; the exception's text the StepSpec field."""
    from flowtrain.cli.graph import flag_of

    with pytest.raises(ConfigError) as info:
        compile_step(StepSpec(**fields))
    assert info.value.spelled(flag_of).startswith(flag + " ")
    assert str(info.value).startswith(flag[2:].replace("-", "_") + " ")


def test_units_bottom_to_top():
    assert units(StepSpec(layers=2)) == [("embed", None), ("layer", 0), ("layer", 1), ("head", None)]


@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
def test_structure(spec):
    g = compile_step(spec, step=4)
    L, M = spec.layers, spec.micro_batches
    assert nx.is_directed_acyclic_graph(g)
    index = {t: i for i, t in enumerate(g)}
    assert all(index[u] < index[v] for u, v in g.edges), "nodes are inserted in a serial (topological) order"
    assert all(t.step == 4 for t in g)
    assert g.graph["spec"]["layers"] == L
    for u, v, reads in g.edges(data="reads"):
        assert not reads or u.takes is not None, f"{v} reads a slot of {u}, which takes none"

    # One task per (layer, micro-batch) of each per-layer kind; per micro-batch kinds; per unit kinds.
    n_recompute = sum(end - c - 1 for c, end in segments(spec))
    assert len(of(g, Forward)) == len(of(g, Backward)) == L * M
    assert len(of(g, Recompute)) == n_recompute * M
    assert len(of(g, Embed)) == len(of(g, Loss)) == len(of(g, EmbedBackward)) == M
    for cls in (ZeroGrad, OffloadGrad, CpuAdam):
        assert {(t.unit, t.layer) for t in of(g, cls)} == set(units(spec))
        assert len(of(g, cls)) == L + 2
    assert len(of(g, GradNorm)) == int(spec.grad_clip)
    # Layer-major fetches each unit once per pass; micro-batch-major once per pass per micro-batch.
    per_pass = 1 + L + 1 + L + n_recompute  # embed, forward, head, backward, recompute
    assert len(of(g, Fetch)) == per_pass * (1 if spec.order == "layer" else M)

    for t in g:
        takes = [p for p, _, r in g.in_edges(t, data="reads") if r]
        pools = sorted(p.takes for p in takes)
        expected = {
            Embed: ["weights"], Forward: ["weights"], Recompute: ["weights"], Loss: ["grads", "weights"],
            Backward: ["grads", "weights"], EmbedBackward: ["grads"], OffloadGrad: ["grads"],
        }.get(type(t), [])
        assert pools == expected, f"{t} reads slots of {takes}"
        for p in takes:
            assert (p.unit, p.layer) == (t.unit, t.layer), f"{t} reads the slot of another unit: {p}"
            if isinstance(p, Fetch) and spec.order == "micro":
                assert p.micro_batch == t.micro_batch or t.micro_batch is None


@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
def test_data_flow(spec):
    """Forward reads its layer's fetch, backward flows down through the layers, and each layer's
    input in backward comes from a checkpoint or a recompute."""
    g = compile_step(spec)
    L, M, k = spec.layers, spec.micro_batches, spec.checkpoint_every
    for i, m in itertools.product(range(L), range(M)):
        fwd, bwd = one(g, Forward, layer=i, micro_batch=m), one(g, Backward, layer=i, micro_batch=m)
        preds = set(g.predecessors(fwd))
        assert any(isinstance(p, Fetch) and p.layer == i and p.phase == "forward" for p in preds)
        assert (one(g, Embed, micro_batch=m) if i == 0 else one(g, Forward, layer=i - 1, micro_batch=m)) in preds
        above = one(g, Loss, micro_batch=m) if i == L - 1 else one(g, Backward, layer=i + 1, micro_batch=m)
        assert g.has_edge(above, bwd)
        assert g.has_edge(one(g, ZeroGrad, unit="layer", layer=i), bwd)
        assert any(isinstance(p, Fetch) and p.layer == i and p.phase == "backward" for p in g.predecessors(bwd))
        if i % k == 0:
            src = one(g, Embed, micro_batch=m) if i == 0 else one(g, Forward, layer=i - 1, micro_batch=m)
        else:
            src = one(g, Recompute, layer=i - 1, micro_batch=m)
        assert g.has_edge(src, bwd), f"backward L{i} m{m} gets its input from {src}"
    for t in of(g, Recompute):
        c = t.layer - t.layer % k
        expected = (one(g, Embed, micro_batch=t.micro_batch) if c == 0 else one(g, Forward, layer=c - 1, micro_batch=t.micro_batch)) \
            if t.layer == c else one(g, Recompute, layer=t.layer - 1, micro_batch=t.micro_batch)
        assert g.has_edge(expected, t)
        assert t.layer % k != k - 1 and t.layer < L - 1, "the top layer of a segment is never recomputed"


@pytest.mark.parametrize("spec", [s for s in SPECS if not s.grad_clip], ids=spec_id)
def test_adam_of_a_layer_waits_for_its_own_gradients_only(spec):
    """``cpu_adam`` of layer i follows every backward of layer i through the layer's
    ``offload_grad``, and no backward below it: Adam runs while the device is still in backward."""
    g = compile_step(spec)
    for i in range(spec.layers):
        adam, off = one(g, CpuAdam, unit="layer", layer=i), one(g, OffloadGrad, unit="layer", layer=i)
        assert list(g.predecessors(adam)) == [off]
        ancestors = nx.ancestors(g, adam)
        for m in range(spec.micro_batches):
            assert g.has_edge(one(g, Backward, layer=i, micro_batch=m), off)
        assert not [t for t in ancestors if isinstance(t, Backward) and t.layer < i]
        assert not [t for t in ancestors if isinstance(t, EmbedBackward)]
    head_adam = one(g, CpuAdam, unit="head")
    assert not [t for t in nx.ancestors(g, head_adam) if isinstance(t, Backward)]
    embed_adam = one(g, CpuAdam, unit="embed")
    assert set(of(g, EmbedBackward)) <= nx.ancestors(g, embed_adam)
    assert g.has_edge(one(g, OffloadGrad, unit="head"), embed_adam) == spec.tied


@pytest.mark.parametrize("spec", [s for s in SPECS if s.grad_clip], ids=spec_id)
def test_grad_clip_puts_the_global_norm_between_every_offload_and_every_adam(spec):
    g = compile_step(spec)
    norm = one(g, GradNorm)
    assert set(g.predecessors(norm)) == set(of(g, OffloadGrad))
    assert set(g.successors(norm)) == set(of(g, CpuAdam))
    adam_units = [(t.unit, t.layer) for t in g if isinstance(t, CpuAdam)]
    assert adam_units == units(spec), "Adam runs bottom-up after the norm"


def test_micro_batch_major_runs_each_micro_batch_through_the_model():
    g = compile_step(StepSpec(layers=2, micro_batches=2, order="micro"))
    compute = [t.label for t in g if t.lane == "compute" and t.micro_batch is not None]
    assert compute == [
        "embed m0", "forward L0 m0", "forward L1 m0", "loss head m0", "backward L1 m0", "backward L0 m0", "embed_backward embed m0",
        "embed m1", "forward L0 m1", "forward L1 m1", "loss head m1", "backward L1 m1", "backward L0 m1", "embed_backward embed m1",
    ]
    assert [t.label for t in g if isinstance(t, Fetch) and t.layer == 0] == [
        "fetch L0 m0 (forward)", "fetch L0 m0 (backward)", "fetch L0 m1 (forward)", "fetch L0 m1 (backward)",
    ]


def test_layer_major_runs_every_micro_batch_through_a_layer_first():
    g = compile_step(StepSpec(layers=2, micro_batches=2, checkpoint_every=2))
    compute = [t.label for t in g if t.lane == "compute" and t.micro_batch is not None]
    assert compute == [
        "embed m0", "embed m1", "forward L0 m0", "forward L0 m1", "forward L1 m0", "forward L1 m1",
        "loss head m0", "loss head m1", "recompute L0 m0", "recompute L0 m1", "backward L1 m0", "backward L1 m1",
        "backward L0 m0", "backward L0 m1", "embed_backward embed m0", "embed_backward embed m1",
    ]


@pytest.mark.parametrize("tied", [False, True])
def test_cross_step_edges_link_adam_to_the_next_fetch(tied):
    spec = StepSpec(layers=3, micro_batches=2, checkpoint_every=2, tied=tied)
    g = compile_steps(spec, 3)
    assert nx.is_directed_acyclic_graph(g)
    assert g.number_of_nodes() == 3 * compile_step(spec).number_of_nodes()
    between = [(u, v) for u, v in g.edges if u.step != v.step]
    assert all(isinstance(u, (CpuAdam, VerifyStep)) and isinstance(v, Fetch) and v.step == u.step + 1
               for u, v in between)
    for s in (1, 2):
        for f in of(g, Fetch, step=s):
            adams = {(p.unit, p.layer) for p in g.predecessors(f) if p.step == s - 1 and isinstance(p, CpuAdam)}
            want = {(f.unit, f.layer)} | ({("embed", None)} if tied and f.unit == "head" else set())
            assert adams == want, f"{f} waits for Adam of {adams}"
            assert g.has_edge(one(g, VerifyStep, step=s - 1), f), "a fetch never reads an update that is undone"
    step0, step1 = compile_step(spec, 0), compile_step(spec, 1)
    assert set(cross_step_edges(step0, step1, spec)) == {(u, v) for u, v in between if v.step == 1}


def test_compile_steps_needs_a_step():
    with pytest.raises(ConfigError, match="steps"):
        compile_steps(StepSpec(layers=1), 0)


@pytest.mark.parametrize("spec", SPECS[::7], ids=spec_id)
def test_json_round_trip(spec):
    g = compile_steps(spec, 2)
    data = graph_to_json(g)
    for node in data["nodes"]:
        assert {"kind", "layer", "micro_batch", "lane", "id"} <= node.keys()
    back = graph_from_json(data)
    assert list(back.nodes) == list(g.nodes)
    assert list(back.edges(data="reads")) == list(g.edges(data="reads"))
    assert back.graph == g.graph


def test_resident_units_have_no_transfers_and_adam_on_the_device():
    """Resident embed, head and layer 0: no fetch, zero_grad or offload_grad for them; one
    gpu_adam each after its last gradient writer; the next step's readers of those units wait
    for it (and only streamed units' fetches wait for a cpu_adam)::

        backward L0 m0, backward L0 m1 -> gpu_adam L0 -> (step 1) forward L0 m0, m1, backward L0 ...
    """
    spec = StepSpec(layers=3, micro_batches=2, resident=("embed", "head", "layer.0"))
    g = compile_steps(spec, 2)
    res = {("embed", None), ("head", None), ("layer", 0)}
    for t in g:
        if (t.unit, t.layer) in res:
            assert t.kind not in ("fetch", "zero_grad", "offload_grad", "cpu_adam"), t
    s0 = [t for t in g if t.step == 0]
    adam_l0 = next(t for t in s0 if t.kind == "gpu_adam" and t.layer == 0)
    assert {str(p) for p in g.predecessors(adam_l0)} == {"backward L0 m0", "backward L0 m1", "found_inf"}
    later = {str(t) for t in g.successors(adam_l0)}
    assert later == {"forward L0 m0 s1", "forward L0 m1 s1", "backward L0 m0 s1", "backward L0 m1 s1"}
    assert sum(t.kind == "gpu_adam" for t in s0) == 3
    assert sum(t.kind == "cpu_adam" for t in s0) == 2
    fetch1 = next(t for t in g if t.kind == "fetch" and t.step == 1 and t.layer == 1)
    assert [p.kind for p in g.predecessors(fetch1)] == ["cpu_adam", "verify_step"]


def test_staged_chunks_each_take_a_staging_slot_read_by_their_adam():
    spec = StepSpec(layers=2, staged=True, grad_chunks={"embed": 3})
    g = compile_step(spec)
    offs = [t for t in g if t.kind == "offload_grad" and t.unit == "embed"]
    assert [t.chunk for t in offs] == [0, 1, 2]
    for off in offs:
        assert off.takes == "host_grads"
        (adam,) = [v for v in g.successors(off) if v.kind == "cpu_adam"]
        assert adam.chunk == off.chunk and g.edges[off, adam]["reads"]
        assert {v.kind for v in g.successors(off)} == {"cpu_adam", "verify_step"}  # its flags settle the step


def test_staged_with_clip_or_mixed_tied_residency_is_refused():
    from flowtrain.cli import graph, train

    with pytest.raises(ConfigError) as info:
        StepSpec(layers=2, staged=True, grad_clip=True).validate()
    assert info.value.spelled(train.flag_of).endswith("use --layout full")  # what train's user changes
    assert info.value.spelled(graph.flag_of).endswith("(leave out --staged)")
    with pytest.raises(ConfigError, match="both resident"):
        StepSpec(layers=2, tied=True, resident=("embed",)).validate()
    with pytest.raises(ConfigError, match="not units"):
        StepSpec(layers=2, resident=("layer.2",)).validate()


NONFINITE_SPECS = [
    StepSpec(layers=L, micro_batches=M, order=o, tied=t, grad_clip=c, resident=r, staged=st,
             grad_chunks={"embed": 2} if st else {})
    for L, M, o, t, c, r, st in itertools.product(
        [1, 3], [1, 2], ["layer", "micro"], [False, True], [False, True],
        [(), ("layer.0",), ("embed", "head", "layer.1"), ("embed", "head", "layer.0", "layer.1", "layer.2")], [False, True],
    )
    if not (st and c) and all(u in ("embed", "head") or int(u[6:]) < L for u in r)
]


def nf_id(s: StepSpec) -> str:
    return spec_id(s) + f"-res{len(s.resident)}" + "-staged" * s.staged


@pytest.mark.parametrize("spec", NONFINITE_SPECS, ids=nf_id)
def test_the_loss_and_every_gradient_are_checked_before_they_can_reach_the_weights(spec):
    """Every ``loss`` precedes every Adam task, in both orders, so a bad loss is known before
    any update. Without clipping, ``found_inf`` follows every gradient (each offload, each
    resident unit's last writer) and precedes every ``gpu_adam``; ``verify_step`` follows every
    offload's flags (and ``found_inf``; with a tied embedding, the embedding's ``cpu_adam``,
    which checks the summed gradient), not every ``cpu_adam``. With clipping ``grad_norm`` plays
    both parts::

        offload_grad * ----> found_inf --> gpu_adam *        (resident units, bottom-up)
        offload_grad * ----> verify_step --> fetch * (next step), each also after its unit's cpu_adam
    """
    g = compile_step(spec)
    losses = set(of(g, Loss))
    adams = [t for t in g if isinstance(t, (CpuAdam, GpuAdam))]
    for a in adams:
        assert losses <= nx.ancestors(g, a), f"{a} may run before a loss"
    gpu, cpu = of(g, GpuAdam), of(g, CpuAdam)
    assert {(t.unit, t.layer) for t in gpu} == {(u, None) if u in ("embed", "head") else ("layer", int(u[6:]))
                                                 for u in spec.resident}
    gradients = set(of(g, OffloadGrad)) | set(of(g, Backward)) | set(of(g, EmbedBackward)) | losses
    if spec.grad_clip:
        assert not of(g, FoundInf) and not of(g, VerifyStep)
        norm = one(g, GradNorm)
        assert gradients <= nx.ancestors(g, norm)
        assert all(g.has_edge(norm, a) for a in adams)
        return
    assert not of(g, GradNorm) and not of(g, GradSqNorm)
    if gpu:
        found = one(g, FoundInf)
        assert gradients <= nx.ancestors(g, found)
        assert all(g.has_edge(found, a) for a in gpu)
        order = [(t.unit, t.layer) for t in g if isinstance(t, GpuAdam)]
        assert order == [u for u in units(spec) if u in order], "resident Adam runs bottom-up"
    else:
        assert not of(g, FoundInf)
    if cpu:
        verify = one(g, VerifyStep)
        tied_checks = {a for a in cpu if spec.tied and a.unit == "embed"}
        assert set(g.predecessors(verify)) == set(of(g, OffloadGrad)) | set(of(g, FoundInf)) | tied_checks
        assert gradients <= nx.ancestors(g, verify) | {verify}
    else:
        assert not of(g, VerifyStep)


def test_the_next_step_waits_for_verify_step_only_where_it_fetches():
    """Resident units are never put back, so the next step's work on them (the forward of the
    bottom layers) still overlaps the CPU Adam of the streamed layers above; only fetches wait
    for ``verify_step``."""
    spec = StepSpec(layers=3, micro_batches=2, resident=("embed", "head", "layer.0"))
    g = compile_steps(spec, 2)
    verify = one(g, VerifyStep, step=0)
    assert all(isinstance(v, Fetch) for v in g.successors(verify))
    assert {v for v in g.successors(verify)} == set(of(g, Fetch, step=1))
    assert not nx.has_path(g, verify, one(g, Forward, layer=0, micro_batch=1, step=1))


@pytest.mark.parametrize("order, micro_batches, every", [("layer", 3, 1), ("layer", 2, 3), ("micro", 3, 2)])
def test_backward_side_fetches_of_a_layer_skipping_idle_experts_follow_its_forwards(order, micro_batches, every):
    """Skipping idle experts: the recompute and backward fetches of such a layer wait for the
    forwards (of the micro-batches they serve) whose routing says what to copy; other layers'
    fetches and the rest of the graph are as without it."""
    spec = StepSpec(layers=4, micro_batches=micro_batches, checkpoint_every=every, order=order, skip_idle_experts=(1, 3))
    g, plain = compile_step(spec), compile_step(msgspec.structs.replace(spec, skip_idle_experts=()))
    assert nx.is_directed_acyclic_graph(g) and set(g) == set(plain)
    extra = set(g.edges) - set(plain.edges)
    assert set(plain.edges) <= set(g.edges)
    for f in g:
        if type(f) is not Fetch or f.unit != "layer" or f.phase == "forward":
            continue
        served = range(micro_batches) if f.micro_batch is None else [f.micro_batch]
        want = {(one(g, Forward, layer=f.layer, micro_batch=m), f) for m in served} if f.layer in spec.skip_idle_experts else set()
        assert {e for e in extra if e[1] == f} == want
        assert all(not g.edges[e]["reads"] for e in want)
    assert extra and all(type(v) is Fetch for _, v in extra)


@pytest.mark.parametrize("fields, words", [
    (dict(skip_idle_experts=(4,)), "distinct layers of 0..3"),
    (dict(skip_idle_experts=(1, 1)), "distinct layers"),
    (dict(skip_idle_experts=(1,), lora=True), "not LoRA"),
])
def test_layers_skipping_idle_experts_are_checked(fields, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        StepSpec(layers=4, **fields).validate()


@pytest.mark.parametrize("order", ["layer", "micro"])
def test_lora_adapters_in_host_memory_are_streamed_units(order):
    """Each layer's adapters: a gradient slot its backward adds into, one whole offload (staged
    or not) and a cpu_adam; no gpu_adam or found_inf; the next step's fetches of the layer
    wait for that cpu_adam. The base stays frozen: nothing else has a gradient."""
    spec = StepSpec(layers=3, micro_batches=2, order=order, lora=True, host_adapters=True, staged=True)
    g = compile_steps(spec, 2)
    assert nx.is_directed_acyclic_graph(g)
    assert not of(g, GpuAdam) and not of(g, FoundInf)
    for s in (0, 1):
        for i in range(3):
            z = one(g, ZeroGrad, step=s, unit="adapter", layer=i)
            off = one(g, OffloadGrad, step=s, unit="adapter", layer=i)
            adam = one(g, CpuAdam, step=s, unit="adapter", layer=i)
            assert off.chunk is None and adam.chunk is None
            assert all(g.has_edge(z, b) for b in of(g, Backward, step=s, layer=i))
            assert g.has_edge(off, adam) and all(nx.has_path(g, b, off) for b in of(g, Backward, step=s, layer=i))
        assert {t.unit for t in of(g, ZeroGrad, step=s)} == {"adapter"}
    for f in of(g, Fetch, step=1, unit="layer"):
        assert g.has_edge(one(g, CpuAdam, step=0, unit="adapter", layer=f.layer), f)
    with pytest.raises(ConfigError, match="LoRA's"):
        StepSpec(layers=2, host_adapters=True).validate()
