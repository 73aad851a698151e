"""What one row of a data file is: its form, found from its keys, and the conversation it means.

A row (a ``.jsonl`` line, or a row of a Parquet, Arrow or ``datasets`` table) is a mapping of
column names to values. Its *form* is decided by its key set (:data:`FORMS`): any other set is
refused, naming the row, so a typo (``"label"``, ``"response"``) never trains on what it was
meant to mask. Two forms most instruction data sets use are conversations written another way,
and become ``messages`` rows here, before anything is tokenised, so they are rendered through
the model's chat template exactly as the same conversation written as ``messages`` is (the same
tokens, the same loss mask)::

    {"instruction": "Add 2 and 3.", "input": "", "output": "5"}      # alpaca (+ optional "system")
    -> {"messages": [{"role": "user", "content": "Add 2 and 3."},
                     {"role": "assistant", "content": "5"}]}

    {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}
    -> {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}

Alpaca: ``system`` (if given and not empty) is a system turn; the user turn is ``instruction``,
then ``input`` on a new line when it is not empty (as LLaMA-Factory joins them); ``output`` is
the assistant turn. ShareGPT: each turn's speaker is ``from`` (or ``role``) and its text
``value`` (or ``content``); ``human``/``user`` are user turns, ``gpt``/``assistant`` assistant
turns, ``system`` and ``tool`` keep their names; a row's own ``system`` is a first system turn.

**Column mapping.** Data whose columns have other names is read through a
:class:`ColumnMap`, ``--data-columns instruction=question,output=answer``: each entry names
the column (right) that holds a row key (left); a key alone keeps the column of that name.
With a map, each row is read from exactly the columns it names (a table's other columns,
``id`` or ``source``, are left alone); without one, every key is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flowtrain.errors import DataError

__all__ = ["CONVERSATION_FORMS", "FORMS", "KEYS", "ROW_EXAMPLE", "ColumnMap", "parse_columns", "row_form"]

#: The keys a row may hold, and the form they make. ``input_ids`` with ``text`` is a
#: pre-tokenized row that kept its text for reading; the ids are what counts.
FORMS = {
    frozenset({"text"}): "text",
    frozenset({"prompt", "completion"}): "prompt/completion",
    frozenset({"messages"}): "messages",
    frozenset({"messages", "tools"}): "messages",
    frozenset({"input_ids"}): "input_ids",
    frozenset({"input_ids", "labels"}): "input_ids",
    frozenset({"input_ids", "text"}): "input_ids",
    frozenset({"instruction", "output"}): "alpaca",
    frozenset({"instruction", "input", "output"}): "alpaca",
    frozenset({"instruction", "output", "system"}): "alpaca",
    frozenset({"instruction", "input", "output", "system"}): "alpaca",
    frozenset({"conversations"}): "sharegpt",
    frozenset({"conversations", "system"}): "sharegpt",
}
#: Every key some form reads: what a column map may name on its left.
KEYS = frozenset().union(*FORMS)
#: The forms that are conversations, rendered with the chat template (loss on assistant turns).
CONVERSATION_FORMS = ("messages", "alpaca", "sharegpt")

ROW_EXAMPLE = (
    '{"text": "..."}, {"prompt": "...", "completion": "..."}, {"messages": [{"role": ..., '
    '"content": ...}, ...]} (+ "tools": [...]), {"instruction": ..., "input": ..., "output": ...} (alpaca), '
    '{"conversations": [{"from": "human", "value": ...}, ...]} (ShareGPT), {"input_ids": [1, 2, 3]} or '
    '{"input_ids": [...], "labels": [...]}'
)

# ShareGPT speakers -> chat roles
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
          "tool": "tool"}

ColumnMap = tuple[tuple[str, str], ...]  # ((row key, column), ...)


def parse_columns(text: str) -> ColumnMap:
    """``"instruction=question,output=answer"`` -> ``(("instruction", "question"), ("output",
    "answer"))``; ``"messages"`` alone -> ``(("messages", "messages"),)``. Raises ValueError
    naming what is wrong (an unknown key, a key or a column named twice, an empty entry)."""
    pairs: list[tuple[str, str]] = []
    for entry in text.split(","):
        key, _, column = (part.strip() for part in entry.partition("="))
        column = column or key
        if not key:
            raise ValueError(f"--data-columns takes KEY=COLUMN entries separated by commas, such as "
                             f"instruction=question,output=answer (got {text!r})")
        if key not in KEYS:
            raise ValueError(f"--data-columns names {key!r}, which no row form reads; the keys are "
                             f"{', '.join(sorted(KEYS))}")
        pairs.append((key, column))
    for i, what in ((0, "key"), (1, "column")):
        names = [p[i] for p in pairs]
        twice = next((n for n in names if names.count(n) > 1), None)
        if twice is not None:
            raise ValueError(f"--data-columns names the {what} {twice!r} twice")
    return tuple(pairs)


def row_form(obj: Mapping[str, Any], where: str, columns: ColumnMap | None = None,
             table: bool = False) -> tuple[str, dict]:
    """The form of the row ``obj`` (one of :data:`FORMS`' values) and the row as its form reads
    it: renamed through ``columns``, and, for alpaca and ShareGPT rows, as a ``messages`` row.
    ``table``: the row is a table's, where every row has every column and a null (None) value
    means that the row has no such key. Raises DataError naming ``where``."""
    if columns is not None:
        missing = [column for _, column in columns if column not in obj]
        if missing:
            have = ", ".join(sorted(obj)) or "no keys"
            raise DataError(f"{where} has no column {missing[0]!r} that --data-columns names (it has {have})")
        obj = {key: obj[column] for key, column in columns}
    else:
        obj = dict(obj)
    if table:
        obj = {k: v for k, v in obj.items() if v is not None}
    form = FORMS.get(frozenset(obj))
    if form is None:
        keys = ", ".join(sorted(obj)) or "no keys"
        hint = "" if columns is not None else "; where the columns have other names, map them with --data-columns"
        raise DataError(f"{where} has {keys}, which is none of the accepted row forms; each row must look like "
                        f"{ROW_EXAMPLE}{hint}")
    if form == "alpaca":
        return form, {"messages": _alpaca(obj, where)}
    if form == "sharegpt":
        return form, {"messages": _sharegpt(obj, where)}
    return form, obj


def _text(where: str, key: str, value: object) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: \"{key}\" is a {type(value).__name__}, not a string; write it as one string")
    return value


def _system(obj: Mapping[str, Any], where: str) -> list[dict]:
    system = _text(where, "system", obj.get("system", ""))
    return [{"role": "system", "content": system}] if system else []


def _alpaca(obj: Mapping[str, Any], where: str) -> list[dict]:
    instruction = _text(where, "instruction", obj["instruction"])
    extra = _text(where, "input", obj.get("input", ""))
    user = f"{instruction}\n{extra}" if extra else instruction
    return [*_system(obj, where), {"role": "user", "content": user},
            {"role": "assistant", "content": _text(where, "output", obj["output"])}]


def _sharegpt(obj: Mapping[str, Any], where: str) -> list[dict]:
    turns = obj["conversations"]
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: \"conversations\" must be a non-empty list of turns such as "
                        f"[{{\"from\": \"human\", \"value\": \"Hi\"}}, {{\"from\": \"gpt\", \"value\": \"Hello\"}}]")
    messages = _system(obj, where)
    for k, turn in enumerate(turns):
        at = f"{where}: conversations[{k}]"
        if not isinstance(turn, Mapping):
            raise DataError(f"{at} is a {type(turn).__name__}, not an object with \"from\" and \"value\"")
        speaker = turn.get("from", turn.get("role"))
        text = turn.get("value", turn.get("content"))
        if not isinstance(speaker, str) or speaker.lower() not in _ROLES:
            raise DataError(f"{at} has speaker {speaker!r}; \"from\" (or \"role\") must be one of "
                            f"{', '.join(_ROLES)}")
        messages.append({"role": _ROLES[speaker.lower()], "content": _text(at, "value", text)})
    return messages
