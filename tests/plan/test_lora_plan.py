"""The planner with LoRA: a frozen base in host memory at the compute dtype's bytes, the adapters
and their Adam state on the GPU, no gradient slots; counted against PEFT's own parameter count
and against what a LoRA run's host state really allocates."""

from __future__ import annotations

import json

import pytest
import torch

from flowtrain.cli import main
from flowtrain.model.adapters import LoraSpec, adapter_flat_maps
from flowtrain.model.presets import preset
from flowtrain.plan.adapters import adapter_numel
from flowtrain.plan.memory import GiB
from flowtrain.plan.request import RunRequest, run_request
from flowtrain.plan.planner import plan_run
from flowtrain.train.host_state import HostState
from flowtrain.train.config.run_config import TrainConfig
from flowtrain.model.hf_config import from_hf


@pytest.mark.parametrize("targets", [None, ("q_proj", "v_proj", "down_proj")])
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_adapter_count_is_pefts(targets):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2)
    chosen = list(targets or ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    model = peft.get_peft_model(transformers.LlamaForCausalLM(config), peft.LoraConfig(r=4, target_modules=chosen))
    theirs = sum(p.numel() for p in model.parameters() if p.requires_grad)

    cfg = from_hf(config.to_dict())
    req = run_request(TrainConfig(seq_len=16, lora_rank=4, lora_targets=targets))
    assert adapter_numel(cfg, req) == theirs


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.filterwarnings("ignore:The following .*_pattern keys did not match:RuntimeWarning")  # PEFT applies them
def test_experts_adapter_count_is_pefts_and_flops_count_those_a_token_reaches(family):
    """Over a mixture of experts PEFT's all-linear adapts the router and every expert's stacked
    weights (gate-and-up at twice the rank): the planner counts what PEFT trains; model FLOPs
    count the router's and attention's adapters whole, the experts' at k of E."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from flowtrain.plan.adapters import adapter_active_numel

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, num_experts_per_tok=2)
    shape.update(dict(num_experts=6, moe_intermediate_size=16, head_dim=8) if family == "qwen3_moe"
                 else dict(num_local_experts=6))
    config = transformers.AutoConfig.for_model(family, **shape)
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(config),
                                peft.LoraConfig(r=4, target_modules="all-linear"))
    trained = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    cfg = from_hf(config.to_dict() | {"architectures": [type(model.base_model.model).__name__]})
    req = run_request(TrainConfig(seq_len=16, lora_rank=4))
    ours = sum(e.numel for lay in adapter_flat_maps(cfg, LoraSpec(4, 8.0)) for e in lay.entries)
    assert ours == sum(trained.values()) <= adapter_numel(cfg, req)  # the plan's count holds the padding too
    experts = sum(n for name, n in trained.items() if ".experts." in name)
    assert experts > 0
    assert adapter_active_numel(cfg, req) == pytest.approx(sum(trained.values()) - experts + experts * 2 / 6)


def test_lora_plan_counts_a_frozen_base_and_resident_adapters(capsys):
    argv = ["plan", "--model", "llama-8b", "--seq-len", "4096", "--batch-size", "16", "--micro-batch-size", "2",
            "--gpu-mem", "10", "--host-mem", "118", "--lora-rank", "16", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    cfg = preset("llama-8b")
    assert data["fits"] and data["gpu_total"] <= 10 * GiB
    assert data["host"]["base"] == 2 * cfg.num_parameters()  # bf16 on a GPU: 2 bytes per parameter
    assert not {"master", "adam", "staging", "gradients", "undo_record"} & set(data["host"])
    assert data["gpu"]["adapters"] == 16 * 41_943_040  # PEFT's count at rank 16 on every linear map
    assert data["budgets"]["grads"] == 0 and not data["gpu"].get("grad_slots")
    assert main(argv[:-1]) == 0
    assert "LoRA over the frozen base" in capsys.readouterr().out


def test_lora_host_state_allocates_what_the_plan_counts():
    """The base in the compute dtype and nothing else in host memory: what HostState allocates
    for a LoRA run equals the plan's ``base`` item; the adapters are the plan's count."""
    cfg = preset("tiny")
    state = HostState.create(cfg, pin=False, dtype=torch.bfloat16, lora=LoraSpec(4, 8.0))
    host = sum(t.numel() * t.element_size() for u in state.units for t in (u.master, u.exp_avg, u.exp_avg_sq))
    plan = plan_run(cfg, RunRequest(seq_len=64, batch_size=2, micro_batch_size=2, resident="none", lora_rank=4),
                    device=torch.device("cuda"), dtype=torch.bfloat16)
    assert host == plan.host["base"] == 2 * cfg.num_parameters()
    assert all(u.grad is None and not u.steps for u in state.units)
    req = run_request(TrainConfig(seq_len=16, lora_rank=4))
    assert sum(a.flat_map.numel for a in state.adapters) == adapter_numel(cfg, req)


def test_adapters_go_to_host_memory_where_the_gpu_cannot_hold_them(capsys):
    """A 70B base's rank-16 adapters with their Adam state (3.3 GB) do not fit a 10 GB card
    beside the work: ``--lora-state auto`` plans them in host memory (16 bytes per parameter),
    the GPU then holding only each layer's copy in its weight slot and a gradient slot of the
    largest layer's adapters; on a large card they stay on the GPU. ``gpu`` asks for the GPU
    whatever fits, and ``host`` for host memory."""
    base = ["plan", "--model", "docs/simulate/llama-70b", "--seq-len", "4096", "--batch-size", "4",
            "--micro-batch-size", "1", "--lora-rank", "16", "--host-mem", "192", "--activations", "offload",
            "--device", "cuda", "--json"]
    plans = {}
    for extra in (("--gpu-mem", "10"), ("--gpu-mem", "10", "--lora-state", "gpu"), ("--gpu-mem", "80"),
                  ("--gpu-mem", "80", "--lora-state", "host")):
        main([*base, *extra])
        plans[extra] = json.loads(capsys.readouterr().out)
    small, forced, large, hosted = plans.values()
    from flowtrain.model.model_dir import read_config

    cfg = read_config("docs/simulate/llama-70b", weights=False)
    n = adapter_numel(cfg, RunRequest(seq_len=4096, batch_size=4, micro_batch_size=1, lora_rank=16))
    per_layer = n // cfg.num_layers
    assert small["fits"] and small["host_adapters"] and small["gpu"]["adapters"] == 0
    assert small["host"]["adapters"] == 16 * n
    assert small["gpu"]["grad_slots"] == small["budgets"]["grads"] * per_layer * 4 > 0
    assert not forced["fits"] and not forced["host_adapters"] and forced["gpu"]["adapters"] == 16 * n
    assert large["fits"] and not large["host_adapters"] and "adapters" not in large["host"]
    assert hosted["host_adapters"] and hosted["gpu"]["adapters"] == 0 and hosted["host"]["adapters"] == 16 * n
    # the weight slots hold a layer's adapters after its weights
    slot = {name: p["gpu"]["weight_slots"] // p["budgets"]["weights"] for name, p in (("small", small), ("forced", forced))}
    assert slot["small"] - slot["forced"] == per_layer * 2


def test_host_adapters_allocate_what_the_plan_counts():
    cfg = preset("tiny")
    req = RunRequest(seq_len=64, batch_size=2, micro_batch_size=2, resident="none", lora_rank=4, lora_state="host")
    plan = plan_run(cfg, req, device=torch.device("cuda"), dtype=torch.bfloat16)
    state = HostState.create(cfg, pin=False, dtype=torch.bfloat16, lora=LoraSpec(4, 8.0), host_adapters=True)
    adapters = sum(t.numel() * t.element_size() for a in state.adapters
                   for t in (a.master, a.exp_avg, a.exp_avg_sq, a.own_grad()))
    assert plan.spec.host_adapters and adapters == plan.host["adapters"]
    assert all(not a.resident and a.master.device.type == "cpu" for a in state.adapters)


def test_host_adapters_keep_every_layer_streamed(capsys):
    """A layer's fetch brings its adapters: with them in host memory no base layer is resident
    (the planner keeps them streamed; naming one is refused in one line, and ``auto`` then
    keeps the adapters on the GPU)."""
    base = ["plan", "--model", "llama-3b", "--seq-len", "4096", "--batch-size", "4", "--micro-batch-size", "1",
            "--lora-rank", "16", "--host-mem", "118", "--device", "cuda", "--json"]
    assert main([*base, "--gpu-mem", "80", "--lora-state", "host"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["host_adapters"] and not [u for u in data["resident"] if u.startswith("layer.")]
    assert main([*base, "--gpu-mem", "80", "--lora-state", "host", "--resident", "layer.0"]) == 2
    assert "leave layer.0 out of --resident" in capsys.readouterr().err
    assert main([*base, "--gpu-mem", "4", "--resident", "embed,head,layer.0"]) == 1  # fits neither way
    assert not json.loads(capsys.readouterr().out)["host_adapters"]


def test_lora_processes_of_a_node_each_count_their_own_base(capsys):
    argv = ["plan", "--model", "llama-8b", "--seq-len", "4096", "--batch-size", "16", "--micro-batch-size", "2",
            "--lora-rank", "16", "--host-mem", "118", "--gpu-mem", "80", "--device", "cuda", "--json"]
    assert main([*argv, "--nproc-per-node", "2"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert two["processes_sharing_host"] == 1 and two["host_node_total"] == 2 * two["host_total"]
    assert two["host"]["base"] == 2 * preset("llama-8b").num_parameters()
    argv[argv.index("--host-mem") + 1] = "25"  # one base fits, two do not
    argv += ["--resident", "none"]
    assert main([*argv, "--nproc-per-node", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["host_fits"]
    assert main([*argv, "--nproc-per-node", "2"]) == 1  # the two bases do not fit
    two = json.loads(capsys.readouterr().out)
    assert not two["host_fits"] and "host bytes of state per parameter)" in " ".join(two["suggestions"])


def test_adapter_work_counts_in_a_layers_phases_not_beside_the_loss():
    """LoRA's adapter work belongs to a layer's forward or backward: where the loss chunks are
    the step's largest phase (the 32B base at micro-batch 1 on a 10 GB card), the plan's peak
    holds them without it, and where a layer's backward is, with it."""
    from flowtrain.plan.memory import gpu_peak

    shared = {"weight_slots": 3 * GiB, "adapters": 2 * GiB}
    loss_first = {**shared, "layer_work": 2 * GiB, "lora_work": GiB // 2, "loss_chunks": 3 * GiB, "layer_gradients": GiB}
    assert gpu_peak(loss_first) == 5 * GiB + GiB + 3 * GiB
    layer_first = {**loss_first, "lora_work": 2 * GiB}
    assert gpu_peak(layer_first) == 5 * GiB + GiB + 4 * GiB
    offloading = {**shared, "layer_work": GiB, "lora_work": GiB, "loss_chunks": GiB, "offload_in_flight": 4 * GiB}
    assert gpu_peak(offloading) == 5 * GiB + 5 * GiB, "a layer's forward does its adapter work beside the copies"
    cfg = preset("qwen2.5-32b")
    req = RunRequest(seq_len=4096, batch_size=16, micro_batch_size=1, gpu_mem=10, host_mem=118, lora_rank=16)
    plan = plan_run(cfg, req, device=torch.device("cuda"), dtype=torch.bfloat16, local_gpu=False)
    g = plan.gpu
    assert not plan.spec.host_adapters and g["loss_chunks"] > g["layer_work"] and g["lora_work"] > 0
    assert plan.gpu_total < sum(g.values()) - g["layer_work"] - g["offload_in_flight"]
