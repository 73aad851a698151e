"""Preference pairs (DPO): a ``.jsonl`` of TRL's preference rows becomes two sequences per pair.

Each row is one pair, in one of TRL's three forms (one file holds one form; the first line
decides, as for every other ``.jsonl``)::

    {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}                 # standard
    {"prompt": [{"role": "user", "content": "Sky?"}],                                   # conversational
     "chosen": [{"role": "assistant", "content": "Blue."}],
     "rejected": [{"role": "assistant", "content": "Green."}]}
    {"prompt_input_ids": [...], "chosen_input_ids": [...], "rejected_input_ids": [...]}  # tokenized

They are read as TRL's ``DPOTrainer`` reads them. A conversational row is rendered with the
model's chat template first (``maybe_apply_chat_template``): the prompt with the generation
prompt added (or, where its last message is the assistant's, continued), each completion as
what ``prompt + completion`` renders to after the prompt's text. Text is then tokenised without
special tokens, and the tokenizer's EOS is appended to each completion (``tokenize_row``).
Tokenized rows are taken as they stand: their completions already end as TRL made them.

Pair ``p`` is rows ``2p`` (prompt + chosen) and ``2p + 1`` (prompt + rejected), right-padded to
``seq_len``; a row's targets are its completion's tokens only (the prompt predicts the first
of them), shifted as everywhere else (:mod:`flowtrain.data.source`)::

    pairs = load_pairs("prefs.jsonl", seq_len=512, vocab_size=32000, tokenizer_dir=model_dir)
    len(pairs) == 2 * rows; pairs.targets[0]   # -100 over the prompt and the padding

A pair longer than ``seq_len`` is refused, naming its line (cutting it would change which
tokens its log-probability sums); so is any row that is not a pair, in one line.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from flowtrain.data import cache as data_cache
from flowtrain.data.files import IGNORE_INDEX, _messages, _parse_line, _preview, _raw_lines, check_ids
from flowtrain.data.source import FromData, Sequences, _check_config, _check_file
from flowtrain.data.text import ChatTemplate, Encoder, load_chat_template, make_encoder
from flowtrain.errors import DataError

__all__ = ["PAIR_KEYS", "TOKENIZED_KEYS", "load_pairs", "pair_rows"]

#: the keys of a standard or conversational preference row
PAIR_KEYS = ("prompt", "chosen", "rejected")
#: the keys of a tokenized preference row
TOKENIZED_KEYS = ("prompt_input_ids", "chosen_input_ids", "rejected_input_ids")

_EXAMPLE = '{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}'


def load_pairs(
    path: str | Path,
    seq_len: int | FromData,
    vocab_size: int,
    tokenizer_dir: str | Path | None = None,
    pad_id: int = 0,
    eos_id: int | None = None,
    byte_tokenizer: bool = False,
) -> Sequences:
    """Read a ``.jsonl`` of preference rows into :class:`Sequences` of ``2 * pairs`` rows (see
    the module). ``seq_len`` may come from the data (:class:`FromData`: the longest pair,
    rounded up). Raises DataError naming the line of a row that cannot be used."""
    path = _check_file(Path(path))
    if path.suffix != ".jsonl":
        raise DataError(f"{path}: preference pairs are read from a .jsonl of rows such as {_EXAMPLE}")
    encoder = functools.cache(lambda: make_encoder(tokenizer_dir, vocab_size, eos_id, byte_tokenizer))
    template = functools.cache(lambda: load_chat_template(tokenizer_dir))
    pairs = list(_read_pairs(path, vocab_size, encoder, template, eos_id))
    if not pairs:
        raise DataError(f"{path} has no preference rows; each line must look like {_EXAMPLE}")
    longest = max(max(len(p) + len(c), len(p) + len(r)) for _, p, c, r in pairs)
    length = seq_len.for_examples(longest) if isinstance(seq_len, FromData) else seq_len
    _check_config(length, vocab_size, pad_id, eos_id)
    ids, targets = pair_rows([(p, c, r) for _, p, c, r in pairs], length, pad_id,
                             where=[f"{path} line {no}" for no, *_ in pairs])
    return Sequences(ids, targets, None, _fingerprint=data_cache.fingerprint([ids, targets]))


def pair_rows(pairs: list[tuple[np.ndarray, np.ndarray, np.ndarray]], seq_len: int, pad_id: int,
              where: list[str] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, targets)``, each ``(2 * len(pairs), seq_len)`` int64: pair ``p``'s prompt +
    chosen in row ``2p``, prompt + rejected in row ``2p + 1``, targets on the completions only."""
    n = 2 * len(pairs)
    ids = torch.full((n, seq_len), pad_id, dtype=torch.int64)
    targets = torch.full((n, seq_len), IGNORE_INDEX, dtype=torch.int64)
    for k, (prompt, chosen, rejected) in enumerate(pairs):
        name = where[k] if where else f"pair {k}"
        for j, completion in enumerate((chosen, rejected)):
            row = np.concatenate([prompt, completion])
            if len(row) > seq_len:
                raise DataError(f"{name}: prompt + {('chosen', 'rejected')[j]} is {len(row)} tokens, longer than "
                                f"--seq-len {seq_len}; raise --seq-len (or leave it out: the longest pair decides) "
                                "or shorten the row")
            if len(prompt) + len(completion) < 2 or len(completion) == 0 or (len(prompt) == 0 and len(completion) < 2):
                raise DataError(f"{name}: its {('chosen', 'rejected')[j]} completion has no token to learn "
                                "(it is empty, or the prompt is empty and it has one token)")
            r = 2 * k + j
            ids[r, : len(row)] = torch.from_numpy(row)
            # position t predicts token t + 1: the completion's tokens, the first from the prompt's last
            first = max(len(prompt) - 1, 0)
            targets[r, first : len(row) - 1] = torch.from_numpy(row[first + 1 :])
    return ids, targets


def _read_pairs(path: Path, vocab_size: int, encoder: Callable[[], Encoder],
                template: Callable[[], ChatTemplate | None],
                eos_id: int | None):
    """``(line number, prompt ids, chosen ids, rejected ids)`` of every row, in file order."""
    form: str | None = None
    for no, raw in _raw_lines(path):
        if not raw.strip():
            continue
        obj = _parse_line(path, no, raw)
        where = f"{path} line {no}"
        this = _form(where, obj)
        if form is None:
            form = this
        elif this != form:
            raise DataError(f"{where} is a {this} preference row, but the file's first row is {form}; one file "
                            "holds one form")
        if this == "tokenized":
            p, c, r = (_ids(where, obj, k, vocab_size) for k in TOKENIZED_KEYS)
        else:
            texts = _conversational(where, obj, template) if this == "conversational" else \
                tuple(_text(where, obj, k) for k in PAIR_KEYS)
            enc = encoder()
            p, c, r = enc.encode_bare(list(texts))
            eos = np.array([] if eos_id is None else [eos_id], dtype=np.int64)
            c, r = np.concatenate([c, eos]), np.concatenate([r, eos])
            for ids in (p, c, r):
                check_ids(ids, vocab_size, where, "the tokenizer's ids do not fit the model's vocabulary")
        yield no, p.astype(np.int64), c.astype(np.int64), r.astype(np.int64)


def _form(where: str, obj: dict) -> str:
    if all(k in obj for k in TOKENIZED_KEYS):
        return "tokenized"
    missing = [k for k in PAIR_KEYS if k not in obj]
    if missing:
        raise DataError(f"{where}: a preference row needs \"prompt\", \"chosen\" and \"rejected\" (or "
                        f"{', '.join(TOKENIZED_KEYS)}); it has no {', '.join(repr(k) for k in missing)}. A row looks "
                        f"like {_EXAMPLE}")
    if all(isinstance(obj[k], str) for k in PAIR_KEYS):
        return "standard"
    if all(isinstance(obj[k], list) for k in PAIR_KEYS):
        return "conversational"
    kinds = ", ".join(f"{k} is a {type(obj[k]).__name__}" for k in PAIR_KEYS)
    raise DataError(f"{where}: \"prompt\", \"chosen\" and \"rejected\" must be three strings or three lists of "
                    f"messages ({kinds})")


def _text(where: str, obj: dict, key: str) -> str:
    value = obj[key]
    if key != "prompt" and not value:
        raise DataError(f"{where}: \"{key}\" is empty; a completion needs at least one token")
    return value


def _ids(where: str, obj: dict, key: str, vocab_size: int) -> np.ndarray:
    value = obj[key]
    ok = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    if not ok:
        raise DataError(f"{where}: \"{key}\" must be a flat list of integers, not {_preview(value)}")
    ids = np.asarray(value, dtype=np.int64)
    check_ids(ids, vocab_size, where, "token ids must be below the model's vocab_size")
    return ids


def _conversational(where: str, obj: dict, template: Callable[[], ChatTemplate | None]) -> tuple[str, str, str]:
    """TRL's ``apply_chat_template`` of a preference row: the prompt's text, and each
    completion's as ``prompt + completion`` rendered, less the prompt's text."""
    chat = template()
    if chat is None:
        raise DataError(f"{where}: a conversational preference row needs the model's chat template, and its tokenizer "
                        "has none; pass --tokenizer DIR with one, or write the rows as strings")
    prompt = _messages(where, obj["prompt"])
    last = prompt[-1]["role"]
    if last not in ("user", "assistant"):
        raise DataError(f"{where}: the prompt's last message is the {last!r}'s; it must be the user's (or the "
                        "assistant's, to be continued)")
    try:
        if last == "user":
            prompt_text = chat.render(prompt, add_generation_prompt=True)
        else:
            prompt_text = chat.render(prompt)
            prompt_text = prompt_text[: prompt_text.rindex(prompt[-1]["content"]) + len(prompt[-1]["content"])]
        out = [prompt_text]
        for key in ("chosen", "rejected"):
            whole = chat.render(prompt + _messages(where, obj[key]))
            if not whole.startswith(prompt_text):
                raise DataError(f"{where}: the chat template renders prompt + {key} so that it does not start with "
                                "the prompt rendered alone; TRL refuses such a template too")
            out.append(whole[len(prompt_text):])
    except ValueError as e:
        raise DataError(f"{where}: the chat template refused the row ({e})") from None
    return out[0], out[1], out[2]
