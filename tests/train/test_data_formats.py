"""The data formats users already have: alpaca and ShareGPT rows, Parquet, Arrow and ``datasets``
folders, and ``--data-columns`` for columns of other names.

Alpaca and ShareGPT rows are conversations written another way: each must give exactly the rows
(ids, targets, positions) of the same conversation written as ``messages``, and training on them
exactly the weights, bit for bit. A table holds the rows of a ``.jsonl`` file and must read as it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flowtrain.data.rows import parse_columns
from flowtrain.data.source import load_sequences
from flowtrain.errors import DataError

pytest.importorskip("transformers")

from test_data_finetune import make_tokenizer, write_jsonl
from test_train_vs_hf import make_checkpoint, run_flowtrain

pa = pytest.importorskip("pyarrow")
import pyarrow.ipc
import pyarrow.parquet  # noqa: F401 - pa.parquet


@pytest.fixture(autouse=True)
def _data_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWTRAIN_CACHE", str(tmp_path / "cache"))


# Words of test_data_finetune's tokenizer, so that every word is one token.
ALPACA = [
    {"instruction": "what is two plus two ?", "input": "", "output": "four ."},
    {"instruction": "what is it ?", "input": "two plus three", "output": "five ."},
    {"instruction": "hi", "input": "", "output": "hello ! what is it ?", "system": "you are the answer"},
    {"instruction": "thanks", "input": "bye", "output": "ok bye !"},
]
SHAREGPT = [
    {"conversations": [{"from": "human", "value": "what is two plus two ?"}, {"from": "gpt", "value": "four ."},
                       {"from": "human", "value": "thanks"}, {"from": "gpt", "value": "ok bye !"}]},
    {"conversations": [{"from": "system", "value": "you are the answer"}, {"from": "human", "value": "hi"},
                       {"from": "gpt", "value": "hello ! what is it ?"}]},
    # the variants: user/assistant speakers, role/content keys, a row's own system
    {"conversations": [{"role": "user", "content": "what is it ?"}, {"role": "assistant", "content": "five ."}],
     "system": "you are helpful"},
    {"conversations": [{"from": "user", "value": "hello"}, {"from": "assistant", "value": "hi"},
                       {"from": "human", "value": "bye"}]},
]


def as_messages(row: dict) -> dict:
    """The ``messages`` row a test writes by hand for an alpaca or ShareGPT row."""
    if "instruction" in row:
        user = row["instruction"] + ("\n" + row["input"] if row["input"] else "")
        system = [{"role": "system", "content": row["system"]}] if row.get("system") else []
        return {"messages": system + [{"role": "user", "content": user},
                                      {"role": "assistant", "content": row["output"]}]}
    roles = {"human": "user", "gpt": "assistant"}
    system = [{"role": "system", "content": row["system"]}] if "system" in row else []
    return {"messages": system + [{"role": roles.get(t.get("from", t.get("role")), t.get("from", t.get("role"))),
                                   "content": t.get("value", t.get("content"))} for t in row["conversations"]]}


def read(path: Path, model: Path, **kw):
    return load_sequences(path, 24, 64, tokenizer_dir=model, **kw)


def same_rows(a, b) -> None:
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.targets, b.targets)
    assert (a.positions is None) == (b.positions is None)
    assert a.positions is None or torch.equal(a.positions, b.positions)
    assert a.report.mask == b.report.mask == "generation"


@pytest.mark.parametrize("rows", [ALPACA, SHAREGPT], ids=["alpaca", "sharegpt"])
def test_alpaca_and_sharegpt_rows_read_as_the_same_messages(tmp_path, rows):
    model = make_tokenizer(tmp_path / "model")
    ours = read(write_jsonl(tmp_path / "rows.jsonl", rows), model)
    messages = read(write_jsonl(tmp_path / "messages.jsonl", [as_messages(r) for r in rows]), model)
    same_rows(ours, messages)
    assert ours.num_targets() > 0


@pytest.mark.parametrize("rows", [ALPACA, SHAREGPT], ids=["alpaca", "sharegpt"])
def test_alpaca_and_sharegpt_training_is_bit_identical_to_messages(tmp_path, rows):
    make_checkpoint(tmp_path / "model")
    make_tokenizer(tmp_path / "model")
    rows = rows * 3  # 12 conversations: the 3 steps of 4
    write_jsonl(tmp_path / "rows.jsonl", rows)
    write_jsonl(tmp_path / "messages.jsonl", [as_messages(r) for r in rows])
    run_flowtrain(tmp_path / "model", tmp_path / "rows.jsonl", tmp_path / "ours", "--long-examples", "truncate", "--seq-len", "48")
    run_flowtrain(tmp_path / "model", tmp_path / "messages.jsonl", tmp_path / "theirs", "--long-examples", "truncate", "--seq-len", "48")
    ours, theirs = load_file(tmp_path / "ours/model.safetensors"), load_file(tmp_path / "theirs/model.safetensors")
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    before = load_file(tmp_path / "model/model.safetensors")
    assert any(not torch.equal(before[n], ours[n]) for n in ours)  # it trained


def write_tables(folder: Path, rows: list[dict]) -> dict[str, Path]:
    """The rows as a Parquet file, an Arrow file, an Arrow stream and datasets folders."""
    datasets = pytest.importorskip("datasets")
    folder.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    rows = [{k: r.get(k) for k in keys} for r in rows]  # a table has every column: None where a row has none
    table = pa.Table.from_pylist(rows)
    paths = {"parquet": folder / "d.parquet", "arrow-file": folder / "file.arrow",
             "arrow-stream": folder / "stream.arrow", "dataset": folder / "ds", "dataset-dict": folder / "dd"}
    pa.parquet.write_table(table, paths["parquet"], row_group_size=2)
    with pa.ipc.new_file(str(paths["arrow-file"]), table.schema) as w:
        w.write_table(table, max_chunksize=3)
    with pa.ipc.new_stream(str(paths["arrow-stream"]), table.schema) as w:
        w.write_table(table)
    datasets.Dataset.from_list(rows).save_to_disk(str(paths["dataset"]))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "test": datasets.Dataset.from_list(rows[:1])}).save_to_disk(str(paths["dataset-dict"]))
    return paths


@pytest.mark.parametrize("kind", ["parquet", "arrow-file", "arrow-stream", "dataset", "dataset-dict"])
def test_tables_read_as_the_same_jsonl(tmp_path, kind):
    model = make_tokenizer(tmp_path / "model")
    jsonl = read(write_jsonl(tmp_path / "rows.jsonl", ALPACA), model)
    same_rows(read(write_tables(tmp_path / "t", ALPACA)[kind], model), jsonl)


def test_a_dataset_selected_or_shuffled_reads_in_its_own_order(tmp_path):
    datasets = pytest.importorskip("datasets")
    model = make_tokenizer(tmp_path / "model")
    datasets.Dataset.from_list(ALPACA).select([3, 1, 0]).save_to_disk(str(tmp_path / "ds"))
    jsonl = read(write_jsonl(tmp_path / "rows.jsonl", [ALPACA[i] for i in (3, 1, 0)]), model, packing=False)
    same_rows(read(tmp_path / "ds", model, packing=False), jsonl)


def test_data_columns_map_other_names_and_leave_other_columns(tmp_path):
    model = make_tokenizer(tmp_path / "model")
    other = [{"id": i, "question": r["instruction"], "context": r["input"], "answer": r["output"]}
             for i, r in enumerate(ALPACA) if "system" not in r]
    plain = [{k: r[k] for k in ("instruction", "input", "output")} for r in ALPACA if "system" not in r]
    jsonl = read(write_jsonl(tmp_path / "rows.jsonl", plain), model)
    columns = parse_columns("instruction=question,input=context,output=answer")
    same_rows(read(write_jsonl(tmp_path / "other.jsonl", other), model, columns=columns), jsonl)
    table = write_tables(tmp_path / "t", other)["parquet"]
    same_rows(read(table, model, columns=columns), jsonl)
    with pytest.raises(DataError, match=r"d.parquet row 0 has answer, context, id, question, which is none of the "
                                        r"accepted row forms.*--data-columns"):
        read(table, model)
    with pytest.raises(DataError, match=r"row 0 has no column 'reply' that --data-columns names"):
        read(table, model, columns=parse_columns("instruction=question,output=reply"))


def test_the_cache_key_changes_with_the_mapping_and_the_folder(tmp_path):
    from flowtrain.data.cache import cache_key

    other = [{"q": r["instruction"], "a": r["output"]} for r in ALPACA]
    model = make_tokenizer(tmp_path / "model")
    path = write_jsonl(tmp_path / "other.jsonl", other)
    read(path, model, columns=parse_columns("instruction=q,output=a"))
    read(path, model, columns=parse_columns("instruction=a,output=q"))  # another mapping, other rows
    assert len([p for p in (tmp_path / "cache" / "data").iterdir() if p.is_dir()]) == 2
    folder = write_tables(tmp_path / "t", ALPACA)["dataset"]
    before = cache_key(folder, {}, model)
    (folder / "state.json").write_text((folder / "state.json").read_text() + " ")
    assert cache_key(folder, {}, model) != before


@pytest.mark.parametrize("rows, pattern", [
    ([ALPACA[0], {"instruction": "hi", "output": 3}], r"rows.jsonl line 2: \"output\" is a int, not a string"),
    ([SHAREGPT[0], {"conversations": [{"from": "bot", "value": "hi"}]}],
     r"rows.jsonl line 2: conversations\[0\] has speaker 'bot'; \"from\" \(or \"role\"\) must be one of"),
    ([SHAREGPT[0], {"conversations": []}], r"rows.jsonl line 2: \"conversations\" must be a non-empty list"),
    ([ALPACA[0], SHAREGPT[0]], r"mixes \"alpaca\" rows \(line 1\) and \"sharegpt\" rows \(line 2\)"),
])
def test_bad_rows_are_named_by_their_line(tmp_path, rows, pattern):
    model = make_tokenizer(tmp_path / "model")
    with pytest.raises(DataError, match=pattern):
        read(write_jsonl(tmp_path / "rows.jsonl", rows), model)


def test_a_bad_table_row_is_named_by_its_index(tmp_path):
    model = make_tokenizer(tmp_path / "model")
    rows = [dict(ALPACA[0]), dict(ALPACA[1]), {**ALPACA[1], "output": ""}]
    rows[2]["instruction"] = None  # a null: the row has no instruction
    path = write_tables(tmp_path / "t", rows)["parquet"]
    with pytest.raises(DataError, match=r"d.parquet row 2 has input, output, which is none of the accepted"):
        read(path, model)


def test_conversations_without_a_chat_template_are_refused(tmp_path):
    model = make_tokenizer(tmp_path / "model", chat_template=None)
    with pytest.raises(DataError, match="holds ShareGPT \\(conversation\\) rows, but the model's tokenizer has no chat"):
        read(write_jsonl(tmp_path / "rows.jsonl", SHAREGPT), model)


@pytest.mark.parametrize("module, kind", [("pyarrow", "parquet"), ("datasets", "dataset")])
def test_a_missing_library_is_one_line_naming_the_install(tmp_path, monkeypatch, module, kind):
    model = make_tokenizer(tmp_path / "model")
    path = write_tables(tmp_path / "t", ALPACA)[kind]
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if it were not installed
    with pytest.raises(DataError, match=r"needs .*, which is not installed; pip install 'flowtrain\[data\]'$"):
        read(path, model)


@pytest.mark.parametrize("text, pattern", [
    ("instruction=question,output=answer", None),
    ("messages", None),
    ("instrution=question", "names 'instrution', which no row form reads"),
    ("instruction=q,output=q", "names the column 'q' twice"),
    ("=q", "KEY=COLUMN entries"),
])
def test_parse_columns(text, pattern):
    if pattern is None:
        assert dict(parse_columns(text))
        return
    with pytest.raises(ValueError, match=pattern):
        parse_columns(text)


def test_the_flag_reads_a_table_with_other_column_names(tmp_path):
    """``flowtrain train --data t.parquet --data-columns ...`` end to end, and the same run's
    settings record the mapping."""
    make_checkpoint(tmp_path / "model")
    make_tokenizer(tmp_path / "model")
    other = [{"q": r["instruction"], "a": r["output"]} for r in ALPACA * 3]
    path = write_tables(tmp_path / "t", other)["parquet"]
    run_flowtrain(tmp_path / "model", path, tmp_path / "out", "--data-columns", "instruction=q,output=a",
                  "--long-examples", "truncate", "--seq-len", "48", "--save-every", "3")
    state = json.loads(next((tmp_path / "out").glob("checkpoint-*/trainer_state.json")).read_text())
    assert state["settings"]["data_columns"] == [["instruction", "q"], ["output", "a"]]
