"""Adding a model family, as docs/concepts.md's checklist says: a family whose layer is one the
existing options describe is one :class:`~flowtrain.model.families.Family` row.

The toy family is Llama's layer under an architecture name transformers does not know. Before
its row exists, a checkpoint of it is refused in one line that names it; with the row, it
trains to the weights Hugging Face's ``LlamaForCausalLM`` reaches with ``torch.optim.AdamW`` on
the same sequences, and the model written keeps the family's name.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

from flowtrain.cli import main
from flowtrain.model.families import FAMILIES, Family, register_family
from tests.train.test_train_vs_hf import make_checkpoint, make_data, reference_train, run_flowtrain

TOY = Family("ToyLlamaForCausalLM", "toy_llama", max_position_embeddings=2048, attention_bias=True)


@pytest.fixture
def toy_checkpoint(tmp_path):
    """A random Llama saved by transformers, its config.json naming the toy architecture."""
    model = make_checkpoint(tmp_path / "model", layers=2, seed=5)
    path = tmp_path / "model" / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "architectures": [TOY.architecture], "model_type": TOY.model_type}))
    return tmp_path / "model", model


def test_an_unknown_family_is_refused_in_one_line(tmp_path, toy_checkpoint, capsys):
    model_dir, _ = toy_checkpoint
    make_data(tmp_path / "data.jsonl")
    assert main(["train", "--model", str(model_dir), "--data", str(tmp_path / "data.jsonl"), "--steps", "1",
                 "--device", "cpu", "--out", str(tmp_path / "out"), "--no-progress"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unsupported architecture 'ToyLlamaForCausalLM'" in err[0], err
    assert not (tmp_path / "out").exists()


def test_a_new_family_is_one_row_and_trains_as_transformers_does(tmp_path, toy_checkpoint):
    model_dir, start = toy_checkpoint
    rows = make_data(tmp_path / "data.jsonl")
    register_family(TOY)
    try:
        with pytest.raises(ValueError, match="already a family"):
            register_family(TOY)
        run_flowtrain(model_dir, tmp_path / "data.jsonl", tmp_path / "out")
    finally:
        del FAMILIES[TOY.architecture]
    ref = reference_train(make_checkpoint(tmp_path / "ref", layers=2, seed=5), rows, lr=0.01, wd=0.1,
                          betas=(0.9, 0.95), eps=1e-6)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["architectures"], written["model_type"]) == ([TOY.architecture], TOY.model_type)
    ours = load_file(tmp_path / "out" / "model.safetensors")
    theirs = dict(ref.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, p in theirs.items():
        err = float((ours[name].float() - p.detach()).norm() / p.detach().norm())
        assert err < 1e-4, f"{name}: relative error {err:.2e}"
        assert not torch.equal(p.detach(), start.get_parameter(name).detach()), f"{name} did not train"
