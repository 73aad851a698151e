"""The held-out loss (``--eval-data``, ``--eval-every``) against transformers, fp32 on the CPU.

The reference is ``LlamaForCausalLM`` loaded from the model the run saved: its summed
cross-entropy over every target token of the eval rows, divided by their number, must equal the
run's last ``eval_loss``, which read the same (final) weights through a forward-only graph of
``fetch``, ``embed``, ``forward`` and ``eval_loss`` tasks in the engine.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from test_train_vs_hf import SEQ, STEPS, make_checkpoint, make_data, run_flowtrain

from flowtrain.cli import main

EVAL_ROWS = 5  # with micro-batches of 2, the last one holds a single row


def make_eval_rows(path, seed=7, vocab=64):
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, vocab, (int(torch.randint(3, SEQ + 5, (1,), generator=g)),), generator=g).tolist()
            for _ in range(EVAL_ROWS)]
    path.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    return rows


def hf_eval_loss(out_dir, rows) -> tuple[float, int]:
    """transformers' mean CE over every target of ``rows`` (cut at SEQ, padded), fp32."""
    model = transformers.AutoModelForCausalLM.from_pretrained(out_dir, torch_dtype=torch.float32)
    ids = torch.zeros(len(rows), SEQ, dtype=torch.long)
    labels = torch.full((len(rows), SEQ), -100, dtype=torch.long)
    for i, r in enumerate(rows):
        r = r[:SEQ]
        ids[i, :len(r)] = torch.tensor(r)
        labels[i, :len(r)] = torch.tensor(r)
    targets = torch.cat([labels[:, 1:], torch.full((len(rows), 1), -100)], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    total = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum", ignore_index=-100)
    n = int((targets != -100).sum())
    return float(total) / n, n


def read_metrics(path):
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    return [x for x in lines if "loss" in x], [x for x in lines if "eval_loss" in x]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("placement", [
    ("--policy", "sequential"),
    ("--policy", "lookahead", "--order", "micro"),
    ("--policy", "double_buffer", "--resident", "embed,head,layer.1"),
])
def test_eval_loss_matches_hf(tmp_path, placement, tied):
    """Two policies and a resident mix (tied and not): the last held-out loss is transformers'
    loss on the saved model, to 1e-5 relative."""
    make_checkpoint(tmp_path / "model", tied=tied)
    assert_eval_matches_hf(tmp_path, *placement)


def assert_eval_matches_hf(tmp_path, *placement):
    """Train the model in ``tmp_path / "model"`` with a held-out loss every 2 steps: the last
    one is transformers' loss on the model saved, to 1e-5 relative, and the first differs."""
    make_data(tmp_path / "data.jsonl")
    rows = make_eval_rows(tmp_path / "eval.jsonl")
    run_flowtrain(tmp_path / "model", tmp_path / "data.jsonl", tmp_path / "out", "--eval-data",
                  str(tmp_path / "eval.jsonl"), "--eval-every", "2", "--metrics", str(tmp_path / "m.jsonl"), *placement)
    _, evals = read_metrics(tmp_path / "m.jsonl")
    assert [e["step"] for e in evals] == [2, STEPS]
    ref, n = hf_eval_loss(tmp_path / "out", rows)
    assert evals[-1]["eval_tokens"] == n
    assert abs(evals[-1]["eval_loss"] - ref) <= 1e-5 * abs(ref), (evals[-1], ref)
    assert evals[0]["eval_loss"] != evals[-1]["eval_loss"]  # the weights moved in between


def _tiny(tmp_path, name, *extra):
    out = tmp_path / name
    args = ["train", "--steps", "5", "--batch-size", "4", "--micro-batch-size", "2", "--seq-len", "16",
            "--device", "cpu", "--no-progress", "--out", str(out), "--metrics", str(tmp_path / f"{name}.jsonl"), *extra]
    assert main(args) == 0
    return out


@pytest.fixture(scope="module")
def eval_text(tmp_path_factory):
    from flowtrain.data.source import default_corpus_path

    path = tmp_path_factory.mktemp("eval") / "eval.txt"
    path.write_text(default_corpus_path().read_text(encoding="utf-8")[:300], encoding="utf-8")
    return path


def test_schedule_weights_and_trace(tmp_path, eval_text, capsys):
    """Every 2 steps of 5 (steps 2 and 4) and after the last (5); the weights end
    bit-identical to a run without evaluation; the eval tasks are in the trace."""
    from safetensors.torch import load_file

    with_eval = _tiny(tmp_path, "with", "--eval-data", str(eval_text), "--eval-every", "2",
                      "--trace", str(tmp_path / "t.json"))
    printed = capsys.readouterr().out
    without = _tiny(tmp_path, "without")
    steps, evals = read_metrics(tmp_path / "with.jsonl")
    assert [e["step"] for e in evals] == [2, 4, 5]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    assert all(e["eval_tokens"] > 0 and e["eval_loss"] > 0 for e in evals)
    assert printed.count("eval_loss") == 3 and "step 2/5  eval_loss" in printed
    assert read_metrics(tmp_path / "without.jsonl")[1] == []
    a, b = load_file(with_eval / "model.safetensors"), load_file(without / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    names = [e["name"] for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e.get("ph") == "X"]
    per_eval = sum(n.startswith("eval_loss") for n in names) / 3  # one per micro-batch, 3 evaluations
    assert per_eval >= 1 and per_eval == int(per_eval)
    assert any(n.startswith("fetch L0 (eval)") for n in names)
    assert any(n.startswith("forward L1 m0 (eval)") for n in names)


@pytest.mark.parametrize("args, message", [
    (["--eval-data", "x.txt"], "--eval-data needs --eval-every N"),
    (["--eval-every", "2"], "--eval-every needs --eval-data FILE"),
    (["--eval-data", "x.txt", "--eval-every", "0"], "--eval-every must be at least 1"),
])
def test_flag_errors_are_one_line(tmp_path, capsys, args, message):
    assert main(["train", "--steps", "1", "--device", "cpu", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
