"""What a run does beside training, on the generic layer path: held-out loss, checkpoints and
resume, an explicit refusal of what the path does not run.

The models are tests/train/generic_models.py's families, saved by transformers; the reference is
transformers itself, fp32 on the CPU.
"""

from __future__ import annotations

import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from generic_models import make_family
from test_eval import assert_eval_matches_hf
from test_train_vs_hf import STEPS, make_data, reference_train, run_flowtrain

from flowtrain.cli import main


@pytest.mark.parametrize("arch, placement", [
    ("Gemma2ForCausalLM", ("--policy", "sequential")),  # tied, soft-capped logits
    ("Qwen3_5ForCausalLM", ("--policy", "lookahead", "--order", "micro", "--resident", "embed,head,layer.1")),
])
def test_eval_loss_matches_transformers(tmp_path, arch, placement):
    make_family(tmp_path / "model", arch)
    assert_eval_matches_hf(tmp_path, *placement)


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


def test_lora_dropout_on_the_generic_path_is_refused_in_one_line(tmp_path, capsys):
    err = _refused(tmp_path, capsys, "--lora-rank", "4", "--lora-dropout", "0.1")
    assert len(err) == 1 and "generic layer path" in err[0] and "--lora-dropout" in err[0], err


def test_a_lora_target_the_model_lacks_is_refused_naming_its_maps(tmp_path, capsys):
    err = _refused(tmp_path, capsys, "--lora-rank", "4", "--lora-targets", "q_proj,wq")
    assert len(err) == 1 and "--lora-targets wq" in err[0] and "o_proj" in err[0], err


def test_saved_attention_on_the_generic_path_is_refused_in_one_line(tmp_path, capsys):
    err = _refused(tmp_path, capsys, "--activations", "attention")
    assert len(err) == 1 and "generic layer path" in err[0] and "--activations" in err[0], err


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Gemma2ForCausalLM", "Qwen3_5ForCausalLM"])
def test_packed_rows_train_like_each_example_alone(tmp_path, arch):
    """Packed documents on the generic path: positions restart at each document, which
    transformers turns into block-causal masks; the weights are transformers' trained on every
    example alone. Qwen3.5's linear-attention layers would carry their state from one document
    into the next: its rows hold one example each, and train like them too."""
    from test_families import _rel_errs
    from test_packing_vs_hf import ROWS, SEQ, STEPS as PACKED_STEPS, _documents, _examples, _reference

    from flowtrain.data.source import load_sequences
    from flowtrain.model import read_config

    if arch == "LlamaForCausalLM":
        from test_train_vs_hf import make_checkpoint

        def build(path):
            return make_checkpoint(path, layers=2, seed=5)
    else:
        def build(path):
            return make_family(path, arch, seed=5)
    build(tmp_path / "model")
    _examples(tmp_path / "data.jsonl", seed=6)
    separates = read_config(tmp_path / "model", layer_path="generic").separates_documents
    assert separates == (arch != "Qwen3_5ForCausalLM")
    loaded = load_sequences(tmp_path / "data.jsonl", SEQ, 64, cache_dir=tmp_path / "cache", packing=separates)
    assert (loaded.positions is not None) == separates
    positions = loaded.positions if separates else torch.arange(SEQ).expand(len(loaded), SEQ)  # a row, one example
    seqs = types.SimpleNamespace(input_ids=loaded.input_ids, targets=loaded.targets, positions=positions)
    most = max(len(_documents(i, t, p)) for i, t, p in zip(seqs.input_ids, seqs.targets, seqs.positions))
    assert most >= 3 if separates else most == 1
    ref = _reference(build(tmp_path / "ref"), seqs, lr=0.01, wd=0.1)
    assert main(["train", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "data.jsonl"),
                 "--steps", str(PACKED_STEPS), "--batch-size", str(ROWS), "--micro-batch-size", "1",
                 "--seq-len", str(SEQ), "--no-shuffle", "--lr", "0.01", "--weight-decay", "0.1",
                 "--betas", "0.9,0.95", "--eps", "1e-6", "--device", "cpu", "--precision", "fp32",
                 "--out", str(tmp_path / "out"), "--no-progress", "--lr-schedule", "constant",
                 "--warmup-steps", "0", "--weight-decay-skip", "none", "--layer-path", "generic"]) == 0
    ours = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for tensor, err in _rel_errs(ours, ref).items():
        assert err < 1e-4, f"{tensor}: relative error {err:.2e}"


def test_two_processes_train_the_weights_of_one(tmp_path):
    """Data parallel on the generic path (torchrun, gloo, the CPU): two processes with half the
    micro-batches each write the weights one process writes."""
    from test_data_parallel import torchrun, assert_same_models

    run = ["--model", "qwen3.5-tiny", "--steps", "2", "--batch-size", "4", "--micro-batch-size", "1", "--seq-len", "32",
           "--device", "cpu", "--precision", "fp32", "--lr", "1e-3", "--no-progress"]
    assert main(["train", *run, "--out", str(tmp_path / "one")]) == 0
    proc = torchrun(tmp_path, "two", run=run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_models(tmp_path / "one", tmp_path / "two")


@pytest.mark.parametrize("where", ["layer.1", "embed", "head"])
def test_a_poisoned_step_is_left_out_exactly(tmp_path, monkeypatch, where):
    """A non-finite gradient in step 2 of 3 on the generic path: the step is skipped, and the
    model written is the one trained on steps 1 and 3 alone."""
    import json

    from flowtrain.train.nonfinite import INJECT_ENV

    make_family(tmp_path / "model", "Gemma2ForCausalLM")
    rows = make_data(tmp_path / "data.jsonl")
    per_step = len(rows) // STEPS
    (tmp_path / "without.jsonl").write_text("".join(json.dumps({"input_ids": r}) + "\n"
                                                    for r in rows[:per_step] + rows[2 * per_step:]))
    args = ["train", "--model", str(tmp_path / "model"), "--batch-size", str(per_step), "--micro-batch-size", "2",
            "--seq-len", "12", "--no-shuffle", "--lr", "0.01", "--device", "cpu", "--precision", "fp32",
            "--no-progress", "--lr-schedule", "constant", "--warmup-steps", "0", "--no-packing"]
    assert main([*args, "--data", str(tmp_path / "without.jsonl"), "--steps", "2", "--out", str(tmp_path / "ref")]) == 0
    monkeypatch.setenv(INJECT_ENV, f"step=1,where={where}")
    assert main([*args, "--data", str(tmp_path / "data.jsonl"), "--steps", "3", "--out", str(tmp_path / "out"),
                 "--metrics", str(tmp_path / "m.jsonl")]) == 0
    skipped = [json.loads(x).get("skipped", False) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert skipped == [False, True, False]
    ref = dict(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ref").named_parameters())
    for name, p in transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").named_parameters():
        assert p.detach().equal(ref[name].detach()), name


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_lora_over_a_hybrid_family_matches_peft(tmp_path):
    """LoRA on the generic path (Qwen3.5: linear-attention and full-attention layers, adapters on
    maps the native layer does not have): the adapter flowtrain writes, read back by PEFT, is
    PEFT + AdamW's after three steps, and the base is untouched."""
    peft = pytest.importorskip("peft")
    from test_lora_train import TARGETS, lora_args

    from flowtrain.model import read_config

    make_family(tmp_path / "model", "Qwen3_5ForCausalLM")
    rows = make_data(tmp_path / "data.jsonl")
    targets = [*TARGETS, "in_proj_qkv", "out_proj"]  # the linear-attention layers' maps too
    config = peft.LoraConfig(r=4, lora_alpha=8.0, lora_dropout=0.0, target_modules=targets)
    ref = peft.get_peft_model(make_family(None, "Qwen3_5ForCausalLM"), config)
    mine = [n for n, _ in ref.named_parameters() if "lora_" in n]
    assert any("linear_attn.in_proj_qkv" in n for n in mine) and any("self_attn.q_proj" in n for n in mine)
    # the reference starts from flowtrain's fresh adapters (A drawn as PEFT draws it, B zero)
    from flowtrain.model.adapters import LoraSpec, adapter_flat_maps
    from flowtrain.model.lora import init_adapter
    from flowtrain.train.config import defaults

    cfg = read_config(tmp_path / "model")
    params = dict(ref.named_parameters())
    with torch.no_grad():
        for lay in adapter_flat_maps(cfg, LoraSpec(4, 8.0, tuple(targets))):
            flat = torch.zeros(lay.numel)
            init_adapter(flat, lay, defaults.SEED)
            for e in lay.entries:
                name = e.name.replace(".lora_A.weight", ".lora_A.default.weight").replace(
                    ".lora_B.weight", ".lora_B.default.weight")
                params[name].copy_(flat[e.offset:e.offset + e.numel].view(e.shape))
    reference_train(ref, rows, lr=0.01, wd=0.1, betas=(0.9, 0.95), eps=1e-6,
                    groups=lambda m: [p for p in m.parameters() if p.requires_grad])
    assert main(lora_args(tmp_path / "data.jsonl", tmp_path / "out", "--model", str(tmp_path / "model"),
                          "--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", ",".join(targets))) == 0
    ours = {n: p.detach() for n, p in peft.PeftModel.from_pretrained(make_family(None, "Qwen3_5ForCausalLM"),
                                                                     tmp_path / "out").named_parameters()}
    theirs = {n: p.detach() for n, p in ref.named_parameters()}
    assert ours.keys() == theirs.keys()
    for name, r in theirs.items():
        err = float((ours[name] - r).norm() / max(float(r.norm()), 1e-12))
        assert err < 1e-4, f"{name}: relative error {err:.2e}"
    assert max(float(theirs[n].norm()) for n in theirs if "lora_B" in n) > 0  # the adapters moved


def test_lora_resumes_and_starts_from_an_adapter_folder(tmp_path):
    """On the generic path a LoRA run resumed from its checkpoint writes the adapter of the
    uninterrupted run, and ``--adapter`` reads the adapter folder it wrote (its target_modules
    name the linear-attention maps by their paths)."""
    from safetensors.torch import load_file

    run = ["train", "--model", "qwen3.5-tiny", "--lora-rank", "4", "--lora-targets", "q_proj,in_proj_qkv,down_proj",
           "--seq-len", "32", "--batch-size", "2", "--device", "cpu", "--no-progress"]
    assert main([*run, "--steps", "2", "--save-every", "1", "--out", str(tmp_path / "a")]) == 0
    assert main([*run, "--steps", "2", "--resume", str(tmp_path / "a" / "checkpoint-1"), "--out", str(tmp_path / "b")]) == 0
    a, b = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("a", "b"))
    assert a.keys() == b.keys() and any("linear_attn.in_proj_qkv" in k for k in a)
    assert all(a[k].equal(b[k]) for k in a)
    assert main(["train", "--model", "qwen3.5-tiny", "--adapter", str(tmp_path / "a"), "--steps", "1", "--seq-len", "32",
                 "--batch-size", "2", "--device", "cpu", "--no-progress", "--out", str(tmp_path / "c")]) == 0
    assert load_file(tmp_path / "c" / "adapter_model.safetensors").keys() == a.keys()


def test_a_load_balancing_loss_whose_routers_cannot_be_found_is_refused(tmp_path, capsys, monkeypatch):
    """A mixture of experts whose config asks for the load-balancing loss, where transformers
    names no router modules to read it from, is refused before loading, rather than trained
    without it."""
    transformers = pytest.importorskip("transformers")

    make_family(tmp_path / "model", "GptOssForCausalLM", output_router_logits=True)
    make_data(tmp_path / "data.jsonl")
    from flowtrain.model.generic.routing import load_balance_of

    monkeypatch.setattr(transformers.GptOssForCausalLM, "_can_record_outputs", {})
    load_balance_of.cache_clear()  # what this process found before, with the real recorder
    capsys.readouterr()
    assert main(["train", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "data.jsonl"), "--steps", "1",
                 "--seq-len", "12", "--device", "cpu", "--no-progress"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "output_router_logits" in err[0] and "cannot find its routers" in err[0], err


def test_a_checkpoint_under_names_transformers_renames_trains_as_the_plain_one(tmp_path):
    """A text model saved inside a vision-language one names its tensors ``model.language_model.``
    where the text model has ``model.``; transformers renames them on loading (its conversion
    rules for the model type), and so does the generic path: both checkpoints train to the same
    model, written under the model's own names."""
    import shutil

    from safetensors.torch import load_file, save_file

    make_family(tmp_path / "plain", "Qwen3_5ForCausalLM")
    shutil.copytree(tmp_path / "plain", tmp_path / "prefixed")
    weights = load_file(tmp_path / "plain" / "model.safetensors")
    renamed = {n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n: t
               for n, t in weights.items()}
    assert any(n.startswith("model.language_model.layers.") for n in renamed)
    save_file(renamed, tmp_path / "prefixed" / "model.safetensors", metadata={"format": "pt"})
    make_data(tmp_path / "data.jsonl", vocab=64)
    for name in ("plain", "prefixed"):
        run_flowtrain(tmp_path / name, tmp_path / "data.jsonl", tmp_path / f"out-{name}")
    a, b = (load_file(tmp_path / f"out-{name}" / "model.safetensors") for name in ("plain", "prefixed"))
    assert a.keys() == b.keys() == weights.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], weights[k]) for k in a)  # trained
