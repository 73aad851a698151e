"""``flowtrain train --lora-rank`` / ``--adapter`` against PEFT + torch.optim.AdamW, fp32 on the CPU.

The reference is code nobody here wrote: transformers' model wrapped by ``peft.PeftModel`` from
the same adapter folder, its adapter parameters trained by ``torch.optim.AdamW`` on the same
rows. After three steps of two micro-batches each, the adapter flowtrain writes to ``--out``
(read back by PEFT itself) must equal the reference's to a relative error of 1e-4 per tensor,
and the frozen base must be untouched.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from flowtrain.cli import main

from test_train_vs_hf import ROWS, SEQ, STEPS, make_checkpoint, make_data, reference_train

# PEFT 0.21 asks transformers 5 a deprecated question when it wraps a model
pytestmark = [pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
              # PEFT names a mixture of experts' stacked experts in its rank and alpha patterns, then ignores them
              pytest.mark.filterwarnings("ignore:The following .*_pattern keys did not match:RuntimeWarning")]

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_dir, out, *, rank=4, alpha=8.0, targets=TARGETS, seed=7, parameters=None, rslora=False,
                 **more):
    """A PEFT adapter over the model in ``base_dir`` with every A and B random (a fresh adapter's
    B is zero, which would leave A's gradient zero in the first step). ``targets`` a list of
    names or PEFT's "all-linear"; ``parameters`` PEFT's target_parameters; ``rslora`` its
    rank-stabilised scaling; ``more`` other LoraConfig settings."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_parameters=parameters,
                             target_modules=targets if isinstance(targets, str) else list(targets), use_rslora=rslora,
                             **more)
    wrapped = peft.get_peft_model(model, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    wrapped.save_pretrained(out)
    return out


def peft_model(base_dir, adapter_dir):
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    return peft.PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)


def reference(base_dir, adapter_dir, rows):
    model = peft_model(base_dir, adapter_dir)
    return reference_train(model, rows, lr=0.01, wd=0.1, betas=(0.9, 0.95), eps=1e-6,
                           groups=lambda m: [p for p in m.parameters() if p.requires_grad])


def adapter_tensors(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def lora_args(data, out, *extra):
    return ["train", "--data", str(data), "--steps", str(STEPS),
            "--batch-size", str(ROWS), "--micro-batch-size", "2", "--seq-len", str(SEQ), "--no-shuffle",
            "--lr", "0.01", "--weight-decay", "0.1", "--betas", "0.9,0.95", "--eps", "1e-6",
            "--device", "cpu", "--precision", "fp32", "--out", str(out), "--no-progress",
            "--lr-schedule", "constant", "--warmup-steps", "0", "--weight-decay-skip", "none", "--no-packing", *extra]


def run_lora(base_dir, data, out, *extra):
    assert main(lora_args(data, out, "--model", str(base_dir), *extra)) == 0


def assert_same_adapter(base_dir, out, ref):
    ours = adapter_tensors(peft_model(base_dir, out))
    theirs = adapter_tensors(ref)
    assert ours.keys() == theirs.keys() and ours
    for name, r in theirs.items():
        err = float((ours[name] - r).norm() / r.norm())
        assert err < 1e-4, f"{name}: relative error {err:.2e}"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    make_checkpoint(d / "model")
    rows = make_data(d / "data.jsonl")
    make_adapter(d / "model", d / "adapter")
    return d, rows, reference(d / "model", d / "adapter", rows)


@pytest.mark.parametrize("placement", [
    (),
    ("--checkpoint-every", "2"),
    ("--activations", "keep"),
    ("--activations", "offload"),
    ("--activations", "attention"),
    ("--order", "micro", "--policy", "lookahead"),
    ("--resident", "embed,head,layer.1"),
    ("--grad-clip", "0.5"),
    # the adapters in host memory: fetched with their layer, updated by CPU AdamW
    ("--lora-state", "host"),
    ("--lora-state", "host", "--activations", "keep"),
    ("--lora-state", "host", "--checkpoint-every", "2", "--order", "micro"),
    ("--lora-state", "host", "--activations", "offload", "--layout", "full"),
    ("--lora-state", "host", "--grad-clip", "0.5"),
])
def test_adapter_matches_peft_adamw(setup, tmp_path, placement):
    d, _, ref = setup
    if "--grad-clip" in placement:  # its own reference: clipped over the adapters
        rows = make_data(d / "data.jsonl")
        model = peft_model(d / "model", d / "adapter")
        ref = reference_train(model, rows, lr=0.01, wd=0.1, betas=(0.9, 0.95), eps=1e-6, clip=0.5,
                              groups=lambda m: [p for p in m.parameters() if p.requires_grad])
    run_lora(d / "model", d / "data.jsonl", tmp_path / "out", "--adapter", str(d / "adapter"), *placement)
    assert_same_adapter(d / "model", tmp_path / "out", ref)


def test_training_moved_the_adapter(setup):
    """Guard against a vacuous comparison: three steps changed every adapter tensor."""
    d, _, ref = setup
    start = adapter_tensors(peft_model(d / "model", d / "adapter"))
    for name, p in adapter_tensors(ref).items():
        assert float((p - start[name]).norm() / p.norm()) > 1e-3, name


MOE = dict(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)


MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2)


# Gemma 3: sliding and full attention layers, its own norms and scaled embeddings
GEMMA3 = dict(head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
              layer_types=["sliding_attention", "full_attention"])


@pytest.mark.parametrize("model_type, tied, extra, targets, parameters", [
    ("qwen3", True, {}, ["q_proj", "v_proj", "down_proj"], None),
    ("mistral", False, {}, ["q_proj", "v_proj", "down_proj"], None),
    ("qwen2", False, {}, "all-linear", None),  # q, k and v with biases, which stay frozen
    ("llama", False, {}, r".*\.(k_proj|up_proj)", None),  # a regular expression over the maps' full names
    ("gemma3_text", True, GEMMA3, "all-linear", None),
    ("gemma3_text", False, GEMMA3, ["q_proj", "o_proj", "up_proj"], None),
    # mixtures of experts: PEFT's all-linear adapts the router and each expert's stacked weights
    # (the gate-and-up adapter at twice the rank), and a dense layer's attention only
    ("qwen3_moe", False, dict(MOE, mlp_only_layers=[1]), "all-linear", None),
    ("qwen3_moe", True, MOE, ["q_proj", "gate_proj", "up_proj", "down_proj"], None),
    ("qwen3_moe", False, MOE, ["k_proj", "down_proj"], None),
    # named as transformers 5 names them: the gate-and-up adapter at the rank itself
    ("qwen3_moe", False, MOE, ["o_proj"], ["gate_up_proj", "down_proj", "gate.weight"]),
    ("mixtral", True, MIXTRAL, TARGETS, None),  # Mixtral has no maps of those MLP names: attention only
    ("mixtral", False, MIXTRAL, ["v_proj", "w1", "w3", "w2", "gate"], None),
])
def test_other_families_and_targets(tmp_path, model_type, tied, extra, targets, parameters):
    """Other families, tied embeddings, adapters on some of the maps only, and mixtures of experts."""
    make_checkpoint(tmp_path / "model", tied=tied, layers=2, seed=3, model_type=model_type, **extra)
    rows = make_data(tmp_path / "data.jsonl", seed=4)
    make_adapter(tmp_path / "model", tmp_path / "adapter", rank=2, alpha=6.0, targets=targets, parameters=parameters)
    ref = reference(tmp_path / "model", tmp_path / "adapter", rows)
    run_lora(tmp_path / "model", tmp_path / "data.jsonl", tmp_path / "out", "--adapter", str(tmp_path / "adapter"))
    assert_same_adapter(tmp_path / "model", tmp_path / "out", ref)


def test_fresh_adapter_and_merge(setup, tmp_path):
    """``--lora-rank`` starts from PEFT's initial adapter (B zero); ``--merge`` writes the base with
    the trained adapter merged in, which equals PEFT's ``merge_and_unload`` of that adapter."""
    d, _, _ = setup
    run_lora(d / "model", d / "data.jsonl", tmp_path / "adapter", "--lora-rank", "4", "--lora-alpha", "8")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (4, 8.0, sorted(TARGETS))
    loaded = peft_model(d / "model", tmp_path / "adapter")
    trained = adapter_tensors(loaded)
    assert any(float(t.norm()) > 0 for n, t in trained.items() if "lora_B" in n), "B should have moved from zero"
    prompt = torch.tensor([[1, 2, 3, 4]])
    assert loaded.generate(input_ids=prompt, max_new_tokens=3, do_sample=False).shape == (1, 7)  # PEFT generates

    # PEFT's name for every map says the default: the merged model is that of the adapter above
    run_lora(d / "model", d / "data.jsonl", tmp_path / "merged", "--lora-rank", "4", "--lora-alpha", "8", "--merge",
             "--lora-targets", "all-linear")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    expect = peft_model(d / "model", tmp_path / "adapter").merge_and_unload()
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(merged(input_ids=ids).logits, expect(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_rslora_trains_merges_and_saves_as_peft(setup, tmp_path):
    """rsLoRA (PEFT's ``use_rslora``: the update scaled by alpha / sqrt(r)): an adapter PEFT made
    trains as PEFT trains it, a fresh ``--lora-rslora`` adapter is written with the setting (PEFT
    loads it at that scale), and its merge is PEFT's."""
    d, rows, _ = setup
    make_adapter(d / "model", tmp_path / "rs", rank=4, alpha=2.0, rslora=True)
    ref = reference(d / "model", tmp_path / "rs", rows)
    run_lora(d / "model", d / "data.jsonl", tmp_path / "out", "--adapter", str(tmp_path / "rs"))
    assert json.loads((tmp_path / "out" / "adapter_config.json").read_text())["use_rslora"] is True
    assert_same_adapter(d / "model", tmp_path / "out", ref)

    flags = ("--lora-rank", "4", "--lora-alpha", "2", "--lora-rslora")
    run_lora(d / "model", d / "data.jsonl", tmp_path / "fresh", *flags)
    loaded = peft_model(d / "model", tmp_path / "fresh")
    assert loaded.peft_config["default"].use_rslora
    scales = {s for m in loaded.modules() if isinstance(getattr(m, "scaling", None), dict) for s in m.scaling.values()}
    assert scales == {1.0}  # 2 / sqrt(4)
    run_lora(d / "model", d / "data.jsonl", tmp_path / "merged", *flags, "--merge")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    expect = peft_model(d / "model", tmp_path / "fresh").merge_and_unload()
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(merged(input_ids=ids).logits, expect(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_rslora_over_experts_trains_as_peft_at_one_rank_and_is_refused_at_two(tmp_path, capsys):
    """rsLoRA over a mixture of experts: the experts' stacked weights named directly (every adapter
    at rank r, one scale) train as PEFT trains them; PEFT's conversion of gate_proj and up_proj
    (the gate-and-up adapter at 2 r: a scale of its own) is refused in one line."""
    make_checkpoint(tmp_path / "model", layers=2, seed=3, model_type="qwen3_moe", **MOE)
    rows = make_data(tmp_path / "data.jsonl", seed=4)
    make_adapter(tmp_path / "model", tmp_path / "direct", rank=2, alpha=6.0, targets=["o_proj"],
                 parameters=["gate_up_proj", "down_proj", "gate.weight"], rslora=True)
    ref = reference(tmp_path / "model", tmp_path / "direct", rows)
    run_lora(tmp_path / "model", tmp_path / "data.jsonl", tmp_path / "out", "--adapter", str(tmp_path / "direct"))
    assert_same_adapter(tmp_path / "model", tmp_path / "out", ref)

    make_adapter(tmp_path / "model", tmp_path / "converted", rank=2, alpha=6.0, targets=["gate_proj", "up_proj"],
                 rslora=True)
    capsys.readouterr()
    assert main(lora_args(tmp_path / "data.jsonl", tmp_path / "out2", "--model", str(tmp_path / "model"),
                          "--adapter", str(tmp_path / "converted"))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a scale other than the other adapters'" in err[0], err
    assert not (tmp_path / "out2").exists()


def test_excluded_maps_train_as_peft(setup, tmp_path):
    """PEFT's all-linear with ``exclude_modules``: the maps it leaves train as PEFT trains them."""
    d, rows, _ = setup
    make_adapter(d / "model", tmp_path / "adapter", targets="all-linear", exclude_modules=["k_proj", "up_proj"])
    ref = reference(d / "model", tmp_path / "adapter", rows)
    run_lora(d / "model", d / "data.jsonl", tmp_path / "out", "--adapter", str(tmp_path / "adapter"))
    assert_same_adapter(d / "model", tmp_path / "out", ref)
    assert not any(".k_proj." in n or ".up_proj." in n for n in adapter_tensors(ref))


def test_held_out_loss_reads_the_adapters(setup, tmp_path):
    """``--eval-data`` with LoRA: the last held-out loss is that of the base with the trained
    adapters, which ``--merge`` writes as a model for transformers to compute it from."""
    from test_eval import hf_eval_loss, make_eval_rows, read_metrics

    d, _, _ = setup
    rows = make_eval_rows(tmp_path / "eval.jsonl")
    run_lora(d / "model", d / "data.jsonl", tmp_path / "merged", "--adapter", str(d / "adapter"), "--merge",
             "--eval-data", str(tmp_path / "eval.jsonl"), "--eval-every", str(STEPS),
             "--metrics", str(tmp_path / "m.jsonl"))
    _, evals = read_metrics(tmp_path / "m.jsonl")
    want, n = hf_eval_loss(tmp_path / "merged", rows)
    assert evals[-1]["eval_tokens"] == n
    assert evals[-1]["eval_loss"] == pytest.approx(want, rel=1e-5)


def test_out_holds_the_adapter_only(setup, tmp_path, capsys):
    """``--out`` of a LoRA run is a PEFT adapter folder: no model weights beside it, and the last
    line says so."""
    d, _, _ = setup
    run_lora(d / "model", d / "data.jsonl", tmp_path / "out", "--adapter", str(d / "adapter"))
    assert f"adapter saved to {tmp_path / 'out'}" in capsys.readouterr().out.splitlines()[-1]
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert "adapter_model.safetensors" in names and "adapter_config.json" in names
    assert not any(n.startswith("model") and n.endswith(".safetensors") for n in names), names


@pytest.mark.parametrize("flags, says", [
    (("--lora-alpha", "8"), "--lora-alpha is for LoRA"),
    (("--merge",), "--merge is for LoRA"),
    (("--lora-rank", "4", "--lora-targets", "q_proj,wq"), "unknown --lora-targets wq"),
    (("--lora-rank", "4", "--lora-dropout", "1"), "dropout must be in [0, 1)"),
    (("--lora-rank", "0",), "--lora-rank"),
    (("--lora-state", "host"), "--lora-state is for LoRA"),
    (("--lora-rank", "4", "--lora-targets", "router"), "--lora-targets router: nothing in this model to adapt"),
])
def test_bad_lora_flags_are_refused_in_one_line(setup, tmp_path, capsys, flags, says):
    d, _, _ = setup
    args = ["train", "--model", str(d / "model"), "--data", str(d / "data.jsonl"), "--steps", "1",
            "--batch-size", "4", "--micro-batch-size", "2", "--seq-len", str(SEQ), "--device", "cpu",
            "--out", str(tmp_path / "out"), *flags]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    assert not (tmp_path / "out").exists()


def test_adapter_folders_flowtrain_cannot_run_are_refused(setup, tmp_path, capsys):
    """``--adapter`` with its own rank given again, a DoRA adapter, or a folder that is no
    adapter: one line each, nothing written."""
    d, _, _ = setup
    base = ["train", "--model", str(d / "model"), "--data", str(d / "data.jsonl"), "--steps", "1",
            "--batch-size", "4", "--micro-batch-size", "2", "--seq-len", str(SEQ), "--device", "cpu",
            "--out", str(tmp_path / "out")]
    dora = tmp_path / "dora"
    shutil.copytree(d / "adapter", dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    for extra, says in [(("--adapter", str(d / "adapter"), "--lora-rank", "4"), "--adapter brings its own rank"),
                        (("--adapter", str(dora)), "use_dora = True is a PEFT setting flowtrain does not run"),
                        (("--adapter", str(d / "model")), "not a PEFT adapter folder")]:
        assert main([*base, *extra]) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
        assert not (tmp_path / "out").exists()


def test_checkpoint_and_resume_continue_exactly(setup, tmp_path, capsys):
    """A LoRA run saved after two steps and resumed (from the checkpoint alone: the base's path
    and the adapters' settings come from it) ends with the adapters of the uninterrupted run, bit
    for bit; the checkpoint holds the adapters, their Adam state and a PEFT adapter_config.json,
    not the base."""
    d, _, _ = setup
    run_lora(d / "model", d / "data.jsonl", tmp_path / "straight", "--adapter", str(d / "adapter"))
    run_lora(d / "model", d / "data.jsonl", tmp_path / "saved", "--adapter", str(d / "adapter"), "--save-every", "2")
    ckpt = tmp_path / "saved" / "checkpoint-2"
    config = json.loads((ckpt / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == str(d / "model")
    from safetensors import safe_open

    names = set()
    for f in ckpt.glob("model-*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            names |= set(st.keys())
    assert names and all("lora_" in n for n in names), sorted(names)[:3]

    capsys.readouterr()
    assert main(lora_args(d / "data.jsonl", tmp_path / "resumed", "--resume", str(ckpt))) == 0
    lora_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("lora "))
    assert lora_line.endswith(f"resumed from {ckpt}"), lora_line  # not "fresh"
    straight = adapter_tensors(peft_model(d / "model", tmp_path / "straight"))
    resumed = adapter_tensors(peft_model(d / "model", tmp_path / "resumed"))
    assert straight.keys() == resumed.keys()
    for name, t in straight.items():
        assert torch.equal(t, resumed[name]), name


def test_resume_refuses_another_adapter_or_rank(setup, tmp_path, capsys):
    d, _, _ = setup
    run_lora(d / "model", d / "data.jsonl", tmp_path / "saved", "--lora-rank", "4", "--save-every", "3")
    ckpt = tmp_path / "saved" / "checkpoint-3"
    for extra, says in [(("--adapter", str(d / "adapter")), "leave out --adapter"),
                        (("--lora-rank", "8"), "lora_rank=4"),
                        (("--lora-rslora",), "lora_rslora=False")]:
        assert main(lora_args(d / "data.jsonl", tmp_path / "o", "--resume", str(ckpt), "--steps", "4", *extra)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
        assert not (tmp_path / "o").exists()


def _dropout_run(d, out, *extra):
    from safetensors.torch import load_file

    run_lora(d / "model", d / "data.jsonl", out, "--lora-rank", "4", *extra)
    return load_file(out / "adapter_model.safetensors")


def _rel(a, b):
    return max(float((a[k] - b[k]).norm() / b[k].norm()) for k in b if float(b[k].norm()) > 0)


def test_dropout_masks_are_drawn_alike_by_the_forward_and_the_recompute(setup, tmp_path):
    """``--lora-dropout``: the forward and the recompute before a backward draw the same masks,
    so every ``--activations`` choice and order trains the same adapters (a backward with other
    masks than its forward's would not); the masks depend on the seed, and dropout changes
    what is trained."""
    d, _, _ = setup
    drop = ("--lora-dropout", "0.3")
    ref = _dropout_run(d, tmp_path / "ref", *drop)
    for n, placement in enumerate([("--activations", "keep"), ("--checkpoint-every", "2"),
                                   ("--activations", "offload"), ("--order", "micro")]):
        assert _rel(_dropout_run(d, tmp_path / f"p{n}", *drop, *placement), ref) < 1e-6, placement
    assert _rel(_dropout_run(d, tmp_path / "seed1", *drop, "--seed", "1"), ref) > 1e-3
    assert _rel(_dropout_run(d, tmp_path / "none"), ref) > 1e-3


def test_dropout_resumes_exactly(setup, tmp_path):
    d, _, _ = setup
    drop = ("--lora-rank", "4", "--lora-dropout", "0.2")
    run_lora(d / "model", d / "data.jsonl", tmp_path / "straight", *drop)
    run_lora(d / "model", d / "data.jsonl", tmp_path / "saved", *drop, "--save-every", "2")
    assert main(lora_args(d / "data.jsonl", tmp_path / "resumed", "--resume", str(tmp_path / "saved" / "checkpoint-2"))) == 0
    from safetensors.torch import load_file

    a, b = (load_file(tmp_path / n / "adapter_model.safetensors") for n in ("straight", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_adapters_in_host_memory_resume_and_skip_as_on_the_gpu(setup, tmp_path, monkeypatch):
    """Adapters in host memory give the GPU-resident adapters' result bit for bit: a checkpoint
    of one resumes as the other (the files are the same), and a step whose gradient turns out
    not finite after some CPU AdamW has run is put back as the device's skips it."""
    d, _, _ = setup
    run_lora(d / "model", d / "data.jsonl", tmp_path / "gpu", "--adapter", str(d / "adapter"), "--lora-state", "gpu")
    run_lora(d / "model", d / "data.jsonl", tmp_path / "saved", "--adapter", str(d / "adapter"), "--save-every", "2",
             "--lora-state", "host")
    assert main(lora_args(d / "data.jsonl", tmp_path / "resumed", "--resume", str(tmp_path / "saved" / "checkpoint-2"),
                          "--lora-state", "gpu")) == 0
    on_gpu = adapter_tensors(peft_model(d / "model", tmp_path / "gpu"))
    for out in ("saved", "resumed"):
        other = adapter_tensors(peft_model(d / "model", tmp_path / out))
        assert other.keys() == on_gpu.keys() and all(torch.equal(t, other[k]) for k, t in on_gpu.items()), out

    monkeypatch.setenv("FLOWTRAIN_INJECT_NAN", "step=1,where=layer.0")
    for state in ("gpu", "host"):
        run_lora(d / "model", d / "data.jsonl", tmp_path / f"nan-{state}", "--adapter", str(d / "adapter"),
                 "--lora-state", state, "--metrics", str(tmp_path / f"{state}.jsonl"))
        skipped = [json.loads(line)["skipped"] for line in (tmp_path / f"{state}.jsonl").read_text().splitlines()]
        assert skipped == [False, True, False], state
    a = adapter_tensors(peft_model(d / "model", tmp_path / "nan-gpu"))
    b = adapter_tensors(peft_model(d / "model", tmp_path / "nan-host"))
    assert all(torch.equal(t, b[k]) for k, t in a.items())
    assert not all(torch.equal(t, on_gpu[k]) for k, t in a.items())  # the skipped step mattered


def test_a_preset_bases_lora_run_resumes_from_its_checkpoint_alone(tmp_path):
    """A run given no model trains the default preset's seeded weights; its checkpoint resumes
    without ``--model`` (the base is made again from the preset and the seed) and ends where the
    uninterrupted run ends, the adapters in host memory as on the device."""
    common = ["--steps", "4", "--device", "cpu", "--precision", "fp32", "--lora-rank", "4", "--no-progress",
              "--batch-size", "4", "--micro-batch-size", "2", "--seq-len", "32"]
    assert main(["train", *common, "--lora-state", "host", "--out", str(tmp_path / "straight")]) == 0
    assert main(["train", *common, "--lora-state", "host", "--out", str(tmp_path / "saved"), "--save-every", "2",
                 "--steps", "2"]) == 0
    assert main(["train", "--resume", str(tmp_path / "saved" / "checkpoint-2"), *common, "--lora-state", "gpu",
                 "--out", str(tmp_path / "resumed")]) == 0
    from safetensors.torch import load_file

    a = load_file(tmp_path / "straight" / "adapter_model.safetensors")
    b = load_file(tmp_path / "resumed" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_visualizer_says_what_a_lora_run_trains(tmp_path):
    common = ["--steps", "2", "--device", "cpu", "--lora-rank", "4", "--no-progress", "--seq-len", "32",
              "--batch-size", "2", "--micro-batch-size", "1"]
    for state, where in (("host", "streamed from host memory, CPU AdamW"), ("gpu", "resident with their AdamW")):
        assert main(["train", *common, "--lora-state", state, "--trace", str(tmp_path / f"{state}.json")]) == 0
        assert main(["viz", str(tmp_path / f"{state}.json"), "--out", str(tmp_path / f"{state}.html")]) == 0
        assert f"trains LoRA rank 4 over a frozen base, the adapters {where}" in (tmp_path / f"{state}.html").read_text()


# ---------------------------------------------------------------------- a mixture of experts' router and experts


@pytest.fixture(scope="module")
def moe_setup(tmp_path_factory):
    """Qwen3-MoE with a dense layer and PEFT's all-linear adapter (router, stacked experts at
    twice the rank, attention), every adapter tensor random, and its reference training."""
    d = tmp_path_factory.mktemp("lora_moe")
    make_checkpoint(d / "model", tied=False, layers=3, seed=5, model_type="qwen3_moe", **dict(MOE, mlp_only_layers=[1]))
    rows = make_data(d / "data.jsonl", seed=6)
    make_adapter(d / "model", d / "adapter", rank=2, alpha=6.0, targets="all-linear")
    return d, rows, reference(d / "model", d / "adapter", rows)


@pytest.mark.parametrize("placement", [
    ("--lora-state", "host"),
    ("--lora-state", "host", "--checkpoint-every", "2", "--order", "micro"),
    ("--activations", "offload", "--layout", "full"),
    ("--resident", "embed,head,layer.2", "--grad-clip", "0.5"),
    ("--activations", "keep", "--lora-state", "host", "--grad-clip", "0.5"),
])
def test_experts_adapters_train_as_peft_in_every_placement(moe_setup, tmp_path, placement):
    """The router's and the stacked experts' adapters against PEFT + AdamW, with the adapters in
    host memory, recomputed or offloaded activations, micro order, a resident layer, clipping."""
    d, _, ref = moe_setup
    if "--grad-clip" in placement:
        rows = make_data(d / "data.jsonl", seed=6)
        ref = reference_train(peft_model(d / "model", d / "adapter"), rows, lr=0.01, wd=0.1, betas=(0.9, 0.95),
                              eps=1e-6, clip=0.5, groups=lambda m: [p for p in m.parameters() if p.requires_grad])
    run_lora(d / "model", d / "data.jsonl", tmp_path / "out", "--adapter", str(d / "adapter"), *placement)
    assert_same_adapter(d / "model", tmp_path / "out", ref)


def test_experts_adapters_moved_and_merge_as_peft_merges(moe_setup, tmp_path):
    """Training moved the experts' and the router's adapters (the comparison is not vacuous); PEFT
    loads the adapter and generates; ``--merge`` writes the base with it merged in, as PEFT's
    ``merge_and_unload``."""
    d, _, ref = moe_setup
    start = adapter_tensors(peft_model(d / "model", d / "adapter"))
    moved = {n: float((p - start[n]).norm() / p.norm()) for n, p in adapter_tensors(ref).items()}
    assert any("experts.base_layer" in n for n in moved) and any("mlp.gate." in n for n in moved)
    assert min(moved.values()) > 1e-3, min(moved.items(), key=lambda kv: kv[1])
    run_lora(d / "model", d / "data.jsonl", tmp_path / "adapter", "--adapter", str(d / "adapter"))
    run_lora(d / "model", d / "data.jsonl", tmp_path / "merged", "--adapter", str(d / "adapter"), "--merge")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    loaded = peft_model(d / "model", tmp_path / "adapter")
    prompt = torch.tensor([[1, 2, 3, 4]])
    assert loaded.generate(input_ids=prompt, max_new_tokens=3, do_sample=False).shape == (1, 7)  # PEFT generates
    expect = loaded.merge_and_unload()
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(merged(input_ids=ids).logits, expect(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_experts_adapters_resume_exactly(moe_setup, tmp_path):
    """A fresh adapter (``--lora-rank``) over the experts, saved after two steps and resumed from the
    checkpoint alone, ends bit for bit as the run that went straight through; PEFT loads it."""
    d, _, _ = moe_setup
    flags = ("--lora-rank", "2", "--lora-gate-up-rank", "3", "--lora-state", "host")
    run_lora(d / "model", d / "data.jsonl", tmp_path / "straight", *flags)
    run_lora(d / "model", d / "data.jsonl", tmp_path / "saved", *flags, "--save-every", "2")
    assert main(lora_args(d / "data.jsonl", tmp_path / "resumed", "--resume", str(tmp_path / "saved" / "checkpoint-2"))) == 0
    config = json.loads((tmp_path / "straight" / "adapter_config.json").read_text())
    assert config["rank_pattern"] == {r".*\.gate_up_proj": 3} and config["alpha_pattern"] == {r".*\.gate_up_proj": 6.0}
    straight = adapter_tensors(peft_model(d / "model", tmp_path / "straight"))
    resumed = adapter_tensors(peft_model(d / "model", tmp_path / "resumed"))
    assert straight.keys() == resumed.keys() and any(".experts." in n for n in straight)
    for name, t in straight.items():
        assert torch.equal(t, resumed[name]), name


@pytest.mark.parametrize("flags, says", [
    (("--lora-rank", "2", "--lora-targets", "q_proj,gate_proj"), "--lora-targets gate_proj and up_proj are one stacked weight"),
    (("--lora-rank", "2", "--lora-dropout", "0.1"), "--lora-dropout does not apply to a mixture of experts"),
    (("--lora-gate-up-rank", "4",), "--lora-gate-up-rank is for LoRA"),
    (("--lora-rank", "2", "--lora-rslora"), "rsLoRA scales each adapter by alpha / sqrt(rank)"),
])
def test_experts_adapter_flags_are_refused_in_one_line(moe_setup, tmp_path, capsys, flags, says):
    d, _, _ = moe_setup
    assert main(lora_args(d / "data.jsonl", tmp_path / "out", "--model", str(d / "model"), *flags)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    assert not (tmp_path / "out").exists()


def test_attention_only_adapters_with_dropout_run_on_a_mixture_of_experts(moe_setup, tmp_path):
    """Dropout is refused only where it would reach the router or the experts."""
    d, _, _ = moe_setup
    run_lora(d / "model", d / "data.jsonl", tmp_path / "out", "--lora-rank", "2", "--lora-dropout", "0.1",
             "--lora-targets", "q_proj,v_proj")
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["q_proj", "v_proj"] and config["target_parameters"] is None


@pytest.mark.parametrize("state, where", [("host", "host"), ("auto", "gpu")])
def test_bench_records_where_the_adapters_lived(setup, tmp_path, state, where):
    """A LoRA bench line says where the adapters and their AdamW lived (``auto`` decides it), so
    the simulator's check against measured runs plans each run as it ran."""
    d, _, _ = setup
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", str(d / "model"), "--data", str(d / "data.jsonl"), "--seq-len", str(SEQ),
                 "--batch-size", "4", "--micro-batch-size", "2", "--steps", "2", "--warmup", "1", "--device", "cpu",
                 "--lora-rank", "4", "--lora-state", state, "--json", str(out)]) == 0
    row = json.loads(out.read_text())
    assert (row["lora_state"], row["lora_rank"]) == (where, 4)
    assert (row["budgets"]["grads"] > 0) == (where == "host")  # host adapters' gradients leave in slots


def test_resume_over_changed_base_weights_is_refused(setup, tmp_path, capsys):
    """The checkpoint holds the adapters, not the base: resumed over a base whose weights
    changed (same config.json), the adapters would be trained on for other weights. The
    checkpoint records the base's fingerprint; a resume over other weights is refused in one
    line, over the same weights (copied elsewhere) it goes on."""
    d, _, _ = setup
    run_lora(d / "model", d / "data.jsonl", tmp_path / "saved", "--lora-rank", "4", "--save-every", "2")
    ckpt = tmp_path / "saved" / "checkpoint-2"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert len(state["base"]["fingerprint"]) == 64
    from safetensors.torch import load_file, save_file

    changed = tmp_path / "changed"
    shutil.copytree(d / "model", changed)
    weights = load_file(changed / "model.safetensors")
    name = next(n for n in weights if "layers.1.mlp.down_proj" in n)
    weights[name] = weights[name] * 1.5  # a fine-tune of one matrix
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})
    resume = ("--resume", str(ckpt), "--steps", "4")
    assert main(lora_args(d / "data.jsonl", tmp_path / "o", *resume, "--model", str(changed))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "other base weights" in err[0] and str(changed) in err[0], err
    assert not (tmp_path / "o").exists()
    same = tmp_path / "same"
    shutil.copytree(d / "model", same)
    assert main(lora_args(d / "data.jsonl", tmp_path / "o2", *resume, "--model", str(same))) == 0


def test_an_adapter_holding_nan_is_refused(setup, tmp_path, capsys):
    d, _, _ = setup
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(d / "adapter", bad)
    tensors = load_file(bad / "adapter_model.safetensors")
    name = sorted(tensors)[3]
    tensors[name][0, 0] = float("nan")
    save_file(tensors, bad / "adapter_model.safetensors", metadata={"format": "pt"})
    assert main(lora_args(d / "data.jsonl", tmp_path / "out", "--model", str(d / "model"), "--adapter", str(bad))) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds NaN or inf" in err[0] and name in err[0], err
    assert not (tmp_path / "out").exists()


def test_the_adapter_names_a_local_base_by_its_absolute_path(setup, tmp_path, monkeypatch):
    """``--model`` given relative: PEFT, loading the adapter from another folder, still finds
    the base (AutoPeftModelForCausalLM reads base_model_name_or_path)."""
    d, _, _ = setup
    shutil.copytree(d / "model", tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    assert main(lora_args(d / "data.jsonl", tmp_path / "out", "--model", "base", "--lora-rank", "4")) == 0
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "base")
    monkeypatch.chdir(d)  # where "base" names nothing
    model = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "out")
    assert any("lora_A" in n for n, _ in model.named_parameters())
