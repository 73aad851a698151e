"""The planner with LoRA: a frozen base in host memory at the compute dtype's bytes, the adapters
and their Adam state on the GPU, no gradient slots; counted against PEFT's own parameter count
and against what a LoRA run's host state really allocates."""

from __future__ import annotations

import json

import pytest
import torch

from flowtrain.cli import main
from flowtrain.model.adapters import LoraSpec
from flowtrain.model.config import preset
from flowtrain.plan.memory import GiB, RunRequest, adapter_numel, plan_run, run_request
from flowtrain.train.host_state import HostState
from flowtrain.train.run_config import TrainConfig


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
    from flowtrain.model.config import ModelConfig

    cfg = ModelConfig.from_hf(config.to_dict())
    req = run_request(TrainConfig(seq_len=16, lora_rank=4, lora_targets=targets))
    assert adapter_numel(cfg, req) == theirs


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
    assert sum(a.layout.numel for a in state.adapters) == adapter_numel(cfg, req)
