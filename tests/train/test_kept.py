"""Kept activations: backward from the forward's own graph instead of a recompute.

A kept layer's saved weights are views of a streaming slot that other layers overwrite before
its backward; the saved-tensor hooks must read them from the backward's fetch instead. So the
real test is a whole training run through the engine, compared bit for bit with recompute.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flowtrain.cli import main
from flowtrain.errors import ConfigError
from flowtrain.graph.compiler import StepSpec, compile_step
from flowtrain.graph.tasks import Backward, Forward
from flowtrain.model import decoder_layer, model_flat_maps, rope_tables
from flowtrain.plan.memory import kept_bytes_per_token
from flowtrain.plan.request import RunRequest
from flowtrain.plan.planner import plan_activations, plan_run
from flowtrain.train.kept import saved_bytes

sys.path.insert(0, str(Path(__file__).parents[1] / "model"))
from model_helpers import small_cfg
from test_train_vs_hf import make_checkpoint, make_data

FAMILIES = {
    "llama": small_cfg(hidden_size=128, intermediate_size=352),
    "qwen3": small_cfg(architecture="Qwen3ForCausalLM", hidden_size=128, intermediate_size=352, head_dim=64),
    "gemma3": small_cfg(architecture="Gemma3ForCausalLM", hidden_size=128, intermediate_size=352, head_dim=64),
}


def _saved_per_token(cfg, dtype, make_layer=lambda: decoder_layer) -> float:
    """Bytes one more token adds to what a kept forward of one layer holds (64 -> 128 tokens);
    ``make_layer`` gives the layer function afresh for each length (a compiled one)."""
    lay = model_flat_maps(cfg)[1]
    flat = (torch.randn(lay.numel, generator=torch.Generator().manual_seed(1)) * 0.05).to(dtype)
    measured = []
    for tokens in (64, 128):
        cos, sin = rope_tables(cfg, tokens, dtype=dtype)
        x = torch.randn(1, tokens, cfg.hidden_size, dtype=dtype)
        layer = make_layer()
        measured.append(saved_bytes(lambda x, w: layer(x, w, cos, sin, cfg, None, None), x, flat, lay))
    return (measured[1] - measured[0]) / 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_plan_counts_at_least_what_autograd_keeps(name, dtype):
    cfg = FAMILIES[name]
    per_token = _saved_per_token(cfg, dtype)
    planned = kept_bytes_per_token(cfg, dtype)
    assert per_token <= planned <= 1.6 * per_token


def test_kept_layers_carry_keep_activations():
    g = compile_step(StepSpec(layers=4, micro_batches=2, keep=(2, 3)))
    for t in g:
        if isinstance(t, (Forward, Backward)):
            assert t.activations == ("keep" if t.layer in (2, 3) else None) and t.phase is None, t
    with pytest.raises(ConfigError, match="need a checkpoint at every layer"):
        StepSpec(layers=4, checkpoint_every=2, keep=(1,)).validate()
    with pytest.raises(ConfigError, match="distinct layers of 0..3"):
        StepSpec(layers=4, keep=(4,)).validate()


def _train(tmp_path, name, model, data, *extra):
    out = tmp_path / name
    assert main(["train", "--model", str(model), "--data", str(data), "--steps", "3", "--batch-size", "4",
                 "--micro-batch-size", "2", "--seq-len", "12", "--no-shuffle", "--lr", "0.01",
                 "--device", "cpu", "--precision", "fp32", "--out", str(out), "--no-progress", *extra]) == 0
    return load_file(out / "model.safetensors")


#: the models and settings on which a run with other activations is compared with recompute
#: (also by test_saved_attention.py)
RUN_MODELS = pytest.mark.parametrize(
    "spec", [dict(model_type="llama", tied=True),
             dict(model_type="gemma3_text", head_dim=8, sliding_window=5,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention"])],
    ids=["llama-tied", "gemma3"])
RUN_SETTINGS = pytest.mark.parametrize(
    "extra", [[], ["--resident", "layer.1", "--policy", "sequential"], ["--order", "micro"]],
    ids=["streamed", "resident-sequential", "micro-order"])


def trains_like_recompute(tmp_path, activations: str, extra, **spec) -> str:
    """Train one 3-layer model (``spec``: make_checkpoint's) on the same data twice, with
    ``--activations recompute`` and with ``--activations`` set to ``activations`` (both with
    ``extra``), check that the weights are the same bit for bit, and return the trace of the
    second run (to show that its path ran)."""
    model, data, trace = tmp_path / "model", tmp_path / "data.jsonl", tmp_path / "trace.json"
    make_checkpoint(model, layers=3, seed=3, **spec)
    make_data(data, seed=4)
    recomputed = _train(tmp_path, "recompute", model, data, "--activations", "recompute", *extra)
    placed = _train(tmp_path, activations, model, data, "--activations", activations, "--trace", str(trace), *extra)
    assert recomputed.keys() == placed.keys()
    for name, t in recomputed.items():
        assert torch.equal(t, placed[name]), name
    return trace.read_text()


@RUN_MODELS
@RUN_SETTINGS
def test_keep_trains_bit_identically_to_recompute(tmp_path, spec, extra):
    assert "backward L2 m1 (keep)" in trains_like_recompute(tmp_path, "keep", extra, **spec)  # the kept path ran


@pytest.mark.parametrize("compile, compiled", [("auto", True), ("inductor", True), ("none", False), ("aot_eager", False)])
def test_auto_keeps_the_top_layers_the_gpu_budget_holds(compile, compiled):
    """On a GPU, as many top layers as the budget holds, at what a kept layer saves with the
    run's ``--compile`` (inductor saves less than eager autograd)."""
    cfg = small_cfg(num_layers=8)
    req = RunRequest(seq_len=64, batch_size=4, micro_batch_size=2, activations="auto", compile=compile)
    plan = plan_run(cfg, req, device=torch.device("cpu"), dtype=torch.float32)
    assert plan.spec.keep == ()  # the CPU recomputes unless asked
    per_layer = kept_bytes_per_token(cfg, torch.bfloat16, compiled) * 2 * 64 * 2
    plan.device, plan.gpu_limit = "cuda", plan.gpu_total + 3 * per_layer + 1
    placed = plan_activations(plan, cfg, req, torch.bfloat16)
    assert placed.spec.keep == (5, 6, 7) and placed.gpu["kept_activations"] == 3 * per_layer
    assert placed.gpu_total <= placed.gpu_limit


@pytest.mark.filterwarnings("ignore")  # dynamo and AOT autograd warn while tracing
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_plan_counts_at_least_what_a_compiled_layer_keeps(name, dtype):
    """A layer compiled by inductor saves what AOT autograd's min-cut partitioner leaves for
    the backward (it recomputes cheap elementwise work instead): traced here with the same
    partitioner and no code generation, the saved tensors are at most the compiled formula,
    and it is at most 25% over them (the eager formula would be about 50% over)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def run_graph(gm, example_inputs):
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=run_graph, bw_compiler=run_graph, partition_fn=min_cut_rematerialization_partition)

    def compiled():
        torch._dynamo.reset()
        return torch.compile(decoder_layer, backend=backend, dynamic=False)

    cfg = FAMILIES[name]
    per_token = _saved_per_token(cfg, dtype, compiled)
    planned = kept_bytes_per_token(cfg, dtype, compiled=True)
    assert per_token <= planned <= 1.25 * per_token
    assert planned < kept_bytes_per_token(cfg, dtype)
