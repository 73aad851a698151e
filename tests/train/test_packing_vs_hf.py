"""Packed training equals transformers + AdamW trained on each example on its own.

flowtrain packs short examples into rows (restarting positions, attention masked between
them). The reference is transformers run on every example *separately* -- no packing, no
mask of ours -- with the loss of a step the sum of its examples' CE over the step's target
tokens (transformers' ``num_items_in_batch`` mean) and torch AdamW. Which examples share a step
is read from flowtrain's packed rows; the packing itself is tested in test_data_pack.py.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from test_families import _rel_errs
from test_train_vs_hf import make_checkpoint

from flowtrain.data.source import load_sequences

SEQ, ROWS, STEPS = 16, 2, 3


def _examples(path, seed, vocab=64, n=24):
    """Rows of ``input_ids`` with ``labels`` (a prompt of -100, then the answer), 3 to 9 long."""
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for _ in range(n):
            length = int(torch.randint(3, 10, (1,), generator=g))
            ids = torch.randint(0, vocab, (length,), generator=g).tolist()
            cut = int(torch.randint(0, length - 1, (1,), generator=g))
            f.write(json.dumps({"input_ids": ids, "labels": [-100] * cut + ids[cut:]}) + "\n")


def _documents(ids, targets, positions):
    """The examples of one packed row: (their ids, their targets), split where positions restart."""
    starts = [t for t in range(len(positions)) if positions[t] == 0] + [len(positions)]
    return [(ids[a:b], targets[a:b]) for a, b in zip(starts, starts[1:])]


def _reference(model, seqs, *, lr, wd):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, betas=(0.9, 0.95), eps=1e-6)
    for s in range(STEPS):
        rows = range(s * ROWS, (s + 1) * ROWS)
        n = int(sum((seqs.targets[r] != -100).sum() for r in rows))
        opt.zero_grad()
        for r in rows:
            for ids, targets in _documents(seqs.input_ids[r], seqs.targets[r], seqs.positions[r]):
                if (targets != -100).any():
                    logits = model(input_ids=ids[None]).logits[0]
                    (F.cross_entropy(logits, targets, reduction="sum", ignore_index=-100) / n).backward()
        opt.step()
    return model


@pytest.mark.parametrize("spec", [dict(model_type="llama"),
                                  dict(model_type="mistral", sliding_window=4),
                                  dict(model_type="gemma3_text", head_dim=8, tied=True, sliding_window=3,
                                       layer_types=["sliding_attention", "full_attention"])],
                         ids=["llama", "mistral-window", "gemma3"])
def test_packed_rows_train_like_each_example_alone(tmp_path, spec):
    from flowtrain.cli import main

    make_checkpoint(tmp_path / "model", layers=2, seed=5, **spec)
    _examples(tmp_path / "data.jsonl", seed=6)
    seqs = load_sequences(tmp_path / "data.jsonl", SEQ, 64, cache_dir=tmp_path / "cache")
    assert seqs.positions is not None and len(seqs) >= ROWS * STEPS
    assert max(len(_documents(i, t, p)) for i, t, p in zip(seqs.input_ids, seqs.targets, seqs.positions)) >= 3
    ref = _reference(make_checkpoint(tmp_path / "ref", layers=2, seed=5, **spec), seqs, lr=0.01, wd=0.1)

    assert main(["train", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "data.jsonl"),
                 "--steps", str(STEPS), "--batch-size", str(ROWS), "--micro-batch-size", "1",
                 "--seq-len", str(SEQ), "--no-shuffle", "--lr", "0.01", "--weight-decay", "0.1",
                 "--betas", "0.9,0.95", "--eps", "1e-6", "--device", "cpu", "--precision", "fp32",
                 "--out", str(tmp_path / "out"), "--no-progress", "--lr-schedule", "constant",
                 "--warmup-steps", "0", "--weight-decay-skip", "none",
                 "--eval-data", str(tmp_path / "data.jsonl"), "--eval-every", str(STEPS),
                 "--metrics", str(tmp_path / "metrics.jsonl")]) == 0
    ours = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for tensor, err in _rel_errs(ours, ref).items():
        assert err < 1e-4, f"{tensor}: relative error {err:.2e}"
    # The held-out loss of the packed file is every example's CE, each run alone.
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (evaluated,) = [r for r in rows if "eval_loss" in r]
    total, n = 0.0, 0
    with torch.no_grad():
        for r in range(len(seqs)):
            for ids, targets in _documents(seqs.input_ids[r], seqs.targets[r], seqs.positions[r]):
                if (targets != -100).any():
                    total += float(F.cross_entropy(ref(input_ids=ids[None]).logits[0], targets,
                                                   reduction="sum", ignore_index=-100))
                    n += int((targets != -100).sum())
    assert evaluated["eval_tokens"] == n
    assert abs(evaluated["eval_loss"] - total / n) < 1e-4 * total / n
