"""The memory planner: layouts, placement, sizing under a GPU cap, and its predictions against
what a run actually takes.

On-paper tests plan for a CUDA device on this CPU machine (``--gpu-mem`` gives the GPU's size);
the measured test trains a ~60M-parameter model on the CPU in a subprocess and compares the
plan with the process's peak resident memory.
"""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import pytest
import torch

from flowtrain.cli import main
from flowtrain.errors import ConfigError
from flowtrain.graph import GRADS, WEIGHTS
from flowtrain.model import ModelConfig, model_flat_maps, preset
from flowtrain.plan.memory import GiB, allocator_share, capped_budget, card_for
from flowtrain.plan.request import RunRequest
from flowtrain.plan.planner import plan_run
from flowtrain.train.host_state import HostState

CUDA = torch.device("cuda")
BF16 = torch.bfloat16


def plan(model="llama-8b", device=CUDA, **kw):
    fields = {"seq_len": 4096, "batch_size": 16, "micro_batch_size": 4, "host_mem": 118.0, "gpu_mem": 139.0, **kw}
    return plan_run(preset(model), RunRequest(**fields), device=device, dtype=BF16 if device.type == "cuda" else torch.float32)


def params(name):
    return sum(lay.numel for lay in model_flat_maps(preset(name)))


def test_staged_layout_is_about_12_host_bytes_per_parameter_with_fp32_master_and_adam():
    p = plan(resident="none")
    assert p.layout == "staged" and p.spec.staged and not p.spec.resident
    n = params("llama-8b")
    assert p.host["master"] == 4 * n and p.host["adam"] == 8 * n and "gradients" not in p.host
    assert 12.0 < p.host_state_bytes_per_param <= 12.5  # 12 plus a three-slot staging ring
    # the embedding and head are larger than a staging slot: they pass in chunks
    assert p.spec.grad_chunks == {"embed": 3, "head": 3}


def test_grad_clip_chooses_the_full_layout_and_says_so_when_forced_staged():
    assert plan(resident="none", grad_clip=True).layout == "full"
    assert plan(resident="none", grad_clip=True).host_state_bytes_per_param >= 16.0
    from flowtrain.cli.train import flag_of

    with pytest.raises(ConfigError) as info:
        plan(resident="none", grad_clip=True, layout="staged")
    assert "--grad-clip" in info.value.spelled(flag_of) and "use --layout full" in info.value.spelled(flag_of)


def test_speed_placement_keeps_embed_head_and_bottom_third_of_layers_on_the_gpu():
    p = plan(model="llama-3b", batch_size=4)
    layers = preset("llama-3b").num_layers
    assert p.spec.resident == ("embed", "head", *(f"layer.{i}" for i in range(-(-layers // 3))))
    assert p.fits


def test_capacity_placement_moves_layers_to_the_gpu_until_the_host_fits():
    """qwen-14b's state (about 177 GB at 12 bytes) cannot live in host memory alone: the less
    host memory there is, the more layers the planner keeps on the GPU, until it fits."""
    roomy, tight = plan(model="qwen-14b", batch_size=8, host_mem=118), plan(model="qwen-14b", batch_size=8, host_mem=108)
    assert roomy.fits and tight.fits
    assert len(tight.spec.resident) > len(roomy.spec.resident)
    fewer = plan(model="qwen-14b", batch_size=8, host_mem=108, resident=",".join(tight.spec.resident[:-1]))
    assert not fewer.host_fits  # one resident layer fewer would not have fitted the host


def test_a_run_too_large_for_both_says_what_would_fit():
    card = card_for(int(128.5 * GiB))  # a card that leaves the plan 128.5 GiB
    p = plan(model="qwen-14b", batch_size=8, host_mem=104, gpu_mem=card)
    assert not p.fits and not p.host_fits
    assert p.max_micro_batch is not None and p.max_micro_batch < 4
    assert f"--micro-batch-size {p.max_micro_batch}" in p.refusal()
    assert plan(model="qwen-14b", batch_size=8, host_mem=104, gpu_mem=card, micro_batch_size=p.max_micro_batch).fits


def test_a_10gb_gpu_cap_shrinks_loss_chunks_and_slots_until_8b_fits():
    """Recomputing from checkpoints on the GPU (auto offloads them instead: test_offload.py)."""
    p = plan(batch_size=2, micro_batch_size=1, gpu_mem=10, activations="recompute")
    assert p.fits and p.gpu_total <= capped_budget(allocator_share(10))
    assert p.spec.resident == ()
    assert p.chunk_tokens < 2048 and p.budgets[GRADS] == 1 and p.budgets[WEIGHTS] == 2
    roomy = plan(batch_size=2, micro_batch_size=1)
    assert roomy.budgets[GRADS] >= 2 and roomy.gpu_total > p.gpu_total


@pytest.mark.parametrize("gpu_mem", [9, 12, 16, 19, 24])
def test_largest_micro_batch_is_the_boundary_of_what_fits(gpu_mem):
    kw = dict(model="llama-8b", batch_size=8, gpu_mem=gpu_mem, resident="none")
    b = plan(micro_batch_size=8, **kw).max_micro_batch
    sizes = (1, 2, 4, 8)
    if b is None:
        assert not any(plan(micro_batch_size=d, **kw).fits for d in sizes)
        return
    assert plan(micro_batch_size=b, **kw).fits
    assert not any(plan(micro_batch_size=d, **kw).fits for d in sizes if d > b)


@pytest.mark.parametrize("model,seq_len,micro", [("qwen2.5-7b", 1024, 79), ("llama-8b", 4096, 4), ("llama-3b", 4096, 3)])
def test_a_compiled_run_counts_the_autotuners_host_copy_of_a_layer_input(model, seq_len, micro):
    cfg = preset(model)
    layer_input = micro * seq_len * cfg.hidden_size * 2  # bf16
    p = plan(model, seq_len=seq_len, micro_batch_size=micro, batch_size=2 * micro)
    copy = p.host["autotune_copy"]
    assert copy & (copy - 1) == 0 and layer_input <= copy < 2 * layer_input  # the allocator's power of two
    eager = plan(model, seq_len=seq_len, micro_batch_size=micro, batch_size=2 * micro, compile="none")
    assert "autotune_copy" not in eager.host
    assert p.host_total - eager.host_total == copy
    assert p.host_state_bytes_per_param == eager.host_state_bytes_per_param  # a transient, not state
    assert "autotune_copy" not in plan(model, device=torch.device("cpu"), seq_len=seq_len, micro_batch_size=micro,
                                       batch_size=2 * micro).host


def test_plan_counts_what_the_state_allocates():
    """The host categories are exactly the bytes HostState allocates, per layout."""
    cfg = preset("tiny")
    for layout in ("staged", "full", "stream-bf16"):
        state = HostState.create(cfg, pin=False, layout=layout, dtype=BF16)
        allocated = sum(t.numel() * t.element_size() for u in state.units
                        for t in (u.master, u.exp_avg, u.exp_avg_sq, u.grad, u.stream) if t is not None)
        p = plan_run(cfg, RunRequest(seq_len=64, batch_size=2, micro_batch_size=2, layout=layout, resident="none"),
                     device=CUDA, dtype=BF16)
        counted = sum(v for k, v in p.host.items() if k not in ("staging", "runtime", "autotune_copy", "undo_record", "data"))
        assert counted == allocated, layout


def test_plan_cli_prints_text_and_json_and_exits_1_when_it_does_not_fit(capsys):
    argv = ["plan", "--model", "llama-8b", "--seq-len", "4096", "--batch-size", "2", "--micro-batch-size", "1",
            "--gpu-mem", "10", "--host-mem", "118"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "layout staged" in text and "fits" in text and "largest micro-batch that fits: 2" in text
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] and data["device"] == "cuda" and data["gpu_total"] <= 10 * GiB
    assert set(data["host"]) >= {"master", "adam", "staging", "runtime"}
    assert main(["plan", "--model", "qwen-14b", "--seq-len", "4096", "--batch-size", "8", "--micro-batch-size", "4",
                 "--gpu-mem", f"{card_for(int(128.5 * GiB)):.3f}", "--host-mem", "104"]) == 1
    assert "to make it fit: use --micro-batch-size" in capsys.readouterr().out


def test_train_refuses_before_allocating_when_the_host_is_too_small(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["train", "--steps", "1", "--host-mem", "0.05", "--device", "cpu", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "does not fit" in err and "host memory" in err
    assert not out.exists()


SMALL = ModelConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_layers=8, num_heads=8,
                    num_kv_heads=4, max_position_embeddings=512)


@pytest.mark.slow  # a training process each; what the plan counts: test_plan_counts_what_the_state_allocates
@pytest.mark.parametrize("layout", ["staged", "full"])
def test_plan_predicts_measured_peak_host_memory_within_10_percent(tmp_path, layout):
    """A 57M-parameter model trained on the CPU in its own process: the planned host bytes (state,
    staging, process runtime, and on the CPU the activations too) against ru_maxrss."""
    from flowtrain.ckpt.hf import save_hf
    from flowtrain.model import init_unit

    model = tmp_path / "model"
    layouts = model_flat_maps(SMALL)
    flats = [torch.empty(lay.numel) for lay in layouts]
    for lay, flat in zip(layouts, flats):
        init_unit(flat, lay, SMALL, seed=0)
    save_hf(model, SMALL, layouts, flats)
    del flats
    result = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "flowtrain.cli", "bench", "--model", str(model), "--device", "cpu", "--seq-len", "64",
           "--batch-size", "4", "--micro-batch-size", "2", "--steps", "3", "--warmup", "1", "--layout", layout,
           "--json", str(result)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    r = json.loads(result.read_text())
    measured, planned = r["host_peak_gib"], r["planned_host_gib"]
    assert abs(planned - measured) / measured < 0.10, (planned, measured)
    assert r["layout"] == layout


def test_request_fields_match_train_config():
    """Every planning field of TrainConfig reaches the plan (a renamed flag would silently plan
    for the default)."""
    from flowtrain.train.run import TrainConfig

    # load_bytes is read from --model; processes and share from torchrun (or plan's --nproc-per-node);
    # grouped_experts from the GPU planned for (this one's, or --machine's file)
    # disk_ahead: the reads of state on disk run ahead by the planner's own number;
    # reference_rows: a DPO run's sequences, counted in --data
    request = {f.name for f in msgspec.structs.fields(RunRequest)} - {"load_bytes", "processes", "share", "grouped_experts",
                                                                      "disk_ahead", "reference_rows"}
    assert request <= {f.name for f in msgspec.structs.fields(TrainConfig)}


def test_the_engine_runs_with_the_budgets_the_plan_sized_buffers_for(monkeypatch):
    """A plan that shrinks a pool (as under --gpu-mem) must reach the engine too: the program
    allocates the plan's slots, so an engine using the policy's larger budget would hand out
    a slot that does not exist."""
    from flowtrain.train import prepare
    from flowtrain.train.run import TrainConfig, train

    real = prepare.plan_and_choose

    def shrunk(*args, **kwargs):
        p = real(*args, **kwargs)
        p.budgets = {**p.budgets, GRADS: 1, WEIGHTS: 1}
        return p

    monkeypatch.setattr(prepare, "plan_and_choose", shrunk)
    seen = []
    metrics = train(TrainConfig(steps=2, device="cpu", progress=False), on_plan=seen.append)
    assert len(metrics) == 2 and seen[0].budgets[GRADS] == 1


@pytest.mark.parametrize("args, needle", [
    (["--seq-len", "262144"], "beyond the model's 8192 positions"),
    (["--seq-len", "4096", "--host-mem", "nan"], "--host-mem must be a finite number"),
    (["--seq-len", "4096", "--micro-batch-size", "3"], "does not divide"),
])
def test_plan_refuses_what_train_refuses(capsys, args, needle):
    """plan builds its request through train's config and checks: no plan for a run train
    would refuse (it planned --seq-len 262144 for a model of 8192 positions)."""
    from flowtrain.cli import main

    argv = ["plan", "--model", "llama-8b", "--batch-size", "16", "--micro-batch-size", "4", *args]
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("extra", [{}, {"checkpoint_every": 4}])
def test_advice_is_a_change_that_fits_and_never_the_setting_in_use(extra):
    """8b in 10 GB at 16 sequences of one per micro-batch, recomputing from checkpoints on the
    GPU, does not fit: offloading them is the first lever, the one change the plan names, and,
    applied, it fits; the batch size is the lever where offloading is not in the list (fewer
    micro-batches, fewer layer inputs kept)."""
    from flowtrain.plan.suggest import _changes

    kw = dict(batch_size=16, micro_batch_size=1, gpu_mem=10, activations="recompute", **extra)
    p = plan(**kw)
    assert not p.fits
    assert p.suggestions == ["use --activations offload"] and plan(**{**kw, "activations": "offload"}).fits
    changes = [text for text, _, _ in _changes(p, RunRequest(seq_len=4096, host_mem=118.0, **kw), "double_buffer")]
    batch = [c for c in changes if c.startswith("--batch-size")]
    assert batch and any(plan(**{**kw, "batch_size": int(c.split()[-1])}).fits for c in batch)
    assert f"--activation-checkpoint-every {kw.get('checkpoint_every', 1)}" not in changes


def test_advice_does_not_repeat_the_policy_in_use():
    req = RunRequest(seq_len=4096, batch_size=16, micro_batch_size=1, host_mem=118.0, gpu_mem=10.0,
                     activations="recompute")
    p = plan_run(preset("llama-8b"), req, device=CUDA, dtype=BF16, policy="sequential")
    assert not p.fits and p.suggestions
    assert not any("--policy sequential" in s for s in p.suggestions)


def test_planning_for_another_machine_ignores_this_gpu(monkeypatch):
    """Planning for a GPU elsewhere (``flowtrain simulate --machine``): ``local_gpu=False`` takes
    ``--gpu-mem`` alone, while a plan for this machine is capped by what its GPU has free."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * GiB, 80 * GiB))
    here = plan(resident="none", gpu_mem=139.0)
    elsewhere = plan_run(preset("llama-8b"), RunRequest(seq_len=4096, batch_size=16, micro_batch_size=4,
                                                        host_mem=118.0, gpu_mem=139.0, resident="none"),
                         device=CUDA, dtype=BF16, local_gpu=False)
    assert here.gpu_limit < 2 * GiB and not here.fits
    assert elsewhere.gpu_limit == capped_budget(allocator_share(139.0)) and elsewhere.fits


@pytest.mark.parametrize("free, total, card_binds", [(9.7, 10.0, True), (7.6, 8.0, True), (130.0, 139.8, False)])
def test_a_plan_here_without_gpu_mem_fits_this_card_as_gpu_mem_would_count_it(monkeypatch, free, total, card_binds):
    """Without ``--gpu-mem`` a plan on this GPU fills GPU_FILL of what is free, and never more than
    the card as ``--gpu-mem`` counts it: on a small card what CUDA keeps outside the allocator is
    more than the 8% the first rule leaves. A plan for that machine from elsewhere takes the same
    limit (``own_plan_card``)."""
    from flowtrain.plan.memory import GPU_FILL, own_plan_card

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(free * GiB), int(total * GiB)))
    here = plan(resident="none", gpu_mem=None)
    card = capped_budget(allocator_share(total))
    assert here.gpu_limit == (card if card_binds else int(free * GiB * GPU_FILL))  # small cards: the card's count
    elsewhere = plan_run(preset("llama-8b"), RunRequest(seq_len=4096, batch_size=16, micro_batch_size=4, host_mem=118.0,
                                                        gpu_mem=own_plan_card(total), resident="none"),
                         device=CUDA, dtype=BF16, local_gpu=False)
    assert elsewhere.gpu_limit == pytest.approx(min(total * GiB * GPU_FILL, card), rel=1e-3)


@pytest.mark.parametrize("spec_kw", [
    {"layers": 4, "micro_batches": 3},
    {"layers": 4, "micro_batches": 3, "order": "micro"},
    {"layers": 4, "micro_batches": 2, "staged": True, "resident": ("embed", "head")},
    {"layers": 4, "micro_batches": 2, "staged": True, "resident": ("embed", "head", *(f"layer.{i}" for i in range(4)))},
])
def test_budgets_asked_once_per_step_shape_are_what_the_policy_proposes(spec_kw):
    """The planner asks a policy for its budgets once per (policy, StepSpec): the answer is the
    policy's proposal on the compiled graph, and two policy objects with the same class but
    other settings are asked separately."""
    from flowtrain.graph import StepSpec
    from flowtrain.plan.planner import _BudgetCache
    from flowtrain.policy import resolve_policy

    cache, spec = _BudgetCache(), StepSpec(**spec_kw)
    for policy in ("double_buffer", "sequential", resolve_policy("lookahead", k=3), resolve_policy("lookahead", k=5)):
        assert cache(spec, policy) == _BudgetCache._ask(spec, policy)
        assert cache(spec, policy) == _BudgetCache._ask(spec, policy)  # the cached answer
    assert cache(spec, resolve_policy("lookahead", k=5))[0][WEIGHTS] == 5


def test_planning_compiles_each_step_shape_once(monkeypatch):
    """8b in 10 GB at one sequence per micro-batch tries ~200 candidates (placements, loss
    chunks, slot caps, micro-batch sizes, suggestions) of ~25 step shapes: the step graph, from
    which the policy proposes budgets, is compiled once per shape, not per candidate (one
    policy: with another, ``--policy sequential`` would be a suggestion, asked separately)."""
    from flowtrain.plan import planner as plan_module

    compiled = []
    real = plan_module.compile_step
    monkeypatch.setattr(plan_module, "compile_step", lambda spec: compiled.append(msgspec.json.encode(spec)) or real(spec))
    monkeypatch.setattr(plan_module, "_policy_budgets", plan_module._BudgetCache())
    req = RunRequest(seq_len=4096, batch_size=16, micro_batch_size=1, host_mem=118.0, gpu_mem=10.0,
                     activations="recompute")
    p = plan_run(preset("llama-8b"), req, device=CUDA, dtype=BF16, policy="sequential")
    assert not p.fits and p.suggestions  # the long way: every fallback was planned
    assert len(compiled) == len(set(compiled)) > 10


def test_gradients_queue_in_host_staging_slots_where_adam_falls_behind_and_host_memory_allows():
    """One micro-batch per step (or micro-batch order, where every gradient is finished by the
    last micro-batch's backward): backward outruns CPU Adam, so the plan adds pinned staging
    slots for half the streamed layers (the CPU then updates bottom layers first and the rest
    wait there) rather than stall backward, and only where host memory holds them."""
    from flowtrain.graph.tasks import HOST_GRADS

    L = preset("llama-3b").num_layers
    base = dict(model="llama-3b", batch_size=4, micro_batch_size=4, resident="none")
    roomy = plan(**base, host_mem=110)
    assert roomy.budgets[HOST_GRADS] == 3 + (L + 1) // 2 and roomy.budgets[GRADS] == 2
    assert roomy.budgets[WEIGHTS] == (L + 2) // 3  # the next forward's fetches start early
    accumulating = plan(**{**base, "batch_size": 16}, host_mem=110)
    assert accumulating.budgets[HOST_GRADS] == 3  # four micro-batches: each layer's backward is long
    assert plan(**{**base, "batch_size": 16}, order="micro", host_mem=110).budgets[HOST_GRADS] == roomy.budgets[HOST_GRADS]
    slot = roomy.host["staging"] // roomy.budgets[HOST_GRADS]
    tight = plan(**base, host_mem=(roomy.host_node_total - slot) / GiB / 0.95)
    assert tight.fits and tight.budgets[HOST_GRADS] == 3
    # the extra weight slots only where the GPU holds them (kept activations come after them)
    recompute = plan(**base, host_mem=110, activations="recompute")
    weight_slot = recompute.gpu["weight_slots"] // recompute.budgets[WEIGHTS]
    small_gpu = plan(**base, host_mem=110, activations="recompute",
                     gpu_mem=(recompute.gpu_total - weight_slot) / GiB / 0.92)
    assert small_gpu.fits and small_gpu.budgets[WEIGHTS] == 2 and small_gpu.budgets[HOST_GRADS] == roomy.budgets[HOST_GRADS]
