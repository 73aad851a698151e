"""Text to token ids: the model's own ``tokenizer.json``, or raw UTF-8 bytes.

A model directory that carries a ``tokenizer.json`` is tokenised with it through the
``tokenizers`` library, exactly as ``AutoTokenizer.from_pretrained(dir)(text)`` would: the
tokenizer's template applies, so a Llama tokenizer puts its BOS in front of every document.
Without one (a preset model that has no directory yet) text falls back to its UTF-8 bytes,
ids 0..255, which any model with ``vocab_size >= 256`` can learn::

    encoder = make_encoder(model_dir, vocab_size=32000, eos_id=None)
    encoder.encode_many(["Hello there.", "Bye."])   # [array([1, 15043, 727, 29889]), ...]
    encoder.eos_id                                  # 2, from tokenizer_config.json

Encoders return ``np.ndarray`` int64 id arrays; range checks against the model's vocabulary
happen in :mod:`flowtrain.train.data_files`, where the line and position are known.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import numpy as np

from flowtrain.errors import DataError

# Files a model directory may carry for its tokenizer; the trainer copies the ones present
# next to its checkpoints so that --out is a complete, loadable model directory.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)

# Tokenizer files that mean "this model has a real tokenizer", so falling back to bytes
# would silently train on ids the model was never meant to see.
_FOREIGN_TOKENIZERS = ("tokenizer.model", "vocab.json")

# Long documents are encoded in pieces of about this many characters (split where a line
# starts), so tokenizers can work on them in parallel without holding one giant Encoding.
CHUNK_CHARS = 1 << 20


def find_tokenizer(model_dir: str | Path | None) -> Path | None:
    """The ``tokenizer.json`` in ``model_dir``, or None when there is none (or no directory)."""
    if model_dir is None:
        return None
    path = Path(model_dir) / "tokenizer.json"
    return path if path.is_file() else None


def tokenizer_files(model_dir: str | Path | None) -> list[Path]:
    """The tokenizer-related files present in ``model_dir``, in :data:`TOKENIZER_FILES` order."""
    if model_dir is None:
        return []
    root = Path(model_dir)
    return [root / name for name in TOKENIZER_FILES if (root / name).is_file()]


class Encoder(Protocol):
    """Turns text into token ids; ``eos_id`` separates documents when joined (None: nothing)."""

    name: str
    eos_id: int | None

    def encode_many(self, texts: list[str]) -> list[np.ndarray]:
        """One int64 id array per text, each a complete document (template applied)."""
        ...

    def encode_document(self, text: str) -> np.ndarray:
        """One long document (a whole .txt file) as one int64 id array."""
        ...


class ByteEncoder:
    """The fallback: a text's UTF-8 bytes are its token ids (0..255), no special tokens."""

    name = "UTF-8 bytes (no tokenizer.json)"

    def __init__(self, eos_id: int | None) -> None:
        self.eos_id = eos_id

    def encode_many(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode_document(text) for text in texts]

    def encode_document(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)


class TokenizerEncoder:
    """A Hugging Face ``tokenizer.json``, loaded through the ``tokenizers`` library."""

    def __init__(self, path: Path, eos_id: int | None) -> None:
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the library raises bare Exceptions for bad files
            raise DataError(
                f"could not load the tokenizer {path}: {exc}; replace it with a valid "
                "tokenizer.json (e.g. one saved by transformers' save_pretrained)"
            ) from None
        # A tokenizer.json saved for inference may truncate or pad every encoding; training
        # data must come through whole.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self._tokenizer = tokenizer
        self.name = str(path)
        self.eos_id = eos_id if eos_id is not None else _configured_eos(path.parent, tokenizer)

    def encode_many(self, texts: list[str]) -> list[np.ndarray]:
        encodings = self._tokenizer.encode_batch(texts, add_special_tokens=True)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def encode_document(self, text: str) -> np.ndarray:
        if len(text) <= CHUNK_CHARS:
            return self.encode_many([text])[0]
        # Encode the pieces bare and put the template (BOS, ...) around the whole once.
        # Only the few seams between pieces may tokenize differently from a single call.
        pieces = self._tokenizer.encode_batch(_split_lines(text), add_special_tokens=False)
        prefix, suffix = self._template()
        ids = [prefix, *(np.asarray(p.ids, dtype=np.int64) for p in pieces), suffix]
        return np.concatenate(ids)

    def _template(self) -> tuple[np.ndarray, np.ndarray]:
        """The special ids the tokenizer's template puts before and after a document."""
        bare = self._tokenizer.encode("a", add_special_tokens=False).ids
        full = self._tokenizer.encode("a", add_special_tokens=True).ids
        for start in range(len(full) - len(bare) + 1):
            if full[start : start + len(bare)] == bare:
                return (
                    np.asarray(full[:start], dtype=np.int64),
                    np.asarray(full[start + len(bare) :], dtype=np.int64),
                )
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty


def make_encoder(tokenizer_dir: str | Path | None, vocab_size: int, eos_id: int | None) -> Encoder:
    """The encoder for a model: its tokenizer.json, else UTF-8 bytes if the vocabulary allows.

    Raises DataError when the directory has a tokenizer in another format only (a
    sentencepiece ``tokenizer.model``, a ``vocab.json``), or when bytes are the only way but
    ``vocab_size < 256``.
    """
    path = find_tokenizer(tokenizer_dir)
    if path is not None:
        return TokenizerEncoder(path, eos_id)
    if tokenizer_dir is not None:
        foreign = [n for n in _FOREIGN_TOKENIZERS if (Path(tokenizer_dir) / n).is_file()]
        if foreign:
            raise DataError(
                f"{tokenizer_dir} has {foreign[0]} but no tokenizer.json; flowtrain reads only "
                "tokenizer.json: convert it with transformers (AutoTokenizer.from_pretrained(dir)"
                ".save_pretrained(dir)) or pass pre-tokenized input_ids data"
            )
    if vocab_size < 256:
        raise DataError(
            f"the model has no tokenizer.json and vocab_size {vocab_size} is below the 256 that "
            "the byte-level fallback needs; give the model a vocab_size of at least 256, add a "
            "tokenizer.json to its directory, or pass pre-tokenized data (input_ids or .npy)"
        )
    return ByteEncoder(eos_id)


def _configured_eos(model_dir: Path, tokenizer) -> int | None:
    """The EOS id named by ``tokenizer_config.json`` (``eos_token``), if any."""
    config = model_dir / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        token = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
    except (ValueError, AttributeError):
        return None  # an unreadable config only costs us the separator, not the run
    if isinstance(token, dict):
        token = token.get("content")
    return tokenizer.token_to_id(token) if isinstance(token, str) else None


def _split_lines(text: str) -> list[str]:
    """Cut ``text`` into pieces of about CHUNK_CHARS, each cut where a non-blank line starts."""
    pieces, start = [], 0
    while len(text) - start > CHUNK_CHARS:
        cut = start + CHUNK_CHARS
        while True:  # the first newline at or after cut - 1 that a non-blank line follows
            newline = text.find("\n", cut - 1)
            if newline < 0 or newline + 1 >= len(text):
                cut = len(text)
                break
            if not text[newline + 1].isspace():
                cut = newline + 1
                break
            cut = newline + 2
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return [p for p in pieces if p]
