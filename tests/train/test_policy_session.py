"""``PolicyTrainer``: GRPO steps through the Python API against a plain torch GRPO, fp32 on the CPU.

The reference is transformers' ``LlamaForCausalLM`` (or PEFT's model over it) from the same
weights, GRPO's per-token loss written out here in torch (clipped ratio, k3 KL to the
reference, the step's token weights), and ``torch.optim.AdamW``. Two steps, the second against
the first's log-probabilities as the old policy's, must give the same weights to a relative
error of 1e-4 per tensor; every returned log-probability must equal transformers' log-softmax
gathered at the token to 1e-5. A session resumed from another's checkpoint goes on bit for bit
as that one did.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flowtrain.errors import ConfigError, DataError
from flowtrain.train import PolicyTrainer, TrainConfig, train

from test_train_vs_hf import assert_same_weights, make_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

ROWS, WIDTH, SEQ = 8, 14, 16
OPT = dict(lr=0.01, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-6)
BETA, EPS_LOW, EPS_HIGH = 0.04, 0.2, 0.28


def config(model_dir, **more) -> TrainConfig:
    base = dict(model=str(model_dir), batch_size=ROWS, micro_batch_size=4, seq_len=SEQ, steps=2, lr=OPT["lr"],
                weight_decay=OPT["weight_decay"], betas=OPT["betas"], eps=OPT["eps"], device="cpu",
                precision="fp32", progress=False, lr_schedule="constant", warmup_steps=0, weight_decay_skip="none")
    return TrainConfig(**{**base, **more})


def make_rows(seed, vocab=64):
    """Prompt + completion rows, right-padded with 0 to WIDTH, and the completions' mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(ROWS, WIDTH, dtype=torch.long)
    mask = torch.zeros(ROWS, WIDTH, dtype=torch.bool)
    for r in range(ROWS):
        p = int(torch.randint(2, 6, (1,), generator=g))
        c = int(torch.randint(1, WIDTH - p + 1, (1,), generator=g))
        ids[r, :p + c] = torch.randint(1, vocab, (p + c,), generator=g)
        mask[r, p:p + c] = True
    return ids, mask


def hf_logps(model, ids, mask):
    """transformers' log-softmax gathered at each token, aligned with ``ids`` (0 outside the mask)."""
    logits = model(input_ids=ids).logits[:, :-1].float()
    picked = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    out = torch.cat([torch.zeros(ids.shape[0], 1), picked], 1)
    return out * mask


def torch_grpo(lp, mask, adv, old, ref, loss_type):
    """GRPO's loss written out: -min(r A, clip(r) A) + beta k3(ref, lp), averaged as TRL does."""
    old = lp.detach() if old is None else old
    ratio = torch.exp(lp - old)
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH) * adv)
    d = ref - lp
    per_token = per_token + BETA * (torch.exp(d) - d - 1)
    m = mask.float()
    if loss_type == "dapo":
        return (per_token * m).sum() / m.sum()
    return ((per_token * m).sum(-1) / m.sum(-1).clamp_min(1)).mean()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("grpo")
    start = make_checkpoint(d / "model")
    return d, start


@pytest.fixture(autouse=True)
def _data_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWTRAIN_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_two_steps_match_torch(setup, tmp_path, loss_type):
    d, start = setup
    model = copy.deepcopy(start)
    frozen = copy.deepcopy(start).eval()
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    steps = [make_rows(10), make_rows(11)]
    advs = [torch.randn(ROWS, generator=torch.Generator().manual_seed(20 + s)) for s in range(2)]
    with PolicyTrainer(config(d / "model"), loss_type=loss_type, beta=BETA, epsilon=EPS_LOW,
                       epsilon_high=EPS_HIGH) as session:
        # the reference's and (for step 2) the old policy's log-probabilities, forward only
        refs = [session.logprobs(ids, mask) for ids, mask in steps]
        for (ids, mask), ref in zip(steps, refs):
            assert (ref - hf_logps(frozen, ids, mask).detach()).abs().max() < 1e-5
        old_2 = refs[1]  # step 2's rows scored by the policy before step 1: ratio != 1 there
        for s, ((ids, mask), adv, ref) in enumerate(zip(steps, advs, refs)):
            old = None if s == 0 else old_2
            out = session.step(ids, mask, adv, old_logps=old, ref_logps=ref)
            opt.zero_grad()
            lp = hf_logps(model, ids, mask)
            assert (out.logps - lp.detach()).abs().max() < 1e-5  # the policy's own, before the update
            assert out.logps.shape == ids.shape and not out.logps[~mask].any()
            loss = torch_grpo(lp, mask, adv[:, None].expand(ROWS, WIDTH), old, ref, loss_type)
            loss.backward()
            opt.step()
            assert abs(out.metrics.loss - float(loss.detach())) < 1e-5
            assert out.metrics.step == s + 1 and set(out.metrics.policy) == {"kl", "clip_ratio/region_mean"}
        assert out.metrics.policy["kl"] > 0
        ours = session.state_dict()
        session.save(tmp_path / "saved")
        theirs = dict(model.named_parameters())
        assert ours.keys() == theirs.keys()
        for name, r in theirs.items():
            err = float((ours[name] - r.detach()).norm() / r.detach().norm())
            assert err < 1e-4, f"{name}: relative error {err:.2e}"
        fresh = transformers.AutoModelForCausalLM.from_pretrained(d / "model")
        session.to_hf(fresh)
        assert all(torch.equal(fresh.get_parameter(n), ours[n]) for n in ours)
    assert_same_weights(tmp_path / "saved", model)
    moved = max(float((p - start.get_parameter(n)).detach().norm()) for n, p in model.named_parameters())
    assert moved > 1e-3


def test_reinforce_and_lora_match_peft(setup, tmp_path):
    """Under LoRA: PEFT's model trained the same way, old_logps left out (REINFORCE's ratio 1),
    the reference the base without its adapters (``logprobs(reference=True)``)."""
    peft = pytest.importorskip("peft")
    from test_lora_train import make_adapter

    d, _ = setup
    make_adapter(d / "model", tmp_path / "adapter", rank=4, alpha=8.0)
    model = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(d / "model"),
                                           tmp_path / "adapter", is_trainable=True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **OPT)
    with PolicyTrainer(config(d / "model", adapter=str(tmp_path / "adapter")), beta=BETA, epsilon=EPS_LOW,
                       epsilon_high=EPS_HIGH) as session:
        for s in range(2):
            ids, mask = make_rows(30 + s)
            adv = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(40 + s))  # per token
            ref = session.logprobs(ids, mask, reference=True)
            with torch.no_grad(), model.disable_adapter():
                assert (ref - hf_logps(model, ids, mask)).abs().max() < 1e-5
            out = session.step(ids, mask, adv, ref_logps=ref)
            opt.zero_grad()
            lp = hf_logps(model, ids, mask)
            assert (out.logps - lp.detach()).abs().max() < 1e-5
            torch_grpo(lp, mask, adv, None, ref, "dapo").backward()
            opt.step()
        session.save(tmp_path / "out")
        merged = session.to_hf(transformers.AutoModelForCausalLM.from_pretrained(d / "model"))
    from test_lora_train import assert_same_adapter  # (imports peft: only where it is there)

    assert_same_adapter(d / "model", tmp_path / "out", model)
    ids, mask = make_rows(50)
    with torch.no_grad():  # the merged copy generates as the adapted model does
        assert (hf_logps(merged, ids, mask) - hf_logps(model, ids, mask)).abs().max() < 1e-4


def test_bad_inputs_are_refused_in_one_line(setup):
    d, _ = setup
    ids, mask = make_rows(60)
    adv = torch.ones(ROWS)
    with PolicyTrainer(config(d / "model"), beta=BETA) as session:
        cases = [
            (lambda: session.step(ids[:6], mask[:6], adv[:6]), "rows"),
            (lambda: session.step(ids, mask[:, :5], adv), "completion_mask is"),
            (lambda: session.step(ids, torch.zeros_like(mask), adv, ref_logps=torch.zeros(ids.shape)), "no token"),
            (lambda: session.step(ids, mask, torch.ones(ROWS, 3), ref_logps=torch.zeros(ids.shape)), "advantages is"),
            (lambda: session.step(ids, mask, adv), "ref_logps"),
            (lambda: session.step(ids, mask, adv, old_logps=torch.zeros(ROWS, 2), ref_logps=torch.zeros(ids.shape)),
             "old_logps is"),
            (lambda: session.step(torch.zeros(ROWS, SEQ + 1, dtype=torch.long), None, adv), "seq_len"),
            (lambda: session.step(ids.float(), mask, adv), "integer"),
            (lambda: session.step(ids + 64, mask, adv), "vocabulary"),
            (lambda: session.step(ids, torch.ones_like(mask), adv), "first token"),
            (lambda: session.step(ids, mask, torch.full((ROWS,), float("nan")), ref_logps=torch.zeros(ids.shape)),
             "not finite"),
            (lambda: session.logprobs(ids, mask, reference=True), "reference=True"),
        ]
        for call, words in cases:
            with pytest.raises((DataError, ConfigError)) as e:
                call()
            assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
        # refused inputs change nothing: the session still steps
        out = session.step(ids, mask, adv, ref_logps=torch.zeros(ids.shape))
        assert out.metrics.step == 1
    for cfg, words in [(config(d / "model", data="x.jsonl"), "data"), (config(d / "model", objective="dpo"), "dpo")]:
        with pytest.raises(ConfigError, match=words):
            PolicyTrainer(cfg)
    with pytest.raises(ConfigError, match="loss_type"):
        PolicyTrainer(config(d / "model"), loss_type="nope")


RESUMED = dict(steps=4, lr_schedule="cosine", warmup_steps=1, min_lr=0.001)  # a rate that changes every step


def resumable_steps(session, first, last, beta=BETA):
    """Steps ``first``..``last`` (1-based) of a fixed run: each step's rows, advantages and
    reference seeded by its number, the old policy's log-probabilities those of a step before
    (so the ratio is clipped somewhere). Returns each step's metrics."""
    out = []
    for s in range(first, last + 1):
        ids, mask = make_rows(70 + s)
        g = torch.Generator().manual_seed(80 + s)
        adv, ref = torch.randn(ROWS, generator=g), -4 - torch.rand(ROWS, WIDTH, generator=g)
        old = (session.logprobs(ids, mask) + 0.3 * torch.randn(ROWS, WIDTH, generator=g)) * mask
        out.append(session.step(ids, mask, adv, old_logps=old, ref_logps=ref if beta else None).metrics)
    return out


def saved_weights(folder):
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    assert files, f"no weights in {folder}"
    return {k: v for f in files for k, v in load_file(f).items()}


def test_resume_goes_on_bit_for_bit(tmp_path):
    """Session A takes 4 steps with a checkpoint every 2; session B resumes A's checkpoint-2 and
    takes steps 3 and 4 on the same rows: the same step count, losses, rates and weights, bit
    for bit (the weights, Adam's moments and step, the schedule's position all came back)."""
    a_cfg = config("tiny", out=str(tmp_path / "a"), save_every=2, **RESUMED)
    with PolicyTrainer(a_cfg, loss_type="grpo", beta=BETA, epsilon=EPS_LOW, epsilon_high=EPS_HIGH) as a:
        whole = resumable_steps(a, 1, 4)
        a_weights = a.state_dict()
    assert sorted(p.name for p in (tmp_path / "a").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    b_cfg = config("tiny", out=str(tmp_path / "b"), resume=str(tmp_path / "a" / "checkpoint-2"), **RESUMED)
    with PolicyTrainer(b_cfg, loss_type="grpo", beta=BETA, epsilon=EPS_LOW, epsilon_high=EPS_HIGH) as b:
        assert b.steps_done == 2
        resumed = resumable_steps(b, 3, 4)
        assert b.steps_done == 4
        b_weights = b.state_dict()
    assert [m.step for m in resumed] == [3, 4]
    assert [(m.loss, m.lr, m.grad_norm) for m in resumed] == [(m.loss, m.lr, m.grad_norm) for m in whole[2:]]
    assert resumed[0].lr != resumed[1].lr
    assert a_weights.keys() == b_weights.keys() and all(torch.equal(a_weights[k], b_weights[k]) for k in a_weights)
    a_saved, b_saved = saved_weights(tmp_path / "a"), saved_weights(tmp_path / "b")
    assert a_saved.keys() == b_saved.keys() and all(torch.equal(a_saved[k], b_saved[k]) for k in a_saved)
    moved = saved_weights(tmp_path / "a" / "checkpoint-2")
    assert any(not torch.equal(moved[k], a_saved[k]) for k in a_saved)  # steps 3 and 4 changed the weights


def test_resume_refuses_other_settings_in_one_line(tmp_path):
    """A session resumes only a session's checkpoint, with the same loss settings (kept in its
    trainer_state.json) and the config's as train checks them, before a step is taken; train
    resumes no session's checkpoint."""
    cut = tmp_path / "cut" / "checkpoint-2"
    with PolicyTrainer(config("tiny", out=str(tmp_path / "cut"), save_every=2), beta=BETA) as session:
        resumable_steps(session, 1, 2)
    sft = tmp_path / "sft"
    train(config("tiny", out=str(sft), save_every=1, steps=1))
    again = dict(out=str(tmp_path / "again"), steps=4)
    cases = [
        (dict(resume=str(cut), **again), dict(beta=0.0), "beta=0.04"),
        (dict(resume=str(cut), **again), dict(beta=BETA, loss_type="grpo"), "loss_type='dapo'"),
        (dict(resume=str(cut), **again), dict(beta=BETA, epsilon_high=0.28), "epsilon_high=0.2"),
        (dict(resume=str(cut), out=str(tmp_path / "again")), dict(beta=BETA), "done 2 steps"),  # steps=2: no step left
        (dict(resume=str(cut), lr=0.02, **again), dict(beta=BETA), "lr=0.01"),
        (dict(resume=str(sft / "checkpoint-1"), **again), dict(beta=BETA), "written by train"),
    ]
    for more, kwargs, words in cases:
        with pytest.raises(ConfigError) as e:
            PolicyTrainer(config("tiny", **more), **kwargs)
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not (tmp_path / "again").exists()  # nothing was written
    with pytest.raises(ConfigError, match="written by a PolicyTrainer"):
        train(config("tiny", out=str(tmp_path / "sft2"), resume=str(cut), steps=4))


def test_grpo_loop_example_runs(tmp_path):
    """docs/examples/grpo_loop.py runs as it stands, start to end, on the CPU."""
    example = Path(__file__).resolve().parents[2] / "docs" / "examples" / "grpo_loop.py"
    done = subprocess.run([sys.executable, str(example), "--out", str(tmp_path / "policy")], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "mean reward" in done.stdout
    assert (tmp_path / "policy" / "config.json").is_file()
