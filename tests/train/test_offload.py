"""Offloaded checkpoints: a layer's input waits in host memory between its forward and backward.

The graph gains an ``offload_act`` (d2h) after the layer's forward and a ``fetch_act`` (h2d,
taking an ``acts`` slot) before the first backward task that reads the checkpoint. A copy out
and back must change nothing, so the real test is a whole training run through the engine,
compared bit for bit with recompute; the planner tests check which checkpoints go and what
they cost on each side.
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import networkx as nx
import pytest
import torch

from flowtrain.errors import ConfigError
from flowtrain.graph.compiler import StepSpec, compile_step
from flowtrain.graph.tasks import ACTS, FetchAct, OffloadAct
from flowtrain.plan.memory import card_for
from flowtrain.plan.request import RunRequest
from flowtrain.plan.planner import plan_run
from flowtrain.policy import resolve_policy
from flowtrain.sim.clock import VirtualRun

sys.path.insert(0, str(Path(__file__).parents[1] / "model"))
from model_helpers import small_cfg
from test_kept import trains_like_recompute  # (3 steps of a 3-layer model on the CPU, in fp32)

CUDA = torch.device("cuda")


def _of(g: nx.DiGraph, cls: type) -> list:
    return [t for t in g if isinstance(t, cls)]


@pytest.mark.parametrize("order", ["layer", "micro"])
@pytest.mark.parametrize("k, offload", [(1, (0, 1, 2)), (2, (0, 2)), (1, (0,))])
def test_each_offloaded_checkpoint_goes_out_after_its_forward_and_back_before_its_backward(order, k, offload):
    spec = StepSpec(layers=4, micro_batches=3, checkpoint_every=k, order=order, offload=offload, staged=True)
    g = compile_step(spec)
    outs, backs = _of(g, OffloadAct), _of(g, FetchAct)
    assert sorted((t.layer, t.micro_batch) for t in outs) == sorted((i, m) for i in offload for m in range(3))
    assert sorted((t.layer, t.micro_batch) for t in backs) == sorted((t.layer, t.micro_batch) for t in outs)
    assert {t.lane for t in outs} == {"d2h"} and {t.lane for t in backs} == {"h2d"}
    assert {t.takes for t in backs} == {ACTS}
    position = {t: n for n, t in enumerate(g)}
    for t in outs:
        (fwd,) = g.predecessors(t)
        assert (fwd.kind, fwd.layer, fwd.micro_batch) == ("forward", t.layer, t.micro_batch)
    for t in backs:
        (out,) = g.predecessors(t)
        assert isinstance(out, OffloadAct) and (out.layer, out.micro_batch) == (t.layer, t.micro_batch)
        readers = [v for v in g.successors(t) if g.edges[t, v]["reads"]]
        # the segment's first task reads it: its recompute where it has one, and its backward
        want = {"recompute", "backward"} if k > 1 else {"backward"}
        assert {r.kind for r in readers} == want and all(r.layer == t.layer for r in readers)
        assert all(position[t] < position[r] for r in readers)
        # on the h2d lane it comes after the weights of the layer that reads it first
        first = min(readers, key=position.__getitem__)
        fetches = [p for p in g.predecessors(first) if p.kind == "fetch"]
        assert all(position[f] < position[t] for f in fetches)
    assert nx.is_directed_acyclic_graph(g)


def test_the_schedule_bounds_checkpoints_back_on_the_device_by_the_acts_budget():
    """On the virtual clock with slow copies back, at most ``acts`` checkpoints are back and
    unread at any time, and the step still completes (no deadlock, both orders)."""
    for order, k in (("layer", 1), ("layer", 2), ("micro", 2)):
        spec = StepSpec(layers=6, micro_batches=4, checkpoint_every=k, order=order, offload=tuple(range(0, 4, k)))
        g = compile_step(spec)
        budget = resolve_policy("double_buffer").propose(g).budgets[ACTS]
        run = VirtualRun(lambda t: 5.0 if t.kind == "fetch_act" else 1.0)
        records = run.run(g)
        assert len(records) == g.number_of_nodes()
        by = {(r.task.kind, r.task.layer, r.task.micro_batch): r for r in records}
        events = []
        for (kind, layer, m), r in by.items():
            if kind == "fetch_act":  # on the device from its copy until its backward is done
                events += [(r.start, 1), (by[("backward", layer, m)].end, -1)]
        live = peak = 0
        for _, d in sorted(events, key=lambda e: (e[0], e[1])):
            live += d
            peak = max(peak, live)
        assert 1 <= peak <= budget, (order, k, peak, budget)


def test_offloaded_layers_must_be_checkpoints():
    with pytest.raises(ConfigError, match="offloaded layers"):
        StepSpec(layers=4, checkpoint_every=2, offload=(1,)).validate()
    with pytest.raises(ConfigError, match="offloaded layers"):
        StepSpec(layers=4, keep=(3,), offload=(3,)).validate()
    with pytest.raises(ConfigError, match="offloaded layers"):
        StepSpec(layers=4, offload=(4,)).validate()


@pytest.mark.parametrize("extra", [[], ["--activation-checkpoint-every", "2"], ["--order", "micro"],
                                   ["--resident", "layer.0", "--policy", "sequential"]],
                         ids=["streamed", "every-2", "micro-order", "resident-sequential"])
def test_offload_trains_bit_identically_to_recompute(tmp_path, extra):
    trace = trains_like_recompute(tmp_path, "offload", extra)
    assert "offload_act L0 m1" in trace and "fetch_act L0 m1" in trace  # the offloaded path ran


# ---- the plan ---------------------------------------------------------------------------------
def _req(**kw) -> RunRequest:
    base = dict(seq_len=512, batch_size=8, micro_batch_size=1, activations="auto", layout="staged",
                resident="none", host_mem=64.0)
    return RunRequest(**{**base, **kw})


def _cfg():
    return small_cfg(num_layers=12, hidden_size=512, intermediate_size=1408, vocab_size=1024)


def _plan(req):
    return plan_run(_cfg(), req, device=CUDA, dtype=torch.bfloat16, local_gpu=False)


def _hidden(req) -> int:
    return req.micro_batch_size * req.seq_len * _cfg().hidden_size * 2


def test_auto_offloads_the_bottom_checkpoints_the_gpu_cannot_hold():
    per_ck = 8 * _hidden(_req())  # every micro-batch's input of one layer (layer-major)
    # room for the state with every checkpoint offloaded (the acts slots, the checkpoints in
    # flight or the layer gradients) and 4 of the 12 layers' checkpoints back on the GPU
    away = _plan(_req(activations="offload", gpu_mem=60.0))
    gib = card_for(away.gpu_total + 4 * per_ck + per_ck // 2)
    plan = _plan(_req(gpu_mem=gib))
    assert plan.fits and plan.spec.keep == ()
    assert plan.spec.offload == tuple(range(8)), plan.spec.offload  # the bottom 8 go to the host
    assert plan.host["offloaded_activations"] == 8 * per_ck
    assert plan.gpu["checkpoints"] == 2 * _hidden(_req()) + 4 * per_ck  # 2 acts slots and 4 back
    assert plan.gpu_total == away.gpu_total + 4 * per_ck
    assert plan.budgets[ACTS] == 2
    # the same run recomputing from checkpoints on the GPU does not fit that budget
    assert not _plan(_req(gpu_mem=gib, activations="recompute")).fits


def test_auto_offloads_nothing_when_the_checkpoints_fit_and_keeps_layers_with_the_rest():
    plan = _plan(_req(gpu_mem=60.0))
    assert plan.spec.offload == () and "offloaded_activations" not in plan.host
    assert plan.spec.keep  # the spare memory keeps layers
    recompute = _plan(_req(gpu_mem=60.0, activations="recompute"))
    assert recompute.spec.offload == () and recompute.spec.keep == ()
    assert recompute.gpu["checkpoints"] == 12 * 8 * _hidden(_req())


@pytest.mark.parametrize("k", [1, 3])
def test_offload_sends_every_checkpoint_and_counts_it_on_the_host(k):
    req = _req(activations="offload", checkpoint_every=k, gpu_mem=60.0)
    plan = _plan(req)
    starts = tuple(range(0, 12, k))
    assert plan.spec.offload == starts and plan.spec.keep == ()
    assert plan.host["offloaded_activations"] == len(starts) * 8 * _hidden(req)
    slots = 2 if k == 1 else 8 + 1
    assert plan.budgets[ACTS] == slots
    # in backward the acts slots; in forward two layers' inputs, one being written, one being
    # copied out; and the eight micro-batches' gradients between two layers' backward
    assert plan.gpu["checkpoints"] == slots * _hidden(req)
    assert plan.gpu["offload_in_flight"] == (2 * 8 + 2) * _hidden(req)
    assert plan.gpu["layer_gradients"] == 8 * _hidden(req)
    # the engine gets the same acts budget from the policy as the plan counted
    graph = compile_step(msgspec.structs.replace(plan.spec))
    assert resolve_policy("double_buffer").propose(graph).budgets[ACTS] == slots


def test_the_cpu_offloads_only_when_asked():
    cpu = torch.device("cpu")
    assert plan_run(_cfg(), _req(host_mem=None), device=cpu, dtype=torch.float32).spec.offload == ()
    asked = plan_run(_cfg(), _req(host_mem=None, activations="offload"), device=cpu, dtype=torch.float32)
    assert asked.spec.offload == tuple(range(12))


def test_llama_8b_takes_16_sequences_in_10_gib_by_offloading_its_checkpoints():
    """The run that motivated offloading: 16 sequences of 4096 per step in 10 GiB. Recomputing
    from checkpoints on the GPU, 32 layers x 16 micro-batches x 32 MiB do not fit beside the
    streaming slots; offloaded, the bottom checkpoints wait in host memory."""
    from flowtrain.model import preset

    req = RunRequest(seq_len=4096, batch_size=16, micro_batch_size=1, host_mem=118.0, gpu_mem=10.0)
    plan = plan_run(preset("llama-8b"), req, device=CUDA, dtype=torch.bfloat16, local_gpu=False)
    assert plan.fits and plan.spec.offload and plan.spec.offload[0] == 0
    assert not plan_run(preset("llama-8b"), msgspec.structs.replace(req, activations="recompute"), device=CUDA,
                        dtype=torch.bfloat16, local_gpu=False).fits


def test_auto_offloads_rather_than_give_up_a_gradient_slot_but_not_when_host_memory_is_short():
    """llama-8b, 2 sequences in 10 GiB: recomputing from checkpoints on the GPU fits only with
    one gradient accumulator; auto offloads the bottom checkpoints and keeps two. With host
    memory the binding limit (qwen-14b in 104 GiB), offloading would make it worse: none."""
    from flowtrain.model import preset

    def plan_for(model, **kw):
        req = RunRequest(**{**dict(seq_len=4096, batch_size=2, micro_batch_size=1, host_mem=118.0), **kw})
        return plan_run(preset(model), req, device=CUDA, dtype=torch.bfloat16, local_gpu=False)

    squeezed = plan_for("llama-8b", gpu_mem=10.0, activations="recompute")
    auto = plan_for("llama-8b", gpu_mem=10.0)
    assert squeezed.fits and auto.fits
    assert squeezed.budgets["grads"] == 1 and auto.budgets["grads"] == 2 and auto.spec.offload
    short = plan_for("qwen-14b", batch_size=8, micro_batch_size=2, host_mem=104.0, gpu_mem=139.0)
    assert short.fits and short.spec.offload == () and short.spec.resident
