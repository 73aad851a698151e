"""What a run does beside training, on the generic layer path: held-out loss, checkpoints and
resume, an explicit refusal of what the path does not run.

The models are tests/train/generic_models.py's families, saved by transformers; the reference is
transformers itself, fp32 on the CPU.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from generic_models import make_family
from test_eval import hf_eval_loss, make_eval_rows, read_metrics
from test_train_vs_hf import STEPS, make_data, run_flowtrain

from flowtrain.cli import main


@pytest.mark.parametrize("arch, placement", [
    ("Gemma2ForCausalLM", ("--policy", "sequential")),  # tied, soft-capped logits
    ("Qwen3_5ForCausalLM", ("--policy", "lookahead", "--order", "micro", "--resident", "embed,head,layer.1")),
])
def test_eval_loss_matches_transformers(tmp_path, arch, placement):
    make_family(tmp_path / "model", arch)
    make_data(tmp_path / "data.jsonl")
    rows = make_eval_rows(tmp_path / "eval.jsonl")
    run_flowtrain(tmp_path / "model", tmp_path / "data.jsonl", tmp_path / "out", "--eval-data",
                  str(tmp_path / "eval.jsonl"), "--eval-every", "2", "--metrics", str(tmp_path / "m.jsonl"), *placement)
    _, evals = read_metrics(tmp_path / "m.jsonl")
    assert [e["step"] for e in evals] == [2, STEPS]
    ref, n = hf_eval_loss(tmp_path / "out", rows)
    assert evals[-1]["eval_tokens"] == n
    assert abs(evals[-1]["eval_loss"] - ref) <= 1e-5 * abs(ref), (evals[-1], ref)


def test_resume_continues_to_the_same_weights(tmp_path):
    """Two steps, a checkpoint, then the third step resumed from it: the model an uninterrupted
    run of three steps writes, tensor for tensor."""
    make_family(tmp_path / "model", "Qwen3NextForCausalLM")
    make_data(tmp_path / "data.jsonl")
    run_flowtrain(tmp_path / "model", tmp_path / "data.jsonl", tmp_path / "straight")
    args = ["train", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "data.jsonl"), "--batch-size", "4",
            "--micro-batch-size", "2", "--seq-len", "12", "--no-shuffle", "--lr", "0.01", "--weight-decay", "0.1",
            "--betas", "0.9,0.95", "--eps", "1e-6", "--device", "cpu", "--precision", "fp32", "--no-progress",
            "--lr-schedule", "constant", "--warmup-steps", "0", "--weight-decay-skip", "none", "--no-packing"]
    assert main([*args, "--steps", "2", "--save-every", "2", "--out", str(tmp_path / "cut")]) == 0
    assert main([*args, "--steps", "3", "--out", str(tmp_path / "cut"), "--resume",
                 str(tmp_path / "cut" / "checkpoint-2")]) == 0
    straight = dict(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "straight").named_parameters())
    resumed = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "cut").named_parameters()
    for name, p in resumed:
        assert p.detach().equal(straight[name].detach()), name


def _refused(tmp_path, capsys, *flags):
    make_family(tmp_path / "model", "Olmo2ForCausalLM")
    make_data(tmp_path / "data.jsonl")
    capsys.readouterr()
    assert main(["train", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "data.jsonl"), "--steps", "1",
                 "--seq-len", "12", "--device", "cpu", "--no-progress", *flags]) != 0
    return capsys.readouterr().err.strip().splitlines()


def test_lora_on_the_generic_path_is_refused_in_one_line(tmp_path, capsys):
    err = _refused(tmp_path, capsys, "--lora-rank", "4")
    assert len(err) == 1 and "generic layer path" in err[0] and "--lora-rank" in err[0], err


def test_saved_attention_on_the_generic_path_is_refused_in_one_line(tmp_path, capsys):
    err = _refused(tmp_path, capsys, "--activations", "attention")
    assert len(err) == 1 and "generic layer path" in err[0] and "--activations" in err[0], err
