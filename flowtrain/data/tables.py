"""Rows of a table: a Parquet file, an Arrow file, or a Hugging Face ``datasets`` folder.

Each is read a batch of rows at a time (a file of any size passes through a bounded amount of
memory) and yields ``(row, {column: value})``, ``row`` counted from 0 as ``datasets`` counts it,
for :mod:`~flowtrain.data.files` to read as it reads ``.jsonl`` lines::

    for row, obj in table_rows(Path("train.parquet")):    # (0, {"instruction": ..., ...}), ...
        ...

* ``.parquet``: through ``pyarrow.parquet``, a row group at a time.
* ``.arrow`` / ``.feather``: Arrow IPC, the file format or the stream format (``datasets``
  writes the stream format into its cache and its ``save_to_disk`` folders).
* a folder that ``datasets.Dataset.save_to_disk`` wrote (``state.json``,
  ``dataset_info.json``, ``data-*.arrow``), read with ``datasets.load_from_disk``; a
  ``DatasetDict`` folder (``dataset_dict.json``) gives its ``train`` split, and another split is
  its subfolder (``--data folder/test``).

The libraries are optional (``pip install 'flowtrain[data]'``): without them the file is
refused in one line that names the command.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flowtrain.errors import DataError

__all__ = ["TABLE_SUFFIXES", "files_of", "is_table", "table_rows"]

TABLE_SUFFIXES = (".parquet", ".arrow", ".feather")
_BATCH_ROWS = 1024
_INSTALL = "pip install 'flowtrain[data]'"


def is_dataset_folder(path: Path) -> bool:
    """Whether ``path`` is a folder that ``datasets``' ``save_to_disk`` wrote."""
    return path.is_dir() and any((path / name).is_file() for name in ("state.json", "dataset_dict.json"))


def is_table(path: Path) -> bool:
    """Whether ``path`` is read by :func:`table_rows`."""
    return path.suffix.lower() in TABLE_SUFFIXES or is_dataset_folder(path)


def files_of(path: Path) -> list[Path]:
    """The files whose bytes make the data at ``path``: the file itself, or every file of a
    ``datasets`` folder (the data cache's key hashes them all)."""
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file())
    return [path]


def table_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(row, {column: value})`` of every row of the table at ``path``, in order."""
    if path.is_dir():
        return _dataset_rows(path)
    if path.suffix.lower() == ".parquet":
        return _parquet_rows(path)
    return _arrow_rows(path)


def _pyarrow(path: Path) -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise DataError(f"reading {path} needs pyarrow, which is not installed; {_INSTALL}") from None
    return pyarrow


def _parquet_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    pa = _pyarrow(path)
    try:
        table = pa.parquet.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path} is not a readable Parquet file ({exc}); write it with "
                        "pyarrow.parquet.write_table or datasets' to_parquet") from None
    return _numbered(table.iter_batches(batch_size=_BATCH_ROWS))


def _arrow_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    pa = _pyarrow(path)
    source = pa.memory_map(str(path), "r")
    try:
        reader = pa.ipc.open_file(source)
        batches: Iterator[Any] = (reader.get_batch(i) for i in range(reader.num_record_batches))
    except pa.ArrowInvalid:
        try:
            batches = iter(pa.ipc.open_stream(source))
        except pa.ArrowInvalid as exc:
            raise DataError(f"{path} is not an Arrow file ({exc}); write it with pyarrow's ipc writers or "
                            "datasets' save_to_disk") from None
    return _numbered(batches)


def _numbered(batches: Iterator[Any]) -> Iterator[tuple[int, dict[str, Any]]]:
    row = 0
    for batch in batches:
        for obj in batch.to_pylist():
            yield row, obj
            row += 1


def _dataset_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"reading the datasets folder {path} needs the datasets library, which is not installed; "
                        f"{_INSTALL}") from None
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        if "train" not in splits:
            raise DataError(f"{path} is a DatasetDict without a \"train\" split (it has {', '.join(splits) or 'none'}); "
                            f"pass the split's folder, such as --data {path / (splits[0] if splits else 'SPLIT')}")
        path = path / "train"
    try:
        dataset = datasets.load_from_disk(str(path))
    except (OSError, ValueError, FileNotFoundError) as exc:
        raise DataError(f"{path} could not be read with datasets.load_from_disk ({exc})") from None
    # arrow tables of the rows in the dataset's order (an indices mapping, from select or
    # shuffle, applied)
    return _numbered(dataset.with_format("arrow").iter(batch_size=_BATCH_ROWS))
