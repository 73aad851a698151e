"""``--order auto``: the planner takes micro-batch order only where the simulator, with the
machine model of the GPU, predicts it faster; everywhere else the order is ``layer``."""

from __future__ import annotations

import json

import msgspec
import pytest
import torch

from flowtrain.cli import main
from flowtrain.cli.plan import format_plan
from flowtrain.model import preset
from flowtrain.plan.request import RunRequest
from flowtrain.plan.planner import plan_run
from flowtrain.sim.choose_plan import plan_and_choose
from flowtrain.sim.machine import load_machine, machine_for_gpu
from flowtrain.sim.predict import predict

CUDA = torch.device("cuda")
H200 = load_machine("h200")


def request(**kw):
    fields = {"seq_len": 4096, "batch_size": 16, "micro_batch_size": 4, "host_mem": 110.0, "gpu_mem": 139.0,
              "order": "auto", **kw}
    return RunRequest(**fields)


def planned(model="llama-3b", machine=H200, **kw):
    return plan_and_choose(preset(model), request(**kw), device=CUDA, dtype=torch.bfloat16, machine=machine)


def test_micro_batch_order_where_it_is_predicted_faster_and_the_numbers_are_the_simulators():
    """llama-3b, 16 sequences in micro-batches of 4 on the H200: every layer's activations of
    one micro-batch fit, where layer order recomputes most layers for four."""
    plan = planned()
    assert plan.spec.order == "micro"
    cfg = preset("llama-3b")
    speeds = {}
    for order in ("layer", "micro"):
        req = request(order=order)
        p = plan_run(cfg, req, device=CUDA, dtype=torch.bfloat16)
        speeds[order] = predict(cfg, p, req, H200).summary.tokens_per_s
    assert speeds["micro"] >= 1.02 * speeds["layer"]
    assert plan.order_choice == (f"auto: predicted on h200 {speeds['micro']:,.0f} tok/s in micro-batch order, "
                                 f"{speeds['layer']:,.0f} in layer order")


@pytest.mark.parametrize("case", ["one micro-batch", "no machine model", "cpu", "several processes", "asked"])
def test_layer_order_without_a_prediction_or_where_asked(case):
    kw = {"one micro-batch": dict(batch_size=4), "no machine model": dict(machine=None),
          "several processes": dict(processes=2), "asked": dict(order="layer")}.get(case, {})
    if case == "cpu":
        plan = plan_and_choose(preset("llama-3b"), request(), device=torch.device("cpu"), dtype=torch.float32)
    else:
        plan = planned(**kw)  # no GPU on this machine: without a machine there is nothing to predict with
    assert plan.spec.order == "layer"
    if case == "no machine model":
        assert plan.order_choice.startswith("auto: no machine model of this GPU")
    else:
        assert plan.order_choice is None
    assert planned(order="micro").spec.order == "micro"  # an explicit order is never changed


def test_layer_order_where_micro_is_not_predicted_faster():
    """The prediction decides, both ways: on a machine whose PCIe is a tenth of the H200's,
    fetching every layer once per micro-batch costs more than the recompute it saves."""
    slow_pcie = msgspec.structs.replace(H200, name="slow-pcie", h2d_gbps=4.5, d2h_gbps=4.5, duplex_gbps=7.0)
    plan = planned(machine=slow_pcie)
    assert plan.spec.order == "layer"
    assert plan.order_choice.startswith("auto: predicted on slow-pcie")


def test_the_gpu_is_matched_to_a_shipped_machine_by_its_name():
    assert machine_for_gpu("NVIDIA H200").name == "h200"
    assert machine_for_gpu("NVIDIA H100 SXM").name == "h100-sxm"
    assert machine_for_gpu("Some Other GPU") is None


@pytest.mark.slow  # a plan that simulates every configuration it weighs: the slow tier
def test_plan_shows_the_choice_and_its_reason(capsys):
    argv = ["plan", "--model", "llama-3b", "--seq-len", "4096", "--batch-size", "16", "--micro-batch-size", "4",
            "--host-mem", "110", "--gpu-mem", "139", "--device", "cuda", "--machine", "h200"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "micro-batch order: micro (auto: predicted on h200 " in out
    assert main([*argv, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["order"] == "micro" and d["order_choice"].startswith("auto: predicted on h200")
    assert main([*argv[:-2], "--order", "layer"]) == 0
    assert "micro-batch order: layer\n" in capsys.readouterr().out


# ---- --activations auto and --layout auto, checked by prediction ------------------------------
def _slow_link():
    return msgspec.structs.replace(load_machine("h200"), h2d_gbps=4.0, d2h_gbps=4.0, duplex_gbps=6.0, name="slow-link")


def _w1_plan(machine, **kw):
    req = RunRequest(**{**dict(seq_len=4096, batch_size=4, micro_batch_size=4, host_mem=110, gpu_mem=80,
                               order="layer"), **kw})
    return plan_and_choose(preset("llama-3b"), req, device=torch.device("cuda"), dtype=torch.bfloat16, local_gpu=False,
                           machine=machine)


def test_the_rules_plan_stands_where_no_alternative_is_predicted_faster():
    ruled, checked = _w1_plan(None), _w1_plan(load_machine("h200"))
    assert checked.memory_choice is None
    assert (checked.layout, checked.spec, checked.budgets) == (ruled.layout, ruled.spec, ruled.budgets)


def test_a_slow_link_takes_the_layout_that_halves_the_fetch_bytes():
    """With the rules' resident units given (more of them is the other way round a slow link)."""
    plan = _w1_plan(_slow_link(), resident=",".join(_w1_plan(None).spec.resident))
    assert plan.layout == "stream-bf16" and plan.fits
    assert "--layout stream-bf16" in plan.memory_choice and "slow-link" in plan.memory_choice
    assert "memory: auto: --layout stream-bf16" in format_plan("llama-3b", plan)


def test_a_setting_given_explicitly_is_not_second_guessed():
    plan = _w1_plan(_slow_link(), layout="staged", activations="keep")
    assert plan.layout == "staged" and plan.memory_choice is None


def test_the_alternatives_are_the_auto_settings_explicit_values():
    from flowtrain.sim.memory_choice import alternatives

    everything = alternatives(RunRequest(seq_len=8, batch_size=1, micro_batch_size=1))
    assert everything == [("activations", "recompute"), ("activations", "keep"), ("layout", "stream-bf16")]
    spaced = alternatives(RunRequest(seq_len=8, batch_size=1, micro_batch_size=1, checkpoint_every=2, grad_clip=True))
    assert spaced == [("activations", "recompute")]


def test_more_resident_layers_are_tried_by_doubling_up_to_the_most_that_fit():
    from flowtrain.sim.memory_choice import more_resident

    cfg = preset("llama-3b")  # 28 layers
    plan = plan_run(cfg, request(order="layer"), device=CUDA, dtype=torch.bfloat16)
    rules = list(plan.spec.resident)
    layers = [u for u in rules if u.startswith("layer.")]
    tried = []

    def fits(value):
        tried.append(value)
        return len(value.split(",")) - len(rules) <= 9  # room for nine more layers

    values = more_resident(cfg, request(order="layer"), plan, fits)
    added = [len(v.split(",")) - len(rules) for v in values]
    assert added == [1, 2, 4, 8, 9]
    for v in values:  # the rules' units first, then the next layers bottom-up
        units = v.split(",")
        assert units[:len(rules)] == rules
        assert units[len(rules):] == [f"layer.{i}" for i in range(len(layers), len(layers) + len(units) - len(rules))]
    assert len(tried) <= 6  # bisection over the 18 layers left, not one plan per layer
    assert more_resident(cfg, request(order="layer", resident="none"), plan, fits) == []


def test_a_mixture_of_experts_waiting_on_cpu_adam_keeps_more_layers_resident():
    """Qwen3-30B-A3B's layer, 12 of them, on the H200: each layer holds 0.6 B parameters for
    little compute, so the rules' third of the layers leaves the step waiting for CPU Adam.
    More layers are taken, the fewest predicted within the margin of the fastest."""
    from flowtrain.sim.memory_choice import MARGIN

    cfg = preset("qwen3-moe-12l")
    kw = dict(order="layer", host_mem=118.0)
    rules = plan_run(cfg, request(**kw), device=CUDA, dtype=torch.bfloat16)
    plan = planned("qwen3-moe-12l", **kw)
    assert plan.fits and "--resident" in (plan.memory_choice or "")
    n_rules, n_plan = (sum(u.startswith("layer.") for u in p.spec.resident) for p in (rules, plan))
    assert n_plan > n_rules
    speed = {}
    for n in (n_plan - 1, n_plan, cfg.num_layers):
        req = request(**kw, resident=",".join(["embed", "head"] + [f"layer.{i}" for i in range(n)]))
        p = plan_run(cfg, req, device=CUDA, dtype=torch.bfloat16)
        speed[n] = predict(cfg, p, req, H200).summary.tokens_per_s if p.fits else 0.0
    assert speed[n_plan] >= MARGIN * predict(cfg, rules, request(**kw), H200).summary.tokens_per_s
    assert MARGIN * speed[n_plan] >= speed[cfg.num_layers]  # all that fit would gain less than the margin


def test_adapters_in_host_memory_keep_every_layer_streamed_whatever_is_predicted():
    """A layer's fetch is what brings its adapters from host memory, so no residency choice
    (the rules' or the prediction's more layers) keeps a layer on the GPU. A tiny model on the
    H200, where every layer would fit and be tried otherwise."""
    from flowtrain.sim.memory_choice import more_resident

    cfg = preset("tiny")
    kw = dict(seq_len=64, batch_size=8, micro_batch_size=4, lora_rank=4)
    on_gpu = planned("tiny", **kw, lora_state="gpu")
    assert any(u.startswith("layer.") for v in more_resident(cfg, request(**kw), on_gpu, lambda v: True)
               for u in v.split(","))  # otherwise the layers are candidates
    plan = planned("tiny", **kw, lora_state="host")
    assert plan.fits and plan.spec.host_adapters
    assert not any(u.startswith("layer.") for u in plan.spec.resident)
    assert more_resident(cfg, request(**kw, lora_state="host"), plan, lambda v: True) == []


def test_of_more_resident_layers_the_fewest_that_clear_both_margins_are_taken():
    """Stub plans and predictions: +1 layer 101.1 tok/s, +2 101.5, +4 102.0, +8 103.0 against the
    rules' 100. The fewest within 2% of the fastest (+1) would not be 2% faster than the rules'
    plan; the fewest that is both (+4) is taken."""
    from types import SimpleNamespace

    from flowtrain.sim.memory_choice import choose_memory

    speed = {0: 100.0, 1: 101.1, 2: 101.5, 4: 102.0, 8: 103.0}

    def stub(resident):
        spec = SimpleNamespace(resident=tuple(resident))
        return SimpleNamespace(fits=len(resident) <= 10, device="cuda", spec=spec, layout="staged", budgets={},
                               chunk_tokens=1)

    def predictions(req, plan, machine):
        more = len(plan.spec.resident) - 2
        return SimpleNamespace(tokens_per_s=speed[more], critical_by_lane={"compute": 0.5, "cpu": 0.5})

    cfg = SimpleNamespace(num_layers=8)
    req = RunRequest(seq_len=8, batch_size=1, micro_batch_size=1, activations="keep", layout="staged")
    rules = stub(("embed", "head"))
    r, plan, why = choose_memory(cfg, req, rules, lambda q: stub(q.resident.split(",")), policy=None,
                                    machine=SimpleNamespace(name="stub"), predictions=predictions)
    assert plan.spec.resident == ("embed", "head", "layer.0", "layer.1", "layer.2", "layer.3")
    assert r.resident == ",".join(plan.spec.resident) and "102 tok/s against 100" in why
    speed.update({4: 101.9, 8: 101.9})  # nothing clears the rules' plan by 2%: it stands
    assert choose_memory(cfg, req, rules, lambda q: stub(q.resident.split(",")), policy=None,
                            machine=SimpleNamespace(name="stub"), predictions=predictions)[2] is None
