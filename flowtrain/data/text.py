"""Text to token ids: the model's own ``tokenizer.json``, or raw UTF-8 bytes; chat templates.

A model directory that carries a ``tokenizer.json`` is tokenised with it through the
``tokenizers`` library, exactly as ``AutoTokenizer.from_pretrained(dir)(text)`` would: the
tokenizer's template applies, so a Llama tokenizer puts its BOS in front of every document.
Without one, text falls back to its UTF-8 bytes, ids 0..255, which any model with
``vocab_size >= 256`` can learn -- but only for a preset model that has no directory
(``tokenizer_dir=None``) or when asked for (``byte_tokenizer=True``, ``--byte-tokenizer``): a
model folder without ``tokenizer.json`` is a pretrained model whose ids are not bytes, and
training it on bytes would silently teach it nonsense::

    encoder = make_encoder(model_dir, vocab_size=32000, eos_id=None)
    encoder.encode_many(["Hello there.", "Bye."])   # [array([1, 15043, 727, 29889]), ...]
    encoder.eos_id                                  # 2, from tokenizer_config.json

Encoders return ``np.ndarray`` int64 id arrays; range checks against the model's vocabulary
happen in :mod:`flowtrain.data.files`, where the line and position are known.

**Chat templates.** :class:`ChatTemplate` renders ``messages`` (and a row's ``tools``) the way
transformers' ``apply_chat_template`` does (a sandboxed Jinja2 environment with ``trim_blocks``
and ``lstrip_blocks``, its ``tojson``, ``raise_exception`` and ``strftime_now``, the special
tokens as variables, ``tools`` and ``documents``); the rendered text is tokenised without adding
special tokens, as transformers does, since the template writes them. ``{% generation %}...{%
endgeneration %}`` blocks render their body unchanged, and :meth:`ChatTemplate.render_spans`
records where each one's text lies, as transformers' ``return_assistant_tokens_mask`` does;
:func:`assistant_mask` turns those spans into the same token mask.

A template is foreign code run on every row, so its rendering is bounded as well as sandboxed: a
template that recurses without end, or builds a string of more than :data:`MAX_RENDER_CHARS`
characters (by ``*``, ``+``, ``~``, a ``{% set %}`` block, a macro or its output), fails that row
with one line instead of ending the process in a RecursionError or MemoryError.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from flowtrain.errors import ConfigError, DataError

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
    "chat_template.jinja",
)

# Tokenizer files that mean "this model has a real tokenizer", so falling back to bytes
# would silently train on ids the model was never meant to see.
_FOREIGN_TOKENIZERS = ("tokenizer.model", "vocab.json")

# Long documents are encoded in pieces of about this many characters (split where a line
# starts), so tokenizers can work on them in parallel without holding one giant Encoding
# (a tokenizers Encoding of a text takes tens of times its size).
CHUNK_CHARS = 1 << 20

#: Most characters a chat template may produce for one rendering, or build on its way there.
#: A conversation of 64 Mi characters is far beyond any context a model is trained at.
MAX_RENDER_CHARS = 64 << 20


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

    def encode_bare(self, texts: list[str]) -> list[np.ndarray]:
        """One int64 id array per text, without the template's special tokens."""
        ...

    def template_ids(self) -> tuple[np.ndarray, np.ndarray]:
        """The special ids the template puts before and after a document (BOS, ...)."""
        ...

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """``text`` encoded without the template's special tokens: its int64 ids and ``(n, 2)``
        int64 character offsets ``[start, end)`` of each token in ``text``."""
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

    def encode_bare(self, texts: list[str]) -> list[np.ndarray]:
        return self.encode_many(texts)

    def template_ids(self) -> tuple[np.ndarray, np.ndarray]:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """Each byte is a token of the character it belongs to: ``é`` is two tokens at [i, i+1)."""
        ids = self.encode_document(text)
        chars = np.repeat(np.arange(len(text), dtype=np.int64), [len(c.encode("utf-8")) for c in text])
        return ids, np.stack([chars, chars + 1], axis=1)


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
        prefix, suffix = self.template_ids()
        return np.concatenate([prefix, self._encode_long(text)[0], suffix])

    def encode_bare(self, texts: list[str]) -> list[np.ndarray]:
        """As one call would, but a text over CHUNK_CHARS characters is encoded in pieces."""
        encodings = iter(self._tokenizer.encode_batch([t for t in texts if len(t) <= CHUNK_CHARS],
                                                      add_special_tokens=False))
        return [np.asarray(next(encodings).ids, dtype=np.int64) if len(t) <= CHUNK_CHARS
                else self._encode_long(t)[0] for t in texts]

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """The call transformers makes in ``apply_chat_template`` (``add_special_tokens=False``),
        with the encoding's character offsets, which its assistant mask reads (a text over
        CHUNK_CHARS characters in pieces, their offsets counted in the whole)."""
        if len(text) > CHUNK_CHARS:
            return self._encode_long(text)
        encoding = self._tokenizer.encode_batch([text], add_special_tokens=False)[0]
        offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
        return np.asarray(encoding.ids, dtype=np.int64), offsets

    def _encode_long(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """``text`` encoded bare in the pieces of :func:`split_stream`, one per core at a time (at
        most 8): an Encoding costs tens of times its text, so one of a whole long text could
        take gigabytes. Its ids and ``(n, 2)`` character offsets in ``text``."""
        ids, offsets, start = [], [], 0
        group: list[str] = []
        pieces = split_stream([text])
        most = max(1, min(8, os.cpu_count() or 1))
        while True:
            piece = next(pieces, None)
            if piece is not None:
                group.append(piece)
            if group and (piece is None or len(group) == most):
                for p, e in zip(group, self._tokenizer.encode_batch(group, add_special_tokens=False)):
                    ids.append(np.asarray(e.ids, dtype=np.int64))
                    offsets.append(np.asarray(e.offsets, dtype=np.int64).reshape(-1, 2) + start)
                    start += len(p)
                group = []
            if piece is None:
                return np.concatenate(ids), np.concatenate(offsets)

    def template_ids(self) -> tuple[np.ndarray, np.ndarray]:
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


def make_encoder(
    tokenizer_dir: str | Path | None,
    vocab_size: int,
    eos_id: int | None,
    byte_tokenizer: bool = False,
) -> Encoder:
    """The encoder for a model: its tokenizer.json, else UTF-8 bytes where that is allowed.

    Which one, and when it is refused, is :func:`check_encoder`'s to decide.
    """
    path = check_encoder(tokenizer_dir, vocab_size, byte_tokenizer)
    return TokenizerEncoder(path, eos_id) if path is not None else ByteEncoder(eos_id)


def check_encoder(
    tokenizer_dir: str | Path | None, vocab_size: int, byte_tokenizer: bool = False
) -> Path | None:
    """The ``tokenizer.json`` text is to be encoded with, or None for UTF-8 bytes; loads nothing.

    Bytes are allowed for a preset model (``tokenizer_dir`` None), when ``byte_tokenizer``
    asks for them, and for a flowtrain checkpoint without tokenizer.json: flowtrain copies the
    tokenizer files into every checkpoint, so one without them was trained on bytes (or ids),
    and resuming or continuing it goes on as it began. Raises DataError when the directory has
    a tokenizer in another format only (a sentencepiece ``tokenizer.model``, a ``vocab.json``),
    when it has no tokenizer at all and bytes are not allowed, or when bytes are the way but
    ``vocab_size < 256``; and ConfigError when bytes are asked for although the directory has
    a tokenizer.json. Cached data runs this again, so a cache never hides one of these errors.
    """
    path = find_tokenizer(tokenizer_dir)
    if path is not None:
        if byte_tokenizer:
            raise ConfigError(
                f"{{byte_tokenizer}} asks for raw UTF-8 bytes, but {tokenizer_dir} has a "
                "tokenizer.json; drop {byte_tokenizer} to use it, or train from a folder without one", named=True)
        return path
    if tokenizer_dir is not None:
        foreign = [n for n in _FOREIGN_TOKENIZERS if (Path(tokenizer_dir) / n).is_file()]
        if foreign:
            raise DataError(
                f"{tokenizer_dir} has {foreign[0]} but no tokenizer.json; flowtrain reads only "
                "tokenizer.json: convert it with transformers (AutoTokenizer.from_pretrained(dir)"
                ".save_pretrained(dir)) or pass pre-tokenized input_ids data"
            )
        if not byte_tokenizer and not _is_flowtrain_checkpoint(Path(tokenizer_dir)):
            raise DataError(
                f"the model folder {tokenizer_dir} has no tokenizer.json, so its text would be "
                "trained as raw UTF-8 bytes; pass --tokenizer DIR (a folder with tokenizer.json "
                "[+ tokenizer_config.json]), or --byte-tokenizer to train on bytes on purpose"
            )
    if vocab_size < 256:
        raise DataError(
            f"the model has no tokenizer.json and vocab_size {vocab_size} is below the 256 that "
            "the byte-level fallback needs; give the model a vocab_size of at least 256, add a "
            "tokenizer.json to its directory, or pass pre-tokenized data (input_ids or .npy)"
        )
    return None


def _is_flowtrain_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` is a checkpoint that flowtrain wrote (its ``manifest.json`` says so)."""
    manifest = folder / "manifest.json"  # checkpoints.MANIFEST_NAME; data must not import it
    try:
        return json.loads(manifest.read_text(encoding="utf-8")).get("format") == "flowtrain-checkpoint"
    except (OSError, ValueError, AttributeError, RecursionError):  # garbage is no checkpoint
        return False


def _configured_eos(model_dir: Path, tokenizer) -> int | None:
    """The EOS id named by ``tokenizer_config.json`` (``eos_token``), if any."""
    token = _special_tokens(model_dir).get("eos_token")
    return tokenizer.token_to_id(token) if token is not None else None


def _tokenizer_config(model_dir: Path) -> dict:
    """``tokenizer_config.json`` as a dict; {} when absent or unreadable."""
    config = model_dir / "tokenizer_config.json"
    if not config.is_file():
        return {}
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (ValueError, RecursionError):  # RecursionError: JSON nested beyond the parser's depth
        return {}  # an unreadable config only costs us the separator, not the run
    return data if isinstance(data, dict) else {}


_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                   "mask_token")


def _special_tokens(model_dir: Path) -> dict[str, str]:
    """The special tokens ``tokenizer_config.json`` names (``{"eos_token": "</s>", ...}``)."""
    config, out = _tokenizer_config(model_dir), {}
    for key in _SPECIAL_TOKENS:
        token = config.get(key)
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str):
            out[key] = token
    return out


class ChatTemplate:
    """A model's Jinja2 chat template, rendered as transformers' ``apply_chat_template`` does.

    ``messages`` with ``None`` values have those keys dropped first (transformers does too), so
    ``{"content": None, "tool_calls": [...]}`` renders as the template expects. ``tools`` (a
    row's list of JSON function schemas) is the template's ``tools`` variable, None without.
    ``has_generation`` says whether the template marks assistant text with ``{% generation %}``
    (found as transformers looks for it, by the tag's spelling in the source).
    """

    def __init__(self, source: str, template: str, special_tokens: dict[str, str]) -> None:
        try:
            import jinja2
            import jinja2.ext
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise DataError(
                f"rendering the chat template in {source} needs jinja2; pip install 'jinja2>=3.1.6'"
            ) from None
        if tuple(int(v) for v in jinja2.__version__.split(".")[:3] if v.isdigit()) < (3, 1, 6):
            # as transformers: older sandboxes have known escapes, and templates are foreign code
            raise DataError(
                f"jinja2 {jinja2.__version__} is too old to run the chat template in {source} "
                "safely; pip install 'jinja2>=3.1.6'"
            )

        tracking = self._tracking = _Tracking()

        class Generation(jinja2.ext.Extension):
            """``{% generation %}...{% endgeneration %}`` renders its body unchanged; while
            :meth:`ChatTemplate.render_spans` runs, it records the body's ``[start, end)`` in the
            output, counted as transformers' ``AssistantTracker`` counts it (the characters
            the rendering has yielded so far)."""

            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

            def _body(self, caller):
                text = caller()
                if tracking.spans is not None:
                    tracking.spans.append((tracking.chars, tracking.chars + len(text)))
                return text

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            # transformers' tojson: Jinja's own escapes HTML characters, which would change text
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        class BoundedSandbox(ImmutableSandboxedEnvironment):
            """The sandbox, with ``*``, ``**`` and ``+`` checked before they run: their result
            would be too large (a 10 GB string is allocated before anything could refuse it)."""

            intercepted_binops = frozenset({"*", "**", "+"})

            def call_binop(self, context, operator, left, right):
                _check_binop(operator, left, right)
                return super().call_binop(context, operator, left, right)

        env = BoundedSandbox(
            trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
        )
        # Every join of template output (the rendering, {% set %} blocks, macros) goes through
        # environment.concat, which compiled templates bind when they are built: bound it first.
        env.concat = _bounded_join  # type: ignore[method-assign]
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(template)
        except jinja2.exceptions.TemplateError as exc:
            raise DataError(f"the chat template in {source} does not compile ({exc}); fix it") from None
        except RecursionError:
            raise DataError(f"the chat template in {source} nests too deeply to compile; fix it") from None
        # ``a ~ b`` compiles to the runtime's str_join, a name of the compiled module: bound it too.
        namespace = self._template.root_render_func.__globals__
        if "str_join" in namespace:
            namespace["str_join"] = lambda seq: _bounded_join(str(x) for x in seq)
        self.source = source
        self._special = dict(special_tokens)
        self.has_generation = bool(_GENERATION_TAG.search(template))

    def render(self, messages: list[dict], add_generation_prompt: bool = False,
               tools: list[dict] | None = None) -> str:
        """The conversation as text. Raises ``ValueError`` with the template's own message."""
        return self._rendered(lambda kwargs: self._template.render(**kwargs), messages,
                              add_generation_prompt, tools)

    def render_spans(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[str, list[tuple[int, int]]]:
        """The conversation as text and the ``[start, end)`` character span of every
        ``{% generation %}`` block in it, in the order the blocks finished: what transformers'
        ``apply_chat_template(..., return_assistant_tokens_mask=True)`` computes its mask from."""

        def generate(kwargs: dict) -> str:
            self._tracking.start()
            blocks = []
            for block in self._template.generate(**kwargs):
                self._tracking.chars += len(block)
                if self._tracking.chars > MAX_RENDER_CHARS:
                    _too_large(self._tracking.chars)
                blocks.append(block)
            return "".join(blocks)

        try:
            text = self._rendered(generate, messages, False, tools)
            return text, list(self._tracking.spans or ())
        finally:
            self._tracking.stop()

    def _rendered(self, render: Callable[[dict], str], messages: list[dict], add_generation_prompt: bool,
                  tools: list[dict] | None) -> str:
        import jinja2

        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        kwargs = dict(messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt,
                      **self._special)
        try:
            return render(kwargs)
        except (jinja2.exceptions.TemplateError, TypeError, KeyError, IndexError) as exc:
            raise ValueError(_one_line(str(exc)) or type(exc).__name__) from None
        except RecursionError:  # a macro calling itself, or a message nested beyond Python's depth
            raise ValueError("it recursed too deeply (a macro that calls itself without end?)") from None
        except (MemoryError, OverflowError):  # e.g. a filter such as center() asked for a huge width
            raise ValueError("it built a value too large to hold in memory") from None


#: How transformers finds out that a template marks assistant text (it warns when asked for a mask
#: that a template without it cannot give): the opening tag's spelling, whitespace control allowed.
_GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")


class _Tracking:
    """The state of one :meth:`ChatTemplate.render_spans`: the characters yielded so far and the
    spans recorded (None: not tracking, as during :meth:`ChatTemplate.render`)."""

    def __init__(self) -> None:
        self.chars = 0
        self.spans: list[tuple[int, int]] | None = None

    def start(self) -> None:
        self.chars, self.spans = 0, []

    def stop(self) -> None:
        self.chars, self.spans = 0, None


def assistant_mask(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """``(n,)`` bool: the tokens (character ``offsets``, ``(n, 2)``) that overlap a generation
    span, exactly as transformers' ``apply_chat_template`` marks ``assistant_masks``: it walks
    the tokens in order with a pointer into the spans, moving past every span that ends at or
    before the token's start, and marks the token if it ends after that span's start.

    Spans in order with tokens in order (every real template) take one ``searchsorted``; any
    other case runs transformers' loop itself, so the answer is the same either way."""
    n = len(offsets)
    if not spans or not n:
        return np.zeros(n, dtype=bool)
    begins = np.array([s for s, _ in spans], dtype=np.int64)
    ends = np.array([e for _, e in spans], dtype=np.int64)
    starts, stops = offsets[:, 0], offsets[:, 1]
    if np.all(np.diff(ends) >= 0) and np.all(np.diff(starts) >= 0):
        k = np.searchsorted(ends, starts, side="right")  # spans that end at or before each start
        inside = k < len(spans)
        return inside & (stops > begins[np.minimum(k, len(spans) - 1)])
    mask, j = np.zeros(n, dtype=bool), 0
    for t in range(n):
        while j < len(spans) and starts[t] >= ends[j]:
            j += 1
        if j == len(spans):
            break
        mask[t] = stops[t] > begins[j]
    return mask


def _one_line(text: str, limit: int = 300) -> str:
    """``text`` on one line, cut to ``limit`` characters: an error quotes, it does not dump."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _too_large(n: int, what: str = "string") -> None:
    import jinja2

    unit = "characters" if what == "string" else "items"
    raise jinja2.exceptions.SecurityError(
        f"it would build a {what} of {n:,} {unit}, more than the {MAX_RENDER_CHARS:,} a rendering may have"
    )


def _bounded_join(parts: Iterable[Any]) -> str:
    """``"".join(parts)``, refusing once the total passes :data:`MAX_RENDER_CHARS` (``parts`` may
    be a template's output generator: it stops being drawn then)."""
    out, total = [], 0
    for part in parts:
        total += len(part)
        if total > MAX_RENDER_CHARS:
            _too_large(total)
        out.append(part)
    return "".join(out)


#: Bits a number computed in a template may have: big-integer products and powers take
#: minutes long before they take the memory (2 ** 10 ** 9, or x * x doubled in a loop).
_MAX_INT_BITS = 1 << 20


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse ``left <operator> right`` in a template when its result would be too large: a
    repeated or joined string, list or tuple of more than :data:`MAX_RENDER_CHARS` items, or an
    integer of more than :data:`_MAX_INT_BITS` bits."""
    sized = (str, list, tuple)

    def integer(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    def kind(x: Any) -> str:
        return "string" if isinstance(x, str) else "list"

    if operator == "*" and isinstance(left, sized) and integer(right):
        if len(left) * right > MAX_RENDER_CHARS:
            _too_large(len(left) * right, kind(left))
    elif operator == "*" and isinstance(right, sized) and integer(left):
        if len(right) * left > MAX_RENDER_CHARS:
            _too_large(len(right) * left, kind(right))
    elif operator == "+" and isinstance(left, sized) and isinstance(right, sized):
        if len(left) + len(right) > MAX_RENDER_CHARS:
            _too_large(len(left) + len(right), kind(left))
    elif integer(left) and integer(right):
        if operator == "*":
            bits = left.bit_length() + right.bit_length()
        elif operator == "**" and right > 0 and abs(left) > 1:
            bits = left.bit_length() * right
        else:
            return
        if bits > _MAX_INT_BITS:
            import jinja2

            raise jinja2.exceptions.SecurityError(
                f"it would compute a number of about {bits:,} bits, more than the {_MAX_INT_BITS:,} "
                "a rendering may"
            )


def load_chat_template(tokenizer_dir: str | Path | None) -> ChatTemplate | None:
    """The chat template of ``tokenizer_dir``, or None when it has none.

    As in transformers, a ``chat_template.jinja`` file wins over ``tokenizer_config.json``'s
    ``chat_template`` (a string, or a list of ``{"name", "template"}`` of which ``default``).
    """
    if tokenizer_dir is None:
        return None
    root = Path(tokenizer_dir)
    special = _special_tokens(root)
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return ChatTemplate(str(jinja_file), jinja_file.read_text(encoding="utf-8"), special)
    template: Any = _tokenizer_config(root).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template:
        return None
    return ChatTemplate(str(root / "tokenizer_config.json"), template, special)


def _split_lines(text: str) -> list[str]:
    """Cut ``text`` into pieces of about CHUNK_CHARS, each cut where a non-blank line starts."""
    return list(split_stream([text]))


def split_stream(blocks: Iterable[str]) -> Iterator[str]:
    """The pieces of :func:`_split_lines` for text that arrives in ``blocks`` (any sizes).

    A piece ends at the first newline at or after CHUNK_CHARS - 1 characters that a non-blank
    line follows; where no line starts before 2 * CHUNK_CHARS characters (one very long line),
    it ends before the first space from CHUNK_CHARS on, else there: so a piece has at most 2 *
    CHUNK_CHARS characters, and the cuts do not depend on how the text was read. At most
    about one piece (plus a block) is held at a time. Yields no empty pieces.
    """
    buf, scan = "", 0  # scan: where the search for the next cut goes on (all before it failed)
    for block in blocks:
        buf += block
        while True:
            cut = _next_cut(buf, scan)
            if cut is None:
                scan = max(scan, len(buf) - 1, CHUNK_CHARS - 1) if len(buf) > CHUNK_CHARS else 0
                break
            yield buf[:cut]
            buf, scan = buf[cut:], 0
    if buf:
        yield buf


def _next_cut(buf: str, scan: int) -> int | None:
    """Where the piece at the start of ``buf`` ends, or None when more text must come first."""
    if len(buf) <= CHUNK_CHARS:
        return None
    most = 2 * CHUNK_CHARS
    at = max(CHUNK_CHARS - 1, scan)
    while True:
        newline = buf.find("\n", at, most)
        if newline < 0:
            break
        if newline + 1 >= len(buf):
            return None  # no cut yet: a later block may bring it (or the end makes one piece)
        if not buf[newline + 1].isspace():
            return newline + 1
        at = newline + 1
    if len(buf) <= most:
        return None  # a line may still start before ``most``
    # No line starts in [CHUNK_CHARS, most): cut before the next space (a word's start to most
    # tokenizers), else anywhere
    space = buf.find(" ", CHUNK_CHARS, most)
    return space if space > 0 else most
