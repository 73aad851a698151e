"""``flowtrain train --objective dpo`` against a plain torch DPO, fp32 on the CPU.

The reference is written here from the paper's formula with code nobody here wrote doing the
work: transformers' ``LlamaForCausalLM`` (or PEFT's model over it), the reference being the
initial weights (under LoRA the base with its adapters disabled, as TRL does with PEFT), each
completion's log-probability summed over its tokens (averaged for IPO), the loss the mean over
a step's pairs, ``torch.optim.AdamW``. Three steps of two micro-batches must give the same
weights to a relative error of 1e-4 per tensor.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from flowtrain.cli import main
from flowtrain.errors import DataError
from flowtrain.train.objectives import grpo_token_loss

from test_train_vs_hf import assert_same_weights, make_checkpoint

# PEFT 0.21 asks transformers 5 a deprecated question when it wraps a model
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

PAIRS = 4  # pairs per step: 8 sequences, two micro-batches of 4
STEPS = 3
SEQ = 16
OPT = dict(lr=0.01, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-6)


def make_pairs(path, seed=1, vocab=64, n=PAIRS * STEPS):
    g = torch.Generator().manual_seed(seed)

    def ids(lo, hi):
        return torch.randint(1, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()

    rows = [{"prompt_input_ids": ids(1, 6), "chosen_input_ids": ids(1, 7), "rejected_input_ids": ids(1, 7)}
            for _ in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def completion_logps(model, rows, key, average=False):
    """Each row's log-probability of its completion ``key`` after its prompt: (rows,)."""
    ids = torch.zeros(len(rows), SEQ, dtype=torch.long)
    labels = torch.full((len(rows), SEQ), -100, dtype=torch.long)
    for i, r in enumerate(rows):
        p, c = r["prompt_input_ids"], r[key]
        ids[i, :len(p) + len(c)] = torch.tensor(p + c)
        labels[i, len(p):len(p) + len(c)] = torch.tensor(c)
    logits = model(input_ids=ids).logits[:, :-1]
    labels = labels[:, 1:]
    mask = labels != -100
    logp = torch.log_softmax(logits.float(), -1).gather(-1, labels.clamp_min(0)[..., None])[..., 0]
    total = (logp * mask).sum(-1)
    return total / mask.sum(-1) if average else total


def reference_dpo(model, rows, *, beta=0.1, loss="sigmoid", ref=None, params=None):
    """Plain torch DPO: ``ref(rows, key)`` the reference's log-probabilities (default: a frozen
    copy of the model as it starts)."""
    frozen = copy.deepcopy(model).eval()
    avg = loss == "ipo"
    ref = ref or (lambda rs, key: completion_logps(frozen, rs, key, avg))
    opt = torch.optim.AdamW(params if params is not None else model.parameters(), **OPT)
    for s in range(STEPS):
        opt.zero_grad()
        for m in range(0, PAIRS, 2):  # two pairs per micro-batch
            rs = rows[s * PAIRS + m:s * PAIRS + m + 2]
            with torch.no_grad():
                rc, rr = ref(rs, "chosen_input_ids"), ref(rs, "rejected_input_ids")
            pc, pr = completion_logps(model, rs, "chosen_input_ids", avg), completion_logps(model, rs, "rejected_input_ids", avg)
            logits = (pc - pr) - (rc - rr)
            losses = -F.logsigmoid(beta * logits) if loss == "sigmoid" else (logits - 1 / (2 * beta)) ** 2
            (losses.sum() / PAIRS).backward()
        opt.step()
    return model


def dpo_args(model_dir, data, out, *extra):
    return ["train", "--model", str(model_dir), "--data", str(data), "--objective", "dpo", "--steps", str(STEPS),
            "--batch-size", str(2 * PAIRS), "--micro-batch-size", "4", "--seq-len", str(SEQ), "--no-shuffle",
            "--lr", "0.01", "--weight-decay", "0.1", "--betas", "0.9,0.95", "--eps", "1e-6",
            "--device", "cpu", "--precision", "fp32", "--out", str(out), "--no-progress",
            "--lr-schedule", "constant", "--warmup-steps", "0", "--weight-decay-skip", "none", *extra]


@pytest.fixture(autouse=True)
def _data_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWTRAIN_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("dpo")
    start = make_checkpoint(d / "model")
    rows = make_pairs(d / "pairs.jsonl")
    return d, rows, start


@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
@pytest.mark.parametrize("placement", [(), ("--order", "micro", "--activations", "keep")])
def test_dpo_matches_torch(setup, tmp_path, loss, placement):
    d, rows, start = setup
    ref = reference_dpo(copy.deepcopy(start), rows, loss=loss)
    assert main(dpo_args(d / "model", d / "pairs.jsonl", tmp_path / "out", "--dpo-loss", loss, *placement)) == 0
    assert_same_weights(tmp_path / "out", ref)


def test_dpo_moved_the_weights_and_reports_rewards(setup, tmp_path):
    d, rows, start = setup
    ref = reference_dpo(copy.deepcopy(start), rows)
    moved = [float((p - start.get_parameter(n)).detach().norm() / p.detach().norm()) for n, p in ref.named_parameters()]
    assert min(moved) > 1e-3
    metrics = tmp_path / "m.jsonl"
    assert main(dpo_args(d / "model", d / "pairs.jsonl", tmp_path / "out", "--metrics", str(metrics))) == 0
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    first = lines[0]
    # the first step's policy is the reference: every reward is 0, the loss log 2
    assert first["rewards/chosen"] == first["rewards/rejected"] == first["rewards/margins"] == 0.0
    assert abs(first["loss"] - 0.693147) < 1e-5
    for line in lines:
        assert abs(line["rewards/margins"] - (line["rewards/chosen"] - line["rewards/rejected"])) < 1e-6
        assert 0.0 <= line["rewards/accuracies"] <= 1.0


def test_resume_is_bit_exact(setup, tmp_path):
    d, _, _ = setup
    assert main(dpo_args(d / "model", d / "pairs.jsonl", tmp_path / "whole")) == 0
    assert main(dpo_args(d / "model", d / "pairs.jsonl", tmp_path / "cut", "--save-every", "1")) == 0
    resumed = tmp_path / "resumed"
    assert main(dpo_args(d / "model", d / "pairs.jsonl", resumed, "--resume", str(tmp_path / "cut" / "checkpoint-1"))) == 0
    a = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "whole").state_dict()
    b = transformers.AutoModelForCausalLM.from_pretrained(resumed).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("where", ["loss", "layer.0"])
def test_a_non_finite_step_is_skipped_and_the_run_goes_on_from_the_step_before(setup, tmp_path, monkeypatch, where):
    """A NaN written into step 2's loss (known before any Adam) or layer 0's gradient (found
    last, after the units above were updated and recorded): the step is skipped as SFT's is
    (``tests/train/test_nonfinite.py``), and the run ends bit for bit where a run on the same
    pairs without that step's ends: nothing of it reached the weights, Adam or the step count."""
    d, rows, _ = setup
    without = tmp_path / "without.jsonl"
    without.write_text("".join(json.dumps(r) + "\n" for r in rows[:PAIRS] + rows[2 * PAIRS:]))
    assert main(dpo_args(d / "model", without, tmp_path / "ref", "--steps", str(STEPS - 1))) == 0
    monkeypatch.setenv("FLOWTRAIN_INJECT_NAN", f"step=1,where={where}")
    metrics = tmp_path / "m.jsonl"
    assert main(dpo_args(d / "model", d / "pairs.jsonl", tmp_path / "nan", "--metrics", str(metrics))) == 0
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [x["skipped"] for x in lines] == [False, True, False]
    # the loss as computed (a NaN is written null)
    assert lines[1]["loss"] is None if where == "loss" else math.isfinite(lines[1]["loss"])
    a = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ref").state_dict()
    b = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "nan").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_another_beta(setup, tmp_path):
    d, _, _ = setup
    assert main(dpo_args(d / "model", d / "pairs.jsonl", tmp_path / "cut", "--save-every", "1", "--steps", "1")) == 0
    code = main(dpo_args(d / "model", d / "pairs.jsonl", tmp_path / "again", "--resume",
                         str(tmp_path / "cut" / "checkpoint-1"), "--dpo-beta", "0.2"))
    assert code != 0


def test_lora_dpo_matches_peft(setup, tmp_path):
    peft = pytest.importorskip("peft")
    from test_lora_train import make_adapter

    d, rows, _ = setup
    make_adapter(d / "model", tmp_path / "adapter", rank=4, alpha=8.0)
    base = transformers.AutoModelForCausalLM.from_pretrained(d / "model")
    model = peft.PeftModel.from_pretrained(base, tmp_path / "adapter", is_trainable=True)

    def ref(rs, key):
        with model.disable_adapter():
            return completion_logps(model, rs, key)

    reference_dpo(model, rows, ref=ref, params=[p for p in model.parameters() if p.requires_grad])
    assert main(dpo_args(d / "model", d / "pairs.jsonl", tmp_path / "out", "--adapter", str(tmp_path / "adapter"))) == 0
    from test_lora_train import assert_same_adapter  # (imports peft: only where it is there)

    assert_same_adapter(d / "model", tmp_path / "out", model)


def test_conversational_rows_train_as_their_tokenized_form(tmp_path):
    """Rendered with the chat template as TRL renders them (prompt with the generation prompt,
    each completion as the rest of prompt + completion, EOS appended), tokenised with
    transformers' tokenizer: the tokenized rows written from that train the same weights."""
    from test_finetune_chat import CHATML_GENERATION, make_bpe_tokenizer, rendered_corpus

    model_dir = tmp_path / "model"
    make_checkpoint(model_dir, vocab=640)
    make_bpe_tokenizer(model_dir, CHATML_GENERATION, rendered_corpus())
    config = json.loads((model_dir / "config.json").read_text())
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    config["eos_token_id"] = hf.convert_tokens_to_ids("<|im_end|>")
    (model_dir / "config.json").write_text(json.dumps(config))
    chats = [("What is two plus two?", "Four.", "Five."), ("Hi", "Hello!", "Go away."),
             ("Thanks!", "You are welcome.", "No."), ("Bye", "Bye!", "What?")] * 2
    conv, tokenized = [], []
    for q, yes, no in chats:
        prompt = [{"role": "user", "content": q}]
        row = {"prompt": prompt, "chosen": [{"role": "assistant", "content": yes}],
               "rejected": [{"role": "assistant", "content": no}]}
        conv.append(row)
        p_text = hf.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        tok = {"prompt_input_ids": hf(p_text, add_special_tokens=False)["input_ids"]}
        for key in ("chosen", "rejected"):
            whole = hf.apply_chat_template(prompt + row[key], tokenize=False)
            assert whole.startswith(p_text)
            tok[f"{key}_input_ids"] = hf(whole[len(p_text):], add_special_tokens=False)["input_ids"] + [hf.eos_token_id]
        tokenized.append(tok)
    (tmp_path / "conv.jsonl").write_text("".join(json.dumps(r) + "\n" for r in conv))
    (tmp_path / "tok.jsonl").write_text("".join(json.dumps(r) + "\n" for r in tokenized))
    for name in ("conv", "tok"):
        args = dpo_args(model_dir, tmp_path / f"{name}.jsonl", tmp_path / f"out-{name}", "--steps", "2")
        args[args.index("--seq-len") + 1] = "48"
        assert main(args) == 0
    a = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out-conv").state_dict()
    b = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out-tok").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("row, says", [
    ({"prompt": "a", "chosen": "b"}, "line 2: a preference row needs"),
    ({"prompt": "a", "chosen": ["b"], "rejected": "c"}, "line 2: \"prompt\", \"chosen\" and \"rejected\" must be"),
    ({"prompt": "a", "chosen": "", "rejected": "c"}, "line 2: \"chosen\" is empty"),
    ({"prompt_input_ids": [1], "chosen_input_ids": [999], "rejected_input_ids": [2]}, "line 2"),
    ({"prompt_input_ids": [1], "chosen_input_ids": ["x"], "rejected_input_ids": [2]}, "line 2: \"chosen_input_ids\""),
    ({"prompt_input_ids": [1] * 20, "chosen_input_ids": [2], "rejected_input_ids": [2]}, "longer than --seq-len 16"),
])
def test_bad_rows_are_refused_in_one_line_naming_the_row(setup, tmp_path, row, says):
    from flowtrain.data.preference import load_pairs

    good = {"prompt": "x", "chosen": "y", "rejected": "z"}
    if "prompt_input_ids" in row:
        good = {"prompt_input_ids": [1], "chosen_input_ids": [2], "rejected_input_ids": [3]}
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError) as e:
        load_pairs(path, SEQ, 300)  # text rows in UTF-8 bytes
    assert says in str(e.value) and "\n" not in str(e.value)
    assert main(dpo_args(setup[0] / "model", path, tmp_path / "out")) != 0


def test_odd_micro_batch_is_refused(setup, tmp_path):
    d, _, _ = setup
    args = dpo_args(d / "model", d / "pairs.jsonl", tmp_path / "out")
    args[args.index("--micro-batch-size") + 1] = "1"
    assert main(args) != 0


def test_grpo_loss_matches_torch():
    """GRPO's per-token loss against the formula written out in torch (TRL's GRPOTrainer)."""
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 7, generator=g, dtype=torch.float64) * 3
    old = logp + torch.randn(3, 7, generator=g, dtype=torch.float64) * 0.3
    ref = logp + torch.randn(3, 7, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(3, 1, generator=g, dtype=torch.float64).expand(3, 7)
    beta, lo, hi = 0.04, 0.2, 0.28
    got = grpo_token_loss(logp, adv, old, ref, beta=beta, epsilon_low=lo, epsilon_high=hi)
    ratio = (logp - old).exp()
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - lo, 1 + hi) * adv)
    kl = (ref - logp).exp() - (ref - logp) - 1
    torch.testing.assert_close(got, -surrogate + beta * kl, rtol=1e-5, atol=1e-5)
    # the first update of a generation: ratio 1, the gradient is the advantage's
    lp = logp.clone().requires_grad_(True)
    grpo_token_loss(lp, adv).sum().backward()
    torch.testing.assert_close(lp.grad, -adv, rtol=1e-5, atol=1e-5)
