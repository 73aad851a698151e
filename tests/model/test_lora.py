"""LoRA adapters in the layer math against PEFT over transformers, fp32 on the CPU: the same
logits and the same adapter gradients from the same weights, and the adapters' layouts named as
PEFT names its tensors."""

from __future__ import annotations

import json

import pytest
import torch

peft = pytest.importorskip("peft")

from model_helpers import flats_from_hf, hf_model, rel_err, small_cfg

from flowtrain.model import bind, model_flat_maps, preset
from flowtrain.model.adapters import DEFAULT_TARGETS, LoraSpec, adapter_flat_maps
from flowtrain.model.functional import decoder_layer, embed, rms_norm, rope_tables
from flowtrain.model.lora import adapted, init_adapter

#: PEFT asks transformers for a property that transformers 5 renamed
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

CASES = {
    "llama": dict(),
    "qwen2 (q, k, v biases)": dict(architecture="Qwen2ForCausalLM", qkv_bias=True),
}


def _cfg(name):
    return small_cfg(num_layers=2, **CASES[name])


def _peft_model(cfg, spec: LoraSpec, seed: int):
    """flowtrain buffers of a random transformers model, and the model with PEFT's adapters on
    ``spec.targets``, every adapter weight random (``init_lora_weights=False``: B is not zero,
    so the update shows)."""
    base = hf_model(cfg, seed=seed)
    flats = flats_from_hf(base, cfg)  # before PEFT wraps the linear maps (and renames their weights)
    config = peft.LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets),
                             lora_dropout=0.0, init_lora_weights=False)
    torch.manual_seed(seed + 1)
    return flats, peft.get_peft_model(base, config)


def _adapter_flats(model, cfg, spec):
    """flowtrain adapter buffers holding ``model``'s adapters, copied by PEFT's saved names."""
    state = {k.replace(".default.", "."): v for k, v in model.state_dict().items() if "lora_" in k}
    flats = []
    for lay in adapter_flat_maps(cfg, spec):
        flat = torch.zeros(lay.numel)
        views = bind(flat, lay)
        for e in lay.entries:
            views[e.key].copy_(state.pop(e.name))
        flats.append(flat)
    assert not state, f"PEFT tensors flowtrain has no place for: {sorted(state)[:3]}"
    return flats


def _logits(cfg, spec, base_flats, adapter_flats, ids):
    layouts = model_flat_maps(cfg)
    cos, sin = rope_tables(cfg, ids.shape[1])
    x = embed(ids, bind(base_flats[0], layouts[0])["embed_tokens"])
    for lay, flat, a_lay, a_flat in zip(layouts[1:-1], base_flats[1:-1], adapter_flat_maps(cfg, spec), adapter_flats):
        x = decoder_layer(x, adapted(bind(flat, lay), bind(a_flat, a_lay), spec.scale), cos, sin, cfg)
    head = bind(base_flats[-1], layouts[-1])
    w = head["lm_head"] if "lm_head" in head else bind(base_flats[0], layouts[0])["embed_tokens"]  # tied
    return rms_norm(x, head["norm"], cfg.rms_norm_eps) @ w.T


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("targets", [DEFAULT_TARGETS, ("q_proj", "v_proj")], ids=["all linear", "q and v"])
def test_logits_and_adapter_gradients_match_peft(name, targets):
    cfg, spec = _cfg(name), LoraSpec(rank=4, alpha=8.0, targets=targets)
    base_flats, model = _peft_model(cfg, spec, seed=3)
    adapters = [f.requires_grad_(True) for f in _adapter_flats(model, cfg, spec)]
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
    probe = torch.randn(2, 12, cfg.vocab_size, generator=torch.Generator().manual_seed(5))

    want = model(input_ids=ids).logits
    (want * probe).sum().backward()
    got = _logits(cfg, spec, base_flats, adapters, ids)
    (got * probe).sum().backward()

    assert rel_err(got.detach(), want.detach()) < 1e-5
    params = dict(model.named_parameters())
    for lay, flat in zip(adapter_flat_maps(cfg, spec), adapters):
        grads = bind(flat.grad, lay)
        for e in lay.entries:
            peft_name = e.name.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")
            assert rel_err(grads[e.key], params[peft_name].grad) < 1e-5, e.name
    assert all(not f.requires_grad for f in base_flats)  # the base takes no gradient


def test_a_fresh_adapter_leaves_the_base_model_as_it_was():
    cfg, spec = _cfg("llama"), LoraSpec(rank=8, alpha=16.0)
    base_flats = flats_from_hf(hf_model(cfg, seed=1), cfg)
    adapters = []
    for lay in adapter_flat_maps(cfg, spec):
        flat = torch.full((lay.numel,), 7.0)  # init overwrites everything, padding included
        init_adapter(flat, lay, seed=0)
        views = bind(flat, lay)
        for key, v in views.items():
            if key.endswith(".lora_B"):
                assert not v.any()
            else:  # Kaiming's uniform bound for a = sqrt(5): 1 / sqrt(fan_in)
                assert v.abs().max() <= v.shape[1] ** -0.5 and v.std() > 0.25 * v.shape[1] ** -0.5
        assert flat.sum() == sum(v.sum() for v in views.values())
        adapters.append(flat)
    ids = torch.randint(0, cfg.vocab_size, (1, 10), generator=torch.Generator().manual_seed(2))
    no_update = _logits(cfg, spec, base_flats, adapters, ids)
    layouts = model_flat_maps(cfg)
    cos, sin = rope_tables(cfg, 10)
    x = embed(ids, bind(base_flats[0], layouts[0])["embed_tokens"])
    for lay, flat in zip(layouts[1:-1], base_flats[1:-1]):
        x = decoder_layer(x, bind(flat, lay), cos, sin, cfg)
    head = bind(base_flats[-1], layouts[-1])
    assert torch.equal(no_update, rms_norm(x, head["norm"], cfg.rms_norm_eps) @ head["lm_head"].T)
    again = torch.empty(adapter_flat_maps(cfg, spec)[1].numel)
    init_adapter(again, adapter_flat_maps(cfg, spec)[1], seed=0)
    assert torch.equal(again, adapters[1])  # the same seed, the same adapter


def test_adapter_layouts_name_what_peft_saves():
    """Attention's adapters as linear maps'; in a layer with experts the router's (``mlp.gate``) and
    one adapter per expert of each stacked weight, PEFT's ``target_parameters`` layout, the
    gate-and-up adapter at twice the rank one ``base_layer`` deeper where ``down_proj`` wraps it."""
    cfg = preset("qwen3-moe-12l")
    e, h, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    spec = LoraSpec(rank=16, alpha=32.0)
    lay = adapter_flat_maps(cfg, spec)[0]
    assert lay.key == "adapter.0"
    assert lay.entry("q_proj.lora_A").name == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert lay.entry("o_proj.lora_B").shape == (cfg.hidden_size, 16)
    stem = "base_model.model.model.layers.0.mlp"
    assert [(x.key, x.name, x.shape) for x in lay.entries[8:]] == [
        ("router.lora_A", f"{stem}.gate.lora_A.weight", (16, h)),
        ("router.lora_B", f"{stem}.gate.lora_B.weight", (e, 16)),
        ("experts_gate_up.lora_A", f"{stem}.experts.base_layer.lora_A.weight", (e * 32, h)),
        ("experts_gate_up.lora_B", f"{stem}.experts.base_layer.lora_B.weight", (2 * inter, e * 32)),
        ("experts_down.lora_A", f"{stem}.experts.lora_A.weight", (e * 16, inter)),
        ("experts_down.lora_B", f"{stem}.experts.lora_B.weight", (h, e * 16))]
    alone = adapter_flat_maps(cfg, LoraSpec(rank=4, alpha=8.0, targets=("gate_proj", "up_proj"), fused_rank=4))[0]
    assert [(x.name, x.shape) for x in alone.entries] == [(f"{stem}.experts.lora_A.weight", (e * 4, h)),
                                                          (f"{stem}.experts.lora_B.weight", (2 * inter, e * 4))]
    dense = adapter_flat_maps(preset("llama-3b"), spec)[0]
    assert [x.key.split(".")[0] for x in dense.entries][::2] == [t for t in DEFAULT_TARGETS if t != "router"]


@pytest.mark.parametrize("bad, why", [
    (dict(rank=0), "rank"), (dict(targets=()), "target"), (dict(targets=("lm_head",)), "unknown LoRA target lm_head"),
    (dict(dropout=1.0), "dropout"),
])
def test_a_bad_spec_is_refused_naming_what(bad, why):
    with pytest.raises(ValueError, match=why):
        adapter_flat_maps(preset("tiny"), LoraSpec(**{"rank": 4, "alpha": 8.0, **bad}))


# ---------------------------------------------------------------------- PEFT's files


def test_an_adapter_flowtrain_saves_loads_in_peft_and_back(tmp_path):
    from flowtrain.ckpt.adapter_files import read_adapter, save_adapter

    cfg, spec = _cfg("llama"), LoraSpec(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"))
    base = hf_model(cfg, seed=6)
    base_flats = flats_from_hf(base, cfg)
    layouts = adapter_flat_maps(cfg, spec)
    gen = torch.Generator().manual_seed(7)
    adapters = [torch.randn(lay.numel, generator=gen) for lay in layouts]
    save_adapter(tmp_path / "adapter", spec, layouts, adapters, base_model="tests/tiny-llama")
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=gen)
    ours = _logits(cfg, spec, base_flats, adapters, ids)

    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    assert loaded.peft_config["default"].r == 4 and loaded.peft_config["default"].lora_alpha == 8.0
    assert rel_err(loaded(input_ids=ids).logits.detach(), ours.detach()) < 1e-5

    spec_back, layouts_back, flats_back = read_adapter(tmp_path / "adapter", cfg)
    assert spec_back == LoraSpec(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"))
    for lay, a, b in zip(layouts, adapters, flats_back):  # the entries, not the padding between them
        for key in bind(a, lay):
            assert torch.equal(bind(a, lay)[key], bind(b, lay)[key])


def test_an_adapter_peft_saves_reads_into_flowtrain(tmp_path):
    from flowtrain.ckpt.adapter_files import read_adapter

    cfg = _cfg("qwen2 (q, k, v biases)")
    base_flats, model = _peft_model(cfg, LoraSpec(rank=2, alpha=6.0), seed=8)
    model.save_pretrained(tmp_path / "peft")
    spec, _, flats = read_adapter(tmp_path / "peft", cfg)
    assert (spec.rank, spec.alpha, set(spec.targets)) == (2, 6.0, set(DEFAULT_TARGETS))
    ids = torch.randint(0, cfg.vocab_size, (1, 11), generator=torch.Generator().manual_seed(9))
    assert rel_err(_logits(cfg, spec, base_flats, flats, ids).detach(), model(input_ids=ids).logits.detach()) < 1e-5


@pytest.mark.parametrize("change, why", [
    (dict(use_dora=True), "use_dora = True is a PEFT setting flowtrain does not run"),
    (dict(rank_pattern={"q_proj": 8}), "rank_pattern"),
    (dict(peft_type="IA3"), "not a LoRA adapter"),
    # a string is a regular expression PEFT matches against a module's whole name
    (dict(target_modules="q_proj|v_proj"), "reaches none of the model's maps"),
    (dict(target_modules=r".*\.q_proj|lm_head"), "reaches lm_head"),
    (dict(target_modules=r".*(proj|embed_tokens)"), "reaches model.embed_tokens"),
    (dict(target_modules="(q_proj"), "is no regular expression"),
    # full module names, as PEFT saves all-linear over a model of fewer than 20 maps
    (dict(target_modules=["model.layers.0.self_attn.q_proj"]), "adapt q_proj in layers 0 of the model's 2"),
    (dict(target_modules=["model.layers.0.self_attn.gate_proj", "model.layers.1.self_attn.gate_proj"]),
     "flowtrain adapts q_proj"),
    (dict(target_modules=["q_proj", "model.norm"]), "target_modules 'model.norm'"),
    (dict(target_modules=["q_proj", "lm_head"]), "unknown LoRA target lm_head"),
    (dict(r=0), "rank must be at least 1"),
    (dict(layers_to_transform=0), "layers_to_transform adapts layers 0 of the model's 2"),
    (dict(layers_to_transform=[0, 1], layers_pattern="blocks"), "layers_pattern 'blocks'"),
    (dict(exclude_modules=r"model\.layers\.0\..*"), "adapt q_proj in layers 1 of the model's 2"),
    (dict(exclude_modules=list(DEFAULT_TARGETS)), "leaves none of the targets"),
    (dict(exclude_modules="(q_proj"), "is no regular expression"),
    (dict(lora_bias=True), "lora_bias"),
    (dict(alora_invocation_tokens=[5, 6]), "alora_invocation_tokens"),
    (dict(bias="all"), "bias = 'all'"),
])
def test_an_adapter_flowtrain_cannot_run_is_refused_naming_the_setting(tmp_path, change, why):
    from flowtrain.ckpt.adapter_files import ADAPTER_CONFIG, read_adapter, save_adapter
    from flowtrain.errors import CheckpointError

    cfg, spec = _cfg("llama"), LoraSpec(rank=4, alpha=8.0)
    layouts = adapter_flat_maps(cfg, spec)
    save_adapter(tmp_path, spec, layouts, [torch.zeros(lay.numel) for lay in layouts])
    config = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps({**config, **change}))
    with pytest.raises(CheckpointError, match=why):
        read_adapter(tmp_path, cfg)


@pytest.mark.parametrize("modules, targets", [
    ([f"model.layers.{i}.{m}" for i in (1, 0) for m in ("mlp.down_proj", "self_attn.q_proj")], ("q_proj", "down_proj")),
    (r".*\.(q_proj|v_proj)", ("q_proj", "v_proj")),
    (r"model\.layers\.\d+\.mlp\..*", ("gate_proj", "up_proj", "down_proj")),
    (["o_proj", "model.layers.0.mlp.up_proj", "model.layers.1.mlp.up_proj"], ("o_proj", "up_proj")),
    ("ALL-LINEAR", DEFAULT_TARGETS),
])
def test_target_modules_by_full_name_or_pattern_read_as_peft_matches_them(tmp_path, modules, targets):
    """PEFT saves ``all-linear`` over a model of fewer than 20 maps as their full names, and a
    config may give a regular expression; where the maps reached are the same in every layer,
    they are flowtrain's targets."""
    from flowtrain.ckpt.adapter_files import ADAPTER_CONFIG, read_spec, save_adapter

    cfg, spec = _cfg("llama"), LoraSpec(rank=4, alpha=8.0)
    layouts = adapter_flat_maps(cfg, spec)
    save_adapter(tmp_path, spec, layouts, [torch.zeros(lay.numel) for lay in layouts])
    config = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps({**config, "target_modules": modules}))
    assert read_spec(tmp_path, cfg).targets == targets


@pytest.mark.parametrize("change, targets", [
    (dict(layers_to_transform=[1, 0]), DEFAULT_TARGETS[:-1]),  # every layer: as without it
    (dict(exclude_modules=["v_proj", "model.layers.0.mlp.up_proj", "model.layers.1.mlp.up_proj"]),
     ("q_proj", "k_proj", "o_proj", "gate_proj", "down_proj")),
    (dict(exclude_modules=r".*\.(q|k)_proj", layers_to_transform=None), ("v_proj", "o_proj", "gate_proj", "up_proj",
                                                                         "down_proj")),
])
def test_exclude_modules_and_every_layer_read_as_peft_applies_them(tmp_path, change, targets):
    """PEFT's ``exclude_modules`` takes maps out of the targets, and ``layers_to_transform``
    naming every layer leaves them as they are."""
    from flowtrain.ckpt.adapter_files import ADAPTER_CONFIG, read_spec, save_adapter

    cfg, spec = _cfg("llama"), LoraSpec(rank=4, alpha=8.0, targets=DEFAULT_TARGETS[:-1])
    layouts = adapter_flat_maps(cfg, spec)
    save_adapter(tmp_path, spec, layouts, [torch.zeros(lay.numel) for lay in layouts])
    config = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps({**config, **change}))
    assert read_spec(tmp_path, cfg).targets == targets


def test_an_adapter_of_another_model_is_refused(tmp_path):
    from flowtrain.ckpt.adapter_files import read_adapter, save_adapter
    from flowtrain.errors import CheckpointError

    spec = LoraSpec(rank=4, alpha=8.0)
    small, other = _cfg("llama"), small_cfg(num_layers=3)
    save_adapter(tmp_path, spec, adapter_flat_maps(small, spec), [torch.zeros(lay.numel) for lay in adapter_flat_maps(small, spec)])
    with pytest.raises(CheckpointError, match="tensors missing, the first base_model.model.model.layers.2"):
        read_adapter(tmp_path, other)
    with pytest.raises(CheckpointError, match="holds no adapter_config.json"):
        read_adapter(tmp_path / "nowhere", small)
