"""Rows with no trained token (no target: under 2 tokens, or no loss after the first) are left
out of the sequences, and counted: the start-up block's ``data`` line says how many and which
came first, and a file in which every row is such a row ends in one line, not in a run.

Conversations use the ChatML test template of test_data_finetune.py, which marks only
``assistant`` turns for the loss (``{% generation %}``): a row whose reply comes under another
role (``bot``) renders, but has nothing to learn.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_data_finetune import CONVERSATIONS, VOCAB, make_tokenizer, write_jsonl
from test_finetune_long_examples import make_qwen3, train_args

from flowtrain.cli import main
from flowtrain.data.source import load_sequences
from flowtrain.errors import DataError

pytest.importorskip("transformers")

TRAINED = CONVERSATIONS[0]  # two assistant turns
UNTRAINED = [{"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}]


@pytest.fixture(autouse=True)
def _data_cache(tmp_path, monkeypatch):
    """Every test builds its data caches in its own folder, not the user's."""
    monkeypatch.setenv("FLOWTRAIN_CACHE", str(tmp_path / "cache"))


def chats(trained_at: set[int], total: int) -> list[dict]:
    """``total`` rows, the ones at the 0-based positions in ``trained_at`` trained, the rest not."""
    return [{"messages": TRAINED if i in trained_at else UNTRAINED} for i in range(total)]


def test_rows_without_a_trained_token_are_counted_with_the_first(tmp_path):
    model = make_tokenizer(tmp_path / "model")
    # lines 1, 2 and 5 are trained; 3, 4 and 6 are not
    path = write_jsonl(tmp_path / "d.jsonl", chats({0, 1, 4}, 6))
    seqs = load_sequences(path, seq_len=64, vocab_size=VOCAB, tokenizer_dir=model)
    assert seqs.report.examples == 3
    assert (seqs.report.untrained, seqs.report.first_untrained) == (3, "line 3")
    ids_rows = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": [5, 6, 7]}, {"input_ids": [5]},
                                                    {"input_ids": [5, 6], "labels": [-100, -100]}])
    seqs = load_sequences(ids_rows, seq_len=8, vocab_size=VOCAB)
    assert (seqs.report.examples, seqs.report.untrained, seqs.report.first_untrained) == (1, 2, "line 2")
    npy = tmp_path / "rows.npy"
    np.save(npy, np.array([[5, 6], [7, 8]]))
    assert load_sequences(npy, seq_len=8, vocab_size=VOCAB).report.untrained == 0  # every row has a target


def test_a_file_of_rows_without_a_trained_token_is_one_clear_error(tmp_path):
    model = make_tokenizer(tmp_path / "model")
    path = write_jsonl(tmp_path / "d.jsonl", chats(set(), 4))
    with pytest.raises(DataError) as info:
        load_sequences(path, seq_len=64, vocab_size=VOCAB, tokenizer_dir=model)
    assert str(info.value) == (
        f"{path} has no usable sequences: every one of its 4 rows (the first at line 1) has fewer than 2 tokens or "
        "no token with a loss (conversations are trained on their \"assistant\" turns only), and predicting a next "
        "token needs at least 2")
    assert not list((tmp_path / "cache" / "data").iterdir())  # nothing half-built is kept


def test_the_start_up_block_says_how_many_rows_had_nothing_to_train(tmp_path, capsys):
    make_qwen3(tmp_path / "qwen3")
    # 40 rows, 10 of them trained (lines 1, 2, 5, 9, ...): 30 left out, the first at line 3
    data = write_jsonl(tmp_path / "chats.jsonl", chats({0, 1, 4, 8, 12, 16, 20, 24, 28, 32}, 40))
    capsys.readouterr()
    assert main(train_args(tmp_path, data, "--out", str(tmp_path / "out"))) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("data "))
    assert "chats.jsonl: 10 examples (30 rows with no trained tokens left out: the first at line 3) in " in line, line


def test_the_command_line_refuses_a_file_with_nothing_to_train_in_one_line(tmp_path, capsys):
    make_qwen3(tmp_path / "qwen3")
    data = write_jsonl(tmp_path / "chats.jsonl", chats(set(), 40))
    capsys.readouterr()
    out = tmp_path / "out"
    assert main(train_args(tmp_path, data, "--out", str(out))) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [
        f"flowtrain: error: {data} has no usable sequences: every one of its 40 rows (the first at line 1) has fewer "
        "than 2 tokens or no token with a loss (conversations are trained on their \"assistant\" turns only), and "
        "predicting a next token needs at least 2"]
    assert "step" not in captured.out and not out.exists()
