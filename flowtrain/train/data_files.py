"""Reading a ``--data`` file into token ids: one reader per format, one shape of answer.

Every reader returns :class:`Parsed`: a list of int64 id arrays and how they are to be used.

* ``kind="stream"``: documents, to be joined (EOS between them) and cut into windows.
  ``.txt`` (one document), ``.jsonl`` rows with ``text``, a 1-D ``.npy``.
* ``kind="rows"``: sequences as they stand, each cut at seq_len or padded.
  ``.jsonl`` rows with ``input_ids``, a 2-D ``.npy``.

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
from flowtrain.train.data_text import Encoder

# Text rows are handed to the tokenizer this many at a time (it encodes a batch in parallel).
_ENCODE_BATCH = 1024

_JSONL_EXAMPLE = '{"text": "..."} or {"input_ids": [1, 2, 3]}'


@dataclass
class Parsed:
    """What a file holds: documents to join (``stream``) or sequences as they stand (``rows``)."""

    kind: Literal["stream", "rows"]
    pieces: list[np.ndarray]  # each (len,) int64
    eos_id: int | None = None  # separator between stream documents, when the tokenizer has one


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


def read_jsonl(path: Path, vocab_size: int, encoder: Callable[[], Encoder]) -> Parsed:
    """JSON lines, each an object with ``input_ids`` (a sequence) or ``text`` (a document).

    A row with both keys counts as ``input_ids`` (the exact form). One file holds one kind:
    sequences that stand alone and documents to be joined do not mix.
    """
    rows: list[np.ndarray] = []
    first_row_line = 0
    texts: list[tuple[int, str]] = []  # (line number, text)
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            obj = _parse_line(path, line_no, raw)
            if "input_ids" in obj:
                if texts:
                    _mixed(path, texts[0][0], line_no)
                rows.append(_id_row(path, line_no, obj["input_ids"], vocab_size))
                first_row_line = first_row_line or line_no
            elif "text" in obj:
                if not isinstance(obj["text"], str):
                    raise DataError(
                        f"{path} line {line_no}: \"text\" is a {type(obj['text']).__name__}, "
                        "not a string; write the document as one JSON string"
                    )
                if rows:
                    _mixed(path, line_no, first_row_line)
                texts.append((line_no, obj["text"]))
            else:
                keys = ", ".join(sorted(obj)) or "no keys"
                raise DataError(
                    f"{path} line {line_no} has neither \"input_ids\" nor \"text\" (it has "
                    f"{keys}); each line must look like {_JSONL_EXAMPLE}"
                )
    if rows:
        return Parsed("rows", rows)
    if not texts:
        raise DataError(f"{path} has no JSON lines; each line must look like {_JSONL_EXAMPLE}")
    enc = encoder()
    hint = _tokenizer_hint(enc, vocab_size)
    docs = []
    for start in range(0, len(texts), _ENCODE_BATCH):
        batch = texts[start : start + _ENCODE_BATCH]
        for (line_no, _), ids in zip(batch, enc.encode_many([t for _, t in batch])):
            check_ids(ids, vocab_size, f"{path} line {line_no}", hint)
            docs.append(ids)
    return Parsed("stream", docs, enc.eos_id)


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
    if isinstance(value, list) and not value:
        return np.zeros(0, dtype=np.int64)  # dropped later, like every row under 2 tokens
    row = np.asarray(value) if isinstance(value, list) else None
    if row is None or row.ndim != 1 or row.dtype.kind not in "iu":
        raise DataError(
            f"{path} line {line_no}: \"input_ids\" must be a flat list of integers such as "
            f"[1, 2, 3], not {json.dumps(value)[:60]}"
        )
    check_ids(row, vocab_size, f"{path} line {line_no}",
              "re-tokenize the data for this model or give the model a larger vocab_size")
    return row.astype(np.int64)


def _mixed(path: Path, text_line: int, ids_line: int) -> None:
    raise DataError(
        f"{path} mixes \"text\" rows (line {text_line}) and \"input_ids\" rows (line {ids_line}); "
        "keep one kind per file: tokenize the text rows or split the file in two"
    )


def _tokenizer_hint(encoder: Encoder, vocab_size: int) -> str:
    return (
        f"the tokenizer ({encoder.name}) does not fit the model's vocab_size {vocab_size}; "
        "use the model's own tokenizer.json or a vocab_size at least as large as the tokenizer's"
    )
