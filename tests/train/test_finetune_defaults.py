"""Fine-tuning defaults: a pretrained model folder gets a fine-tune's optimizer settings, a preset
the demo's, a resumed run its checkpoint's; and the norms-biases weight-decay rule trains exactly
what torch AdamW with two parameter groups trains (Hugging Face's Trainer's grouping)."""

from __future__ import annotations

import pytest
from test_train_vs_hf import ROWS, SEQ, STEPS, assert_same_weights, make_checkpoint, make_data, reference_train

from flowtrain.model import model_flat_maps, preset
from flowtrain.train.config import defaults
from flowtrain.train.optimizer import decay_segments, no_decay_ranges, skips_decay
from flowtrain.train.run import TrainConfig
from flowtrain.train.prepare import resolve_defaults

transformers = pytest.importorskip("transformers")


def test_defaults_follow_where_the_weights_come_from():
    cfg = TrainConfig(steps=1000)
    scratch = resolve_defaults(cfg, pretrained=False, saved=None)
    tune = resolve_defaults(cfg, pretrained=True, saved=None)
    assert (scratch.lr, scratch.lr_schedule, scratch.warmup_steps, scratch.weight_decay_skip) == (
        3e-3, "constant", 0, "none")
    assert (tune.lr, tune.lr_schedule, tune.warmup_steps, tune.weight_decay_skip) == (2e-5, "cosine", 30, "norms-biases")
    # what the user set stays; a resume takes the checkpoint's settings for the rest
    mine = resolve_defaults(TrainConfig(steps=10, lr=1e-4), pretrained=True, saved=None)
    assert mine.lr == 1e-4 and mine.warmup_steps == 1
    resumed = resolve_defaults(cfg, pretrained=True, saved={"lr": 3e-3, "lr_schedule": "constant", "warmup_steps": 0,
                                                             "weight_decay": 0.01, "weight_decay_skip": "none"})
    assert (resumed.lr, resumed.lr_schedule, resumed.weight_decay_skip) == (3e-3, "constant", "none")
    assert defaults.optimizer_defaults(True, 1)["warmup_steps"] == 1


def test_which_parameters_skip_decay():
    for name in ("model.layers.0.input_layernorm.weight", "model.layers.3.post_attention_layernorm.weight",
                 "model.norm.weight", "model.layers.1.self_attn.q_norm.weight", "model.layers.0.self_attn.q_proj.bias"):
        assert skips_decay(name), name
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.down_proj.weight",
                 "model.layers.2.self_attn.o_proj.weight"):
        assert not skips_decay(name), name
    layer = model_flat_maps(preset("tiny"))[1]
    ranges = no_decay_ranges(layer.entries, "norms-biases")
    assert ranges and no_decay_ranges(layer.entries, "none") == []
    segs = decay_segments(0, layer.numel, ranges)
    assert segs[0][0] == 0 and segs[-1][1] == layer.numel
    assert all(a[1] == b[0] for a, b in zip(segs, segs[1:]))  # contiguous cover


def two_groups(model, wd=0.5):
    """Hugging Face's Trainer's grouping: no decay on norm weights and biases."""
    decay = [p for n, p in model.named_parameters() if not skips_decay(n)]
    no = [p for n, p in model.named_parameters() if skips_decay(n)]
    return [{"params": decay, "weight_decay": wd}, {"params": no, "weight_decay": 0.0}]


@pytest.mark.parametrize("extra", [(), ("--resident", "embed,head,layer.0"), ("--layout", "full")])
def test_no_decay_on_norms_and_biases_matches_two_torch_groups(tmp_path, extra):
    from flowtrain.cli import main

    make_checkpoint(tmp_path / "model", seed=2)
    rows = make_data(tmp_path / "data.jsonl", seed=3)
    ref = reference_train(make_checkpoint(tmp_path / "ref", seed=2), rows, lr=0.01, wd=0.5, betas=(0.9, 0.999),
                          eps=1e-8, groups=two_groups)
    args = ["train", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "data.jsonl"), "--steps", str(STEPS),
            "--batch-size", str(ROWS), "--micro-batch-size", "2", "--seq-len", str(SEQ), "--no-shuffle",
            "--lr", "0.01", "--weight-decay", "0.5", "--lr-schedule", "constant", "--warmup-steps", "0",
            "--device", "cpu", "--precision", "fp32", "--out", str(tmp_path / "out"), "--no-progress",
            "--no-packing", *extra]  # the reference pads each row
    assert main(args) == 0  # --weight-decay-skip norms-biases is a model folder's default
    assert_same_weights(tmp_path / "out", ref)
