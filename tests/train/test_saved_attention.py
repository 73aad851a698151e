"""Saved attention outputs: the rebuild before a layer's backward takes the forward's attention.

Three levels: one layer (record in a no-grad forward, replay under autograd: the same output and
gradients, bit for bit, as a plain rebuild; nothing kept where the call is not plain causal), a
whole training run through the engine (bit-identical to recompute), and the planner (where
``auto`` saves attention and what memory it takes)."""

from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from flowtrain.cli import main
from flowtrain.errors import ConfigError
from flowtrain.graph.compiler import StepSpec, compile_step
from flowtrain.graph.tasks import Backward, Forward
from flowtrain.model import bind, decoder_layer, model_flat_maps, preset, rope_tables
from flowtrain.model import saved_attention as sa
from flowtrain.model.attention import Documents, rotary_for
from flowtrain.plan.attention import attention_pays, saved_attention_bytes
from flowtrain.plan.request import RunRequest
from flowtrain.plan.planner import plan_run

sys.path.insert(0, str(Path(__file__).parents[1] / "model"))
from model_helpers import small_cfg
from test_kept import RUN_MODELS, RUN_SETTINGS, trains_like_recompute
from test_train_vs_hf import make_checkpoint, make_data

FAMILIES = {
    "llama": small_cfg(hidden_size=128, intermediate_size=352),
    "qwen3": small_cfg(architecture="Qwen3ForCausalLM", hidden_size=128, intermediate_size=352, head_dim=64),
    "gemma3": small_cfg(architecture="Gemma3ForCausalLM", hidden_size=128, intermediate_size=352, head_dim=64),
    "mha": small_cfg(num_kv_heads=4),
}
SEQ = 48
CUDA = torch.device("cuda")


def _layer(cfg, seed=1):
    lay = model_flat_maps(cfg)[1]
    flat = torch.randn(lay.numel, generator=torch.Generator().manual_seed(seed)) * 0.05
    return lay, flat


def _forward_and_rebuild(cfg, layer_fn=decoder_layer, record=None, docs=None, seed=2):
    """The forward pass (no grad) and the rebuild's output and (dx, dw), recording into and
    replaying ``record`` where given."""
    lay, flat = _layer(cfg)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, SEQ, cfg.hidden_size, generator=gen)
    dy = torch.randn(2, SEQ, cfg.hidden_size, generator=gen)
    cos, sin = rotary_for(*rope_tables(cfg, SEQ), docs)

    with torch.no_grad(), sa.recording(record):  # None: a plain forward
        y0 = layer_fn(x, bind(flat, lay), cos, sin, cfg, docs, None)
    xx, ff = x.clone().requires_grad_(True), flat.clone().requires_grad_(True)
    with torch.enable_grad(), sa.replaying(record):
        y = layer_fn(xx, bind(ff, lay), cos, sin, cfg, docs, None)
        dx, dw = torch.autograd.grad(y, (xx, ff), dy)
    return y0, y, dx, dw


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_replayed_layer_is_bit_identical_to_a_plain_rebuild(name):
    cfg = FAMILIES[name]
    plain = _forward_and_rebuild(cfg)
    record = sa.AttentionRecord()
    kept_after_forward = []
    with mock.patch.object(sa, "_plain", side_effect=AssertionError("attention ran again")):
        real = sa._forward

        def forward(*a, **k):
            out = real(*a, **k)
            kept_after_forward.append(out)
            return out

        with mock.patch.object(sa, "_forward", side_effect=forward):
            saved = _forward_and_rebuild(cfg, record=record)
    assert len(kept_after_forward) == 1  # one attention call kept, and none ran again
    out, lse = kept_after_forward[0]
    assert out.shape == (2, cfg.num_heads, SEQ, cfg.head_dim) and lse.shape == (2, cfg.num_heads, SEQ)
    assert not record.kept  # the backward let go of it
    for a, b in zip(plain, saved):
        assert torch.equal(a, b)


def test_what_a_record_holds_and_lets_go():
    cfg = FAMILIES["llama"]
    lay, flat = _layer(cfg)
    cos, sin = rope_tables(cfg, SEQ)
    record = sa.AttentionRecord()
    assert not record.kept and record.nbytes() == 0
    with torch.no_grad(), sa.recording(record):
        decoder_layer(torch.randn(2, SEQ, cfg.hidden_size), bind(flat, lay), cos, sin, cfg)
    assert record.kept and record.kernel == "cpu_flash"
    assert record.nbytes() == saved_attention_bytes(cfg, 2 * SEQ, 4)
    assert sa.MODE is None and sa._RECORD is None  # closed again
    with sa.recording(None), sa.replaying(None):  # no record: nothing opens
        assert sa.MODE is None and sa._RECORD is None
    record.clear()
    assert not record.kept


def test_packed_documents_and_windows_keep_nothing_and_run_attention_again():
    """Only plain causal calls are kept; the others (here packed rows, whose masked kernel is
    not one of the kept ones) replay by running attention again, with the same values."""
    cfg = FAMILIES["llama"]
    positions = torch.cat([torch.arange(20), torch.arange(SEQ - 20)]).expand(2, SEQ)
    docs = Documents.from_positions(positions.contiguous())
    plain = _forward_and_rebuild(cfg, docs=docs)
    record = sa.AttentionRecord()
    saved = _forward_and_rebuild(cfg, record=record, docs=docs)
    assert not record.kept
    for a, b in zip(plain, saved):
        assert torch.equal(a, b)


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's compiler stack, on some versions
def test_a_compiled_layer_records_and_replays_without_recompiling_per_record():
    """In a compiled layer the kept call is a graph break (one compile per mode, not one per
    record: the record is never read by traced code); values as the eager plain rebuild."""
    from torch._dynamo.utils import counters

    cfg = FAMILIES["llama"]
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(decoder_layer, backend="aot_eager", dynamic=False)
    plain = _forward_and_rebuild(cfg)
    graphs = []
    for _ in range(3):
        record = sa.AttentionRecord()
        saved = _forward_and_rebuild(cfg, layer_fn=compiled, record=record)
        assert not record.kept
        for a, b in zip(plain, saved):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[1:] == graphs[:1] * 2


# ---- the step graph and the cost model --------------------------------------------------------
def test_layers_saving_attention_carry_attn_activations():
    g = compile_step(StepSpec(layers=4, micro_batches=2, keep=(3,), save_attention=(1, 2)))
    for t in g:
        if isinstance(t, (Forward, Backward)):
            assert t.activations == {3: "keep", 1: "attn", 2: "attn"}.get(t.layer) and t.phase is None, t
    with pytest.raises(ConfigError, match="checkpoint at every layer"):
        StepSpec(layers=4, checkpoint_every=2, save_attention=(1,)).validate()
    with pytest.raises(ConfigError, match="not kept"):
        StepSpec(layers=4, keep=(1,), save_attention=(1,)).validate()
    with pytest.raises(ConfigError, match=r"of 0\.\.3"):
        StepSpec(layers=4, save_attention=(4,)).validate()


def test_the_cost_model_takes_the_attention_forward_off_the_backward():
    from flowtrain.sim.costs import CostModel
    from flowtrain.sim.machine import load_machine
    from flowtrain.sim.predict import shape_of

    cfg = preset("llama-8b")
    req = RunRequest(seq_len=65536, batch_size=1, micro_batch_size=1)
    plan = plan_run(cfg, req, device=CUDA, dtype=torch.bfloat16, local_gpu=False)
    costs = CostModel(load_machine("h200"), shape_of(cfg, plan, req))
    parts = costs.layer_breakdown()
    plain = costs.seconds(Backward(unit="layer", layer=0, micro_batch=0))
    saved = costs.seconds(Backward(unit="layer", layer=0, micro_batch=0, activations="attn"))
    kept = costs.seconds(Backward(unit="layer", layer=0, micro_batch=0, activations="keep"))
    assert plain - saved == pytest.approx(parts["attention_forward"])
    assert kept < saved < plain and parts["attention_forward"] > 0.5 * parts["forward"]


# ---- a whole run ------------------------------------------------------------------------------
@RUN_MODELS
@RUN_SETTINGS
def test_attention_trains_bit_identically_to_recompute(tmp_path, spec, extra):
    kept = []
    real = sa._forward

    def forward(*a, **k):
        kept.append(a[0])
        return real(*a, **k)

    with mock.patch.object(sa, "_forward", side_effect=forward):
        # one document per row: plain causal attention, the calls that keep their output
        trace = trains_like_recompute(tmp_path, "attention", ["--no-packing", *extra], **spec)
    assert "backward L2 m1 (attn)" in trace  # the saved-attention path ran
    assert kept  # and some layer's attention was kept (gemma3: the full-attention layer)


# ---- the plan ---------------------------------------------------------------------------------
def _plan(model, seq_len, **kw):
    req = RunRequest(**{**dict(seq_len=seq_len, batch_size=1, micro_batch_size=1, host_mem=118.0,
                               gpu_mem=139.0), **kw})
    return plan_run(preset(model), req, device=CUDA, dtype=torch.bfloat16, local_gpu=False)


def test_attention_pays_at_long_sequences_only():
    cfg = preset("llama-8b")
    assert not attention_pays(cfg, 4096) and not attention_pays(cfg, 32768)
    assert attention_pays(cfg, 65536) and attention_pays(cfg, 262144)
    assert attention_pays(preset("llama-3b"), 65536)


def test_auto_saves_attention_at_262k_tokens_from_the_top_with_checkpoints_offloaded_below():
    plan = _plan("llama-8b-256k", 262144)
    L = 32
    n = len(plan.spec.save_attention)
    assert plan.fits and 12 <= n < L  # as many as fit: the GPU does not hold all 32
    assert plan.spec.save_attention == tuple(range(L - n, L))
    assert plan.spec.resident == ()  # residency buys nothing at minutes per step
    assert plan.spec.offload == tuple(range(len(plan.spec.offload))) and plan.spec.offload
    per = saved_attention_bytes(preset("llama-8b-256k"), 262144, 2)
    assert plan.gpu["saved_attention"] == n * per
    # one more saved layer would not fit, whatever is offloaded (the host holds no more)
    assert plan.gpu_total + per > plan.gpu_limit or plan.host_node_total + per > plan.host_limit
    assert plan.gpu_total <= plan.gpu_limit and plan.host_node_total <= plan.host_limit


def test_auto_saves_every_layer_where_memory_holds_them_and_offloads_only_what_that_needs():
    plan = _plan("llama-3b", 65536)
    assert plan.fits and plan.spec.save_attention == tuple(range(28))
    # nothing offloaded that the GPU could hold: one checkpoint fewer offloaded would not fit
    n_off = len(plan.spec.offload)
    if n_off:
        per_ck = plan.host["offloaded_activations"] // n_off
        assert plan.gpu_total + per_ck > plan.gpu_limit


def test_short_sequences_plan_as_before():
    for model, seq, b, mb in (("llama-3b", 4096, 4, 4), ("llama-8b", 4096, 16, 8)):
        plan = _plan(model, seq, batch_size=b, micro_batch_size=mb, order="layer")
        assert plan.spec.save_attention == ()


def test_asking_for_attention_saves_every_layer_or_says_what_fits():
    plan = _plan("llama-3b", 8192, batch_size=4, micro_batch_size=4, activations="attention")
    assert plan.fits and plan.spec.save_attention == tuple(range(28)) and plan.spec.keep == ()
    small = _plan("llama-8b-256k", 262144, activations="attention")
    assert not small.fits and "--activations auto" in small.suggestions[0]
    with pytest.raises(ConfigError, match="attention needs --activation-checkpoint-every 1"):
        _plan("llama-3b", 8192, activations="attention", checkpoint_every=2)


def test_a_state_folder_makes_room_for_every_layers_attention_moving_only_what_it_needs():
    """262,144 tokens of llama-8b do not hold every saved output without one (above); with a
    state folder under ``--disk-state auto`` the checkpoints the outputs displace go to host
    memory, and as many units' Adam moments go to disk as that needs, from the head down."""
    plan = _plan("llama-8b-256k", 262144, activations="attention", disk_state="auto")
    L = 32
    assert plan.fits and plan.spec.save_attention == tuple(range(L))
    assert plan.host_node_total <= plan.host_limit and plan.gpu_total <= plan.gpu_limit
    moments = [k for k, f in plan.disk.items() if "exp_avg" in f]
    assert 0 < len(moments) < L + 2 and not any("master" in f for f in plan.disk.values())
    assert list(plan.spec.disk) == ["head", *(f"layer.{i}" for i in range(L - 1, L - len(moments), -1))]
    n_off = len(plan.spec.offload)
    per_ck = plan.host["offloaded_activations"] // n_off
    # more checkpoints offloaded than the host holds without the folder ...
    without = _plan("llama-8b-256k", 262144, activations="attention")
    assert n_off > len(without.spec.offload)
    # ... and only as many as the GPU needs: one fewer would not fit it
    assert plan.gpu_total + per_ck > plan.gpu_limit


def test_moments_on_disk_leave_room_for_more_saved_outputs_and_auto_alone_moves_nothing():
    base = _plan("llama-8b-256k", 262144)
    auto = _plan("llama-8b-256k", 262144, disk_state="auto")
    assert auto.disk == {} and auto.spec.save_attention == base.spec.save_attention  # no disk traffic unasked
    moments = _plan("llama-8b-256k", 262144, disk_state="moments")
    assert moments.fits and len(moments.spec.disk) == 34
    assert len(moments.spec.save_attention) > len(base.spec.save_attention)
    assert len(moments.spec.offload) > len(base.spec.offload)
    assert moments.host_node_total <= moments.host_limit and moments.gpu_total <= moments.gpu_limit


def test_the_cli_refuses_attention_with_spaced_checkpoints(tmp_path, capsys):
    model, data = tmp_path / "model", tmp_path / "data.jsonl"
    make_checkpoint(model, layers=2, seed=1)
    make_data(data, seed=2)
    capsys.readouterr()
    rc = main(["train", "--model", str(model), "--data", str(data), "--steps", "1", "--batch-size", "2",
               "--micro-batch-size", "1", "--seq-len", "12", "--device", "cpu", "--activations", "attention",
               "--activation-checkpoint-every", "2", "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and "--activation-checkpoint-every 1" in err[0]
    assert not (tmp_path / "out").exists()


# ---- on a GPU (skipped without CUDA; run on the H200 with docs/bench/h200.sh tests) ---------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused kernels run on a GPU")
#: torch warns once per new thread that it makes the primary CUDA context current: harmless
quiet_cublas = pytest.mark.filterwarnings("ignore:Attempting to run cuBLAS")


def _rel(a, b) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm())


@needs_cuda
@quiet_cublas
@pytest.mark.parametrize("backend, kernel", [("auto", "cudnn"), ("flash", "flash")])
def test_gpu_kernels_are_kept_and_replayed(backend, kernel):
    """In bf16, GQA with head size 128 at 2,048 tokens: each backend's kernel keeps its output,
    the rebuild runs no attention, and the gradients are those of a plain rebuild (the fused
    backward accumulates in its own order: equal up to bf16 rounding)."""
    from flowtrain.model.attention import attention_backends

    cfg = small_cfg(hidden_size=1024, intermediate_size=2048, num_heads=8, num_kv_heads=2)
    lay = model_flat_maps(cfg)[1]
    gen = torch.Generator().manual_seed(5)
    flat = (torch.randn(lay.numel, generator=gen) * 0.02).to("cuda", torch.bfloat16)
    x = torch.randn(2, 2048, cfg.hidden_size, generator=gen).to("cuda", torch.bfloat16)
    dy = torch.randn(2, 2048, cfg.hidden_size, generator=gen).to("cuda", torch.bfloat16)
    cos, sin = rope_tables(cfg, 2048, "cuda", torch.bfloat16)

    def rebuild(record):
        with attention_backends(backend, "cuda"):
            with torch.no_grad(), sa.recording(record):
                y0 = decoder_layer(x, bind(flat, lay), cos, sin, cfg)
            kept = record is not None and record.kernel
            xx, ff = x.clone().requires_grad_(True), flat.clone().requires_grad_(True)
            with torch.enable_grad(), sa.replaying(record):
                y = decoder_layer(xx, bind(ff, lay), cos, sin, cfg)
                dx, dw = torch.autograd.grad(y, (xx, ff), dy)
        return kept, (y0, y, dx, dw)

    _, plain = rebuild(None)
    record = sa.AttentionRecord()
    with mock.patch.object(sa, "_plain", side_effect=AssertionError("attention ran again")):
        kept, saved = rebuild(record)
    assert kept == kernel and not record.kept
    for a, b in zip(plain, saved):
        assert _rel(a, b) < 1e-2


@needs_cuda
@quiet_cublas
@pytest.mark.filterwarnings("ignore")  # inductor and its dependencies warn while compiling
def test_gpu_training_with_saved_attention_matches_recompute(tmp_path):
    """A bf16 run with the compiled layer and every layer's attention saved trains what the
    recomputing run trains (bf16 rounding apart), and did keep attention outputs."""
    from safetensors.torch import load_file

    from flowtrain.train.run import TrainConfig, train

    def run(name, activations):
        out = tmp_path / name
        cfg = TrainConfig(model="tiny", steps=4, batch_size=4, micro_batch_size=2, seq_len=256, device="cuda",
                          precision="bf16", out=str(out), progress=False, compile="inductor", resident="none",
                          activations=activations)
        metrics = train(cfg)
        return load_file(out / "model.safetensors"), metrics

    recomputed, _ = run("recompute", "recompute")
    kernels = []
    real = sa._forward
    with mock.patch.object(sa, "_forward", side_effect=lambda *a, **k: kernels.append(a[0]) or real(*a, **k)):
        saved, metrics = run("attention", "attention")
    assert kernels and set(kernels) <= {"cudnn", "flash"}
    assert metrics[-1].loss < metrics[0].loss
    for name, ref in recomputed.items():
        assert _rel(saved[name].float(), ref.float()) < 2e-2, name
