"""flowtrain train against Hugging Face transformers + torch.optim.AdamW, fp32 on the CPU.

The reference is code nobody here wrote: ``LlamaForCausalLM`` trained with ``torch.optim.AdamW``
on the same sequences, the loss being the mean over all target tokens of each optimizer step.
Three steps with two micro-batches per step must give the same weights to a relative error of
1e-4 per tensor, for every built-in policy and checkpoint spacing 1 and 2.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from flowtrain.cli import main

SEQ = 12
ROWS = 4  # sequences per step
STEPS = 3


def make_checkpoint(path, *, tied=False, layers=3, seed=0, vocab=64, model_type="llama", **extra):
    """A small random model of ``model_type`` ("llama", "mistral", "qwen3", ...), saved to
    ``path``; ``extra`` config keys override or add to the shared shape."""
    torch.manual_seed(seed)
    shape = dict(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0, tie_word_embeddings=tied,
        attn_implementation="sdpa",
    )
    config = transformers.AutoConfig.for_model(model_type, **{**shape, **extra})
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    return model


def make_data(path, seed=1, vocab=64):
    """Rows of varying length: some cut at SEQ, some padded."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(ROWS * STEPS):
        n = int(torch.randint(3, SEQ + 5, (1,), generator=g))
        rows.append(torch.randint(0, vocab, (n,), generator=g).tolist())
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps({"input_ids": r}) + "\n")
    return rows


def reference_train(model, rows, *, lr, wd, betas, eps, clip=None, micro=2, groups=None):
    """``groups(model)``: torch parameter groups instead of one group of every parameter."""
    params = groups(model) if groups is not None else model.parameters()
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=wd, betas=betas, eps=eps)
    for s in range(STEPS):
        batch = rows[s * ROWS:(s + 1) * ROWS]
        ids = torch.zeros(ROWS, SEQ, dtype=torch.long)
        labels = torch.full((ROWS, SEQ), -100, dtype=torch.long)
        for i, r in enumerate(batch):
            r = r[:SEQ]
            ids[i, :len(r)] = torch.tensor(r)
            labels[i, :len(r)] = torch.tensor(r)
        targets = torch.cat([labels[:, 1:], torch.full((ROWS, 1), -100)], dim=1)
        n = int((targets != -100).sum())
        opt.zero_grad()
        for m in range(0, ROWS, micro):
            logits = model(input_ids=ids[m:m + micro]).logits
            loss = F.cross_entropy(logits.flatten(0, 1), targets[m:m + micro].flatten(), reduction="sum",
                                   ignore_index=-100) / n
            loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model


def assert_same_weights(out_dir, ref):
    ours = transformers.AutoModelForCausalLM.from_pretrained(out_dir)
    theirs = dict(ref.named_parameters())
    compared = 0
    for name, p in ours.named_parameters():
        r = theirs[name].detach()
        err = float((p.detach() - r).norm() / r.norm())
        assert err < 1e-4, f"{name}: relative error {err:.2e}"
        compared += 1
    assert compared == len(theirs)


def run_flowtrain(model_dir, data, out, *extra):
    args = ["train", "--model", str(model_dir), "--data", str(data), "--steps", str(STEPS),
            "--batch-size", str(ROWS), "--micro-batch-size", "2", "--seq-len", str(SEQ), "--no-shuffle",
            "--lr", "0.01", "--weight-decay", "0.1", "--betas", "0.9,0.95", "--eps", "1e-6",
            "--device", "cpu", "--precision", "fp32", "--out", str(out), "--no-progress",
            # the reference is one torch AdamW group at a constant rate (a model folder's defaults
            # are a fine-tune's: warm-up, cosine, no decay on norms and biases)
            "--lr-schedule", "constant", "--warmup-steps", "0", "--weight-decay-skip", "none",
            # ... and pads every row on its own, as transformers' collator does
            "--no-packing", *extra]
    assert main(args) == 0


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    model = make_checkpoint(d / "model")
    rows = make_data(d / "data.jsonl")
    ref = reference_train(make_checkpoint(d / "unused"), rows, lr=0.01, wd=0.1, betas=(0.9, 0.95), eps=1e-6)
    return d, ref, model


@pytest.mark.parametrize("policy", ["sequential", "double_buffer", "lookahead"])
@pytest.mark.parametrize("spacing", [1, 2])
def test_matches_hf_adamw(setup, tmp_path, policy, spacing):
    d, ref, _ = setup
    run_flowtrain(d / "model", d / "data.jsonl", tmp_path / "out", "--policy", policy,
                  "--checkpoint-every", str(spacing))
    assert_same_weights(tmp_path / "out", ref)


@pytest.mark.parametrize("activations, spacing", [("keep", 1), ("offload", 1), ("offload", 2), ("attention", 1)])
@pytest.mark.parametrize("order", ["layer", "micro"])
def test_every_activations_choice_matches_hf(setup, tmp_path, activations, spacing, order):
    """Kept activations, checkpoints offloaded to host memory and saved attention outputs train
    the reference's weights."""
    d, ref, _ = setup
    run_flowtrain(d / "model", d / "data.jsonl", tmp_path / "out", "--activations", activations,
                  "--checkpoint-every", str(spacing), "--order", order)
    assert_same_weights(tmp_path / "out", ref)


def test_training_changed_the_weights(setup, tmp_path):
    """Guard against a vacuous comparison: the reference moved away from the start."""
    d, ref, start = setup
    moved = [float((p - start.get_parameter(n)).detach().norm() / p.detach().norm()) for n, p in ref.named_parameters()]
    assert min(moved) > 1e-3


@pytest.mark.parametrize("order", ["layer", "micro"])
@pytest.mark.parametrize("resident", ["none", "embed,head,layer.0"])
def test_tied_with_grad_clip(tmp_path, order, resident):
    make_checkpoint(tmp_path / "model", tied=True, layers=2, seed=3)
    rows = make_data(tmp_path / "data.jsonl", seed=4)
    ref = reference_train(make_checkpoint(tmp_path / "ref", tied=True, layers=2, seed=3), rows, lr=0.01, wd=0.1,
                          betas=(0.9, 0.95), eps=1e-6, clip=0.5)
    run_flowtrain(tmp_path / "model", tmp_path / "data.jsonl", tmp_path / "out", "--grad-clip", "0.5",
                  "--order", order, "--resident", resident)
    assert_same_weights(tmp_path / "out", ref)


@pytest.mark.parametrize("placement", [
    ("--layout", "full"),
    ("--layout", "stream-bf16"),
    ("--resident", "embed,head,layer.1"),
    ("--resident", "layer.0,layer.2", "--layout", "full"),
    ("--resident", "embed,head,layer.0,layer.1,layer.2"),
])
@pytest.mark.parametrize("order", ["layer", "micro"])
def test_layouts_and_resident_units_match_hf(setup, tmp_path, placement, order):
    """Every host layout and any mix of device-resident units (Adam on the device) trains the
    same weights as the reference, in both micro-batch orders."""
    d, ref, _ = setup
    run_flowtrain(d / "model", d / "data.jsonl", tmp_path / "out", "--order", order, *placement)
    assert_same_weights(tmp_path / "out", ref)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("placement", [(), ("--resident", "embed,head"), ("--resident", "layer.1")])
def test_staged_chunks_of_large_units_match_hf(tmp_path, tied, placement):
    """A vocabulary of 512 makes the embedding (and head) larger than one staging slot (the
    largest layer), so their gradients pass to the host in several chunks, each updated by its
    own cpu_adam; tied, the embedding's chunks also add the head's part."""
    make_checkpoint(tmp_path / "model", tied=tied, layers=2, seed=5, vocab=512)
    rows = make_data(tmp_path / "data.jsonl", seed=6, vocab=512)
    ref = reference_train(make_checkpoint(tmp_path / "ref", tied=tied, layers=2, seed=5, vocab=512), rows,
                          lr=0.01, wd=0.1, betas=(0.9, 0.95), eps=1e-6)
    run_flowtrain(tmp_path / "model", tmp_path / "data.jsonl", tmp_path / "out", "--trace",
                  str(tmp_path / "t.json"), *placement)
    assert_same_weights(tmp_path / "out", ref)
    kinds = [e["name"] for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e.get("ph") == "X"]
    if not placement:
        assert any("cpu_adam embed c1" in k for k in kinds), "the embedding should be staged in chunks"


def test_staged_layout_refuses_grad_clip(setup, tmp_path, capsys):
    d, _, _ = setup
    args = ["train", "--model", str(d / "model"), "--data", str(d / "data.jsonl"), "--steps", "1",
            "--batch-size", "4", "--micro-batch-size", "2", "--seq-len", str(SEQ), "--device", "cpu",
            "--layout", "staged", "--grad-clip", "1.0", "--out", str(tmp_path / "out")]
    assert main(args) == 2
    assert "--layout full" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_compiled_layer_matches_hf(setup, tmp_path):
    """``--compile``: the decoder layer through torch.compile (dynamo + AOTAutograd; the
    ``aot_eager`` backend keeps the CPU test fast, the GPU runs inductor) trains the same weights."""
    d, ref, _ = setup
    run_flowtrain(d / "model", d / "data.jsonl", tmp_path / "out", "--compile", "aot_eager")
    assert_same_weights(tmp_path / "out", ref)


@pytest.mark.parametrize("other", [("--layout", "stream-bf16"), ("--resident", "embed,head,layer.0")])
def test_bf16_copies_give_the_same_weights_as_casting_on_the_fly(setup, tmp_path, other):
    """In bf16 compute, the stream-bf16 layout's pinned bf16 copy (refreshed by cpu_adam) and a
    resident unit's compute copy (refreshed by gpu_adam) hold exactly the rounding that a fetch
    of the fp32 master casts on the fly, so training gives bit-identical weights."""
    from safetensors.torch import load_file

    d, _, _ = setup
    runs = {}
    for name, extra in (("cast", ("--layout", "staged", "--resident", "none")), ("copy", other)):
        out = tmp_path / name
        args = ["train", "--model", str(d / "model"), "--data", str(d / "data.jsonl"), "--steps", str(STEPS),
                "--batch-size", str(ROWS), "--micro-batch-size", "2", "--seq-len", str(SEQ), "--no-shuffle",
                "--lr", "0.01", "--device", "cpu", "--precision", "bf16", "--out", str(out), "--no-progress",
                "--lr-schedule", "constant", "--warmup-steps", "0", *extra]
        assert main(args) == 0
        runs[name] = load_file(out / "model.safetensors")
    for key, ref in runs["cast"].items():
        assert torch.equal(runs["copy"][key], ref), key
