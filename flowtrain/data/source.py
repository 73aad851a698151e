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
stand*: cut at ``seq_len`` (keeping the start) or right-padded. Sequences under 2 tokens or
without a single target teach nothing and are dropped. Formats live in
:mod:`~flowtrain.data.files`, tokenizers and chat templates in
:mod:`~flowtrain.data.text`.

**Fine-tuning.** ``.jsonl`` rows may also be ``{"prompt", "completion"}`` (loss on the
completion and its EOS), ``{"messages": [...]}`` (the model's chat template; loss on the
assistant turns) or ``{"input_ids", "labels"}`` (labels as transformers takes them: aligned with
the ids, -100 for no loss). Each example is one sequence of its own, padded to ``seq_len``.
Several short examples are *not* packed into one sequence: that needs attention masked between
documents (and positions restarted), which the model does not have yet; until then packing would
let one example attend to another.

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
    read_jsonl,
    read_npy,
    read_txt,
)
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
    "TOKENIZER_FILES",
    "Batch",
    "Sequences",
    "default_corpus_path",
    "find_tokenizer",
    "load_sequences",
    "step_batches",
    "tokenizer_files",
]

_FORMATS = (".jsonl", ".txt", ".npy")


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

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def micro_batches(self, micro_batch_size: int) -> list[Batch]:
        """The step cut into consecutive micro-batches of ``micro_batch_size`` rows (views)."""
        if micro_batch_size < 1 or len(self) % micro_batch_size:
            raise ConfigError(
                f"--micro-batch-size {micro_batch_size} does not divide --batch-size "
                f"{len(self)}; pick a divisor of {len(self)}"
            )
        return [
            Batch(self.input_ids[i : i + micro_batch_size], self.targets[i : i + micro_batch_size],
                  None if self.positions is None else self.positions[i : i + micro_batch_size])
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
    seq_len: int,
    vocab_size: int,
    tokenizer_dir: str | Path | None = None,
    pad_id: int = 0,
    eos_id: int | None = None,
    byte_tokenizer: bool = False,
    *,
    packing: bool = True,
    cache_dir: str | Path | None = None,
) -> Sequences:
    """Read a ``.jsonl``, ``.txt`` or ``.npy`` file into :class:`Sequences`, through the cache.

    Text is tokenised with ``tokenizer_dir/tokenizer.json`` when there is one; as UTF-8 bytes
    when ``tokenizer_dir`` is None (a preset) or ``byte_tokenizer`` is set; a ``tokenizer_dir``
    without tokenizer.json is refused for text. ``messages`` rows use the chat template found in
    ``tokenizer_dir``. ``eos_id`` separates joined documents and ends completions; when None,
    the tokenizer's ``tokenizer_config.json`` may name one. ``packing`` packs fine-tuning rows
    (see the module). The rows are built once into ``cache_dir`` (default: see
    :func:`~flowtrain.data.cache.cache_root`) and mapped from there. Raises DataError for
    a file that cannot be used and ConfigError for impossible sizes or ids.
    """
    _check_config(seq_len, vocab_size, pad_id, eos_id)
    path = _check_file(Path(path))
    settings = {"seq_len": seq_len, "packing": packing, "vocab_size": vocab_size, "pad_id": pad_id,
                "eos_id": eos_id, "byte_tokenizer": byte_tokenizer, "chunk_chars": data_text.CHUNK_CHARS}
    text: list[bool] = []  # set when text is tokenised: a cached load checks the tokenizer again

    @functools.cache
    def encoder():
        text.append(True)
        return make_encoder(tokenizer_dir, vocab_size, eos_id, byte_tokenizer)

    def build(folder: Path) -> dict:
        parsed = _parse(path, vocab_size, encoder, tokenizer_dir)
        packed = packing and parsed.kind == "rows"
        with data_cache.RowWriter(folder, seq_len, positions=packed) as out:
            if parsed.kind == "stream":
                data_pack.stream_rows(path, parsed.pieces, parsed.eos_id, seq_len, pad_id, out)
            elif packed:
                layout = data_pack.packed_rows(path, parsed.pieces, seq_len, pad_id, out, folder)
                np.save(folder / "layout.npy", layout)
            else:
                data_pack.plain_rows(path, parsed.pieces, seq_len, pad_id, out)
            return {**out.close(), "kind": parsed.kind, "text": bool(text), "source": str(path)}

    rows = data_cache.open_rows(data_cache.cached(path, settings, tokenizer_dir, build, cache_dir))
    if rows.index["text"]:
        check_encoder(tokenizer_dir, vocab_size, byte_tokenizer)  # the errors a miss would raise
    return Sequences(rows.input_ids, rows.targets, rows.positions,
                     _num_targets=rows.index["num_targets"], _fingerprint=rows.index["fingerprint"])


def _check_file(path: Path) -> Path:
    if not path.exists():
        raise DataError(f"data file {path} does not exist; pass a .jsonl, .txt or .npy file")
    if not path.is_file():
        raise DataError(f"data path {path} is not a file; pass a .jsonl, .txt or .npy file")
    suffix = path.suffix.lower()
    if suffix not in _FORMATS:
        raise DataError(
            f"data file {path} has an unknown extension {suffix or '(none)'!r}; use .jsonl "
            "(text or input_ids rows), .txt (plain text) or .npy (token ids)"
        )
    if path.stat().st_size == 0:
        raise DataError(f"data file {path} is empty; give it some text or token ids")
    return path


def _parse(path: Path, vocab_size: int, encoder, tokenizer_dir) -> Parsed:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return read_jsonl(path, vocab_size, encoder, lambda: load_chat_template(tokenizer_dir))
    if suffix == ".txt":
        return read_txt(path, vocab_size, encoder)
    return read_npy(path, vocab_size)


def step_batches(
    seqs: Sequences, batch_size: int, *, shuffle: bool, seed: int, start_step: int = 0
) -> Iterator[Batch]:
    """Yield full batches forever, epoch after epoch.

    Epoch ``e`` visits every sequence once: in file order, or (``shuffle``) in a permutation
    drawn from a ``torch.Generator`` seeded from ``(seed, e)``, so a run is reproducible and
    epochs differ. Batches always have ``batch_size`` rows: one that reaches the end of an
    epoch continues into the next epoch's order, so no sequence is starved (with fewer
    sequences than ``batch_size`` a batch spans several epochs). ``start_step`` skips that
    many batches without building them, for resuming a run.
    """
    if batch_size < 1:
        raise ConfigError(f"--batch-size {batch_size} must be at least 1")
    if start_step < 0:
        raise ConfigError(f"start_step {start_step} must be at least 0")
    n = len(seqs)
    if n == 0:
        raise DataError("there are no sequences to batch; the data set is empty")
    return _batches(seqs, batch_size, shuffle, seed, start_step)  # checks above run eagerly


def _batches(
    seqs: Sequences, batch_size: int, shuffle: bool, seed: int, start_step: int
) -> Iterator[Batch]:
    n = len(seqs)
    epoch, offset = divmod(start_step * batch_size, n)
    order = _epoch_order(n, epoch, shuffle, seed)[offset:]
    while True:
        while len(order) < batch_size:
            epoch += 1
            order = torch.cat([order, _epoch_order(n, epoch, shuffle, seed)])
        rows, order = order[:batch_size], order[batch_size:]
        positions = None if seqs.positions is None else seqs.positions[rows]
        yield Batch(seqs.input_ids[rows], seqs.targets[rows], positions)  # copies: rows read here


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
            f"--seq-len {seq_len} is too short: predicting a next token needs at least 2"
        )
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
