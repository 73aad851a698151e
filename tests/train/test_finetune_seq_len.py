"""Without --seq-len, a file of examples sets the length of the rows: its longest example,
rounded up to a multiple of 64, at most the model's max_position_embeddings. Token streams (the
bundled corpus, text) keep 128; a number the user gives is used as given; the number a run
settles on is a plain int in everything it records, and a resumed run keeps its own."""

from __future__ import annotations

import json

import pytest
from test_data_finetune import CONVERSATIONS, VOCAB, make_tokenizer, write_jsonl

from flowtrain.cli import build_parser, main
from flowtrain.cli.train import config_from_args
from flowtrain.data.source import FromData, load_sequences
from flowtrain.train.config import defaults
from flowtrain.train.run import TrainConfig
from flowtrain.train.prepare import prepare

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _data_cache(tmp_path, monkeypatch):
    """Every test builds its data caches in its own folder, not the user's."""
    monkeypatch.setenv("FLOWTRAIN_CACHE", str(tmp_path / "cache"))


def long_chat(turns: int) -> list[dict]:
    """A conversation of ``turns`` exchanges: 31 tokens for 2, 10 more for each further one."""
    out = []
    for k in range(turns):
        out += [{"role": "user", "content": "what is two plus two ?" if k == 0 else "thanks"},
                {"role": "assistant", "content": "four ." if k == 0 else "ok bye !"}]
    return out


def test_from_data_rounds_the_longest_example_up_and_caps_it_at_the_model(tmp_path):
    model = make_tokenizer(tmp_path / "model")
    path = write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in CONVERSATIONS])
    seqs = load_sequences(path, FromData(stream=128, multiple=64, most=2048), VOCAB, tokenizer_dir=model)
    assert seqs.seq_len == 64 and seqs.report.longest == 31 and seqs.report.seq_len_from_data
    assert not seqs.report.capped and seqs.report.cut == seqs.report.dropped == (0, 0)
    assert load_sequences(path, FromData(stream=128, multiple=16, most=2048), VOCAB, tokenizer_dir=model).seq_len == 32
    capped = load_sequences(path, FromData(stream=128, multiple=64, most=24), VOCAB, tokenizer_dir=model,
                            long_examples="truncate")
    assert capped.seq_len == 24 and capped.report.capped and capped.report.cut[0] == 1


def test_a_token_stream_keeps_its_default(tmp_path):
    (tmp_path / "t.txt").write_text("hello there, a plain text file. " * 40)
    seqs = load_sequences(tmp_path / "t.txt", FromData(stream=128, multiple=64, most=2048), 256)
    assert seqs.seq_len == 128 and seqs.report.kind == "stream"
    assert load_sequences(tmp_path / "t.txt", FromData(stream=128, multiple=64, most=96), 256).seq_len == 96


def test_the_default_is_128_and_any_number_given_is_the_users():
    assert defaults.SEQ_LEN == 128 and not defaults.seq_len_given(TrainConfig().seq_len)
    assert defaults.seq_len_given(TrainConfig(seq_len=128).seq_len)
    given = config_from_args(build_parser("train").parse_args(["train", "--seq-len", "128"]))
    assert defaults.seq_len_given(given.seq_len) and type(given.seq_len) is int
    assert not defaults.seq_len_given(config_from_args(build_parser("train").parse_args(["train"])).seq_len)


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "tokens per sequence (default: 128) for text and the bundled corpus; a file of examples" in text
    assert "rounded up to a multiple of 64, at most the model's max_position_embeddings" in text
    assert "--long-examples {auto,error,drop,truncate}" in text and "auto (the default)" in text


def test_the_bundled_corpus_keeps_128(tmp_path):
    run = prepare(TrainConfig(model="tiny", steps=1, batch_size=2, micro_batch_size=1, device="cpu"))
    assert run.cfg.seq_len == 128 and type(run.cfg.seq_len) is int and run.seqs.seq_len == 128


def make_qwen3(folder):
    from test_finetune_end_to_end import make_qwen3 as make

    make(folder)  # max_position_embeddings 128
    return folder


def run_args(tmp_path, data, *extra):
    return ["train", "--model", str(tmp_path / "qwen3"), "--data", str(data), "--batch-size", "2",
            "--micro-batch-size", "1", "--device", "cpu", "--no-progress", "--lr-schedule", "constant",
            "--warmup-steps", "0", *extra]


def data_line(text: str) -> str:
    return next(x for x in text.splitlines() if x.startswith("data "))


def test_a_run_reads_its_length_from_the_data_and_records_the_number(tmp_path, capsys):
    make_qwen3(tmp_path / "qwen3")
    data = write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in CONVERSATIONS])
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(run_args(tmp_path, data, "--steps", "1", "--out", str(out), "--save-every", "1")) == 0
    text = capsys.readouterr().out
    assert ("3 examples in 2 sequences of 64 tokens (from the data: the longest example, 31 tokens, rounded up)"
            in data_line(text))
    assert "steps      1 of 2 sequences (128 tokens" in text
    state = json.loads((out / "checkpoint-1" / "trainer_state.json").read_text())
    assert state["settings"]["seq_len"] == 64  # a number, not the default's type


def test_a_resumed_run_without_seq_len_keeps_the_checkpoints(tmp_path, capsys):
    make_qwen3(tmp_path / "qwen3")
    data = write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in CONVERSATIONS])
    out = tmp_path / "out"
    assert main(run_args(tmp_path, data, "--steps", "1", "--seq-len", "96", "--out", str(out), "--save-every", "1")) == 0
    capsys.readouterr()
    assert main(run_args(tmp_path, data, "--steps", "2", "--resume", str(out), "--out", str(out), "--overwrite")) == 0
    line = data_line(capsys.readouterr().out)
    assert "3 examples in 1 sequence of 96 tokens," in line and "from the data" not in line  # not the data's 64


def test_one_sequence_is_spoken_of_in_the_singular(tmp_path):
    from flowtrain.train.summary import data_description

    model = make_tokenizer(tmp_path / "model")
    path = write_jsonl(tmp_path / "one.jsonl", [{"messages": CONVERSATIONS[1]}])
    seqs = load_sequences(path, FromData(stream=128, multiple=64), VOCAB, tokenizer_dir=model)
    assert data_description(seqs).startswith("1 example in 1 sequence of 64 tokens (from the data: the longest "
                                             "example, 21 tokens, rounded up), 7 target tokens; ")
    (tmp_path / "t.txt").write_text("a short text")
    assert data_description(load_sequences(tmp_path / "t.txt", 128, 256)) == "1 sequence of 128 tokens, 11 target tokens"


def test_the_model_caps_the_length_and_auto_refuses_what_does_not_fit(tmp_path, capsys):
    make_qwen3(tmp_path / "qwen3")
    data = write_jsonl(tmp_path / "chats.jsonl", [{"messages": long_chat(12)}, {"messages": CONVERSATIONS[1]}])
    args = run_args(tmp_path, data, "--steps", "1")
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "1 example longer than the model's 128 positions" in err[0], err
    assert "the first at line 1 (131 tokens)" in err[0] and "--long-examples drop" in err[0]
    assert "or --seq-len" not in err[0]  # the model's positions are the limit: no longer --seq-len to suggest
    assert main([*args, "--long-examples", "truncate"]) == 0
    line = data_line(capsys.readouterr().out)
    assert ("2 examples in 2 sequences of 128 tokens (from the data: the model's 128 positions; the longest example "
            "has 131 tokens)") in line and "examples longer than 128 tokens: 1 cut" in line, line


def test_held_out_examples_longer_than_every_training_one_set_the_length(tmp_path, capsys):
    """Without --seq-len, the rows take the longest example of --data and --eval-data both: a
    held-out conversation longer than all the training ones is evaluated whole, not refused."""
    make_qwen3(tmp_path / "qwen3")
    data = write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in CONVERSATIONS])  # longest: 31 tokens
    held_out = write_jsonl(tmp_path / "held.jsonl", [{"messages": long_chat(7)}, {"messages": CONVERSATIONS[0]}])  # 81
    metrics = tmp_path / "m.jsonl"
    capsys.readouterr()
    assert main(run_args(tmp_path, data, "--steps", "1", "--eval-data", str(held_out), "--eval-every", "1",
                         "--metrics", str(metrics))) == 0
    line = data_line(capsys.readouterr().out)
    assert "in 1 sequence of 128 tokens (from the data: the longest held-out example, rounded up; the longest here " \
           "has 31 tokens)" in line, line
    evals = [r for r in map(json.loads, metrics.read_text().splitlines()) if "eval_loss" in r]
    assert len(evals) == 1 and evals[0]["eval_loss"] > 0
