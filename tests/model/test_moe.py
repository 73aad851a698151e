"""Mixture-of-experts families (Qwen3-MoE, Mixtral) against transformers' own modules, fp32 on
the CPU: routing, the experts (the loop and the grouped GEMM path), whole-model logits read from
a checkpoint that ``save_pretrained`` wrote (the Hub's one tensor per expert) or from the fused
form transformers 5 keeps in memory, and flowtrain's saved checkpoint loaded back by transformers.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from model_helpers import rel_err
from safetensors.torch import save_file

from flowtrain.ckpt.hf import load_into, save_hf
from flowtrain.model import bind, model_flat_maps, read_config
from flowtrain.model.config import ModelConfig
from flowtrain.model.presets import PRESETS
from flowtrain.model.functional import decoder_layer, embed, rms_norm, rope_tables
from flowtrain.model.moe import experts_grouped, experts_loop, route
from flowtrain.model.hf_config import from_hf, to_hf

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
CONFIGS = {
    "qwen3-moe": dict(model_type="qwen3_moe", head_dim=8, num_experts=6, num_experts_per_tok=2,
                      moe_intermediate_size=16, norm_topk_prob=False, mlp_only_layers=[1]),
    "qwen3-moe-norm-step": dict(model_type="qwen3_moe", head_dim=8, num_experts=5, num_experts_per_tok=3,
                                moe_intermediate_size=16, norm_topk_prob=True, decoder_sparse_step=2),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, rope_theta=10000.0),
}


def _hf(name, seed=0, **over):
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(**{**SHAPE, **CONFIGS[name], **over})
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # every weight random, norms around one, so nothing hides
        for n, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape) if n.endswith("norm.weight") else 0.3 * torch.randn(p.shape))
    return model.eval()


def _logits(cfg: ModelConfig, flats, ids):
    layouts = model_flat_maps(cfg)
    cos, sin = rope_tables(cfg, ids.shape[1])
    x = embed(ids, bind(flats[0], layouts[0])["embed_tokens"])
    for lay, flat in zip(layouts[1:-1], flats[1:-1]):
        x = decoder_layer(x, bind(flat, lay), cos, sin, cfg)
    head = bind(flats[-1], layouts[-1])
    w = head["lm_head"] if "lm_head" in head else bind(flats[0], layouts[0])["embed_tokens"]
    return rms_norm(x, head["norm"], cfg.rms_norm_eps) @ w.T


def _load(path):
    cfg = read_config(path)
    layouts = model_flat_maps(cfg)
    flats = [torch.zeros(lay.numel) for lay in layouts]
    load_into(path, cfg, layouts, flats)
    return cfg, flats


# ---------------------------------------------------------------------- routing and experts


@pytest.mark.parametrize("name, norm", [("qwen3-moe", False), ("qwen3-moe", True), ("mixtral", True)])
def test_routing_matches_transformers_router(name, norm):
    model = _hf(name, norm_topk_prob=norm) if name != "mixtral" else _hf(name)
    cfg = from_hf(model.config.to_dict() | {"architectures": [type(model).__name__]})
    assert cfg.norm_topk_prob == norm
    gate = model.model.layers[0].mlp.gate
    h = torch.randn(2, 7, 32)
    logits, weights, experts = gate(h)
    r = route(h, gate.weight.detach(), cfg)
    assert torch.equal(r.experts, experts)
    torch.testing.assert_close(r.weights, weights, rtol=0, atol=0)
    torch.testing.assert_close(r.logits, logits, rtol=0, atol=0)
    if norm:
        torch.testing.assert_close(r.weights.sum(-1), torch.ones(14))
    else:  # the raw top-k probabilities: less than one in all
        assert float(r.weights.sum(-1).max()) < 1


@pytest.mark.parametrize("name", ["qwen3-moe", "mixtral"])
def test_experts_match_transformers_block(name):
    model = _hf(name, seed=1)
    cfg = from_hf(model.config.to_dict() | {"architectures": [type(model).__name__]})
    block = model.model.layers[0].mlp
    h = torch.randn(3, 5, 32)
    with torch.no_grad():
        want = block(h).reshape(-1, 32)
        r = route(h, block.gate.weight, cfg)
        gu = block.experts.gate_up_proj
        inter = gu.shape[1] // 2
        gate, up, down = gu[:, :inter], gu[:, inter:], block.experts.down_proj
        loop = experts_loop(h.reshape(-1, 32), r, gate, up, down)
        grouped = experts_grouped(h.reshape(-1, 32), r, gate.contiguous(), up.contiguous(), down)
    assert rel_err(loop, want) < 1e-6
    assert rel_err(grouped, loop) < 1e-6  # the CUDA path's sums, run here by torch's CPU kernel


def test_grouped_experts_gradients_match_the_loop():
    """Both paths under autograd: the same input and weight gradients (fp32, CPU)."""
    cfg = PRESETS["mixtral-4l"]
    torch.manual_seed(0)
    x = torch.randn(9, 16)
    router_w = torch.randn(8, 16)
    ws = [torch.randn(8, 12, 16), torch.randn(8, 12, 16), torch.randn(8, 16, 12)]
    grads = []
    for run in (experts_loop, experts_grouped):
        leaves = [t.clone().requires_grad_(True) for t in (x, router_w, *ws)]
        r = route(leaves[0], leaves[1], cfg)
        y = run(leaves[0], r, *leaves[2:])
        grads.append(torch.autograd.grad(y, leaves, torch.randn(9, 16, generator=torch.Generator().manual_seed(1))))
    for a, b in zip(*grads):
        assert rel_err(a, b) < 1e-6


# dynamo instantiates a custom autograd.Function while tracing it, which torch itself deprecates
@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")
def test_grouped_experts_trace_as_one_graph():
    """Routing and the grouped experts compile whole (inductor then fuses their elementwise work
    and differentiates them as one graph): no data-dependent shape, no graph break. bf16, the
    dtype the grouped GEMM takes."""
    cfg = PRESETS["qwen3-moe-12l"]
    bf16 = torch.bfloat16
    x, router_w = torch.randn(24, 32, dtype=bf16), torch.randn(cfg.num_experts, 32, dtype=bf16)
    ws = [torch.randn(cfg.num_experts, 16, 32, dtype=bf16), torch.randn(cfg.num_experts, 16, 32, dtype=bf16),
          torch.randn(cfg.num_experts, 32, 16, dtype=bf16)]

    def layer(x, router_w, gate, up, down):
        return experts_grouped(x, route(x, router_w, cfg), gate, up, down)

    explained = torch._dynamo.explain(layer)(x, router_w, *ws)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


# ---------------------------------------------------------------------- whole models, checkpoints


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers_from_hub_checkpoint(tmp_path, name):
    model = _hf(name, seed=2)
    model.save_pretrained(tmp_path)
    names = json.loads((tmp_path / "config.json").read_text())
    cfg, flats = _load(tmp_path)
    assert cfg.moe and cfg.num_experts == model.config.num_experts
    if name == "qwen3-moe":  # layer 1 is dense: mlp_only_layers
        assert [cfg.layer_sparse(i) for i in range(3)] == [True, False, True] and names["mlp_only_layers"] == [1]
    if name == "qwen3-moe-norm-step":  # decoder_sparse_step 2: only layer 1 has experts
        assert cfg.sparse_layers() == [1]
    ids = torch.randint(0, 64, (2, 11))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = _logits(cfg, flats, ids)
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("name", ["qwen3-moe", "mixtral"])
def test_reads_the_fused_in_memory_form(tmp_path, name):
    """A checkpoint written from transformers 5's state dict as it is in memory (experts fused
    as gate_up_proj and down_proj, Mixtral's block named mlp) loads to the same weights."""
    model = _hf(name, seed=3)
    model.save_pretrained(tmp_path / "hub")
    (tmp_path / "fused").mkdir()
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "hub" / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "fused" / "model.safetensors")
    _, hub = _load(tmp_path / "hub")
    _, fused = _load(tmp_path / "fused")
    assert all(torch.equal(a, b) for a, b in zip(hub, fused))


@pytest.mark.parametrize("name", ["qwen3-moe", "mixtral"])
@pytest.mark.parametrize("tied", [False, True])
def test_saved_checkpoint_loads_in_transformers(tmp_path, name, tied):
    model = _hf(name, seed=4, tie_word_embeddings=tied)
    model.save_pretrained(tmp_path / "in")
    cfg, flats = _load(tmp_path / "in")
    save_hf(tmp_path / "out", cfg, model_flat_maps(cfg), flats)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    with safe_open(str(tmp_path / "in" / "model.safetensors"), "pt") as f:
        assert saved == set(f.keys())  # the Hub's names, as save_pretrained writes them
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        assert rel_err(back(input_ids=ids).logits, model(input_ids=ids).logits) < 1e-6
    assert read_config(tmp_path / "out") == cfg


# ---------------------------------------------------------------------- configs and presets


def test_presets_have_the_published_sizes():
    """Qwen3-30B-A3B: 30.5B parameters, 3.3B active; Qwen3-235B-A22B: 235.1B, 22.2B;
    Mixtral-8x7B: 46.7B, 12.9B active."""
    sizes = {name: (PRESETS[name].num_parameters(), PRESETS[name].active_parameters())
             for name in ("qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b")}
    assert round(sizes["qwen3-235b-a22b"][0] / 1e9, 1) == 235.1 and round(sizes["qwen3-235b-a22b"][1] / 1e9, 1) == 22.2
    assert round(sizes["qwen3-30b-a3b"][0] / 1e9, 1) == 30.5 and round(sizes["qwen3-30b-a3b"][1] / 1e9, 1) == 3.4
    assert round(sizes["mixtral-8x7b"][0] / 1e9, 1) == 46.7 and round(sizes["mixtral-8x7b"][1] / 1e9, 1) == 12.9
    for name in ("qwen3-30b-a3b", "qwen3-235b-a22b", "qwen3-moe-12l", "mixtral-8x7b", "mixtral-4l"):
        cfg = PRESETS[name]
        assert from_hf(to_hf(cfg)) == cfg
        assert sum(lay.numel for lay in model_flat_maps(cfg)) >= cfg.num_parameters()
    assert PRESETS["qwen3-moe-12l"].num_layers == 12 and PRESETS["mixtral-4l"].num_layers == 4


def test_model_flops_count_what_a_token_multiplies_by():
    """6 N_matmul + 6 L (heads x head_dim) S per token, as MFU counts them: N_matmul every weight
    but the input embedding (a lookup), the active ones of a mixture of experts; a tied matrix
    counts once, as the head. The attention term is the query heads' width, not the hidden size."""
    from flowtrain.model.counts import model_flops_per_token

    dense = PRESETS["llama-8b"]  # untied: a 128,256 x 4,096 embedding and head
    n = sum(e.numel for lay in model_flat_maps(dense) for e in lay.entries)
    assert model_flops_per_token(dense, 4096) == 6.0 * (n - 128256 * 4096) + 6.0 * 32 * (32 * 128) * 4096
    tied = PRESETS["gemma3-1b"]  # one matrix, counted as the head; 4 heads of 256 over a hidden size of 1,152
    n = sum(e.numel for lay in model_flat_maps(tied) for e in lay.entries)
    assert tied.tie_word_embeddings and model_flops_per_token(tied, 4096) == 6.0 * n + 6.0 * 26 * (4 * 256) * 4096
    moe = PRESETS["qwen3-30b-a3b"]  # 32 heads of 128 over a hidden size of 2,048
    inactive = 48 * (128 - 8) * 3 * 2048 * 768
    assert moe.active_parameters() == moe.num_parameters() - inactive
    assert model_flops_per_token(moe, 4096) == (6.0 * (moe.num_parameters() - inactive - 151936 * 2048)
                                                + 6.0 * 48 * (32 * 128) * 4096)


def test_dense_families_refuse_expert_fields():
    from flowtrain.errors import ConfigError

    with pytest.raises(ConfigError, match="has no experts"):
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2,
                    num_kv_heads=2, num_experts=4).validate()
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        PRESETS["mixtral-4l"].__class__(**{**{f: getattr(PRESETS["mixtral-4l"], f)
                                               for f in PRESETS["mixtral-4l"].__struct_fields__},
                                            "num_experts_per_tok": 9}).validate()
