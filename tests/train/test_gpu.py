"""On a CUDA machine: the GPU path computes the same training run as the CPU path.

Skipped without CUDA (CI has no GPU); run on the lent H200 with the device tool.
"""

from __future__ import annotations

import pytest
import torch

from flowtrain.train.run import TrainConfig, train

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    # torch warns once per new thread (autograd's device thread, our launcher threads) that it
    # makes the primary CUDA context current before the first cuBLAS call: harmless.
    pytest.mark.filterwarnings("ignore:Attempting to run cuBLAS"),
]


def _weights(tmp_path, device, precision, policy="double_buffer", compile="none", **kw):
    from safetensors.torch import load_file

    out = tmp_path / f"{device}-{precision}-{policy}"
    cfg = TrainConfig(model="tiny", steps=4, batch_size=8, micro_batch_size=4, seq_len=64, device=device,
                      precision=precision, policy=policy, out=str(out), progress=False, compile=compile, **kw)
    metrics = train(cfg)
    return load_file(out / "model.safetensors"), metrics


@pytest.mark.parametrize("policy", ["sequential", "double_buffer", "lookahead"])
def test_cuda_fp32_matches_cpu(tmp_path, policy):
    cpu, _ = _weights(tmp_path, "cpu", "fp32", policy, checkpoint_every=2, grad_clip=1.0)
    gpu, _ = _weights(tmp_path, "cuda", "fp32", policy, checkpoint_every=2, grad_clip=1.0)
    for name, ref in cpu.items():
        err = float((gpu[name] - ref).norm() / ref.norm())
        assert err < 1e-3, f"{name}: {err:.2e}"  # TF32 may be on for matmuls


@pytest.mark.parametrize("placement", [
    {"resident": "embed,head,layer.0"},
    {"layout": "stream-bf16", "resident": "none"},
    {"layout": "full", "resident": "layer.1"},
    {"activations": "offload", "resident": "none"},
    {"activations": "offload", "checkpoint_every": 2, "order": "micro"},
    {"activations": "keep"},
])
def test_cuda_placements_match_cpu(tmp_path, placement):
    """Resident units (Adam on the GPU), staged chunks, the streaming copy, checkpoints offloaded
    to host memory (copied on their own streams) and kept activations compute the same training
    run on the GPU as on the CPU."""
    cpu, _ = _weights(tmp_path / "cpu", "cpu", "fp32")
    gpu, _ = _weights(tmp_path / "gpu", "cuda", "fp32", **placement)
    for name, ref in cpu.items():
        err = float((gpu[name] - ref).norm() / ref.norm())
        assert err < 1e-3, f"{name}: {err:.2e}"


@pytest.mark.filterwarnings("ignore")  # inductor and its dependencies warn while compiling; numbers matter here
def test_cuda_compiled_layer_matches_eager(tmp_path):
    eager, _ = _weights(tmp_path / "eager", "cuda", "fp32")
    compiled, _ = _weights(tmp_path / "compiled", "cuda", "fp32", compile="inductor")
    for name, ref in eager.items():
        err = float((compiled[name] - ref).norm() / ref.norm())
        assert err < 1e-3, f"{name}: {err:.2e}"


def test_cuda_bf16_trains(tmp_path):
    from flowtrain.train import pinning

    _, metrics = _weights(tmp_path, "cuda", "bf16")
    assert metrics[-1].loss < metrics[0].loss
    assert pinning._REGISTERED == []  # the run gave its pinned pages back


def test_the_shared_state_is_pinned_and_copies_to_the_gpu(monkeypatch):
    """Where the processes of a node share the state, the streamed units' masters are views of a
    mapped shared-memory file, page-locked for ``fetch``: copies from them to the GPU run
    asynchronously and bring the values written on the host (one process here, the node's
    barrier and hand-over on a one-process gloo group)."""
    import torch.distributed as dist

    from flowtrain.model import preset
    from flowtrain.train import pinning
    from flowtrain.train.distributed import World
    from flowtrain.train.host_state import HostState

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        state = HostState.create(preset("tiny"), pin=True, layout="staged", world=World(local_size=2),
                                 chunks={}, dtype=torch.bfloat16, device="cuda")
        # the pinned file starts with the first unit's master, and the whole file is registered
        assert state.arena is not None and state.units[0].master.data_ptr() in pinning._REGISTERED
        state.init_random(0)
        for u in state.units:
            assert u.master.is_pinned()
            out = torch.empty_like(u.master, device="cuda")
            out.copy_(u.master, non_blocking=True)
            torch.cuda.synchronize()
            assert torch.equal(out.cpu(), u.master)
        pinning.unpin_all()
    finally:
        dist.destroy_process_group()


def test_probe_measures_attention_by_length_for_each_kernel(tmp_path):
    """``flowtrain probe --quick`` on the GPU writes an ``attention_tflops`` table simulate reads:
    both fused kernels, every length measured, positive rates."""
    import json

    from flowtrain.cli import main
    from flowtrain.sim.machine import load_machine

    out = tmp_path / "probe.json"
    assert main(["probe", "--quick", "--device", "cuda", "--out", str(out), "--disk-dir", str(tmp_path)]) == 0
    table = json.loads(out.read_text())["attention_tflops"]
    assert sorted(table) == ["cudnn", "flash"]
    for points in table.values():
        assert [seq for seq, _ in points] == [2048, 8192] and all(rate > 0 for _, rate in points)
    machine = load_machine(out)
    assert machine.attention_rate("flash", 4096) is not None


def _adapter(tmp_path, device, precision, compile="none", **kw):
    from safetensors.torch import load_file

    out = tmp_path / f"lora-{device}-{precision}-{compile}-{kw.get('steps', 4)}"
    settings = {"steps": 4, "batch_size": 8, "micro_batch_size": 4, "seq_len": 64, **kw}
    cfg = TrainConfig(model="tiny", device=device, precision=precision, out=str(out), progress=False,
                      compile=compile, **settings)
    metrics = train(cfg)
    return out, load_file(out / "adapter_model.safetensors"), metrics


@pytest.mark.filterwarnings("ignore")  # inductor and its dependencies warn while compiling; numbers matter here
@pytest.mark.parametrize("placement", [{}, {"activations": "keep"}, {"activations": "offload"},
                                       {"lora_state": "host", "activations": "keep"}])
def test_cuda_lora_matches_cpu(tmp_path, placement):
    """LoRA on the GPU, from an adapter whose B is not zero (two CPU steps from a fresh one):
    fp32 and compiled trains the CPU's adapters; bf16 (a bf16 base streamed as it is, the
    adapters' products in bf16) trains them within bf16's rounding, and its loss falls."""
    start, first, _ = _adapter(tmp_path, "cpu", "fp32", lora_rank=4, steps=2, lr=0.02)
    _, cpu, _ = _adapter(tmp_path, "cpu", "fp32", adapter=str(start), **placement)
    _, gpu, _ = _adapter(tmp_path, "cuda", "fp32", compile="inductor", adapter=str(start), **placement)
    _, bf16, metrics = _adapter(tmp_path, "cuda", "bf16", compile="inductor", adapter=str(start), **placement)
    assert metrics[-1].loss < metrics[0].loss
    for name, ref in cpu.items():
        moved = float((ref - first[name]).norm())
        assert moved > 0, name
        fp32_err = float((gpu[name] - ref).norm()) / moved  # of what the four steps changed
        bf16_err = float((bf16[name] - ref).norm() / ref.norm())
        assert fp32_err < 1e-2 and bf16_err < 2e-2, (name, fp32_err, bf16_err)


@pytest.mark.filterwarnings("ignore")  # inductor and transformers warn while loading and compiling
def test_cuda_skips_idle_experts_as_the_cpu(tmp_path):
    """``--skip-idle-experts`` on the GPU: fp32 trains the CPU's weights; bf16 with the compiled
    layer and grouped experts (empty groups included) and every layer streamed leaves the experts
    no token reached in any step exactly as loaded, and its backward fetches left their share on
    the host."""
    from safetensors.torch import load_file
    from test_idle_experts import _setup

    _setup(tmp_path, "qwen3-moe")

    def run(name, device, precision, compile="none", resident="auto"):
        out = tmp_path / name
        cfg = TrainConfig(model=str(tmp_path / "model"), data=str(tmp_path / "data.jsonl"), steps=3, batch_size=4,
                          micro_batch_size=2, seq_len=12, device=device, precision=precision, compile=compile,
                          out=str(out), progress=False, skip_idle_experts=True, save_dtype="fp32", resident=resident)
        metrics = train(cfg)
        return load_file(out / "model.safetensors"), metrics

    cpu, _ = run("cpu", "cpu", "fp32")
    gpu, _ = run("gpu", "cuda", "fp32")
    for name, ref in cpu.items():
        err = float((gpu[name] - ref).norm() / ref.norm())
        assert err < 1e-3, f"{name}: {err:.2e}"  # TF32 may be on for matmuls
    start = load_file(tmp_path / "model" / "model.safetensors")
    # streamed layers (the H200's plan may keep every layer of this small model resident, where
    # the idle experts are skipped by the GPU's AdamW and nothing is fetched)
    bf16, metrics = run("bf16", "cuda", "bf16", "inductor", resident="none")
    # bf16 logits may route a near tie elsewhere than fp32 does, so not necessarily the CPU's
    # experts: but updated with a zero gradient, every idle one would move (weight decay)
    assert any(torch.equal(cpu[k], start[k]) for k in cpu if "experts" in k)
    assert any(torch.equal(bf16[k], start[k]) for k in bf16 if "experts" in k)
    assert all(m.experts_unfetched is not None and 0 < m.experts_unfetched < 1 for m in metrics)


@pytest.mark.filterwarnings("ignore")  # inductor, PEFT and transformers warn while loading and compiling
@pytest.mark.parametrize("lora_state, rank", [("gpu", 8), ("host", 3)])
def test_cuda_lora_experts_match_cpu(tmp_path, lora_state, rank):
    """LoRA over a mixture of experts' router and experts (PEFT's all-linear: the gate-and-up
    adapters at twice the rank) on the GPU: fp32 (the experts one by one) trains the CPU's
    adapters; bf16 with the compiled layer (grouped experts, two grouped GEMMs per adapted
    projection, rank 3 padded to 8) lowers the loss and moves every adapter the CPU's way (the
    grouped GEMMs against the loop, input by input: ``tests/model/test_lora_experts.py``)."""
    from safetensors.torch import load_file
    from test_lora_train import MOE, make_adapter, make_checkpoint, make_data

    make_checkpoint(tmp_path / "model", tied=False, layers=2, seed=5, model_type="qwen3_moe", **MOE)
    make_data(tmp_path / "data.jsonl", seed=6)
    make_adapter(tmp_path / "model", tmp_path / "adapter", rank=rank, alpha=2.0 * rank, targets="all-linear")

    def run(name, device, precision, compile="none"):
        out = tmp_path / name
        cfg = TrainConfig(model=str(tmp_path / "model"), data=str(tmp_path / "data.jsonl"), steps=3, batch_size=4,
                          micro_batch_size=2, seq_len=12, device=device, precision=precision, compile=compile,
                          out=str(out), progress=False, adapter=str(tmp_path / "adapter"), lora_state=lora_state,
                          lr=0.01)
        metrics = train(cfg)
        return load_file(out / "adapter_model.safetensors"), metrics

    start = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    cpu, _ = run("cpu", "cpu", "fp32")
    gpu, _ = run("gpu", "cuda", "fp32")
    bf16, metrics = run("bf16", "cuda", "bf16", "inductor")
    assert any(".experts." in k for k in cpu) and metrics[-1].loss < metrics[0].loss
    for name, ref in cpu.items():
        moved = (ref - start[name]).flatten()
        assert float(moved.norm()) > 0, name
        assert float((gpu[name] - ref).norm() / moved.norm()) < 1e-2, name  # TF32 may be on for matmuls
        # bf16 rounds this small random model's base and routes near ties elsewhere: the update
        # goes the same way (cosine 0.9 and more on the CPU), not to within a tolerance
        assert float(torch.nn.functional.cosine_similarity((bf16[name] - start[name]).flatten(), moved, dim=0)) > 0.5



def _starve() -> None:
    """Hold the caching allocator to what it has reserved now: its next request for new memory
    is refused, with PyTorch's own message."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(torch.cuda.memory_reserved() / total)


@pytest.mark.parametrize("before, where", [(True, r"setting up the run's GPU buffers"), (False, r"task .+")])
def test_running_out_of_gpu_memory_is_one_error_that_names_where_and_the_plan(tmp_path, monkeypatch, before, where):
    """The allocator's refusal, while the buffers are made (a card holding less than planned)
    or in a step's task (whichever first asks for new memory once the buffers are made; every
    layer's forward asks for 64 MiB more), ends the run with a GpuOutOfMemory naming where, what
    was asked and held, and the plan's count; no final model is written."""
    from flowtrain.errors import GpuOutOfMemory
    from flowtrain.train import program as program_module
    from flowtrain.train import run as run_module

    build, forward = run_module.build_state, program_module.HANDLERS["forward"]

    def build_starved(run):
        if before:
            _starve()
        built = build(run)
        if not before:
            _starve()
        return built

    def forward_with_work(program, task, ctx):
        torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # more than any cached block of this run
        forward(program, task, ctx)

    monkeypatch.setattr(run_module, "build_state", build_starved)
    for kind in ("forward", "recompute"):
        monkeypatch.setitem(program_module.HANDLERS, kind, forward_with_work)
    out = tmp_path / "out"
    cfg = TrainConfig(model="tiny", steps=2, batch_size=4, micro_batch_size=2, seq_len=64, device="cuda",
                      out=str(out), progress=False, compile="none")
    try:
        with pytest.raises(GpuOutOfMemory, match=rf"^{where} ran out of GPU memory: [\d.]+ [KMG]?i?B could not be "
                                                 r"allocated with [\d.]+ [KMG]?i?B allocated.*the plan counted a peak of"):
            train(cfg)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert not (out / "model.safetensors").exists()
