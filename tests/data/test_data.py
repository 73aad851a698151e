"""Tests for flowtrain.data.source: file formats, targets as Hugging Face defines them, batching.

The reference for targets is transformers' own ``ForCausalLMLoss`` (labels = input_ids with
padding set to -100, shifted inside the loss); our pre-shifted targets must give the same CE.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from tokenizers.processors import TemplateProcessing

from flowtrain.data import text as data_text
from flowtrain.data.source import (
    Batch,
    Sequences,
    default_corpus_path,
    find_tokenizer,
    load_sequences,
    step_batches,
    tokenizer_files,
)
from flowtrain.errors import ConfigError, DataError

WORDS = "the cat sat on a mat dog ran far away and came back home".split()
SPECIAL = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}



@pytest.fixture(autouse=True)
def _data_cache(tmp_path, monkeypatch):
    """Every test builds its data caches in its own folder, not the user's."""
    monkeypatch.setenv("FLOWTRAIN_CACHE", str(tmp_path / "cache"))

# --- helpers -----------------------------------------------------------------------------


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def make_tokenizer(model_dir: Path, *, eos_token: str | None = "</s>", truncate: int | None = None):
    """A WordLevel tokenizer whose template puts <s> (id 1) before every document."""
    model_dir.mkdir(exist_ok=True)
    vocab = dict(SPECIAL) | {w: i + len(SPECIAL) for i, w in enumerate(WORDS)}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    if truncate is not None:
        tok.enable_truncation(max_length=truncate)
    tok.save(str(model_dir / "tokenizer.json"))
    if eos_token is not None:
        (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos_token}))
    return tok


def ids_of(text: str) -> list[int]:
    """The test tokenizer's ids for ``text`` without the template."""
    return [len(SPECIAL) + WORDS.index(w) for w in text.split()]


def expected_targets(ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    out = torch.full_like(ids, -100)
    for i, n in enumerate(lengths):
        out[i, : n - 1] = ids[i, 1:n]
    return out


def rows_of(batch: Batch) -> list[int]:
    """Which sequence each batch row is, for data sets built by ``numbered``."""
    return [int(r[0]) // 2 for r in batch.input_ids]


def numbered(tmp_path: Path, n: int) -> Sequences:
    """n sequences [2i, 2i+1]: sequence i is recognisable by its first token."""
    path = tmp_path / "numbered.npy"
    np.save(path, np.arange(2 * n, dtype=np.int32).reshape(n, 2))
    return load_sequences(path, seq_len=2, vocab_size=2 * n)


# --- targets against Hugging Face ---------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_targets_give_hugging_face_causal_lm_loss(tmp_path, seed):
    from transformers.loss.loss_utils import ForCausalLMLoss

    gen = torch.Generator().manual_seed(seed)
    vocab, seq_len = 11, 9
    raw = [
        torch.randint(0, vocab, (int(n),), generator=gen).tolist()
        for n in torch.randint(0, 14, (12,), generator=gen)
    ]
    raw[0] = [0, 0, 0, 5]  # real tokens equal to pad_id must still be trained on
    raw[1] = list(range(vocab)) + [1]  # longer than seq_len: cut
    seqs = load_sequences(write_jsonl(tmp_path / "d.jsonl", [{"input_ids": r} for r in raw]),
                          seq_len=seq_len, vocab_size=vocab, pad_id=0, packing=False)

    kept = [r[:seq_len] for r in raw if min(len(r), seq_len) >= 2]
    assert len(seqs) == len(kept)
    labels = torch.full((len(kept), seq_len), -100)
    for i, r in enumerate(kept):
        assert seqs.input_ids[i, : len(r)].tolist() == r
        labels[i, : len(r)] = torch.tensor(r)  # HF: labels = input_ids, padding -> -100

    logits = torch.randn(len(kept), seq_len, vocab, generator=gen, dtype=torch.float64)
    hf_sum = ForCausalLMLoss(logits, labels, vocab, num_items_in_batch=torch.tensor(1.0))
    ours_sum = F.cross_entropy(logits.flatten(0, 1), seqs.targets.flatten(), reduction="sum")
    torch.testing.assert_close(ours_sum, hf_sum.to(ours_sum.dtype))
    assert seqs.num_targets() == int((labels[:, 1:] != -100).sum())

    # Micro-batch CE sums over the step's num_targets == HF's mean over the whole step.
    batch = Batch(seqs.input_ids[:8], seqs.targets[:8])
    total = sum(
        F.cross_entropy(logits[i : i + 2].flatten(0, 1), mb.targets.flatten(), reduction="sum")
        for i, mb in zip(range(0, 8, 2), batch.micro_batches(2))
    )
    hf_mean = ForCausalLMLoss(logits[:8], labels[:8], vocab)
    torch.testing.assert_close(total / batch.num_targets(), hf_mean.to(total.dtype))


# --- .jsonl -------------------------------------------------------------------------------


def test_jsonl_input_ids_are_cut_padded_and_short_rows_dropped(tmp_path):
    rows = [[1, 2, 3, 4, 5, 6], [7, 8], [9], [], [4, 5, 6]]
    path = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": r} for r in rows])
    seqs = load_sequences(path, seq_len=4, vocab_size=10, pad_id=0, packing=False)
    assert seqs.input_ids.dtype == seqs.targets.dtype == torch.int64
    assert seqs.input_ids.tolist() == [[1, 2, 3, 4], [7, 8, 0, 0], [4, 5, 6, 0]]
    assert seqs.targets.tolist() == [[2, 3, 4, -100], [8, -100, -100, -100], [5, 6, -100, -100]]
    assert len(seqs) == 3 and seqs.num_targets() == 6


def test_jsonl_padding_uses_pad_id_and_blank_lines_are_skipped(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"input_ids": [1, 2]}\n\n   \n{"input_ids": [3, 4, 5], "text": "ignored"}\n')
    seqs = load_sequences(path, seq_len=4, vocab_size=10, pad_id=9, packing=False)
    assert seqs.input_ids.tolist() == [[1, 2, 9, 9], [3, 4, 5, 9]]
    assert seqs.targets.tolist() == [[2, -100, -100, -100], [4, 5, -100, -100]]


def test_jsonl_text_rows_are_tokenised_joined_with_eos_and_windowed(tmp_path):
    make_tokenizer(tmp_path / "model")
    docs = ["the cat sat", "a dog ran far away", "came back home"]
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in docs])
    seqs = load_sequences(path, seq_len=7, vocab_size=40, tokenizer_dir=tmp_path / "model")

    # <s> doc </s> <s> doc </s> <s> doc: BOS from the template, EOS from tokenizer_config.json
    stream = [1, *ids_of(docs[0]), 2, 1, *ids_of(docs[1]), 2, 1, *ids_of(docs[2])]
    assert len(stream) == 16  # 2 full windows of 7, tail of 2 kept
    want = torch.tensor([stream[0:7], stream[7:14], stream[14:] + [0] * 5])
    assert torch.equal(seqs.input_ids, want)
    assert torch.equal(seqs.targets, expected_targets(want, [7, 7, 2]))


def test_jsonl_text_eos_argument_overrides_tokenizer_config(tmp_path):
    make_tokenizer(tmp_path / "model", eos_token=None)
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "the cat"}, {"text": "a dog"}])
    no_eos = load_sequences(path, seq_len=6, vocab_size=40, tokenizer_dir=tmp_path / "model")
    assert no_eos.input_ids.tolist() == [[1, *ids_of("the cat"), 1, *ids_of("a dog")]]
    with_eos = load_sequences(path, seq_len=7, vocab_size=40, tokenizer_dir=tmp_path / "model",
                              eos_id=3)
    assert with_eos.input_ids.tolist() == [[1, *ids_of("the cat"), 3, 1, *ids_of("a dog")]]


def test_tokenizer_truncation_saved_in_tokenizer_json_is_ignored(tmp_path):
    make_tokenizer(tmp_path / "model", truncate=3)
    path = tmp_path / "d.txt"
    path.write_text("the cat sat on a mat")
    seqs = load_sequences(path, seq_len=16, vocab_size=40, tokenizer_dir=tmp_path / "model")
    assert seqs.input_ids[0, :7].tolist() == [1, *ids_of("the cat sat on a mat")]


# --- .txt ---------------------------------------------------------------------------------


def test_txt_with_tokenizer_matches_the_tokenizer_and_cuts_exact_windows(tmp_path):
    tok = make_tokenizer(tmp_path / "model")
    text = "the cat sat on a mat\nthe dog ran far away\n\nand came back home\n" * 3
    path = tmp_path / "d.txt"
    path.write_text(text)
    seqs = load_sequences(path, seq_len=9, vocab_size=40, tokenizer_dir=tmp_path / "model")
    stream = tok.encode(text).ids
    assert stream[0] == 1 and len(stream) == 46  # 5 windows of 9, tail of 1 dropped
    assert seqs.input_ids.tolist() == [stream[i : i + 9] for i in range(0, 45, 9)]
    assert (seqs.targets[:, -1] == -100).all() and seqs.num_targets() == 5 * 8


def test_long_txt_is_encoded_in_pieces_with_one_template(tmp_path, monkeypatch):
    tok = make_tokenizer(tmp_path / "model")
    text = "".join(f"{WORDS[i % 14]} {WORDS[(i * 5) % 14]}\n" for i in range(300))
    path = tmp_path / "d.txt"
    path.write_text(text)
    monkeypatch.setattr(data_text, "CHUNK_CHARS", 64)
    assert len(data_text._split_lines(text)) > 10
    seqs = load_sequences(path, seq_len=2000, vocab_size=40, tokenizer_dir=tmp_path / "model")
    want = tok.encode(text).ids  # one BOS, then the words
    assert seqs.input_ids[0, : len(want)].tolist() == want
    assert seqs.num_targets() == len(want) - 1


def test_byte_fallback_encodes_utf8_and_keeps_only_tails_of_two(tmp_path):
    path = tmp_path / "d.txt"
    path.write_text("héllo wor", encoding="utf-8")  # 10 bytes: é is two
    seqs = load_sequences(path, seq_len=4, vocab_size=256, tokenizer_dir=tmp_path,
                          byte_tokenizer=True)  # a folder without tokenizer.json: asked for
    raw = list("héllo wor".encode("utf-8"))
    assert seqs.input_ids.tolist() == [raw[0:4], raw[4:8], raw[8:10] + [0, 0]]
    assert seqs.targets.tolist()[2] == [raw[9], -100, -100, -100]

    path.write_text("héllo wo", encoding="utf-8")  # 9 bytes: the 1-token tail is dropped
    assert load_sequences(path, seq_len=4, vocab_size=256).input_ids.tolist() == [
        raw[0:4], raw[4:8]
    ]


def test_byte_fallback_needs_vocab_of_256_only_for_text(tmp_path):
    txt = tmp_path / "d.txt"
    txt.write_text("hello")
    with pytest.raises(DataError, match="256"):
        load_sequences(txt, seq_len=4, vocab_size=255)
    ids = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [1, 2, 3]}])
    assert len(load_sequences(ids, seq_len=4, vocab_size=10)) == 1


# --- .npy ---------------------------------------------------------------------------------


def test_npy_1d_is_a_stream_cut_into_exact_windows(tmp_path):
    path = tmp_path / "d.npy"
    np.save(path, np.arange(23, dtype=np.uint16))
    seqs = load_sequences(path, seq_len=5, vocab_size=30, pad_id=29)
    assert seqs.input_ids.tolist() == [
        [0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14], [15, 16, 17, 18, 19],
        [20, 21, 22, 29, 29],
    ]
    assert seqs.targets[-1].tolist() == [21, 22, -100, -100, -100]
    assert seqs.num_targets() == 4 * 4 + 2


def test_npy_2d_rows_are_sequences_as_they_stand(tmp_path):
    path = tmp_path / "d.npy"
    np.save(path, np.array([[1, 2, 3, 4, 5, 6], [6, 5, 4, 3, 2, 1]], dtype=np.int64))
    cut = load_sequences(path, seq_len=4, vocab_size=8)
    assert cut.input_ids.tolist() == [[1, 2, 3, 4], [6, 5, 4, 3]]
    assert cut.targets.tolist() == [[2, 3, 4, -100], [5, 4, 3, -100]]
    padded = load_sequences(path, seq_len=8, vocab_size=8, pad_id=7)
    assert padded.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 7], [6, 5, 4, 3, 2, 1, 7, 7]]
    assert padded.num_targets() == 10


# --- errors -------------------------------------------------------------------------------


def error_cases(tmp_path: Path):
    """(name, file writer, load kwargs, pattern the DataError message must match)."""

    def text(name, content):
        def write():
            (tmp_path / name).write_text(content, encoding="utf-8")
            return tmp_path / name

        return write

    def bytes_file(name, content):
        def write():
            (tmp_path / name).write_bytes(content)
            return tmp_path / name

        return write

    def npy(name, array):
        def write():
            np.save(tmp_path / name, array)
            return tmp_path / name

        return write

    def npz_named_npy():
        np.savez(tmp_path / "archive.npz", ids=np.arange(4))
        return (tmp_path / "archive.npz").rename(tmp_path / "archive.npy")

    def tokenizer_model_only():
        (tmp_path / "sp").mkdir()
        (tmp_path / "sp" / "tokenizer.model").write_bytes(b"\x00")
        return text("t.txt", "hello")()

    def broken_tokenizer():
        (tmp_path / "bad").mkdir()
        (tmp_path / "bad" / "tokenizer.json").write_text("{not json")
        return text("t.txt", "hello")()

    return [
        ("missing", lambda: tmp_path / "nope.jsonl", {}, "does not exist"),
        ("directory", lambda: tmp_path, {}, "not a file"),
        ("empty", text("e.jsonl", ""), {}, "is empty"),
        ("unknown extension", text("d.csv", "a,b"), {}, r"unknown extension '\.csv'"),
        ("malformed json", text("d.jsonl", '{"text": "a b"}\n\n{"text": oops}\n'), {},
         r"line 3 is not valid JSON"),
        ("not an object", text("d.jsonl", "[1, 2, 3]\n"), {}, r"line 1 is a JSON list"),
        ("neither key", text("d.jsonl", '{"input_ids": [1, 2]}\n{"tokens": [1]}\n'), {},
         r"line 2 has tokens, which is none of the accepted row forms"),
        ("text not a string", text("d.jsonl", '{"text": ["a"]}\n'), {},
         r"line 1: \"text\" is a list"),
        ("ids not ints", text("d.jsonl", '{"input_ids": [1, 2.5]}\n'), {}, "flat list of integers"),
        ("ids nested", text("d.jsonl", '{"input_ids": [[1, 2]]}\n'), {}, "flat list of integers"),
        ("mixed kinds", text("d.jsonl", '{"input_ids": [1, 2]}\n{"text": "hi"}\n'), {},
         r"mixes \"input_ids\" rows \(line 1\) and \"text\" rows \(line 2\)"),
        ("only blank lines", text("d.jsonl", "\n  \n"), {}, "no JSON lines"),
        ("id too large", text("d.jsonl", '{"input_ids": [1, 2]}\n{"input_ids": [3, 300, 4]}\n'),
         {}, r"line 2: token id 300 at position 1 .*0\.\.255"),
        ("negative id", text("d.jsonl", '{"input_ids": [1, -1]}\n'), {}, r"line 1: token id -1"),
        ("no usable rows", text("d.jsonl", '{"input_ids": [1]}\n{"input_ids": []}\n'), {},
         "no usable sequences"),
        ("one token of text", text("d.txt", "a"), {}, r"no usable sequences.* 1 token"),
        ("txt not utf-8", bytes_file("d.txt", b"ok \xff\xfe"), {}, "not UTF-8"),
        ("npy float", npy("f.npy", np.ones(4)), {}, "float64 values"),
        ("npy 3-D", npy("c.npy", np.ones((2, 2, 2), dtype=np.int32)), {}, "3-D array"),
        ("npy empty", npy("z.npy", np.zeros(0, dtype=np.int32)), {}, "empty array"),
        ("npy 1-D id too large", npy("b.npy", np.array([1, 2, 256])), {},
         r"token id 256 at position 2"),
        ("npy 2-D id too large", npy("r.npy", np.array([[1, 2], [3, 999]])), {},
         r"row 1: token id 999 at position 1"),
        ("npy garbage", text("g.npy", "not an array"), {}, "not a readable .npy"),
        ("npz under an .npy name", npz_named_npy, {}, "an .npz archive"),
        ("tokenizer.model only", tokenizer_model_only, {"tokenizer_dir": tmp_path / "sp"},
         "tokenizer.model but no tokenizer.json"),
        ("broken tokenizer.json", broken_tokenizer, {"tokenizer_dir": tmp_path / "bad"},
         "could not load the tokenizer"),
    ]


def test_every_bad_file_raises_one_clear_data_error(tmp_path):
    for name, write, kwargs, pattern in error_cases(tmp_path):
        path = write()
        with pytest.raises(DataError, match=pattern) as info:
            load_sequences(path, seq_len=4, vocab_size=256, **kwargs)
        message = str(info.value)
        assert "\n" not in message, name
        assert str(path) in message or "tokenizer" in message, name


def test_tokenizer_ids_beyond_the_model_vocabulary_name_the_line(tmp_path):
    make_tokenizer(tmp_path / "model")  # ids up to 17
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "the cat"}, {"text": "back home"}])
    with pytest.raises(DataError, match=r"line 2: token id 1[67] .*tokenizer"):
        load_sequences(path, seq_len=4, vocab_size=16, tokenizer_dir=tmp_path / "model")


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"seq_len": 1}, "seq_len 1"),
        ({"vocab_size": 0}, "vocab_size 0"),
        ({"pad_id": 256}, "pad_id 256"),
        ({"pad_id": -1}, "pad_id -1"),
        ({"eos_id": 300}, "eos_id 300"),
    ],
)
def test_impossible_sizes_and_ids_are_config_errors(tmp_path, kwargs, pattern):
    path = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [1, 2, 3]}])
    args = {"seq_len": 4, "vocab_size": 256} | kwargs
    with pytest.raises(ConfigError, match=pattern):
        load_sequences(path, **args)


# --- step_batches -------------------------------------------------------------------------


def take(seqs: Sequences, n: int, **kwargs) -> list[Batch]:
    it = step_batches(seqs, **kwargs)
    return [next(it) for _ in range(n)]


def test_without_shuffle_batches_follow_file_order_and_wrap_into_the_next_epoch(tmp_path):
    seqs = numbered(tmp_path, 5)
    batches = take(seqs, 4, batch_size=2, shuffle=False, seed=0)
    assert [rows_of(b) for b in batches] == [[0, 1], [2, 3], [4, 0], [1, 2]]
    assert torch.equal(batches[0].input_ids, seqs.input_ids[:2])
    assert torch.equal(batches[0].targets, seqs.targets[:2])


def test_fewer_sequences_than_batch_size_repeat_to_fill_the_batch(tmp_path):
    seqs = numbered(tmp_path, 3)
    batches = take(seqs, 2, batch_size=8, shuffle=False, seed=0)
    assert [rows_of(b) for b in batches] == [[0, 1, 2, 0, 1, 2, 0, 1], [2, 0, 1, 2, 0, 1, 2, 0]]
    shuffled = take(seqs, 3, batch_size=8, shuffle=True, seed=5)
    flat = [r for b in shuffled for r in rows_of(b)]
    assert all(len(b) == 8 for b in shuffled)
    assert all(sorted(flat[i : i + 3]) == [0, 1, 2] for i in range(0, 24, 3))  # whole epochs


def test_shuffle_is_deterministic_per_seed_and_each_epoch_a_new_permutation(tmp_path):
    seqs = numbered(tmp_path, 10)
    run = [rows_of(b) for b in take(seqs, 25, batch_size=4, shuffle=True, seed=7)]
    again = [rows_of(b) for b in take(seqs, 25, batch_size=4, shuffle=True, seed=7)]
    other = [rows_of(b) for b in take(seqs, 25, batch_size=4, shuffle=True, seed=8)]
    assert run == again
    assert run != other
    flat = [r for rows in run for r in rows]  # 100 rows = 10 epochs of 10 sequences
    epochs = [flat[i : i + 10] for i in range(0, 100, 10)]
    assert all(sorted(e) == list(range(10)) for e in epochs)  # every sequence once per epoch
    assert len({tuple(e) for e in epochs}) == 10  # epochs are shuffled differently
    assert epochs[0] != list(range(10))
    assert all(len(rows) == 4 for rows in run)


def test_start_step_resumes_the_same_sequence_of_batches(tmp_path):
    seqs = numbered(tmp_path, 7)
    full = [rows_of(b) for b in take(seqs, 12, batch_size=3, shuffle=True, seed=1)]
    resumed = [rows_of(b) for b in take(seqs, 4, batch_size=3, shuffle=True, seed=1, start_step=8)]
    assert resumed == full[8:]


def test_bad_batch_size_is_a_config_error(tmp_path):
    seqs = numbered(tmp_path, 3)
    with pytest.raises(ConfigError, match="batch_size 0"):
        step_batches(seqs, 0, shuffle=False, seed=0)  # raised at the call, not the first step


def test_micro_batches_split_the_step_in_order(tmp_path):
    rows = [{"input_ids": list(range(1, n))} for n in range(3, 11)]  # 2..9 tokens
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    seqs = load_sequences(path, seq_len=6, vocab_size=20, packing=False)
    batch = next(step_batches(seqs, 8, shuffle=True, seed=3))
    micro = batch.micro_batches(2)
    assert len(micro) == 4 and all(m.input_ids.shape == (2, 6) for m in micro)
    assert torch.equal(torch.cat([m.input_ids for m in micro]), batch.input_ids)
    assert torch.equal(torch.cat([m.targets for m in micro]), batch.targets)
    assert sum(m.num_targets() for m in micro) == batch.num_targets() == seqs.num_targets()
    assert batch.micro_batches(8)[0].input_ids.shape == (8, 6)
    with pytest.raises(ConfigError, match="micro_batch_size 3 does not divide batch_size 8"):
        batch.micro_batches(3)


# --- tokenizer files and the shipped corpus -----------------------------------------------


def test_find_tokenizer_and_tokenizer_files(tmp_path):
    assert find_tokenizer(tmp_path) is None and find_tokenizer(None) is None
    assert tokenizer_files(tmp_path) == []
    make_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text("{}")
    (tmp_path / "config.json").write_text("{}")
    assert find_tokenizer(str(tmp_path)) == tmp_path / "tokenizer.json"
    assert tokenizer_files(tmp_path) == [
        tmp_path / "tokenizer.json",
        tmp_path / "tokenizer_config.json",
        tmp_path / "generation_config.json",
    ]


def test_default_corpus_is_shipped_english_text_for_a_byte_model():
    path = default_corpus_path()
    raw = path.read_bytes()
    assert 100_000 <= len(raw) <= 300_000
    text = raw.decode("utf-8")
    assert text.count(" the ") > 500 and text.count("\n\n") > 100
    seqs = load_sequences(path, seq_len=256, vocab_size=256)
    assert len(seqs) == len(raw) // 256 + (len(raw) % 256 >= 2)
    assert seqs.num_targets() > 0.99 * len(raw)
