"""The cost model: each kind's time follows its work and the machine's rate, and the H200
numbers reproduce the measured W1 trace they were fitted to."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from flowtrain.graph.tasks import Backward, CpuAdam, Fetch, Forward, GpuAdam, Loss, OffloadGrad, SaveUnit
from flowtrain.sim.costs import CostModel, Shape
from flowtrain.sim.machine import load_machine

TRACE = Path(__file__).parents[2] / "docs" / "bench" / "2026-12-02" / "w1-trace.json"

#: llama-3b at W1's shape (4 x 4096 tokens per micro-batch); numel as the layout pads them; the
#: W1 trace these tests compare with ran the flash attention kernel
W1 = Shape(hidden=3072, intermediate=8192, layers=28, heads=24, kv_heads=8, head_dim=128, vocab=128256,
           seq_len=4096, micro_batch_size=4, layer_numel=100_669_440,
           numel={"embed": 394_002_432, "head": 394_005_504}, chunk_tokens=2048, attention_backend="flash")


def test_small_gemms_are_slower_per_flop():
    c = CostModel(load_machine("h200"), W1)
    per_flop = [c.gemm_seconds(d, d, d) / (2 * d**3) for d in (128, 512, 4096)]
    assert per_flop[0] > per_flop[1] > per_flop[2]
    assert c.gemm_seconds(8192, 8192, 8192) / (2 * 8192**3) == pytest.approx(
        1 / (c.m.matmul_tflops * 1e12), rel=0.02)


def test_copies_share_the_link_when_both_directions_copy():
    m = load_machine("h200")
    c = CostModel(m, W1)
    fetch = Fetch(unit="layer", layer=20, phase="forward")
    alone, shared = c.copy_seconds(fetch, False), c.copy_seconds(fetch, True)
    assert shared > alone
    assert c.copy_bytes(fetch) == 4 * W1.layer_numel
    assert CostModel(m, W1.__class__(**{**_fields(W1), "fetch_bytes": 2})).copy_bytes(fetch) == 2 * W1.layer_numel
    off = OffloadGrad(unit="layer", layer=20)
    assert c.copy_seconds(off, False) == pytest.approx(4 * W1.layer_numel / (m.d2h_gbps * 1e9), rel=0.02)


def _fields(s):
    return {f: getattr(s, f) for f in s.__struct_fields__}


def test_cpu_adam_per_task_scales_with_workers_and_refresh():
    m = load_machine("h200")
    one = CostModel(m, W1).seconds(CpuAdam(unit="layer", layer=20))
    assert one == pytest.approx(W1.layer_numel / (m.cpu_adam_gparams * 1e9))
    four = CostModel(m, Shape(**{**_fields(W1), "adam_workers": 4})).seconds(CpuAdam(unit="layer", layer=20))
    assert four == pytest.approx(4 * one)  # four at once, each with a quarter of the cores
    refresh = CostModel(m, Shape(**{**_fields(W1), "refresh": True})).seconds(CpuAdam(unit="layer", layer=20))
    assert refresh > one


def test_chunked_tasks_cost_their_share():
    shape = Shape(**{**_fields(W1), "grad_chunks": {"embed": 4}})
    c = CostModel(load_machine("h200"), shape)
    whole = c.seconds(CpuAdam(unit="embed"))
    part = c.seconds(CpuAdam(unit="embed", chunk=0))
    assert part == pytest.approx(whole / 4, rel=1e-3)


def test_backward_costs_a_forward_and_more_and_faster_machines_are_faster():
    costs = {name: CostModel(load_machine(name), W1) for name in ("h200", "a100-80gb", "rtx3080-10gb")}
    for c in costs.values():
        f, b = c.seconds(Forward(layer=3, micro_batch=0)), c.seconds(Backward(layer=3, micro_batch=0))
        assert 2.5 * f < b < 4.5 * f
    fwd = [costs[n].seconds(Forward(layer=3, micro_batch=0)) for n in ("h200", "a100-80gb", "rtx3080-10gb")]
    assert fwd == sorted(fwd)
    assert costs["h200"].seconds(SaveUnit(unit="layer", layer=0)) == pytest.approx(
        12 * W1.layer_numel / (costs["h200"].m.disk_write_gbps * 1e9))


def test_a_kept_layer_backward_runs_no_forward_again():
    """--activations keep: the forward's activations stay, so the backward saves one forward."""
    c = CostModel(load_machine("h200"), W1)
    f = c.seconds(Forward(layer=3, micro_batch=0))
    rebuilt, kept = c.seconds(Backward(layer=3, micro_batch=0)), c.seconds(Backward(layer=3, micro_batch=0, activations="keep"))
    assert kept == pytest.approx(rebuilt - f + c.m.launch_us * 1e-6)


@pytest.mark.skipif(not TRACE.exists(), reason="the W1 trace is not in this checkout")
def test_h200_reproduces_the_measured_w1_task_times():
    """Fitted to this trace (docs/simulate.md): each kind's median within 12%."""
    events = [e for e in json.loads(TRACE.read_text())["traceEvents"] if e.get("ph") == "X"]
    steady = [e for e in events if 3 <= e["args"]["step"] <= 5]

    def measured(kind, unit="layer", phase=None):
        return statistics.median(e["dur"] / 1e6 for e in steady if e["cat"] == kind and e["args"]["unit"] == unit
                                 and (phase is None or e["args"].get("phase") == phase))

    c = CostModel(load_machine("h200"), W1)
    pairs = {
        "forward": (c.seconds(Forward(layer=20, micro_batch=0)), measured("forward")),
        "backward": (c.seconds(Backward(layer=20, micro_batch=0)), measured("backward")),
        "loss": (c.seconds(Loss(unit="head", micro_batch=0)), measured("loss", "head")),
        "fetch": (c.copy_seconds(Fetch(unit="layer", layer=20, phase="forward"), False), measured("fetch", phase="forward")),
        "offload_grad": (c.copy_seconds(OffloadGrad(unit="layer", layer=20), False), measured("offload_grad")),
        "cpu_adam": (c.seconds(CpuAdam(unit="layer", layer=20)), measured("cpu_adam")),
        "gpu_adam": (c.seconds(GpuAdam(unit="layer", layer=2)), measured("gpu_adam")),
    }
    off = {k: p / m - 1 for k, (p, m) in pairs.items()}
    assert all(abs(v) < 0.12 for v in off.values()), off


def test_experts_cost_more_than_a_dense_mlp_of_their_flops_the_fewer_rows_each_gets():
    """A sparse layer's k experts of width I do a dense MLP's FLOPs of width k I, but as E small
    GEMMs: the fewer tokens per micro-batch, the fewer rows each expert's GEMM has and the
    further below the dense rate it runs; at many rows per expert the two meet."""
    m = load_machine("h200")
    moe = {**_fields(W1), "hidden": 2048, "intermediate": 8 * 768, "experts": 128, "experts_per_token": 8}
    dense = {**moe, "experts": 0, "experts_per_token": 0}
    ratios = []
    for tokens_per_micro_batch in (1024, 16384, 1 << 20):
        shape = {"seq_len": 1024, "micro_batch_size": tokens_per_micro_batch // 1024}
        sparse_s = CostModel(m, Shape(**{**moe, **shape}))._mlp_gemm_seconds()
        dense_s = CostModel(m, Shape(**{**dense, **shape}))._mlp_gemm_seconds()
        ratios.append(sparse_s / dense_s)
    assert ratios[0] > ratios[1] > ratios[2] > 1.0
    assert ratios[2] < 1.1  # 65,536 rows per expert: as fast as dense, the router aside


def test_lora_adapters_add_their_gemms_and_passes_to_the_frozen_layer():
    """A LoRA layer: the base's forward and input gradients (no weight gradients), plus the
    adapters' own work: their GEMMs, which the backward runs twice, and their elementwise passes
    (the forward's over the adapted outputs; the backward's over outputs and inputs). The
    adapters' GEMMs are thin (one size is the rank), so they run below the base's rate per FLOP;
    their passes grow with the adapted outputs and inputs."""
    m = load_machine("h200")
    per_layer = 16 * (3072 * 4 + 2 * 1024 + 3 * 8192 + 3072 + 2 * 8192)  # rank 16 on every map of a layer
    lora = {**_fields(W1), "adapter_params": 28 * per_layer, "lora_rank": 16,
            "adapter_outputs": 3072 * 2 + 2 * 1024 + 3 * 8192, "adapter_inputs": 3072 * 6 + 8192}
    c, full = CostModel(m, Shape(**lora)), CostModel(m, W1)
    gemms, passes = c._adapter_seconds()
    backward_passes = c._adapter_backward_ew()
    fwd = Forward(layer=3, micro_batch=0)
    kept = Backward(layer=3, micro_batch=0, activations="keep")
    assert gemms > 0 and passes > 0 and backward_passes > 0
    assert c.seconds(fwd) == pytest.approx(full.seconds(fwd) + gemms + passes)
    launch = m.launch_us * 1e-6
    assert c.seconds(Backward(layer=3, micro_batch=0)) == pytest.approx(c.seconds(fwd) + c.seconds(kept) - launch)
    assert c.seconds(kept) - 2 * gemms - backward_passes < 0.8 * full.seconds(kept)  # the frozen base: input gradients only
    flops = 2 * W1.tokens * per_layer
    assert c.gemm_seconds(W1.tokens, 16, per_layer // 16) > 2 * flops / (m.matmul_tflops * 1e12)  # thin: under half rate
    wider = CostModel(m, Shape(**{**lora, "adapter_outputs": 2 * lora["adapter_outputs"]}))
    assert wider._adapter_seconds()[1] > passes and wider._adapter_backward_ew() > backward_passes
    more_inputs = CostModel(m, Shape(**{**lora, "adapter_inputs": 2 * lora["adapter_inputs"]}))
    assert more_inputs._adapter_backward_ew() > backward_passes and more_inputs._adapter_seconds()[1] == passes


def test_an_mlp_in_pieces_pays_its_eager_passes_and_a_weight_gradient_add_per_piece():
    """Past MLP_CHUNK_TOKENS the MLP runs eager, piece by piece (flowtrain.model.mlp): its forward
    makes more passes over the intermediate than the compiled path, and its backward rebuilds
    gate and up and adds the weight gradients in fp32 once a piece, so more pieces cost more."""
    m = load_machine("h100-sxm")
    long = {**_fields(W1), "seq_len": 65536, "micro_batch_size": 1}
    plain, pieces = CostModel(m, Shape(**long)), CostModel(m, Shape(**{**long, "mlp_pieces": 2}))
    fwd, bwd = Forward(layer=3, micro_batch=0), Backward(layer=3, micro_batch=0, activations="keep")
    assert pieces.seconds(fwd) > plain.seconds(fwd)
    extra = pieces.seconds(bwd) - plain.seconds(bwd)
    assert extra > 2 * plain.gemm_seconds(65536, W1.intermediate, W1.hidden)  # the rebuild's GEMMs and more
    more = CostModel(m, Shape(**{**long, "mlp_pieces": 4}))
    added = 2 * 3 * W1.hidden * W1.intermediate * (4 + 2 + 4) / (m.hbm_gbps * 1e9)  # two more pieces' adds
    assert more.seconds(bwd) - pieces.seconds(bwd) == pytest.approx(added)


def test_the_loss_pays_for_each_chunk_of_logits():
    """The same tokens in smaller loss chunks take longer: each chunk's own kernels cost beyond
    their passes over the logits (fitted to the H100 traces' loss tasks)."""
    m = load_machine("h100-sxm")
    big, small = CostModel(m, W1), CostModel(m, Shape(**{**_fields(W1), "chunk_tokens": 512}))
    loss = Loss(unit="head", micro_batch=0)
    assert small.seconds(loss) > big.seconds(loss)
    per_chunk = small.sw["loss_chunk_seconds"]
    assert small.seconds(loss) - big.seconds(loss) > (W1.tokens / 512 - W1.tokens / 2048) * per_chunk
