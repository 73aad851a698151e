"""The generic layer path trains families flowtrain has no layer math for like transformers + AdamW.

Each family (tests/train/generic_models.py) is saved by transformers, trained three steps by
``flowtrain train`` and by the reference of tests/train/test_train_vs_hf.py
(its own ``...ForCausalLM`` with ``torch.optim.AdamW``, fp32 on the CPU), and the model flowtrain
writes is loaded back with ``from_pretrained`` and compared tensor by tensor.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from generic_models import FAMILIES, make_family
from test_train_vs_hf import STEPS, assert_same_weights, make_data, reference_train, run_flowtrain

from flowtrain.model.hf_config import from_hf

@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_family_matches_transformers_adamw(tmp_path, arch):
    make_family(tmp_path / "model", arch)
    rows = make_data(tmp_path / "data.jsonl", vocab=64)
    ref = reference_train(make_family(None, arch), rows, lr=0.01, wd=0.1, betas=(0.9, 0.95), eps=1e-6)
    run_flowtrain(tmp_path / "model", tmp_path / "data.jsonl", tmp_path / "out")
    assert_same_weights(tmp_path / "out", ref)
    start = make_family(None, arch)
    moved = [float((p - start.get_parameter(n)).detach().norm()) for n, p in ref.named_parameters()]
    assert max(moved) > 1e-3 and STEPS == 3


def test_auto_runs_unknown_families_on_the_generic_path():
    cfg = from_hf(make_family(None, "Olmo2ForCausalLM").config.to_dict())
    assert cfg.layer_path == "generic" and cfg.num_layers == 4


def test_llama_native_and_generic_train_the_same_weights(tmp_path):
    """``--layer-path generic`` forced on a family with native layer math: the same model out."""
    transformers = pytest.importorskip("transformers")
    from test_train_vs_hf import make_checkpoint

    make_checkpoint(tmp_path / "model", tied=True, layers=2, seed=5)
    make_data(tmp_path / "data.jsonl", seed=6)
    run_flowtrain(tmp_path / "model", tmp_path / "data.jsonl", tmp_path / "native", "--layer-path", "native")
    run_flowtrain(tmp_path / "model", tmp_path / "data.jsonl", tmp_path / "generic", "--layer-path", "generic")
    native = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "native")
    generic = dict(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "generic").named_parameters())
    for name, p in native.named_parameters():
        err = float((p - generic[name]).detach().norm() / p.detach().norm())
        assert err < 1e-5, f"{name}: {err:.2e}"


def test_experts_stored_fused_load_too(tmp_path):
    """A checkpoint that keeps a layer's experts fused, under the names transformers uses in
    memory, trains like the Hub's one-tensor-per-expert form (Qwen3-Next saves the latter)."""
    import json

    from safetensors.torch import save_file

    model = make_family(None, "Qwen3NextForCausalLM")
    (tmp_path / "model").mkdir()
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, tmp_path / "model" / "model.safetensors")
    (tmp_path / "model" / "config.json").write_text(json.dumps(model.config.to_dict()))
    assert any(n.endswith("experts.gate_up_proj") for n, _ in model.named_parameters())
    rows = make_data(tmp_path / "data.jsonl", vocab=64)
    ref = reference_train(make_family(None, "Qwen3NextForCausalLM"), rows, lr=0.01, wd=0.1, betas=(0.9, 0.95), eps=1e-6)
    run_flowtrain(tmp_path / "model", tmp_path / "data.jsonl", tmp_path / "out")
    assert_same_weights(tmp_path / "out", ref)
