"""Reading a ``--data`` file into token ids: one reader per format, one shape of answer.

Every reader returns :class:`Parsed`: how the ids are to be used, and an *iterator* of
:class:`Piece` that reads, tokenises and checks the file as it is drawn, so a file of any size
passes through a bounded amount of memory (a batch of lines, or a piece of text of about
``CHUNK_CHARS`` characters, at a time). A ``.jsonl`` row is parsed whole, so one line may have
at most :data:`MAX_LINE_BYTES`; a longer one is refused before it is parsed, naming it. A long
text (a row's text, completion or conversation) is tokenised in pieces all the same::

    parsed = read_jsonl(path, vocab_size, encoder)
    for piece in parsed.pieces:          # (ids, labels, starts), one row or document part each
        ...

* ``kind="stream"``: documents, to be joined (EOS between them) and cut into windows.
  ``.txt`` (one document, in parts: ``starts`` is True for the first only), ``.jsonl`` rows
  with ``text``, a 1-D ``.npy`` (in parts).
* ``kind="rows"``: sequences as they stand, each cut at seq_len or padded, with ``labels``
  (aligned with the ids as in transformers: ``labels[t]`` is what position ``t`` is, -100 where
  no loss is taken; None means every token is learnt). ``.jsonl`` rows with ``input_ids``
  (optionally ``labels``), ``prompt`` + ``completion``, ``messages``, or the alpaca and
  ShareGPT rows that :mod:`~flowtrain.data.rows` reads as ``messages``; a 2-D ``.npy``.

A Parquet or Arrow file, or a ``datasets`` folder (:mod:`~flowtrain.data.tables`), holds the
same rows as a ``.jsonl`` file, one per table row, and is read the same way, an error naming
the row (``data.parquet row 6``, counted from 0).

**Fine-tuning rows.** ``{"prompt": p, "completion": c}`` is the tokenizer's template prefix
(BOS), ``p`` and ``c`` encoded each on its own (so a token never straddles the boundary), and
EOS when the tokenizer has one; the loss is on ``c`` and the EOS. ``{"messages": [...]}``
(optionally with ``"tools": [...]``, JSON function schemas passed to the template as
transformers' ``apply_chat_template(messages, tools=...)`` passes them) is rendered with the
model's chat template and the loss is on the assistant turns (those with ``tool_calls``
included; ``tool`` and every other role's turns carry none), found by one of two rules:

* *Generation markers*, where the template has ``{% generation %}...{% endgeneration %}``: the
  tokens transformers' ``apply_chat_template(messages, tokenize=True, return_dict=True,
  return_assistant_tokens_mask=True)`` marks, computed the same way (each token that overlaps
  the text of a generation block; :func:`~flowtrain.data.text.assistant_mask`).
* *Turn by turn*, where it has none: for each assistant message ``k``, the tokens of
  ``render(messages[:k], add_generation_prompt=True)`` (everything before it, its header
  included) and of ``render(messages[:k+1])`` must both be prefixes of the whole conversation's
  tokens, and the tokens between the two are that turn's (its content and end-of-turn text, e.g.
  ChatML's ``<|im_end|>\n``). A template that rewrites earlier turns as the conversation grows
  (so a prefix does not hold) is refused for that line rather than guessed at.

:attr:`Parsed.mask` says which rule a file was read with (the run's start-up block shows it).

Readers check every id against the model's vocabulary here, where the line and position are
still known, so a bad file fails with ``data.jsonl line 7: token id 70000 at position 3 ...``
instead of an index error deep inside the embedding. An error can come late in the file, after
earlier pieces were drawn: whoever draws them must drop what it made of them (the cache does).
"""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple, cast

import numpy as np

from flowtrain.data import text as data_text
from flowtrain.data.rows import CONVERSATION_FORMS, ROW_EXAMPLE, ColumnMap, row_form
from flowtrain.data.tables import is_table, table_rows
from flowtrain.data.text import ChatTemplate, Encoder
from flowtrain.errors import DataError

# Text rows are handed to the tokenizer this many at a time (it encodes a batch in parallel),
# and at most about this many bytes of lines: a batch of long rows must not add up to gigabytes.
_ENCODE_BATCH = 1024
_ENCODE_BATCH_BYTES = 8 << 20
#: Most bytes one ``.jsonl`` line may have. A row is parsed whole (JSON has no streaming
#: reader in the standard library), which costs a few times its size, so a longer line is
#: refused, naming it, before it is parsed: 16 MiB is about 4 M tokens of English text or 2 M
#: token ids, beyond the context any model is trained at (a row that long cannot be learnt
#: whole), while a mistake (a whole corpus on one line) would otherwise cost tens of GB.
MAX_LINE_BYTES = 16 << 20
# Bytes read from a .txt file at a time, and ids of a 1-D .npy checked and handed on at a time.
_READ_BYTES = 1 << 20
_NPY_CHUNK = 1 << 22

_JSONL_EXAMPLE = ROW_EXAMPLE

IGNORE_INDEX = -100  # a target that is not one: torch's and Hugging Face's ignore_index


class Piece(NamedTuple):
    """One row of a ``rows`` file, or one document (or part of one) of a ``stream`` file."""

    ids: np.ndarray  # (len,) int64
    labels: np.ndarray | None = None  # rows: (len,) int64, -100 = no loss; None: the ids
    starts: bool = True  # stream: a document starts here (False: it goes on from the last piece)
    row: int = -1  # rows: where in the file it came from, as Parsed.row_name counts (a line, a row)


@dataclass
class Parsed:
    """What a file holds: documents to join (``stream``) or sequences as they stand (``rows``)."""

    kind: Literal["stream", "rows"]
    pieces: Iterator[Piece]  # lazy: reading, tokenising and checking happen as it is drawn
    eos_id: int | None = None  # separator between stream documents, when the tokenizer has one
    #: what Piece.row counts: "line" (1-based, .jsonl) or "row" (0-based, .npy and tables)
    row_name: str = "line"
    #: messages rows: "generation" (the template's {% generation %} marks) or "turns" (turn by turn)
    mask: str | None = None


def read_txt(path: Path, vocab_size: int, encoder: Callable[[], Encoder]) -> Parsed:
    """A plain UTF-8 text file: one document, read and tokenised in pieces of about
    ``CHUNK_CHARS`` characters cut where a line starts (see ``data_text.split_stream``)."""
    enc = encoder()
    return Parsed("stream", _txt_pieces(path, vocab_size, enc), enc.eos_id)


def _txt_pieces(path: Path, vocab_size: int, enc: Encoder) -> Iterator[Piece]:
    hint = _tokenizer_hint(enc, vocab_size)
    texts = data_text.split_stream(_utf8_blocks(path))
    first = next(texts, "")
    second = next(texts, None)
    if second is None and len(first) <= data_text.CHUNK_CHARS:  # short: one call, template and all
        ids = enc.encode_many([first])[0]
        check_ids(ids, vocab_size, f"{path}", hint)
        yield Piece(ids)
        return
    yield from _document_pieces(enc, [first] + ([second] if second is not None else []), texts, vocab_size,
                                f"{path}", hint)


def _document_pieces(enc: Encoder, head: list[str], rest: Iterator[str], vocab_size: int, where: str,
                     hint: str) -> Iterator[Piece]:
    """A long document, given as its pieces (``head``, then ``rest``), as ``encode_document``
    encodes it: the pieces bare, the template (BOS, ...) around the whole once."""
    prefix, suffix = enc.template_ids()
    done = 0
    for ids in _framed(prefix, _encode_in_batches(enc, head, rest), suffix):
        check_ids(ids, vocab_size, where, hint, offset=done)
        yield Piece(ids, starts=done == 0)
        done += len(ids)


def _encode_in_batches(enc: Encoder, head: list[str], rest: Iterator[str]) -> Iterator[np.ndarray]:
    """``encode_bare`` of every text, a few at a time: the tokenizer runs a batch in parallel,
    one text a core, and each text of a batch costs tens of times its size while it is encoded
    (about 100 MB for a piece of ``CHUNK_CHARS``), so a batch has one piece per core, at most 8."""
    batch, most = list(head), max(1, min(8, os.cpu_count() or 1))
    for text in rest:
        batch.append(text)
        if len(batch) >= most:
            yield from enc.encode_bare(batch)
            batch = []
    if batch:
        yield from enc.encode_bare(batch)


def _framed(prefix: np.ndarray, parts: Iterable[np.ndarray], suffix: np.ndarray) -> Iterator[np.ndarray]:
    if prefix.size:
        yield prefix
    yield from (p for p in parts if p.size)
    if suffix.size:
        yield suffix


def _utf8_blocks(path: Path) -> Iterator[str]:
    """The file's text in blocks; DataError naming the byte offset of the first bad byte."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    fed = 0  # bytes handed to the decoder so far
    with path.open("rb") as f:
        while True:
            raw = f.read(_READ_BYTES)
            held = len(decoder.getstate()[0])  # bytes of a character cut by the last block
            try:
                text = decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{path} is not UTF-8 text (bad byte at offset {fed - held + exc.start}); "
                    "re-save it as UTF-8"
                ) from None
            fed += len(raw)
            if text:
                yield text
            if not raw:
                return


def read_jsonl(
    path: Path,
    vocab_size: int,
    encoder: Callable[[], Encoder],
    chat_template: Callable[[], ChatTemplate | None] = lambda: None,
    columns: ColumnMap | None = None,
) -> Parsed:
    """Rows, one object each, in one of the forms of ``_JSONL_EXAMPLE``: the lines of a
    ``.jsonl`` file, or the rows of a table (:mod:`~flowtrain.data.tables`: Parquet, Arrow, a
    ``datasets`` folder), read through the column map ``columns`` (:mod:`~flowtrain.data.rows`).

    ``text`` rows are documents (a stream); every other form gives one sequence per row; alpaca
    and ShareGPT rows are conversations, read as the ``messages`` rows they mean. One file holds
    one form (``input_ids`` rows with and without ``labels`` count as one); the first row
    decides, and a row of another form is refused when it is reached.
    """
    row_name = "row" if is_table(path) else "line"
    probe = _lines(path, columns=columns)
    first = next(probe, None)
    probe.close()  # the first row decides the form; the file is read from the top below
    if first is None:
        raise DataError(f"{path} has no {'rows' if row_name == 'row' else 'JSON lines'}; each "
                        f"{row_name} must look like {_JSONL_EXAMPLE}")
    form = first.form
    lines = _lines(path, form=(form, first.no), columns=columns)
    if form == "input_ids":
        return Parsed("rows", _id_rows(lines, vocab_size), row_name=row_name)
    if form == "text":
        enc = encoder()
        return Parsed("stream", _text_rows(lines, vocab_size, enc), enc.eos_id)
    if form == "prompt/completion":
        return Parsed("rows", _prompt_rows(lines, vocab_size, encoder()), row_name=row_name)
    template = chat_template()
    if template is None:
        raise DataError(
            f"{path} holds {_FORM_NAMES[form]} rows, but the model's tokenizer has no chat template "
            "(chat_template in tokenizer_config.json, or chat_template.jinja); pass --tokenizer "
            "DIR with one, or write the rows as prompt/completion"
        )
    mask = "generation" if template.has_generation else "turns"
    return Parsed("rows", _chat_rows(lines, vocab_size, encoder(), template), mask=mask, row_name=row_name)


_FORM_NAMES = {"messages": "\"messages\"", "alpaca": "alpaca (conversation)", "sharegpt": "ShareGPT (conversation)"}


def holds_conversations(path: Path, columns: ColumnMap | None = None) -> bool:
    """Whether ``path`` holds conversations (``messages``, alpaca or ShareGPT rows), by its first
    row (False for a file that does not, or whose first row cannot be read: reading it fails
    later, properly)."""
    if path.suffix.lower() != ".jsonl" and not is_table(path):
        return False
    lines = _lines(path, columns=columns)
    try:
        first = next(lines, None)
    except (DataError, OSError):
        return False
    finally:
        lines.close()
    return first is not None and first.form in CONVERSATION_FORMS


class _Line(NamedTuple):
    no: int  # a line (1-based) or a table's row (0-based)
    where: str  # "data.jsonl line 7", "data.parquet row 6": how an error names it
    obj: dict
    form: str  # one of rows.FORMS' values
    size: int  # bytes (about, for a table's row)


def _lines(path: Path, form: tuple[str, int] | None = None,
           columns: ColumnMap | None = None) -> Generator[_Line, None, None]:
    """Each row, read through ``columns``: each non-blank line of a ``.jsonl`` file, parsed, or
    each row of a table; with ``form`` (the file's form and the row that set it), a row of
    another form is refused. A line over :data:`MAX_LINE_BYTES` is refused unparsed."""
    table = is_table(path)
    name = "row" if table else "line"
    for no, obj, size in (_table_objects(path) if table else _jsonl_objects(path)):
        where = f"{path} {name} {no}"
        this, obj = row_form(obj, where, columns, table=table)
        if form is not None and this != form[0]:
            raise DataError(
                f"{path} mixes \"{form[0]}\" rows ({name} {form[1]}) and \"{this}\" rows ({name} "
                f"{no}); keep one form per file: convert the rows or split the file"
            )
        yield _Line(no, where, obj, this, size)


def _jsonl_objects(path: Path) -> Iterator[tuple[int, dict, int]]:
    for line_no, raw in _raw_lines(path):
        if raw.isspace():
            continue
        yield line_no, _parse_line(path, line_no, raw), len(raw)


def _table_objects(path: Path) -> Iterator[tuple[int, dict, int]]:
    for row, obj in table_rows(path):
        yield row, obj, _size(obj)


def _size(value: object) -> int:
    """About the bytes ``value`` takes as JSON (for batching rows by size)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(len(k) + _size(v) for k, v in value.items())
    if isinstance(value, list):
        return 8 * len(value) if value and isinstance(value[0], int) else sum(_size(v) for v in value)
    return 8


def _raw_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of each line, holding at most :data:`MAX_LINE_BYTES` (+1) of one:
    a longer line is measured to its end in blocks and refused, naming its size."""
    with path.open("rb") as f:
        line_no = 0
        while raw := f.readline(MAX_LINE_BYTES + 1):
            line_no += 1
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                size = len(raw)
                del raw
                while (block := f.readline(_READ_BYTES)) and not block.endswith(b"\n"):
                    size += len(block)
                size += len(block)
                raise DataError(
                    f"{path} line {line_no} has {size:,} bytes, more than the {_bytes(MAX_LINE_BYTES)} one "
                    "row may have (a row is read whole); split it into rows of a few MB (a long text into "
                    "several text rows, or into a .txt file of its own, which is read in pieces)"
                )
            yield line_no, raw


def _bytes(n: int) -> str:
    return f"{n >> 20} MiB" if n % (1 << 20) == 0 else f"{n:,} bytes"


def _batched(lines: Iterator[_Line]) -> Iterator[list[_Line]]:
    """Rows in batches of at most ``_ENCODE_BATCH`` rows and about ``_ENCODE_BATCH_BYTES``
    bytes (a single longer row is a batch of its own)."""
    batch: list[_Line] = []
    size = 0
    for line in lines:
        if batch and size + line.size > _ENCODE_BATCH_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(line)
        size += line.size
        if len(batch) == _ENCODE_BATCH:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _id_rows(lines: Iterator[_Line], vocab_size: int) -> Iterator[Piece]:
    """``input_ids`` rows taken as given; ``labels``, where a row has them, aligned with them."""
    for line_no, where, obj, _, _ in lines:
        ids = _id_row(where, obj["input_ids"], vocab_size)
        if "labels" not in obj:
            yield Piece(ids, row=line_no)
            continue
        lab = _int_list(where, "labels", obj["labels"])
        if len(lab) != len(ids):
            raise DataError(
                f"{where}: \"labels\" has {len(lab)} entries but \"input_ids\" has "
                f"{len(ids)}; labels are aligned with input_ids (labels[t] for position t, "
                "-100 where no loss is taken)"
            )
        bad = np.flatnonzero((lab != IGNORE_INDEX) & ((lab < 0) | (lab >= vocab_size)))
        if bad.size:
            pos = int(bad[0])
            raise DataError(
                f"{where}: label {lab[pos]} at position {pos} is neither -100 nor "
                f"inside the model's vocabulary 0..{vocab_size - 1}"
            )
        yield Piece(ids, lab, row=line_no)


def _text_rows(lines: Iterator[_Line], vocab_size: int, enc: Encoder) -> Iterator[Piece]:
    """Each row a document; one longer than ``CHUNK_CHARS`` characters is tokenised in pieces,
    as a ``.txt`` file is, so its tokenizing costs the memory of a piece, not of the row."""
    hint = _tokenizer_hint(enc, vocab_size)
    for batch in _batched(lines):
        texts = [_string(line.where, line.obj, "text") for line in batch]
        short = iter(enc.encode_many([t for t in texts if len(t) <= data_text.CHUNK_CHARS]))
        for line, text in zip(batch, texts):
            if len(text) > data_text.CHUNK_CHARS:
                yield from _document_pieces(enc, [], data_text.split_stream([text]), vocab_size, line.where, hint)
                continue
            ids = next(short)
            check_ids(ids, vocab_size, line.where, hint)
            yield Piece(ids)


def _prompt_rows(lines: Iterator[_Line], vocab_size: int, enc: Encoder) -> Iterator[Piece]:
    """Template prefix + prompt (no loss), then completion + EOS (loss)."""
    prefix, _ = enc.template_ids()
    end = np.array([] if enc.eos_id is None else [enc.eos_id], dtype=np.int64)
    hint = _tokenizer_hint(enc, vocab_size)
    for batch in _batched(lines):
        prompts = enc.encode_bare([_string(line.where, line.obj, "prompt") for line in batch])
        completions = enc.encode_bare([_string(line.where, line.obj, "completion") for line in batch])
        for line, prompt, completion in zip(batch, prompts, completions):
            ids = np.concatenate([prefix, prompt, completion, end])
            check_ids(ids, vocab_size, line.where, hint)
            lab = ids.copy()
            lab[: len(prefix) + len(prompt)] = IGNORE_INDEX
            yield Piece(ids, lab, row=line.no)


def _chat_rows(lines: Iterator[_Line], vocab_size: int, enc: Encoder, template: ChatTemplate) -> Iterator[Piece]:
    """Each conversation rendered whole; labels on the assistant turns only (see the module)."""
    hint = _tokenizer_hint(enc, vocab_size)
    for line_no, where, obj, _, _ in lines:
        messages = _messages(where, obj["messages"])
        tools = _tools(where, obj.get("tools"))
        try:
            if template.has_generation:
                ids, lab = _by_generation_marks(messages, tools, enc, template)
            else:
                ids, lab = _turn_by_turn(where, messages, tools, enc, template)
        except ValueError as exc:
            raise DataError(
                f"{where}: the chat template ({template.source}) failed on this conversation: {exc}"
            ) from None
        check_ids(ids, vocab_size, where, hint)
        yield Piece(ids, lab, row=line_no)


def _by_generation_marks(messages: list[dict], tools: list[dict] | None, enc: Encoder,
                         template: ChatTemplate) -> tuple[np.ndarray, np.ndarray]:
    """Ids and labels of a conversation whose template marks assistant text: what transformers'
    ``return_assistant_tokens_mask`` marks is learnt, nothing else."""
    text, spans = template.render_spans(messages, tools)
    ids, offsets = enc.encode_offsets(text)
    return ids, np.where(data_text.assistant_mask(offsets, spans), ids, IGNORE_INDEX)


def _turn_by_turn(where: str, messages: list[dict], tools: list[dict] | None, enc: Encoder,
                  template: ChatTemplate) -> tuple[np.ndarray, np.ndarray]:
    """Ids and labels of a conversation whose template has no generation marks: each assistant
    turn's tokens lie between the conversation rendered up to it and through it."""
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    texts = [template.render(messages, tools=tools)]
    for k in turns:
        texts += [template.render(messages[:k], add_generation_prompt=True, tools=tools),
                  template.render(messages[: k + 1], tools=tools)]
    encoded = enc.encode_bare(texts)
    ids = encoded[0]
    lab = np.full_like(ids, IGNORE_INDEX)
    for k, before, through in zip(turns, encoded[1::2], encoded[2::2]):
        if not (_is_prefix(before, ids) and _is_prefix(through, ids)) or len(before) > len(through):
            raise DataError(
                f"{where}: the chat template does not render this conversation turn by turn "
                f"(the text up to messages[{k}] is not a prefix of the whole), so its "
                "assistant tokens cannot be found; mark them in the template with {% generation %} ... "
                "{% endgeneration %} (docs/training.md), or pre-tokenize it as input_ids + labels"
            )
        lab[len(before) : len(through)] = ids[len(before) : len(through)]
    return ids, lab


def _tools(where: str, value: object) -> list[dict] | None:
    """A row's ``tools``: a list of JSON objects (function schemas), or None for none."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise DataError(
            f"{where}: \"tools\" must be a list of objects (JSON function schemas, such as "
            f"[{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}]), not {_preview(value)}"
        )
    return value


def _messages(where: str, value: object) -> list[dict]:
    ok = isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in value
    )
    if not ok or not value:
        raise DataError(
            f"{where}: \"messages\" must be a non-empty list of objects with a string \"role\" "
            f"and a \"content\", such as [{{\"role\": \"user\", \"content\": \"Hi\"}}], not "
            f"{_preview(value)}"
        )
    return cast(list[dict], value)  # checked just above: a list of dicts


def _is_prefix(part: np.ndarray, whole: np.ndarray) -> bool:
    return len(part) <= len(whole) and bool(np.array_equal(whole[: len(part)], part))


def _string(where: str, obj: dict, key: str) -> str:
    value = obj[key]
    if not isinstance(value, str):
        raise DataError(
            f"{where}: \"{key}\" is a {type(value).__name__}, not a string; "
            "write it as one JSON string"
        )
    return value


def read_npy(path: Path, vocab_size: int) -> Parsed:
    """A NumPy integer array, memory-mapped: 1-D is a token stream, 2-D one sequence per row."""
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
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
    if array.ndim == 1:
        return Parsed("stream", _npy_stream(path, array, vocab_size))
    return Parsed("rows", _npy_rows(path, array, vocab_size), row_name="row")


_NPY_HINT = "re-tokenize the data for this model or give the model a larger vocab_size"


def _npy_stream(path: Path, array: np.ndarray, vocab_size: int) -> Iterator[Piece]:
    for start in range(0, len(array), _NPY_CHUNK):
        ids = np.asarray(array[start : start + _NPY_CHUNK], dtype=np.int64)
        check_ids(ids, vocab_size, str(path), _NPY_HINT, offset=start)
        yield Piece(ids, starts=start == 0)


def _npy_rows(path: Path, array: np.ndarray, vocab_size: int) -> Iterator[Piece]:
    step = max(1, _NPY_CHUNK // array.shape[1])
    for start in range(0, len(array), step):
        block = np.asarray(array[start : start + step], dtype=np.int64)
        bad = np.argwhere((block < 0) | (block >= vocab_size))
        if bad.size:
            row, col = (int(v) for v in bad[0])
            raise DataError(
                f"{path} row {start + row}: token id {block[row, col]} at position {col} is "
                f"outside the model's vocabulary 0..{vocab_size - 1}; {_NPY_HINT}"
            )
        yield from (Piece(row, row=start + i) for i, row in enumerate(block))


def check_ids(ids: np.ndarray, vocab_size: int, where: str, hint: str, offset: int = 0) -> None:
    """Raise DataError naming the first id outside ``0 .. vocab_size - 1`` (its position counted
    from ``offset``, for a part of a longer document)."""
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size:
        pos = int(bad[0])
        raise DataError(
            f"{where}: token id {ids[pos]} at position {offset + pos} is outside the model's "
            f"vocabulary 0..{vocab_size - 1}; {hint}"
        )


def _parse_line(path: Path, line_no: int, raw: bytes) -> dict:
    try:
        obj = json.loads(raw)
    except UnicodeDecodeError:
        raise DataError(f"{path} line {line_no} is not UTF-8; re-save the file as UTF-8") from None
    except RecursionError:  # the parser recurses once per level: [[[[...]]]] ends it
        raise DataError(
            f"{path} line {line_no} nests its JSON too deeply to read; a row is one object of "
            'strings and flat lists, such as {"text": "..."} or {"messages": [{"role": "user", "content": "..."}]}'
        ) from None
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


def _id_row(where: str, value: object, vocab_size: int) -> np.ndarray:
    """One ``input_ids`` value as an int64 array, checked for type and range."""
    row = _int_list(where, "input_ids", value)
    check_ids(row, vocab_size, where, _NPY_HINT)
    return row


def _int_list(where: str, key: str, value: object) -> np.ndarray:
    if isinstance(value, list) and not value:
        return np.zeros(0, dtype=np.int64)  # dropped later, like every row under 2 tokens
    try:
        row = np.asarray(value) if isinstance(value, list) else None
    except (ValueError, OverflowError, RecursionError):  # nested, ragged or huge: numpy refuses
        row = None
    if row is None or row.ndim != 1 or row.dtype.kind not in "iu":
        raise DataError(
            f"{where}: \"{key}\" must be a flat list of integers such as "
            f"[1, 2, 3], not {_preview(value)}"
        )
    return row.astype(np.int64)


def _preview(value: object, limit: int = 60) -> str:
    """The start of ``value`` as JSON, for an error line: never the whole of a large value, and
    never a RecursionError from a deeply nested one."""
    head: object
    if isinstance(value, (list, str)):
        head = value[:limit]
    elif isinstance(value, dict):
        head = dict(list(value.items())[:limit])
    else:
        head = value
    try:
        text = json.dumps(head)
    except (ValueError, TypeError, RecursionError):
        return f"a {type(value).__name__} nested too deeply to show"
    return text[:limit]


def _tokenizer_hint(encoder: Encoder, vocab_size: int) -> str:
    return (
        f"the tokenizer ({encoder.name}) does not fit the model's vocab_size {vocab_size}; "
        "use the model's own tokenizer.json or a vocab_size at least as large as the tokenizer's"
    )
