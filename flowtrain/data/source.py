"""Training data: a ``--data`` file becomes sequences, sequences become optimizer steps.

::

    seqs = load_sequences("data.jsonl", seq_len=512, vocab_size=32000, tokenizer_dir=model_dir)
    for batch in step_batches(seqs, batch_size=8, shuffle=True, seed=0):   # yields forever
        for mb in batch.micro_batches(2):
            logits = model(mb.input_ids)                                  # (2, 512, vocab)
            # mb.positions: None, or (2, 512) int64 restarting at 0 at every packed example
            ce = F.cross_entropy(logits.flatten(0, 1), mb.targets.flatten(), reduction="sum")
            (ce / batch.num_targets()).backward()                         # mean over the step

**What a file holds.** ``.txt`` (one document), ``.jsonl`` rows with ``text`` and a 1-D ``.npy``
are token *streams*: documents are tokenised, joined with the EOS token between them and cut
into windows of exactly ``seq_len`` tokens (a final tail of 2 or more tokens is kept, padded).
``.jsonl`` rows with ``input_ids`` and the rows of a 2-D ``.npy`` are *sequences as they
stand*, learnt whole: padded, or, longer than ``seq_len``, cut or dropped (see below).
Sequences under 2 tokens or without a single target teach nothing and are left out, counted
(:attr:`DataReport.untrained`, the first in :attr:`DataReport.first_untrained`); a file of
nothing else raises DataError saying so.
Formats live in :mod:`~flowtrain.data.files`, tokenizers and chat templates in
:mod:`~flowtrain.data.text`.

**Fine-tuning.** ``.jsonl`` rows may also be ``{"prompt", "completion"}`` (loss on the
completion and its EOS), ``{"messages": [...]}`` with optional ``"tools": [...]`` (the model's
chat template; loss on the assistant turns) or ``{"input_ids", "labels"}`` (labels as
transformers takes them: aligned with the ids, -100 for no loss). Every row (these and the
sequences above) is one *example*. With ``packing`` (the default) short examples share a
sequence, each whole: best fit decreasing, with ``positions`` restarting at every example so
that the model restarts rotary positions and keeps attention inside each example
(:mod:`~flowtrain.data.pack`); without it each example is a sequence of its own, padded.

**Examples longer than seq_len** are never cut silently: ``long_examples`` says what becomes
of them, and :attr:`Sequences.report` counts the examples cut and dropped and the target tokens
they lost. ``"truncate"`` cuts each at ``seq_len``, keeping its start (a sequence cut so that
no target is left is left out); ``"drop"`` leaves them out; ``"error"`` raises DataError naming
how many there are and the first, after building the cache as ``"drop"`` does (so choosing
``drop`` next reuses it); ``"auto"`` is ``"error"`` for conversations (``messages`` rows) and
``"truncate"`` for every other row, as a token stream is cut into windows.

**seq_len from the data.** ``seq_len`` may be a :class:`FromData`: the rows are then as long as
the longest example with a target, rounded up to a multiple (64 for ``flowtrain train``), at
least ``FromData.least`` (``flowtrain train`` puts the held-out set's length there, so that its
examples fit too), at most the model's positions; a token stream has no examples to measure and
takes ``FromData.stream``.

**Which tokenizer.** Text (``.txt``, ``text``, ``prompt``/``completion``, ``messages``) is
tokenised with ``tokenizer_dir/tokenizer.json``. A preset model (``tokenizer_dir=None``) learns
raw UTF-8 bytes; a model folder without a tokenizer.json is refused unless ``byte_tokenizer``
says that bytes are meant (``--byte-tokenizer``), since a pretrained model's ids are not bytes.
A flowtrain checkpoint without one goes on in bytes: flowtrain copies the tokenizer files into
every checkpoint, so it was trained on bytes (or on ids) from the start.

**Targets, as Hugging Face defines the loss.** ``LlamaForCausalLM(input_ids, labels=input_ids)``
with padding labelled -100 shifts inside the loss: position ``t`` predicts token ``t + 1``, the
last position and padding predict nothing. We do the shift once, here, so the model and the
scheduler never see a label that is not a target::

    input_ids  [ 5  9  7  3 | pad pad ]          (4 real tokens, seq_len 6)
    targets    [ 9  7  3 -100 -100 -100 ]        (3 targets)

Rows with labels shift the labels, so a position predicts only a token that carries a loss::

    input_ids  [ 1  5  9 | 7  3  2 ]              (BOS, prompt 5 9, completion 7 3, EOS 2)
    labels     [ -100 -100 -100 | 7  3  2 ]
    targets    [ -100 -100  7  3  2 -100 ]        (3 targets: no prompt token is one)

Summing ``cross_entropy(..., reduction="sum")`` over every micro-batch and dividing by
``batch.num_targets()`` gives exactly HF's mean over the whole step, however the step is split.
Padding sits only at the right, so causal attention never lets a real token see it and no
attention mask is needed. Packed rows concatenate the examples' own targets: the last token of
an example predicts nothing, so no target crosses into the next example, and the step has
exactly the targets (the loss's denominator) that it has unpacked.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

import numpy as np
import torch

from flowtrain.data import cache as data_cache
from flowtrain.data import pack as data_pack
from flowtrain.data import text as data_text
from flowtrain.data.files import (
    IGNORE_INDEX,
    Parsed,
    holds_conversations,
    read_jsonl,
    read_npy,
    read_txt,
)
from flowtrain.data.rows import ColumnMap
from flowtrain.data.tables import TABLE_SUFFIXES, is_dataset_folder
from flowtrain.data.text import (
    TOKENIZER_FILES,
    check_encoder,
    find_tokenizer,
    load_chat_template,
    make_encoder,
    tokenizer_files,
)
from flowtrain.errors import ConfigError, DataError

__all__ = [
    "IGNORE_INDEX",
    "LONG_EXAMPLES",
    "TOKENIZER_FILES",
    "Batch",
    "DataReport",
    "FromData",
    "Sequences",
    "default_corpus_path",
    "find_tokenizer",
    "load_sequences",
    "step_batches",
    "tokenizer_files",
]

_FORMATS = (".jsonl", ".txt", ".npy", *TABLE_SUFFIXES)
_ACCEPTED = "pass a .jsonl, .txt, .npy, .parquet or .arrow file, or a datasets folder (save_to_disk)"

#: What ``long_examples`` may say about an example longer than seq_len (see the module).
LONG_EXAMPLES = ("auto", "error", "drop", "truncate")

@dataclass(frozen=True)
class FromData:
    """A ``seq_len`` the data chooses (``flowtrain train`` without ``--seq-len``): rows of
    examples are as long as the longest example, rounded up to a multiple of ``multiple``, at
    most ``most`` (the model's ``max_position_embeddings``); a token stream, which has no
    examples, is cut into windows of ``stream`` tokens (at most ``most``). The numbers are the
    caller's: ``flowtrain.train.config.defaults`` says why 128 and 64."""

    stream: int
    multiple: int
    most: int | None = None
    #: rows at least this long (another file's examples that must fit too: the held-out set's)
    least: int = 0

    def for_stream(self) -> int:
        return min(self.stream, self.most) if self.most is not None else self.stream

    def for_examples(self, longest: int, own: bool = False) -> int:
        """Rows for examples of at most ``longest`` tokens (``own``: leaving out ``least``)."""
        rounded = -(-max(longest, 2) // self.multiple) * self.multiple
        rounded = rounded if own else max(rounded, self.least)
        return min(rounded, self.most) if self.most is not None else rounded


@dataclass(frozen=True)
class DataReport:
    """What reading a file did, for the run's start-up block (kept in the cache's index)."""

    kind: str = "stream"  # "stream" (documents cut into windows) or "rows" (examples)
    examples: int = 0  # rows: examples in the sequences, whole or cut
    longest: int = 0  # rows: tokens of the longest example with a target, before any cut
    seq_len_from_data: bool = False  # seq_len was a FromData
    capped: bool = False  # ... and the model's positions set it, below the longest example
    widened: bool = False  # ... and FromData.least (the held-out set's examples) set it, above this file's
    cut: tuple[int, int] = (0, 0)  # (examples cut at seq_len, target tokens they lost)
    dropped: tuple[int, int] = (0, 0)  # (examples longer than seq_len left out, their target tokens)
    first_dropped: str | None = None  # e.g. "line 7 (97 tokens)"
    untrained: int = 0  # rows: examples left out for having no target (no token with a loss)
    first_untrained: str | None = None  # e.g. "line 3"
    mask: str | None = None  # messages: "generation" (its {% generation %} marks) or "turns"

    @classmethod
    def from_index(cls, report: dict) -> DataReport:
        return cls(**{**report, "cut": tuple(report.get("cut", (0, 0))),
                      "dropped": tuple(report.get("dropped", (0, 0)))})


@dataclass(eq=False)
class Sequences:
    """All sequences of a data set, ready to be batched (on the CPU, or mapped from the cache)."""

    input_ids: torch.Tensor  # (N, seq_len) int64, padding filled with pad_id
    targets: torch.Tensor  # (N, seq_len) int64, next token where both are real, else -100
    #: (N, seq_len) int64, each token's position within its own example (0 at every example
    #: start and at the start of the padding); None: 0..seq_len-1 in every row (not packed)
    positions: torch.Tensor | None = None
    _num_targets: int | None = field(default=None, repr=False)  # known from the cache index
    _fingerprint: str | None = field(default=None, repr=False)
    #: what reading the file did: examples, the longest, those cut or dropped, the mask rule
    report: DataReport = field(default_factory=DataReport, repr=False)

    def __post_init__(self) -> None:
        shapes = [self.input_ids.shape, self.targets.shape]
        if self.positions is not None:
            shapes.append(self.positions.shape)
        if len(set(shapes)) != 1 or self.input_ids.ndim != 2:
            raise DataError(
                "input_ids, targets (and positions) " + ", ".join(str(tuple(s)) for s in shapes)
                + " must be (N, seq_len) tensors of one shape"
            )

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def num_targets(self) -> int:
        """How many positions predict a token (the loss's denominator over the whole set)."""
        if self._num_targets is None:
            self._num_targets = int((self.targets != IGNORE_INDEX).sum())
        return self._num_targets

    def fingerprint(self) -> str:
        """A short hash of the rows (input ids, targets, and positions when packed), as the run
        sees them; unpacked, the hash earlier checkpoints recorded. Cached
        data takes it from the cache index instead of reading every row."""
        if self._fingerprint is None:
            tensors = [self.input_ids, self.targets]
            self._fingerprint = data_cache.fingerprint(
                tensors + ([self.positions] if self.positions is not None else []))
        return self._fingerprint

    def __repr__(self) -> str:
        packed = ", packed" if self.positions is not None else ""
        return f"<Sequences {len(self)} x {self.seq_len}, {self.num_targets():,} targets{packed}>"


@dataclass(eq=False)
class Batch:
    """The sequences of one optimizer step."""

    input_ids: torch.Tensor  # (batch_size, seq_len) int64
    targets: torch.Tensor  # (batch_size, seq_len) int64, -100 where nothing is predicted
    #: (batch_size, seq_len) int64 positions within each packed example, restarting at 0 where
    #: an example (or the padding) starts; attention must not cross a restart. None: not packed,
    #: every row is one sequence at positions 0..seq_len-1.
    positions: torch.Tensor | None = None
    #: (batch_size,) int64: which rows of the data set these are (read by preference training,
    #: whose reference log-probabilities are kept per row); None where nobody asked
    rows: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def micro_batches(self, micro_batch_size: int) -> list[Batch]:
        """The step cut into consecutive micro-batches of ``micro_batch_size`` rows (views)."""
        if micro_batch_size < 1 or len(self) % micro_batch_size:
            raise ConfigError(
                f"{{micro_batch_size}} {micro_batch_size} does not divide {{batch_size}} "
                f"{len(self)}; pick a divisor of {len(self)}", named=True)
        return [
            Batch(self.input_ids[i : i + micro_batch_size], self.targets[i : i + micro_batch_size],
                  None if self.positions is None else self.positions[i : i + micro_batch_size],
                  None if self.rows is None else self.rows[i : i + micro_batch_size])
            for i in range(0, len(self), micro_batch_size)
        ]

    def num_targets(self) -> int:
        """Targets across the whole step: divide every micro-batch's CE *sum* by this."""
        return int((self.targets != IGNORE_INDEX).sum())

    def __repr__(self) -> str:
        packed = ", packed" if self.positions is not None else ""
        return f"<Batch {len(self)} x {self.input_ids.shape[1]}, {self.num_targets():,} targets{packed}>"


def load_sequences(
    path: str | Path,
    seq_len: int | FromData,
    vocab_size: int,
    tokenizer_dir: str | Path | None = None,
    pad_id: int = 0,
    eos_id: int | None = None,
    byte_tokenizer: bool = False,
    *,
    packing: bool = True,
    long_examples: str = "truncate",
    cache_dir: str | Path | None = None,
    columns: ColumnMap | None = None,
) -> Sequences:
    """Read a ``.jsonl``, ``.txt``, ``.npy``, ``.parquet`` or ``.arrow`` file, or a ``datasets``
    folder, into :class:`Sequences`, through the cache. ``columns`` maps row keys to the
    columns that hold them (:func:`~flowtrain.data.rows.parse_columns`; None: the keys as
    they are).

    Text is tokenised with ``tokenizer_dir/tokenizer.json`` when there is one; as UTF-8 bytes
    when ``tokenizer_dir`` is None (a preset) or ``byte_tokenizer`` is set; a ``tokenizer_dir``
    without tokenizer.json is refused for text. ``messages`` rows use the chat template found in
    ``tokenizer_dir``. ``eos_id`` separates joined documents and ends completions; when None,
    the tokenizer's ``tokenizer_config.json`` may name one. ``seq_len`` is a number or a
    :class:`FromData`; ``packing`` packs examples and ``long_examples`` (one of
    :data:`LONG_EXAMPLES`; ``"truncate"``, what this function always did, unless asked
    otherwise; ``flowtrain train`` asks for ``"auto"``) says what becomes of an example longer
    than seq_len (see the module). The rows are built once into ``cache_dir``
    (default: see :func:`~flowtrain.data.cache.cache_root`) and mapped from there. Raises
    DataError for a file that cannot be used and ConfigError for impossible sizes or ids.
    """
    if long_examples not in LONG_EXAMPLES:
        raise ConfigError(f"{{long_examples}} must be one of {', '.join(LONG_EXAMPLES)} (got {long_examples!r})", named=True)
    if isinstance(seq_len, FromData) and seq_len.multiple < 1:
        raise ConfigError(f"a seq_len from the data is rounded up to a multiple of at least 1 (got {seq_len.multiple})")
    _check_config(seq_len if isinstance(seq_len, int) else seq_len.for_stream(), vocab_size, pad_id, eos_id)
    path = _check_file(Path(path))
    chosen = (seq_len if isinstance(seq_len, int)
              else ["from the data", seq_len.stream, seq_len.most, seq_len.multiple, seq_len.least])
    drop = long_examples in ("drop", "error") or (long_examples == "auto" and holds_conversations(path, columns))
    settings = {"seq_len": chosen, "packing": packing, "long_examples": "drop" if drop else "truncate",
                "vocab_size": vocab_size, "pad_id": pad_id, "eos_id": eos_id, "byte_tokenizer": byte_tokenizer,
                "chunk_chars": data_text.CHUNK_CHARS}
    if columns is not None:  # (only then: the key of every other file stays what it was)
        settings["columns"] = [list(c) for c in columns]
    text: list[bool] = []  # set when text is tokenised: a cached load checks the tokenizer again

    @functools.cache
    def encoder():
        text.append(True)
        return make_encoder(tokenizer_dir, vocab_size, eos_id, byte_tokenizer)

    def build(folder: Path) -> dict:
        parsed = _parse(path, vocab_size, encoder, tokenizer_dir, columns)
        if parsed.kind == "stream":
            length = seq_len if isinstance(seq_len, int) else seq_len.for_stream()
            with data_cache.RowWriter(folder, length, positions=False) as out:
                data_pack.stream_rows(path, parsed.pieces, parsed.eos_id, length, pad_id, out)
                index = out.close()
            report = {"kind": "stream", "seq_len_from_data": not isinstance(seq_len, int)}
        else:
            index, report = _build_rows(path, parsed, folder, seq_len, pad_id, packing, drop, long_examples)
        return {**index, "kind": parsed.kind, "text": bool(text), "source": str(path.absolute()), "report": report}

    def build_or_say(folder: Path) -> dict:
        try:
            return build(folder)
        except MemoryError:  # under a memory limit (ulimit, a container): one line, no half-built cache
            raise DataError(
                f"ran out of memory reading {path} into token rows; give the run more memory, or split its "
                "longest rows (docs/training.md, \"How long a row may be\")"
            ) from None

    rows = data_cache.open_rows(data_cache.cached(path, settings, tokenizer_dir, build_or_say, cache_dir))
    if rows.index["text"]:
        check_encoder(tokenizer_dir, vocab_size, byte_tokenizer)  # the errors a miss would raise
    report = DataReport.from_index(rows.index["report"])
    if long_examples in ("error", "auto") and report.dropped[0]:  # "auto" drops conversations only
        raise _long_examples_error(path, report, rows.index["seq_len"])
    return Sequences(rows.input_ids, rows.targets, rows.positions, _num_targets=rows.index["num_targets"],
                     _fingerprint=rows.index["fingerprint"], report=report)


def _build_rows(path: Path, parsed: Parsed, folder: Path, seq_len: int | FromData, pad_id: int, packing: bool,
                drop: bool, long_examples: str) -> tuple[dict, dict]:
    """Write the rows of a file of examples into ``folder``: spool them whole, choose seq_len
    (from the data, if asked), cut or ``drop`` the long ones, then pad or pack. The index
    entries of the files written and the report."""
    spooled = data_pack.Spooled(parsed.pieces, folder)
    try:
        untrained = (f"{parsed.row_name} {spooled.first_untrained}" if spooled.first_untrained is not None
                     else None)
        if not len(spooled):
            raise _no_rows(path, None, untrained=(spooled.untrained, untrained), chat=parsed.mask is not None)
        length = seq_len if isinstance(seq_len, int) else seq_len.for_examples(spooled.longest)
        fitted = data_pack.fit(spooled, length, drop_long=drop)
        first = (f"{parsed.row_name} {fitted.first_dropped[0]} ({fitted.first_dropped[1]:,} tokens)"
                 if fitted.first_dropped else None)
        report = {"kind": "rows", "examples": len(fitted.keep), "longest": spooled.longest,
                  "seq_len_from_data": not isinstance(seq_len, int),
                  "capped": not isinstance(seq_len, int) and length < spooled.longest,
                  "widened": not isinstance(seq_len, int) and length > seq_len.for_examples(spooled.longest, own=True),
                  "cut": [fitted.cut_count, fitted.cut_lost], "dropped": [fitted.dropped_count, fitted.dropped_lost],
                  "first_dropped": first, "untrained": spooled.untrained, "first_untrained": untrained,
                  "mask": parsed.mask}
        if not len(fitted.keep):
            if fitted.dropped_count and long_examples in ("error", "auto"):
                raise _long_examples_error(path, DataReport.from_index(report), length)
            raise _no_rows(path, length, fitted.dropped_count)
        with data_cache.RowWriter(folder, length, positions=packing) as out:
            if packing:
                np.save(folder / "layout.npy", data_pack.packed_rows(spooled, fitted, length, pad_id, out))
            else:
                data_pack.plain_rows(spooled, fitted, length, pad_id, out)
            return out.close(), report
    finally:
        spooled.remove()


def _no_rows(path: Path, seq_len: int | None, dropped: int = 0, untrained: tuple[int, str | None] = (0, None),
             chat: bool = False) -> DataError:
    count, first = untrained
    if count:
        turns = " (conversations are trained on their \"assistant\" turns only)" if chat else ""
        return DataError(
            f"{path} has no usable sequences: every one of its {count:,} row{'s' if count != 1 else ''} (the first "
            f"at {first}) has fewer than 2 tokens or no token with a loss{turns}, and predicting a next token "
            "needs at least 2"
        )
    if dropped:
        return DataError(
            f"{path} has no usable sequences: every example with a target is longer than --seq-len {seq_len} "
            f"and --long-examples drop left all {dropped:,} out; pass a larger --seq-len or --long-examples truncate"
        )
    within = f" within the first --seq-len {seq_len}" if seq_len is not None else ""
    return DataError(
        f"{path} has no usable sequences: every one has fewer than 2 tokens or no token "
        f"with a loss{within}, and predicting a next token needs at least 2"
    )


def _long_examples_error(path: Path, report: DataReport, seq_len: int) -> DataError:
    """The one line ``long_examples="error"`` ends in: how many, the first, what to pass."""
    count, lost = report.dropped
    limit = (f"the model's {seq_len:,} positions (--seq-len from the data, at most max_position_embeddings)"
             if report.capped else f"--seq-len {seq_len}")
    larger = "" if report.capped else f", or --seq-len {report.longest} or more to keep every one whole"
    return DataError(
        f"{path}: {count:,} example{'s' if count != 1 else ''} longer than {limit}, the first at "
        f"{report.first_dropped}, {lost:,} target tokens in all; pass --long-examples drop to train without "
        f"them or --long-examples truncate to cut them at {seq_len} tokens{larger}"
    )


def _check_file(path: Path) -> Path:
    if not path.exists():
        raise DataError(f"data file {path} does not exist; {_ACCEPTED}")
    if is_dataset_folder(path):
        return path
    if not path.is_file():
        raise DataError(f"data path {path} is not a file nor a datasets folder (no state.json or "
                        f"dataset_dict.json in it); {_ACCEPTED}")
    suffix = path.suffix.lower()
    if suffix not in _FORMATS:
        raise DataError(
            f"data file {path} has an unknown extension {suffix or '(none)'!r}; use .jsonl "
            "(text, prompt/completion, messages, alpaca, ShareGPT or input_ids rows), .txt (plain text), "
            ".npy (token ids), or .parquet / .arrow (the rows of a .jsonl as a table)"
        )
    if path.stat().st_size == 0:
        raise DataError(f"data file {path} is empty; give it some text or token ids")
    return path


def _parse(path: Path, vocab_size: int, encoder, tokenizer_dir, columns: ColumnMap | None) -> Parsed:
    suffix = path.suffix.lower()
    if suffix == ".jsonl" or suffix in TABLE_SUFFIXES or path.is_dir():
        return read_jsonl(path, vocab_size, encoder, lambda: load_chat_template(tokenizer_dir), columns)
    if columns is not None:
        raise DataError(f"--data-columns maps the columns of rows, but {path} is a {suffix} file, which has none")
    if suffix == ".txt":
        return read_txt(path, vocab_size, encoder)
    return read_npy(path, vocab_size)


def step_batches(
    seqs: Sequences, batch_size: int, *, shuffle: bool, seed: int, start_step: int = 0, pairs: bool = False
) -> Iterator[Batch]:
    """Yield full batches forever, epoch after epoch.

    Epoch ``e`` visits every sequence once: in file order, or (``shuffle``) in a permutation
    drawn from a ``torch.Generator`` seeded from ``(seed, e)``, so a run is reproducible and
    epochs differ. Batches always have ``batch_size`` rows: one that reaches the end of an
    epoch continues into the next epoch's order, so no sequence is starved (with fewer
    sequences than ``batch_size`` a batch spans several epochs). ``start_step`` skips that
    many batches without building them, for resuming a run.

    ``pairs`` (preference pairs, :mod:`flowtrain.data.preference`): rows ``2p`` and ``2p + 1``
    are one pair and stay together, next to each other, in that order; the pairs are what is
    shuffled, and ``batch_size`` (rows) must be even. Each batch then says which rows it holds
    (:attr:`Batch.rows`).
    """
    if pairs:
        if batch_size < 2 or batch_size % 2 or len(seqs) % 2:
            raise ConfigError(f"{{batch_size}} {batch_size} counts sequences, two per preference pair: it must be "
                              "even", named=True)
        return _pair_batches(seqs, batch_size, shuffle, seed, start_step)
    if batch_size < 1:
        raise ConfigError(f"{{batch_size}} {batch_size} must be at least 1", named=True)
    if start_step < 0:
        raise ConfigError(f"start_step {start_step} must be at least 0")
    n = len(seqs)
    if n == 0:
        raise DataError("there are no sequences to batch; the data set is empty")
    return _batches(seqs, batch_size, shuffle, seed, start_step)  # checks above run eagerly


def _epoch_chunks(n: int, per: int, shuffle: bool, seed: int, start_step: int) -> Iterator[torch.Tensor]:
    """``per`` of ``n`` items a step, forever, epoch after epoch (:func:`_epoch_order`); a chunk
    that reaches the end of an epoch continues into the next one's order. ``start_step`` skips
    the chunks of the steps before it."""
    epoch, offset = divmod(start_step * per, n)
    order = _epoch_order(n, epoch, shuffle, seed)[offset:]
    while True:
        while len(order) < per:
            epoch += 1
            order = torch.cat([order, _epoch_order(n, epoch, shuffle, seed)])
        chunk, order = order[:per], order[per:]
        yield chunk


def _batches(
    seqs: Sequences, batch_size: int, shuffle: bool, seed: int, start_step: int
) -> Iterator[Batch]:
    for rows in _epoch_chunks(len(seqs), batch_size, shuffle, seed, start_step):
        positions = None if seqs.positions is None else seqs.positions[rows]
        yield Batch(seqs.input_ids[rows], seqs.targets[rows], positions)  # copies: rows read here


def _pair_batches(seqs: Sequences, batch_size: int, shuffle: bool, seed: int, start_step: int) -> Iterator[Batch]:
    """:func:`_batches` over pairs: each pair's two rows together, in order."""
    for chosen in _epoch_chunks(len(seqs) // 2, batch_size // 2, shuffle, seed, start_step):
        rows = torch.stack([2 * chosen, 2 * chosen + 1], dim=1).reshape(-1)
        yield Batch(seqs.input_ids[rows], seqs.targets[rows], None, rows)


def default_corpus_path() -> Path:
    """The small English corpus shipped with flowtrain, for a first run without ``--data``."""
    try:
        resource = files("flowtrain") / "resources" / "corpus.txt"
    except NotADirectoryError:
        # Python 3.11 cannot list a namespace package (no __init__.py) that an editable
        # install also maps through a path hook; the corpus still sits next to this package.
        resource = Path(__file__).resolve().parent.parent / "resources" / "corpus.txt"
    if not isinstance(resource, Path) or not resource.is_file():
        raise DataError(
            f"the corpus shipped with flowtrain is missing ({resource}); reinstall flowtrain "
            "or pass --data FILE"
        )
    return resource


def _check_config(seq_len: int, vocab_size: int, pad_id: int, eos_id: int | None) -> None:
    if seq_len < 2:
        raise ConfigError(
            f"{{seq_len}} {seq_len} is too short: predicting a next token needs at least 2", named=True)
    if vocab_size < 1:
        raise ConfigError(f"vocab_size {vocab_size} must be at least 1")
    if not 0 <= pad_id < vocab_size:
        raise ConfigError(
            f"pad_id {pad_id} is outside the vocabulary 0..{vocab_size - 1}; set the model's "
            "pad_token_id to a valid id (padding is never a target, any id will do)"
        )
    if eos_id is not None and not 0 <= eos_id < vocab_size:
        raise ConfigError(
            f"eos_id {eos_id} is outside the vocabulary 0..{vocab_size - 1}; fix the model's "
            "eos_token_id"
        )


def _epoch_order(n: int, epoch: int, shuffle: bool, seed: int) -> torch.Tensor:
    """The order of epoch ``epoch``: 0..n-1, or a permutation seeded from (seed, epoch)."""
    if not shuffle:
        return torch.arange(n)
    # One 64-bit seed per (seed, epoch) pair; the odd multiplier spreads nearby seeds apart.
    generator = torch.Generator().manual_seed((seed * 0x9E3779B97F4A7C15 + epoch) % 2**64)
    return torch.randperm(n, generator=generator)
