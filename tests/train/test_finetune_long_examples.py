"""Examples longer than --seq-len are never cut silently: they are counted with the target tokens
they lose, and --long-examples says whether they are cut (truncate), left out (drop) or stop
the run before it trains (error; auto: error for conversations, truncate for other rows).

The counts are checked against examples worked out by hand with the WordLevel test tokenizer of
test_data_finetune.py (one token per word, ``<s>`` before every text, ``</s>`` after a
completion), and against transformers' own assistant mask for conversations.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_data_finetune import CONVERSATIONS, VOCAB, ids, make_tokenizer, write_jsonl

from flowtrain.cli import main
from flowtrain.data.source import load_sequences
from flowtrain.errors import DataError

transformers = pytest.importorskip("transformers")

# <s> prompt completion </s>: 10, 4 and 9 tokens with 3, 2 and 7 targets (completion + EOS)
ROWS = [{"prompt": "what is two plus two ?", "completion": "four ."},
        {"prompt": "hi", "completion": "hello"},
        {"prompt": "two", "completion": "three four five it the answer"}]


@pytest.fixture(autouse=True)
def _data_cache(tmp_path, monkeypatch):
    """Every test builds its data caches in its own folder, not the user's."""
    monkeypatch.setenv("FLOWTRAIN_CACHE", str(tmp_path / "cache"))


def cache_folders(tmp_path):
    return sorted(p.name for p in (tmp_path / "cache" / "data").iterdir())


@pytest.mark.parametrize("packing", [True, False])
def test_truncate_cuts_and_counts_what_each_cut_loses(tmp_path, packing):
    model = make_tokenizer(tmp_path / "model")
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    seqs = load_sequences(path, seq_len=8, vocab_size=VOCAB, tokenizer_dir=model, packing=packing,
                          long_examples="truncate")
    # line 1 keeps "four" of its 3 targets, line 3 keeps all but the EOS: 2 cut, 2 + 1 lost
    assert seqs.report.cut == (2, 3) and seqs.report.dropped == (0, 0)
    assert seqs.report.examples == 3 and seqs.report.longest == 10
    assert seqs.num_targets() == 1 + 2 + 6
    kept = sorted(t for t in seqs.targets.flatten().tolist() if t != -100)
    assert kept == sorted(ids("four") + ids("hello") + [2] + ids("three four five it the answer"))


@pytest.mark.parametrize("packing", [True, False])
def test_drop_leaves_long_examples_out_and_counts_their_targets(tmp_path, packing):
    model = make_tokenizer(tmp_path / "model")
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    seqs = load_sequences(path, seq_len=8, vocab_size=VOCAB, tokenizer_dir=model, packing=packing,
                          long_examples="drop")
    assert seqs.report.dropped == (2, 3 + 7) and seqs.report.cut == (0, 0)
    assert seqs.report.first_dropped == "line 1 (10 tokens)" and seqs.report.examples == 1
    assert seqs.input_ids[0, :4].tolist() == [1, *ids("hi hello"), 2] and seqs.num_targets() == 2


def test_error_names_the_count_the_first_row_and_the_flag_in_one_line(tmp_path):
    model = make_tokenizer(tmp_path / "model")
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(DataError) as info:
        load_sequences(path, seq_len=8, vocab_size=VOCAB, tokenizer_dir=model, long_examples="error")
    message = str(info.value)
    assert message == (f"{path}: 2 examples longer than --seq-len 8, the first at line 1 (10 tokens), 10 target "
                       "tokens in all; pass --long-examples drop to train without them or --long-examples truncate "
                       "to cut them at 8 tokens, or --seq-len 10 or more to keep every one whole")
    # the folder it built is what drop builds: choosing drop next maps it, tokenising nothing
    built = cache_folders(tmp_path)
    assert len(built) == 1
    dropped = load_sequences(path, seq_len=8, vocab_size=VOCAB, tokenizer_dir=model, long_examples="drop")
    assert cache_folders(tmp_path) == built and dropped.report.dropped == (2, 10)
    with pytest.raises(DataError, match="2 examples longer than --seq-len 8"):  # and a cached error is the same
        load_sequences(path, seq_len=8, vocab_size=VOCAB, tokenizer_dir=model, long_examples="error")
    assert len(load_sequences(path, seq_len=10, vocab_size=VOCAB, tokenizer_dir=model, long_examples="error")) > 0


def test_auto_refuses_long_conversations_and_cuts_other_rows(tmp_path):
    model = make_tokenizer(tmp_path / "model")
    chats = write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in CONVERSATIONS])
    with pytest.raises(DataError, match=r"chats\.jsonl: 1 example longer than --seq-len 24, the first at line 1 "
                                        r"\(31 tokens\)"):
        load_sequences(chats, seq_len=24, vocab_size=VOCAB, tokenizer_dir=model, long_examples="auto")
    pairs = write_jsonl(tmp_path / "pairs.jsonl", ROWS)
    cut = load_sequences(pairs, seq_len=8, vocab_size=VOCAB, tokenizer_dir=model, long_examples="auto")
    assert cut.report.cut == (2, 3)
    ids_rows = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": list(range(12))}, {"input_ids": [3, 4]}])
    cut = load_sequences(ids_rows, seq_len=8, vocab_size=VOCAB, long_examples="auto")
    assert cut.report.cut == (1, 11 - 7) and cut.input_ids[0].tolist() == list(range(8))


def test_an_example_cut_to_no_target_is_counted_and_left_out(tmp_path):
    model = make_tokenizer(tmp_path / "model")
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "two two two two", "completion": "four"},
                                             {"prompt": "hi", "completion": "hello"}])
    seqs = load_sequences(path, seq_len=4, vocab_size=VOCAB, tokenizer_dir=model, long_examples="truncate")
    assert len(seqs) == 1 and seqs.report.cut == (1, 2) and seqs.report.examples == 1


def test_a_2d_npy_names_its_first_long_row(tmp_path):
    rows = np.arange(30, dtype=np.int32).reshape(3, 10) % 7
    np.save(tmp_path / "rows.npy", rows)
    with pytest.raises(DataError, match=r"rows\.npy: 3 examples longer than --seq-len 6, the first at row 0 "
                                        r"\(10 tokens\), 27 target tokens in all"):
        load_sequences(tmp_path / "rows.npy", seq_len=6, vocab_size=7, long_examples="error")
    cut = load_sequences(tmp_path / "rows.npy", seq_len=6, vocab_size=7)  # the library's default: truncate
    assert cut.report.cut == (3, 3 * 4) and torch.equal(cut.input_ids, torch.from_numpy(rows[:, :6]).long())


def test_when_every_example_is_dropped_the_line_says_why(tmp_path):
    model = make_tokenizer(tmp_path / "model")
    path = write_jsonl(tmp_path / "d.jsonl", ROWS[:1])
    with pytest.raises(DataError, match=r"every example with a target is longer than --seq-len 8 and "
                                        r"--long-examples drop left all 1 out"):
        load_sequences(path, seq_len=8, vocab_size=VOCAB, tokenizer_dir=model, long_examples="drop")
    with pytest.raises(DataError, match=r"1 example longer than --seq-len 8, the first at line 1"):
        load_sequences(path, seq_len=8, vocab_size=VOCAB, tokenizer_dir=model, long_examples="error")
    assert not any(p.name.startswith("examples.") for p in (tmp_path / "cache").rglob("*"))  # no scratch left


# --- the command line ----------------------------------------------------------------------


def make_qwen3(folder):
    from test_finetune_end_to_end import make_qwen3 as make

    make(folder)
    return folder


def train_args(tmp_path, data, *extra):
    return ["train", "--model", str(tmp_path / "qwen3"), "--data", str(data), "--steps", "1", "--batch-size", "2",
            "--micro-batch-size", "1", "--device", "cpu", "--no-progress", *extra]


def test_the_command_line_stops_on_long_conversations_in_one_line_before_training(tmp_path, capsys):
    make_qwen3(tmp_path / "qwen3")
    data = write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in CONVERSATIONS])
    capsys.readouterr()
    out = tmp_path / "out"
    assert main(train_args(tmp_path, data, "--seq-len", "24", "--out", str(out),
                           "--metrics", str(tmp_path / "m.jsonl"))) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert err == [f"flowtrain: error: {data}: 1 example longer than --seq-len 24, the first at line 1 (31 tokens), "
                   "7 target tokens in all; pass --long-examples drop to train without them or --long-examples "
                   "truncate to cut them at 24 tokens, or --seq-len 31 or more to keep every one whole"]
    assert "step" not in captured.out and not out.exists() and not (tmp_path / "m.jsonl").exists()
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "qwen3")
    mask = hf.apply_chat_template(CONVERSATIONS[0], tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)["assistant_masks"]
    assert sum(mask) == 7  # the target tokens the line counts are transformers' assistant tokens


@pytest.mark.parametrize("choice, words", [("drop", "examples longer than 24 tokens: 1 dropped (7 target tokens)"),
                                           ("truncate", "examples longer than 24 tokens: 1 cut (4 target tokens lost)")])
def test_the_start_up_block_counts_what_was_cut_or_dropped(tmp_path, capsys, choice, words):
    make_qwen3(tmp_path / "qwen3")
    data = write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in CONVERSATIONS])
    capsys.readouterr()
    assert main(train_args(tmp_path, data, "--seq-len", "24", "--long-examples", choice)) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("data "))
    assert words in line and "loss on assistant turns by generation markers" in line, line
    examples = 2 if choice == "drop" else 3
    assert f"chats.jsonl: {examples} examples in " in line


def test_a_file_whose_examples_all_fit_says_so(tmp_path, capsys):
    make_qwen3(tmp_path / "qwen3")
    data = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": r["prompt"], "completion": r["completion"]} for r in ROWS])
    capsys.readouterr()
    assert main(train_args(tmp_path, data, "--seq-len", "16")) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("data "))
    assert "3 examples in 2 sequences of 16 tokens, 12 target tokens; every example within 16 tokens" in line, line
    assert "assistant" not in line  # prompt/completion rows have no chat rule to name


def test_long_examples_is_checked_and_recorded(tmp_path):
    from flowtrain.ckpt.resume import settings_of
    from flowtrain.cli.train import flag_of
    from flowtrain.errors import ConfigError
    from flowtrain.train.config.checks import check_fields
    from flowtrain.train.config.run_config import TrainConfig

    with pytest.raises(ConfigError) as info:
        check_fields(TrainConfig(long_examples="cut"))
    assert info.value.spelled(flag_of) == "--long-examples must be auto, error, drop or truncate (got 'cut')"
    assert settings_of(TrainConfig(long_examples="drop"))["long_examples"] == "drop"
    assert json.loads(json.dumps(settings_of(TrainConfig())))["long_examples"] == "auto"
