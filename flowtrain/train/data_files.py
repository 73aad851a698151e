"""Reading a ``--data`` file into token ids: one reader per format, one shape of answer.

Every reader returns :class:`Parsed`: a list of int64 id arrays and how they are to be used.

* ``kind="stream"``: documents, to be joined (EOS between them) and cut into windows.
  ``.txt`` (one document), ``.jsonl`` rows with ``text``, a 1-D ``.npy``.
* ``kind="rows"``: sequences as they stand, each cut at seq_len or padded, with ``labels``
  (aligned with the ids as in transformers: ``labels[t]`` is what position ``t`` is, -100 where
  no loss is taken; None means every token is learnt). ``.jsonl`` rows with ``input_ids``
  (optionally ``labels``), ``prompt`` + ``completion`` or ``messages``; a 2-D ``.npy``.

**Fine-tuning rows.** ``{"prompt": p, "completion": c}`` is the tokenizer's template prefix
(BOS), ``p`` and ``c`` encoded each on its own (so a token never straddles the boundary), and
EOS when the tokenizer has one; the loss is on ``c`` and the EOS. ``{"messages": [...]}`` is
rendered with the model's chat template and the loss is on the assistant turns, found turn by
turn: for each assistant message ``k``, the tokens of ``render(messages[:k],
add_generation_prompt=True)`` (everything before it, its header included) and of
``render(messages[:k+1])`` must both be prefixes of the whole conversation's tokens, and the
tokens between the two are that turn's (its content and end-of-turn text, e.g. ChatML's
``<|im_end|>\n``). A template that rewrites earlier turns as the conversation grows (so a prefix
does not hold) is refused for that line rather than guessed at.

Readers check every id against the model's vocabulary here, where the line and position are
still known, so a bad file fails with ``data.jsonl line 7: token id 70000 at position 3 ...``
instead of an index error deep inside the embedding.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from flowtrain.errors import DataError
from flowtrain.train.data_text import ChatTemplate, Encoder

# Text rows are handed to the tokenizer this many at a time (it encodes a batch in parallel).
_ENCODE_BATCH = 1024

_JSONL_EXAMPLE = (
    '{"text": "..."}, {"prompt": "...", "completion": "..."}, {"messages": [{"role": ..., '
    '"content": ...}, ...]}, {"input_ids": [1, 2, 3]} or {"input_ids": [...], "labels": [...]}'
)

IGNORE_INDEX = -100  # a target that is not one: torch's and Hugging Face's ignore_index

# The keys a row may hold, and the form they make; any other key set is refused, so a typo
# ("label", "response") never trains on what it was meant to mask. ``input_ids`` with ``text``
# is a pre-tokenized row that kept its text for reading; the ids are what counts.
_FORMS = {
    frozenset({"text"}): "text",
    frozenset({"prompt", "completion"}): "prompt/completion",
    frozenset({"messages"}): "messages",
    frozenset({"input_ids"}): "input_ids",
    frozenset({"input_ids", "labels"}): "input_ids",
    frozenset({"input_ids", "text"}): "input_ids",
}


@dataclass
class Parsed:
    """What a file holds: documents to join (``stream``) or sequences as they stand (``rows``)."""

    kind: Literal["stream", "rows"]
    pieces: list[np.ndarray]  # each (len,) int64
    eos_id: int | None = None  # separator between stream documents, when the tokenizer has one
    labels: list[np.ndarray] | None = None  # rows only: one per piece, same length, -100 = no loss


def read_txt(path: Path, vocab_size: int, encoder: Callable[[], Encoder]) -> Parsed:
    """A plain UTF-8 text file: one document, tokenised whole."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{path} is not UTF-8 text (bad byte at offset {exc.start}); re-save it as UTF-8"
        ) from None
    enc = encoder()
    ids = enc.encode_document(text)
    check_ids(ids, vocab_size, f"{path}", _tokenizer_hint(enc, vocab_size))
    return Parsed("stream", [ids], enc.eos_id)


def read_jsonl(
    path: Path,
    vocab_size: int,
    encoder: Callable[[], Encoder],
    chat_template: Callable[[], ChatTemplate | None] = lambda: None,
) -> Parsed:
    """JSON lines, one object each, in one of the forms of ``_JSONL_EXAMPLE``.

    ``text`` rows are documents (a stream); every other form gives one sequence per row. One
    file holds one form (``input_ids`` rows with and without ``labels`` count as one).
    """
    rows: dict[str, list[tuple[int, dict]]] = {}  # form -> [(line number, row)]
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            obj = _parse_line(path, line_no, raw)
            form = _FORMS.get(frozenset(obj))
            if form is None:
                keys = ", ".join(sorted(obj)) or "no keys"
                raise DataError(
                    f"{path} line {line_no} has {keys}, which is none of the accepted row forms; "
                    f"each line must look like {_JSONL_EXAMPLE}"
                )
            if rows and form not in rows:
                other = next(iter(rows))  # the file's form so far
                first = rows[other][0][0]
                raise DataError(
                    f"{path} mixes \"{other}\" rows (line {first}) and \"{form}\" rows (line "
                    f"{line_no}); keep one form per file: convert the rows or split the file"
                )
            rows.setdefault(form, []).append((line_no, obj))
    if not rows:
        raise DataError(f"{path} has no JSON lines; each line must look like {_JSONL_EXAMPLE}")
    form, lines = next(iter(rows.items()))
    if form == "input_ids":
        return _id_rows(path, lines, vocab_size)
    if form == "text":
        return _text_rows(path, lines, vocab_size, encoder())
    if form == "prompt/completion":
        return _prompt_rows(path, lines, vocab_size, encoder())
    template = chat_template()
    if template is None:
        raise DataError(
            f"{path} holds \"messages\" rows, but the model's tokenizer has no chat template "
            "(chat_template in tokenizer_config.json, or chat_template.jinja); pass --tokenizer "
            "DIR with one, or write the rows as prompt/completion"
        )
    return _chat_rows(path, lines, vocab_size, encoder(), template)


def _id_rows(path: Path, lines: list[tuple[int, dict]], vocab_size: int) -> Parsed:
    """``input_ids`` rows taken as given; ``labels``, where a row has them, aligned with them."""
    pieces, labels = [], []
    for line_no, obj in lines:
        ids = _id_row(path, line_no, obj["input_ids"], vocab_size)
        pieces.append(ids)
        if "labels" not in obj:
            labels.append(ids)
            continue
        lab = _int_list(path, line_no, "labels", obj["labels"])
        if len(lab) != len(ids):
            raise DataError(
                f"{path} line {line_no}: \"labels\" has {len(lab)} entries but \"input_ids\" has "
                f"{len(ids)}; labels are aligned with input_ids (labels[t] for position t, "
                "-100 where no loss is taken)"
            )
        bad = np.flatnonzero((lab != IGNORE_INDEX) & ((lab < 0) | (lab >= vocab_size)))
        if bad.size:
            pos = int(bad[0])
            raise DataError(
                f"{path} line {line_no}: label {lab[pos]} at position {pos} is neither -100 nor "
                f"inside the model's vocabulary 0..{vocab_size - 1}"
            )
        labels.append(lab)
    return Parsed("rows", pieces, labels=labels)


def _text_rows(path: Path, lines: list[tuple[int, dict]], vocab_size: int, enc: Encoder) -> Parsed:
    texts = [(line_no, _string(path, line_no, obj, "text")) for line_no, obj in lines]
    hint = _tokenizer_hint(enc, vocab_size)
    docs = []
    for start in range(0, len(texts), _ENCODE_BATCH):
        batch = texts[start : start + _ENCODE_BATCH]
        for (line_no, _), ids in zip(batch, enc.encode_many([t for _, t in batch])):
            check_ids(ids, vocab_size, f"{path} line {line_no}", hint)
            docs.append(ids)
    return Parsed("stream", docs, enc.eos_id)


def _prompt_rows(
    path: Path, lines: list[tuple[int, dict]], vocab_size: int, enc: Encoder
) -> Parsed:
    """Template prefix + prompt (no loss), then completion + EOS (loss)."""
    prefix, _ = enc.template_ids()
    end = np.array([] if enc.eos_id is None else [enc.eos_id], dtype=np.int64)
    hint = _tokenizer_hint(enc, vocab_size)
    pieces, labels = [], []
    for start in range(0, len(lines), _ENCODE_BATCH):
        batch = lines[start : start + _ENCODE_BATCH]
        prompts = enc.encode_bare([_string(path, n, obj, "prompt") for n, obj in batch])
        completions = enc.encode_bare([_string(path, n, obj, "completion") for n, obj in batch])
        for (line_no, _), prompt, completion in zip(batch, prompts, completions):
            ids = np.concatenate([prefix, prompt, completion, end])
            check_ids(ids, vocab_size, f"{path} line {line_no}", hint)
            lab = ids.copy()
            lab[: len(prefix) + len(prompt)] = IGNORE_INDEX
            pieces.append(ids)
            labels.append(lab)
    return Parsed("rows", pieces, labels=labels)


def _chat_rows(
    path: Path, lines: list[tuple[int, dict]], vocab_size: int, enc: Encoder,
    template: ChatTemplate,
) -> Parsed:
    """Each conversation rendered whole; labels on the assistant turns only (see the module)."""
    hint = _tokenizer_hint(enc, vocab_size)
    pieces, labels = [], []
    for line_no, obj in lines:
        where = f"{path} line {line_no}"
        messages = _messages(where, obj["messages"])
        turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        try:
            texts = [template.render(messages)]
            for k in turns:
                texts += [template.render(messages[:k], add_generation_prompt=True),
                          template.render(messages[: k + 1])]
        except ValueError as exc:
            raise DataError(
                f"{where}: the chat template ({template.source}) failed on this conversation: {exc}"
            ) from None
        encoded = enc.encode_bare(texts)
        ids = encoded[0]
        check_ids(ids, vocab_size, where, hint)
        lab = np.full_like(ids, IGNORE_INDEX)
        for k, before, through in zip(turns, encoded[1::2], encoded[2::2]):
            if not (_is_prefix(before, ids) and _is_prefix(through, ids)) or len(before) > len(through):
                raise DataError(
                    f"{where}: the chat template does not render this conversation turn by turn "
                    f"(the text up to messages[{k}] is not a prefix of the whole), so its "
                    "assistant tokens cannot be found; pre-tokenize it as input_ids + labels"
                )
            lab[len(before) : len(through)] = ids[len(before) : len(through)]
        pieces.append(ids)
        labels.append(lab)
    return Parsed("rows", pieces, labels=labels)


def _messages(where: str, value: object) -> list[dict]:
    ok = isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in value
    )
    if not ok or not value:
        raise DataError(
            f"{where}: \"messages\" must be a non-empty list of objects with a string \"role\" "
            f"and a \"content\", such as [{{\"role\": \"user\", \"content\": \"Hi\"}}], not "
            f"{json.dumps(value)[:60]}"
        )
    return value


def _is_prefix(part: np.ndarray, whole: np.ndarray) -> bool:
    return len(part) <= len(whole) and bool(np.array_equal(whole[: len(part)], part))


def _string(path: Path, line_no: int, obj: dict, key: str) -> str:
    value = obj[key]
    if not isinstance(value, str):
        raise DataError(
            f"{path} line {line_no}: \"{key}\" is a {type(value).__name__}, not a string; "
            "write it as one JSON string"
        )
    return value


def read_npy(path: Path, vocab_size: int) -> Parsed:
    """A NumPy integer array: 1-D is a token stream, 2-D one sequence per row."""
    try:
        array = np.load(path, allow_pickle=False)
    except Exception as exc:  # numpy raises ValueError, OSError, EOFError, ... for bad files
        raise DataError(
            f"{path} is not a readable .npy file ({exc}); write token ids with "
            "np.save(path, ids.astype(np.int32))"
        ) from None
    if not isinstance(array, np.ndarray):  # an .npz archive saved under an .npy name
        array.close()
        raise DataError(f"{path} is an .npz archive, not one array; save one array with np.save")
    if array.dtype.kind not in "iu":
        raise DataError(
            f"{path} holds {array.dtype} values, not token ids; save an integer array "
            "(e.g. np.save(path, ids.astype(np.int32)))"
        )
    if array.ndim not in (1, 2):
        raise DataError(
            f"{path} is a {array.ndim}-D array of shape {array.shape}; save a 1-D token stream "
            "or a 2-D array with one sequence per row"
        )
    if array.size == 0:
        raise DataError(f"{path} holds an empty array of shape {array.shape}; it has no tokens")
    hint = "re-tokenize the data for this model or give the model a larger vocab_size"
    if array.ndim == 1:
        check_ids(array, vocab_size, str(path), hint)
        return Parsed("stream", [array.astype(np.int64)])
    bad = np.argwhere((array < 0) | (array >= vocab_size))
    if bad.size:
        row, col = (int(v) for v in bad[0])
        raise DataError(
            f"{path} row {row}: token id {array[row, col]} at position {col} is outside the "
            f"model's vocabulary 0..{vocab_size - 1}; {hint}"
        )
    return Parsed("rows", list(array.astype(np.int64)))


def check_ids(ids: np.ndarray, vocab_size: int, where: str, hint: str) -> None:
    """Raise DataError naming the first id outside ``0 .. vocab_size - 1``."""
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size:
        pos = int(bad[0])
        raise DataError(
            f"{where}: token id {ids[pos]} at position {pos} is outside the model's "
            f"vocabulary 0..{vocab_size - 1}; {hint}"
        )


def _parse_line(path: Path, line_no: int, raw: bytes) -> dict:
    try:
        obj = json.loads(raw)
    except UnicodeDecodeError:
        raise DataError(f"{path} line {line_no} is not UTF-8; re-save the file as UTF-8") from None
    except json.JSONDecodeError as exc:
        raise DataError(
            f"{path} line {line_no} is not valid JSON ({exc.msg} at column {exc.colno}); "
            f"each line must be one JSON object such as {_JSONL_EXAMPLE}"
        ) from None
    if not isinstance(obj, dict):
        raise DataError(
            f"{path} line {line_no} is a JSON {type(obj).__name__}, not an object; "
            f"each line must look like {_JSONL_EXAMPLE}"
        )
    return obj


def _id_row(path: Path, line_no: int, value: object, vocab_size: int) -> np.ndarray:
    """One ``input_ids`` value as an int64 array, checked for type and range."""
    row = _int_list(path, line_no, "input_ids", value)
    check_ids(row, vocab_size, f"{path} line {line_no}",
              "re-tokenize the data for this model or give the model a larger vocab_size")
    return row


def _int_list(path: Path, line_no: int, key: str, value: object) -> np.ndarray:
    if isinstance(value, list) and not value:
        return np.zeros(0, dtype=np.int64)  # dropped later, like every row under 2 tokens
    row = np.asarray(value) if isinstance(value, list) else None
    if row is None or row.ndim != 1 or row.dtype.kind not in "iu":
        raise DataError(
            f"{path} line {line_no}: \"{key}\" must be a flat list of integers such as "
            f"[1, 2, 3], not {json.dumps(value)[:60]}"
        )
    return row.astype(np.int64)


def _tokenizer_hint(encoder: Encoder, vocab_size: int) -> str:
    return (
        f"the tokenizer ({encoder.name}) does not fit the model's vocab_size {vocab_size}; "
        "use the model's own tokenizer.json or a vocab_size at least as large as the tokenizer's"
    )
