"""LoRA on a mixture of experts' router and stacked experts against PEFT over transformers 5,
fp32 on the CPU: the same logits and adapter gradients, a folder flowtrain writes loads in
PEFT as the model flowtrain ran, PEFT's folders read back, the merge as PEFT's; and the grouped
experts with adapters (the GPU's path, run here on the CPU) against the loop."""

from __future__ import annotations

import json

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from model_helpers import rel_err
from test_lora import _logits
from test_moe import SHAPE

from flowtrain.ckpt.adapter_files import ADAPTER_CONFIG, read_adapter, read_spec, save_adapter
from flowtrain.ckpt.hf import load_into
from flowtrain.errors import CheckpointError
from flowtrain.model import bind, model_flat_maps, read_config
from flowtrain.model.adapters import LoraSpec, adapter_flat_maps
from flowtrain.model.lora import merge_adapter
from flowtrain.model.moe import ExpertAdapters, Routing, experts_grouped, experts_loop

pytestmark = [pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
              pytest.mark.filterwarnings("ignore:.*_pattern keys did not match:RuntimeWarning")]

MODELS = {
    "qwen3-moe": dict(model_type="qwen3_moe", head_dim=8, num_experts=5, num_experts_per_tok=2,
                      moe_intermediate_size=16, norm_topk_prob=True, mlp_only_layers=[1]),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, rope_theta=10000.0,
                    tie_word_embeddings=True),
}
#: (target_modules, target_parameters, the spec flowtrain reads from them)
ADAPTERS = {
    "all-linear": ("all-linear", None, dict(targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj", "router"))),
    "experts named": (["q_proj"], ["gate_up_proj", "down_proj"],
                      dict(targets=("q_proj", "gate_proj", "up_proj", "down_proj"), fused_rank=2)),
    "down and router": (["v_proj"], ["down_proj", "gate.weight"], dict(targets=("v_proj", "down_proj", "router"))),
}


def _model(tmp_path, name, seed=0):
    """A random transformers model of ``name``, saved, and flowtrain's buffers of it."""
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(**{**SHAPE, **MODELS[name]})
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape) if n.endswith("norm.weight") else 0.3 * torch.randn(p.shape))
    model.save_pretrained(tmp_path / "base")
    cfg = read_config(tmp_path / "base")
    flats = [torch.zeros(lay.numel) for lay in model_flat_maps(cfg)]
    load_into(tmp_path / "base", cfg, model_flat_maps(cfg), flats)
    return model.eval(), cfg, flats


def _peft(model, adapter: str, seed=1):
    modules, parameters, _ = ADAPTERS[adapter]
    config = peft.LoraConfig(r=2, lora_alpha=6.0, target_modules=modules, target_parameters=parameters,
                             lora_dropout=0.0, init_lora_weights=False)
    torch.manual_seed(seed)
    wrapped = peft.get_peft_model(model, config)
    with torch.no_grad():  # B too: PEFT's ParamWrapper starts it at zero even so
        for n, p in wrapped.named_parameters():
            if "lora_" in n:
                p.copy_(0.3 * torch.randn(p.shape))
    return wrapped


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("adapter", list(ADAPTERS))
def test_logits_gradients_and_files_match_peft(tmp_path, name, adapter):
    """PEFT's adapter, saved and read by flowtrain: the spec PEFT's names mean, the same logits
    and adapter gradients; written back by flowtrain, PEFT loads it as the same model."""
    model, cfg, base = _model(tmp_path, name)
    wrapped = _peft(model, adapter)
    wrapped.save_pretrained(tmp_path / "peft")
    spec, layouts, adapters = read_adapter(tmp_path / "peft", cfg)
    want = LoraSpec(rank=2, alpha=6.0, **ADAPTERS[adapter][2])
    assert (spec.rank, spec.alpha, spec.targets, spec.gate_up_rank) == (2, 6.0, want.targets, want.gate_up_rank)
    adapters = [a.requires_grad_(True) for a in adapters]
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(2))
    probe = torch.randn(2, 10, 64, generator=torch.Generator().manual_seed(3))

    want = wrapped(input_ids=ids).logits
    (want * probe).sum().backward()
    got = _logits(cfg, spec, base, adapters, ids)
    (got * probe).sum().backward()
    assert rel_err(got.detach(), want.detach()) < 1e-5
    params = dict(wrapped.named_parameters())
    for lay, flat in zip(layouts, adapters):
        grads = bind(flat.grad, lay)
        for e in lay.entries:
            name_ = e.name.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")
            assert rel_err(grads[e.key], params[name_].grad) < 1e-4, e.name  # fp32 sums in another order

    save_adapter(tmp_path / "ours", spec, layouts, [a.detach() for a in adapters])
    fresh = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager")
    loaded = peft.PeftModel.from_pretrained(fresh, tmp_path / "ours")
    assert set(loaded.peft_config["default"].target_parameters or []) == set(wrapped.peft_config["default"].target_parameters or [])
    with torch.no_grad():
        assert rel_err(loaded(input_ids=ids).logits, want.detach()) < 1e-5


@pytest.mark.parametrize("name", list(MODELS))
def test_merge_matches_peft_merge_and_unload(tmp_path, name):
    model, cfg, base = _model(tmp_path, name, seed=4)
    wrapped = _peft(model, "all-linear", seed=5)
    wrapped.save_pretrained(tmp_path / "peft")
    spec, layouts, adapters = read_adapter(tmp_path / "peft", cfg)
    for flat, lay, a, a_lay in zip(base[1:-1], model_flat_maps(cfg)[1:-1], adapters, layouts):
        merge_adapter(flat, lay, a, a_lay, spec.scale)
    empty = LoraSpec(rank=1, alpha=1.0, targets=("q_proj",))
    zero = [torch.zeros(lay.numel) for lay in adapter_flat_maps(cfg, empty)]
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = wrapped.merge_and_unload()(input_ids=ids).logits
        assert rel_err(_logits(cfg, empty, base, zero, ids), want) < 1e-5


def _routing(tokens: int, experts: int, k: int, gen) -> Routing:
    logits = torch.randn(tokens, experts, generator=gen)
    probs = torch.softmax(logits, -1)
    top, chosen = torch.topk(probs, k, dim=-1)
    return Routing(logits=logits, probs=probs, experts=chosen, weights=top / top.sum(-1, keepdim=True))


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("which, r", [("both", 8), ("gate_up", 8), ("down", 8), ("both", 3)])
def test_grouped_experts_with_adapters_match_the_loop(device, dtype, tol, which, r):
    """The grouped path's adapters (two more grouped GEMMs per projection, the GPU's) against the
    loop's, forward and every gradient, with an expert no token reaches; a rank whose rows span
    no multiple of 16 bytes runs padded with zeros in the grouped path."""
    if device == "cuda" and dtype == torch.float32:
        pytest.skip("torch's grouped GEMM on CUDA is bf16 only")
    gen = torch.Generator().manual_seed(0)
    e, h, inter, tokens = 4, 32, 16, 24
    x = torch.randn(tokens, h, generator=gen).to(device, dtype).requires_grad_(True)
    route = Routing(**{k: v.to(device) for k, v in vars(_routing(tokens, e - 1, 2, gen)).items()})  # expert e-1 idle
    weights = [(0.2 * torch.randn(s, generator=gen)).to(device, dtype)
               for s in ((e, inter, h), (e, inter, h), (e, h, inter))]
    raw = {"experts_gate_up.lora_A": torch.randn(e * 2 * r, h, generator=gen),
           "experts_gate_up.lora_B": torch.randn(2 * inter, e * 2 * r, generator=gen),
           "experts_down.lora_A": torch.randn(e * r, inter, generator=gen),
           "experts_down.lora_B": torch.randn(h, e * r, generator=gen)}
    raw = {k: (0.2 * v).to(device).requires_grad_(True) for k, v in raw.items()
           if which == "both" or k.startswith(f"experts_{which}")}
    probe = torch.randn(tokens, h, generator=gen).to(device)

    def run(fn, align=1):
        for t in (x, *raw.values()):
            t.grad = None
        lora = ExpertAdapters.of({**raw, "lora_scale": torch.tensor(1.5, device=device)}, e, dtype)
        assert lora is not None
        lora = lora.padded(align)
        assert all(p[0].shape[1] % align == 0 for p in (lora.gate_up, lora.down) if p is not None)
        out = fn(x, route, *weights, lora)
        (out.float() * probe).sum().backward()
        return out.detach().float(), [t.grad.float().clone() for t in (x, *raw.values())]

    (loop, loop_grads), (grouped, grouped_grads) = run(experts_loop), run(experts_grouped, 16 // x.element_size())
    assert rel_err(grouped, loop) < tol
    for a, b in zip(grouped_grads, loop_grads):
        assert rel_err(a, b) < tol
    idle = [g for k, g in zip(raw, loop_grads[1:]) if k.endswith("lora_A")]
    rank = 2 * r if which != "down" else r
    assert float(idle[0].view(e, rank, -1)[e - 1].abs().max()) == 0  # no token, no gradient for its A


def _write(tmp_path, config):
    from flowtrain.ckpt.adapter_files import ADAPTER_WEIGHTS

    tmp_path.mkdir(exist_ok=True)
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4, **config}))
    (tmp_path / ADAPTER_WEIGHTS).write_bytes(b"")
    return tmp_path


@pytest.mark.parametrize("config, says", [
    (dict(target_modules=["q_proj"], target_parameters=["gate_up_proj"], rank_pattern={r".*\.gate_up_proj": 4}),
     "a scale other than the other adapters'"),
    (dict(target_modules=["q_proj"], rank_pattern={"q_proj": 8}), "per-map ranks and alphas"),
    (dict(target_modules=["q_proj"], target_parameters=["experts.w13"]), "target_parameters 'experts.w13'"),
    (dict(target_modules=["q_proj", "gate_proj"]), "gate_proj and up_proj are one stacked weight"),
    (dict(target_modules=["q_proj", "down_proj"], lora_dropout=0.1), "LoRA dropout does not apply"),
    (dict(target_modules=["q_proj"], exclude_modules=["k_proj"]), "over a mixture of experts is a PEFT setting flowtrain does not run"),
])
def test_moe_adapters_flowtrain_cannot_run_are_refused(tmp_path, config, says):
    cfg = read_config_of(tmp_path)
    with pytest.raises(CheckpointError, match=says):
        read_spec(_write(tmp_path / "adapter", config), cfg)


def read_config_of(tmp_path):
    _, cfg, _ = _model(tmp_path, "qwen3-moe")
    return cfg


def test_a_folder_with_dense_layer_mlp_adapters_is_refused_saying_why(tmp_path):
    """PEFT 0.22's all-linear also adapts the MLP of a mixture of experts' layer without experts
    (here layer 1), which flowtrain does not run: such a folder is refused in one error that names
    the layer and the PEFT version, where a plain extra tensor gets no such reason."""
    from safetensors.torch import load_file, save_file

    model, cfg, _ = _model(tmp_path, "qwen3-moe")
    _peft(model, "all-linear").save_pretrained(tmp_path / "peft")
    weights = tmp_path / "peft" / "adapter_model.safetensors"
    tensors = load_file(weights)
    assert not any(".layers.1.mlp." in n for n in tensors)  # the layout flowtrain runs
    dense = "base_model.model.model.layers.1.mlp.down_proj"
    save_file({**tensors, f"{dense}.lora_A.weight": torch.zeros(2, 48), f"{dense}.lora_B.weight": torch.zeros(32, 2)},
              str(weights))
    with pytest.raises(CheckpointError, match=r"the first .*layers\.1\.mlp\.down_proj\.lora_A.* MLP of layer 1, "
                                              r"a layer without experts, as PEFT 0\.22's all-linear"):
        read_adapter(tmp_path / "peft", cfg)
    save_file({**tensors, "base_model.model.model.layers.0.self_attn.q_proj.extra.weight": torch.zeros(1)}, str(weights))
    with pytest.raises(CheckpointError, match="has no place for") as refused:
        read_adapter(tmp_path / "peft", cfg)
    assert "PEFT 0.22" not in str(refused.value)
