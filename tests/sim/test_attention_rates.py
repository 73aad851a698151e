"""Attention's rate by kernel and sequence length (a machine file's ``attention_tflops``): read
at the points, interpolated in log(seq) between them and clamped outside; the run's
``--attention-backend`` picks the kernel; a machine without the table predicts as before; and
llama-8b at 262,144 tokens on the H200 comes within 15% of its measured 1,591 tokens/s."""

from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path

import msgspec
import pytest

from flowtrain.errors import ConfigError
from flowtrain.graph.tasks import Backward, Forward
from flowtrain.sim.costs import SOFTWARE, CostModel, Shape, attention_kernel, attention_rates
from flowtrain.sim.machine import Machine, load_machine, machine_names

H200 = load_machine("h200")
#: ``flowtrain probe`` on the H200 (causal attention forward+backward, TFLOP/s by sequence length)
PROBE_FILE = Path(__file__).parents[2] / "docs" / "bench" / "2026-12-04" / "h200-probe.json"
PROBE = {"cudnn": [(4096, 496.0), (32768, 560.0), (131072, 546.0), (262144, 534.0), (524288, 516.0)],
         "flash": [(4096, 266.0), (32768, 325.0), (131072, 328.0), (262144, 326.0), (524288, 318.0)]}
#: llama-8b's layer (32 heads, 8 KV heads, head_dim 128) at one sequence of ``seq_len`` tokens
LLAMA8B = dict(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, head_dim=128, vocab=128256,
               micro_batch_size=1, layer_numel=218_112_000)


def shape(seq_len: int, backend: str = "auto") -> Shape:
    return Shape(**LLAMA8B, seq_len=seq_len, attention_backend=backend)


# ---- the table ----------------------------------------------------------------------------
def test_the_h200_file_holds_the_probed_rates():
    assert H200.attention_tflops == PROBE
    assert "flowtrain probe on the lent H200" in H200.notes["attention_tflops"]
    # every length the probe measured, as it measured it (rounded to whole TFLOP/s)
    probed = json.loads(PROBE_FILE.read_text())["attention_tflops"]
    for kernel, points in probed.items():
        assert [(seq, float(round(rate))) for seq, rate in points] == [p for p in PROBE[kernel] if p[0] <= points[-1][0]]


@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
def test_the_rate_is_exact_at_each_point(kernel):
    for seq, rate in PROBE[kernel]:
        assert H200.attention_rate(kernel, seq) == rate


@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
def test_between_two_points_the_rate_is_linear_in_log_seq_and_monotone(kernel):
    points = PROBE[kernel]
    for (s0, r0), (s1, r1) in itertools.pairwise(points):
        mid = round(math.sqrt(s0 * s1))  # halfway in log(seq)
        assert H200.attention_rate(kernel, mid) == pytest.approx((r0 + r1) / 2, rel=1e-4)
        lengths = [round(s0 * (s1 / s0) ** (i / 16)) for i in range(17)]
        rates = [H200.attention_rate(kernel, s) for s in lengths]
        assert all(min(r0, r1) <= r <= max(r0, r1) for r in rates)
        steps = [b - a for a, b in itertools.pairwise(rates)]
        assert all(d >= 0 for d in steps) if r1 >= r0 else all(d <= 0 for d in steps)


@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
def test_outside_the_points_the_rate_is_the_nearest_ones(kernel):
    (first, r_first), (last, r_last) = PROBE[kernel][0], PROBE[kernel][-1]
    assert H200.attention_rate(kernel, 1) == H200.attention_rate(kernel, first // 2) == r_first
    assert H200.attention_rate(kernel, last * 2) == H200.attention_rate(kernel, 10**9) == r_last


def test_a_kernel_the_table_does_not_name_has_no_rate():
    assert Machine(name="x").attention_rate("cudnn", 4096) is None
    one = Machine(name="x", attention_tflops={"flash": [(1024, 100.0)]})
    assert one.attention_rate("cudnn", 4096) is None and one.attention_rate("flash", 4096) == 100.0


def test_the_rate_splits_into_forward_and_backward_as_the_two_fixed_rates_do():
    for kernel in ("cudnn", "flash"):
        for seq in (4096, 50_000, 262144):
            fwd, bwd = attention_rates(H200, kernel, seq)
            assert bwd / fwd == pytest.approx(H200.attention_bwd_tflops / H200.attention_fwd_tflops)  # 240 / 330
            ratio = SOFTWARE["attention_bwd_ratio"]
            # forward and backward together: (1 + 2.5) forward FLOPs at the table's rate
            assert 1 / fwd + ratio / bwd == pytest.approx((1 + ratio) / H200.attention_rate(kernel, seq))


def test_a_saved_attention_layer_still_costs_less():
    for backend in ("auto", "flash"):
        c = CostModel(H200, shape(262144, backend))
        plain = c.seconds(Backward(layer=3, micro_batch=0))
        saved = c.seconds(Backward(layer=3, micro_batch=0, activations="attn"))
        assert plain - saved == pytest.approx(c.layer_breakdown()["attention_forward"]) and saved < plain


@pytest.mark.parametrize("table, words", [
    ({"cudnn-only": [[4096, 500]]}, "kernel 'cudnn-only'"),
    ({"cudnn": []}, "is empty"),
    ({"cudnn": [[8192, 500], [4096, 490]]}, "increasing"),
    ({"cudnn": [[4096, 500], [4096, 490]]}, "increasing"),
    ({"cudnn": [[0, 500]]}, "increasing"),
    ({"flash": [[4096, 0]]}, "must be > 0"),
])
def test_a_bad_table_is_a_config_error(tmp_path, table, words):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"name": "bad", "attention_tflops": table}))
    with pytest.raises(ConfigError, match=words):
        load_machine(str(path))


def test_a_file_extending_the_h200_keeps_its_table_or_replaces_it(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"name": "mine", "extends": "h200"}))
    assert load_machine(str(path)).attention_tflops == PROBE
    path.write_text(json.dumps({"name": "mine", "extends": "h200", "attention_tflops": {"flash": [[4096, 200]]}}))
    assert load_machine(str(path)).attention_tflops == {"flash": [(4096, 200.0)]}
    path.write_text(H200.to_json())  # written back as a file, it reads the same
    assert load_machine(str(path)) == H200


# ---- the kernel a run uses ----------------------------------------------------------------
def test_auto_is_cudnn_on_cuda_and_flash_is_flash():
    assert attention_kernel("auto") == "cudnn" and attention_kernel("flash") == "flash"
    assert attention_kernel("auto", "cpu") == "flash"
    assert Shape(**LLAMA8B, seq_len=4096).attention_backend == "auto"  # as flowtrain train's default
    with pytest.raises(ValueError, match="auto or flash"):
        attention_kernel("cudnn")


def test_auto_and_flash_differ_at_long_context_on_the_h200():
    auto, flash = CostModel(H200, shape(262144, "auto")), CostModel(H200, shape(262144, "flash"))
    assert auto.attention_kernel == "cudnn" and flash.attention_kernel == "flash"
    # cuDNN's rate against flash's at this length (534 and 326 TFLOP/s): attention 1.64x faster
    rates = {kernel: H200.attention_rate(kernel, 262144) for kernel in ("cudnn", "flash")}
    assert flash.layer_breakdown()["attention"] / auto.layer_breakdown()["attention"] == pytest.approx(rates["cudnn"] / rates["flash"])
    for task in (Forward(layer=3, micro_batch=0), Backward(layer=3, micro_batch=0)):
        assert auto.seconds(task) < 0.75 * flash.seconds(task)


def test_a_machine_without_the_table_predicts_exactly_as_before():
    """The fixed attention_fwd_tflops / attention_bwd_tflops at every length, whatever the kernel."""
    bare = msgspec.structs.replace(H200, attention_tflops={})
    for seq in (4096, 262144):
        s = shape(seq)
        flops = 2.0 * s.tokens * s.seq_len * s.heads * s.head_dim
        in_step = SOFTWARE["in_step"]  # the fixed rates, as every kernel runs inside a training step
        before = flops / (bare.attention_fwd_tflops * 1e12 * in_step) + SOFTWARE["attention_bwd_ratio"] * flops / (
            bare.attention_bwd_tflops * 1e12 * in_step)
        for backend in ("auto", "flash"):
            c = CostModel(bare, shape(seq, backend))
            assert c.attention_tflops == (bare.attention_fwd_tflops, bare.attention_bwd_tflops)
            assert c.layer_breakdown()["attention"] == before  # the same floating-point sum, exactly
    measured = {"h200", "h100-sxm"}  # the H100 SXM carries the H200's table: the same die and clocks
    assert {n for n in machine_names() if load_machine(n).attention_tflops} == measured
    others = [load_machine(n) for n in machine_names() if n not in measured]
    for m in others:
        auto, flash = CostModel(m, shape(262144, "auto")), CostModel(m, shape(262144, "flash"))
        assert auto.layer_breakdown() == flash.layer_breakdown()


# ---- the 262K prediction, through the CLI's own path ---------------------------------------
def simulate(argv: list[str], machine: Machine):
    """What ``flowtrain simulate`` predicts for ``argv`` (flowtrain.cli.simulate.run's path)."""
    from flowtrain.cli import simulate as cli
    from flowtrain.cli.plan import plan_for

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    args = p.parse_args(argv)
    _, req, plan, _, _, predictions = plan_for(args, machine, with_predictions=True)
    assert plan.fits
    return plan, predictions.prediction(req, plan, machine, adam_workers=args.adam_workers, steps=args.steps,
                                        world=req.processes, nodes=args.nnodes)


LONG = ["--model", "llama-8b-256k", "--seq-len", "262144", "--batch-size", "1", "--micro-batch-size", "1",
        "--host-mem", "118", "--machine", "h200"]
MEASURED_262K = 1591.0  # tokens/s, 405 model TFLOP/s (docs/bench/history/2026-12-03-offloaded-checkpoints-long-context.md)


def test_llama_8b_at_262k_tokens_is_predicted_within_15_percent():
    plan, pred = simulate(LONG, H200)
    assert plan.spec.save_attention  # the plan saves attention outputs at this length, as the run did
    assert pred.shape.attention_backend == "auto"  # simulate's default, as train's
    assert abs(pred.summary.tokens_per_s / MEASURED_262K - 1) < 0.15, pred.summary.tokens_per_s
    # with the fixed 4,096-token flash rates (the machine file before the table) it was 40% slow
    _, before = simulate(LONG, msgspec.structs.replace(H200, attention_tflops={}))
    assert before.summary.tokens_per_s < 0.65 * MEASURED_262K
