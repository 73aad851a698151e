"""Training data: a ``--data`` file becomes sequences, sequences become optimizer steps.

::

    seqs = load_sequences("data.jsonl", seq_len=512, vocab_size=32000, tokenizer_dir=model_dir)
    for batch in step_batches(seqs, batch_size=8, shuffle=True, seed=0):   # yields forever
        for mb in batch.micro_batches(2):
            logits = model(mb.input_ids)                                  # (2, 512, vocab)
            ce = F.cross_entropy(logits.flatten(0, 1), mb.targets.flatten(), reduction="sum")
            (ce / batch.num_targets()).backward()                         # mean over the step

**What a file holds.** ``.txt`` (one document), ``.jsonl`` rows with ``text`` and a 1-D ``.npy``
are token *streams*: documents are tokenised, joined with the EOS token between them and cut
into windows of exactly ``seq_len`` tokens (a final tail of 2 or more tokens is kept, padded).
``.jsonl`` rows with ``input_ids`` and the rows of a 2-D ``.npy`` are *sequences as they
stand*: cut at ``seq_len`` (keeping the start) or right-padded. Sequences under 2 tokens or
without a single target teach nothing and are dropped. Formats live in
:mod:`~flowtrain.train.data_files`, tokenizers and chat templates in
:mod:`~flowtrain.train.data_text`.

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
attention mask is needed.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

import numpy as np
import torch

from flowtrain.errors import ConfigError, DataError
from flowtrain.train.data_files import (
    IGNORE_INDEX,
    Parsed,
    read_jsonl,
    read_npy,
    read_txt,
)
from flowtrain.train.data_text import (
    TOKENIZER_FILES,
    find_tokenizer,
    load_chat_template,
    make_encoder,
    tokenizer_files,
)

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
    """All sequences of a data set, on the CPU, ready to be batched."""

    input_ids: torch.Tensor  # (N, seq_len) int64, padding filled with pad_id
    targets: torch.Tensor  # (N, seq_len) int64, next token where both are real, else -100

    def __post_init__(self) -> None:
        if self.input_ids.shape != self.targets.shape or self.input_ids.ndim != 2:
            raise DataError(
                f"input_ids {tuple(self.input_ids.shape)} and targets "
                f"{tuple(self.targets.shape)} must be two (N, seq_len) tensors of one shape"
            )

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def num_targets(self) -> int:
        """How many positions predict a token (the loss's denominator over the whole set)."""
        return int((self.targets != IGNORE_INDEX).sum())

    def __repr__(self) -> str:
        return f"<Sequences {len(self)} x {self.seq_len}, {self.num_targets():,} targets>"


@dataclass(eq=False)
class Batch:
    """The sequences of one optimizer step."""

    input_ids: torch.Tensor  # (batch_size, seq_len) int64
    targets: torch.Tensor  # (batch_size, seq_len) int64, -100 where nothing is predicted

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
            Batch(self.input_ids[i : i + micro_batch_size], self.targets[i : i + micro_batch_size])
            for i in range(0, len(self), micro_batch_size)
        ]

    def num_targets(self) -> int:
        """Targets across the whole step: divide every micro-batch's CE *sum* by this."""
        return int((self.targets != IGNORE_INDEX).sum())

    def __repr__(self) -> str:
        return f"<Batch {len(self)} x {self.input_ids.shape[1]}, {self.num_targets():,} targets>"


def load_sequences(
    path: str | Path,
    seq_len: int,
    vocab_size: int,
    tokenizer_dir: str | Path | None = None,
    pad_id: int = 0,
    eos_id: int | None = None,
    byte_tokenizer: bool = False,
) -> Sequences:
    """Read a ``.jsonl``, ``.txt`` or ``.npy`` file into :class:`Sequences`.

    Text is tokenised with ``tokenizer_dir/tokenizer.json`` when there is one; as UTF-8 bytes
    when ``tokenizer_dir`` is None (a preset) or ``byte_tokenizer`` is set; a ``tokenizer_dir``
    without tokenizer.json is refused for text. ``messages`` rows use the chat template found in
    ``tokenizer_dir``. ``eos_id`` separates joined documents and ends completions; when None,
    the tokenizer's ``tokenizer_config.json`` may name one. Raises DataError for a file that
    cannot be used and ConfigError for impossible sizes or ids.
    """
    _check_config(seq_len, vocab_size, pad_id, eos_id)
    path = Path(path)
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

    encoder = functools.cache(lambda: make_encoder(tokenizer_dir, vocab_size, eos_id, byte_tokenizer))
    if suffix == ".jsonl":
        parsed = read_jsonl(path, vocab_size, encoder, lambda: load_chat_template(tokenizer_dir))
    elif suffix == ".txt":
        parsed = read_txt(path, vocab_size, encoder)
    else:
        parsed = read_npy(path, vocab_size)
    if parsed.kind == "rows":
        return _pack_rows(path, parsed, seq_len, pad_id)
    ids, lengths = _pack_stream(path, parsed, seq_len, pad_id)
    return _sequences(ids, ids, lengths)


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
        yield Batch(seqs.input_ids[rows], seqs.targets[rows])


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


def _pack_rows(path: Path, parsed: Parsed, seq_len: int, pad_id: int) -> Sequences:
    """Sequences as they stand: cut at seq_len, right-padded; those without a target dropped."""
    labels_of = parsed.labels if parsed.labels is not None else parsed.pieces
    rows = [
        (ids[:seq_len], lab[:seq_len])
        for ids, lab in zip(parsed.pieces, labels_of)
        if (lab[1:seq_len] != IGNORE_INDEX).any()  # a target needs a labelled token at t >= 1
    ]
    if not rows:
        raise DataError(
            f"{path} has no usable sequences: every one has fewer than 2 tokens or no token "
            f"with a loss within the first --seq-len {seq_len}, and predicting a next token "
            "needs at least 2"
        )
    ids = np.full((len(rows), seq_len), pad_id, dtype=np.int64)
    labels = np.full((len(rows), seq_len), IGNORE_INDEX, dtype=np.int64)
    lengths = np.array([len(row) for row, _ in rows], dtype=np.int64)
    for i, (row, lab) in enumerate(rows):
        ids[i, : len(row)] = row
        labels[i, : len(lab)] = lab
    return _sequences(ids, labels, lengths)


def _pack_stream(
    path: Path, parsed: Parsed, seq_len: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Documents joined (EOS between) and cut into windows of exactly seq_len tokens.

    The tail after the last full window is kept, padded, if it has 2 tokens or more.
    """
    eos = parsed.eos_id  # the eos_id argument, else the tokenizer's (make_encoder decides)
    parts: list[np.ndarray] = []
    for doc in (d for d in parsed.pieces if d.size):
        if parts and eos is not None and parts[-1][-1] != eos:
            parts.append(np.array([eos], dtype=np.int64))
        parts.append(doc)
    stream = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    total = len(stream)
    full, tail = divmod(total, seq_len)
    if tail < 2:
        stream, tail = stream[: full * seq_len], 0
    if len(stream) == 0:
        raise DataError(
            f"{path} has no usable sequences: it holds {total} token(s) after "
            "tokenizing, and predicting a next token needs at least 2; add more data"
        )
    rows = full + (1 if tail else 0)
    ids = np.full(rows * seq_len, pad_id, dtype=np.int64)
    ids[: len(stream)] = stream
    lengths = np.full(rows, seq_len, dtype=np.int64)
    if tail:
        lengths[-1] = tail
    return ids.reshape(rows, seq_len), lengths


def _sequences(ids: np.ndarray, labels: np.ndarray, lengths: np.ndarray) -> Sequences:
    """Targets from right-padded ids and their labels (the ids themselves, or -100 where no
    loss is taken): ``targets[:, t] = labels[:, t + 1]`` where ``t + 1`` is real."""
    next_real = np.arange(1, ids.shape[1])[None, :] < lengths[:, None]  # (N, seq_len - 1)
    targets = np.full_like(ids, IGNORE_INDEX)
    targets[:, :-1] = np.where(next_real, labels[:, 1:], IGNORE_INDEX)
    return Sequences(torch.from_numpy(ids), torch.from_numpy(targets))


def _epoch_order(n: int, epoch: int, shuffle: bool, seed: int) -> torch.Tensor:
    """The order of epoch ``epoch``: 0..n-1, or a permutation seeded from (seed, epoch)."""
    if not shuffle:
        return torch.arange(n)
    # One 64-bit seed per (seed, epoch) pair; the odd multiplier spreads nearby seeds apart.
    generator = torch.Generator().manual_seed((seed * 0x9E3779B97F4A7C15 + epoch) % 2**64)
    return torch.randperm(n, generator=generator)
