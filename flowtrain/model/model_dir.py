"""Reading a Hugging Face model directory: its ``config.json``, and its weights' safetensors
headers checked against that config before anything is allocated.

A wrong or damaged checkpoint should be refused in one line before the host state it would
be loaded into exists (tens of GB for a real model), not midway through the load::

    cfg = read_config("Llama-3.2-1B")           # config.json, and every tensor's header checked
    check_weight_headers(path, cfg, require=True)  # a loader about to read weights

The checks read kilobytes: ``config.json``, the shard index and each file's header.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from .config import ModelConfig, short_repr
from .flat_map import FlatMap, hub_form, model_flat_maps
from .hf_config import from_hf

__all__ = ["CONFIG_NAME", "as_model_names", "check_weight_headers", "model_renames", "read_config", "weights_fingerprint"]

#: A Hugging Face model directory's configuration file.
CONFIG_NAME = "config.json"


#: The weights of a model directory: one file, or an index naming shards (checkpoint.py's names).
_WEIGHTS_NAME, _INDEX_NAME = "model.safetensors", "model.safetensors.index.json"
#: Largest JSON file read whole (config.json, the index) and largest safetensors header; the
#: safetensors library refuses headers above 100 MB too. Real ones are kilobytes.
_MAX_JSON_BYTES = 64 << 20
_MAX_HEADER_BYTES = 100_000_000
#: safetensors dtypes a weight may have, with their bytes per element: floating point only. An
#: integer or bool tensor would be cast to float silently (quantized weights without their scales).
_FLOAT_DTYPES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2}


def read_config(model_dir: str | os.PathLike[str], *, weights: bool = True, layer_path: str = "auto") -> ModelConfig:
    """The :class:`ModelConfig` of a Hugging Face model directory.

    Where the directory holds weights, their safetensors headers are checked against the config
    too (:func:`check_weight_headers`): a few kilobytes read, so a wrong or damaged checkpoint
    is refused before the host state it would be loaded into is allocated. A directory with
    ``config.json`` alone is accepted (``flowtrain plan`` and ``simulate`` need no weights).
    Without ``weights`` the headers are not checked: a LoRA checkpoint keeps its base's
    ``config.json`` beside the adapters' weights."""
    path = Path(model_dir)
    if not path.is_dir():
        raise CheckpointError(f"model directory {str(path)!r} does not exist or is not a directory")
    cfg_path = path / CONFIG_NAME
    if not cfg_path.is_file():
        raise CheckpointError(
            f"{str(path)!r} has no {CONFIG_NAME}; point at a Hugging Face model directory"
        )
    cfg = from_hf(_read_json(cfg_path), layer_path)
    if weights:
        check_weight_headers(path, cfg)
    return cfg


def _read_json(path: Path) -> Any:
    """A small JSON file, or :class:`CheckpointError` in one line: too large, unreadable, not
    JSON, or nested too deeply for the parser (which would raise RecursionError)."""
    try:
        if path.stat().st_size > _MAX_JSON_BYTES:
            raise CheckpointError(f"cannot read {path}: {path.stat().st_size:,} bytes, more than the "
                                  f"{_MAX_JSON_BYTES:,} a JSON file of a model may have")
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {short_repr(str(e), 200)}") from e
    except RecursionError:
        raise CheckpointError(f"cannot read {path}: its JSON is nested too deeply") from None


def check_weight_headers(model_dir: str | os.PathLike[str], cfg: ModelConfig, *, require: bool = False) -> None:
    """Check the safetensors headers of ``model_dir`` against ``cfg`` without reading a weight:
    every tensor the config implies is present, has its shape and a floating dtype, and its
    bytes lie inside its file. Raises :class:`CheckpointError` naming the file and tensor, with
    the same words as loading would. A directory without weight files passes (nothing to
    check) unless ``require``: a caller about to load weights refuses it before allocating."""
    path = Path(model_dir)
    index = path / _INDEX_NAME
    if not index.is_file() and not (path / _WEIGHTS_NAME).is_file():
        if require:
            raise CheckpointError(f"{str(path)!r} has neither {_WEIGHTS_NAME} nor {_INDEX_NAME}")
        return
    maps = model_flat_maps(cfg)
    if index.is_file():
        weight_map = _read_json(index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} is not a valid safetensors index: it has no 'weight_map' object")
        expected = _as_stored(cfg, maps, set(weight_map))
        files: dict[Path, list[str]] = {}
        for name in expected:
            if not isinstance(weight_map.get(name), str):
                raise CheckpointError(f"tensor {name!r} is missing from {index}")
            files.setdefault(path / weight_map[name], []).append(name)
    else:
        header, _ = _safetensors_header(path / _WEIGHTS_NAME)
        expected = _as_stored(cfg, maps, set(header))
        files = {path / _WEIGHTS_NAME: list(expected)}
    for file, names in files.items():
        if not file.is_file():
            raise CheckpointError(f"shard {short_repr(str(file), 200)} named in {index} does not exist")
        header, data_bytes = _safetensors_header(file)
        for name in names:
            _check_tensor(file, name, header.get(name), expected[name], data_bytes)


#: what :func:`weights_fingerprint` reads of each tensor: this many evenly spaced pieces of
#: this many bytes (the whole tensor where it is no larger)
_PRINT_PIECES, _PRINT_PIECE = 16, 4096


def weights_fingerprint(model_dir: str | os.PathLike[str]) -> str:
    """A SHA-256 over every weight of ``model_dir``: its name, dtype and shape, and 16 evenly
    spaced 4 KiB pieces of its bytes (all of them up to 64 KiB). Weights that changed (another
    fine-tune or release of the same architecture) give another fingerprint, for a read of at
    most 64 KiB a tensor (about 50 MB for a 32B model). A LoRA checkpoint records its base's, so
    that a resume over other base weights is refused. Call :func:`check_weight_headers` first."""
    path = Path(model_dir)
    index = path / _INDEX_NAME
    if index.is_file():
        files = sorted({path / f for f in _read_json(index)["weight_map"].values()})
    else:
        files = [path / _WEIGHTS_NAME]
    digest = hashlib.sha256()
    for file in files:
        header, data_bytes = _safetensors_header(file)
        start = file.stat().st_size - data_bytes
        try:
            with open(file, "rb") as f:
                for name in sorted(k for k in header if k != "__metadata__"):
                    info = header[name]
                    digest.update(json.dumps([name, info["dtype"], info["shape"]]).encode())
                    lo, hi = info["data_offsets"]
                    for at, size in _pieces(lo, hi):
                        f.seek(start + at)
                        digest.update(f.read(size))
        except OSError as e:
            raise CheckpointError(f"cannot read {file}: {e}") from e
    return digest.hexdigest()


def _pieces(lo: int, hi: int) -> list[tuple[int, int]]:
    """``(offset, size)`` of the pieces :func:`weights_fingerprint` reads of bytes ``[lo, hi)``."""
    if hi - lo <= _PRINT_PIECES * _PRINT_PIECE:
        return [(lo, hi - lo)]
    step = (hi - lo - _PRINT_PIECE) // (_PRINT_PIECES - 1)
    return [(lo + i * step, _PRINT_PIECE) for i in range(_PRINT_PIECES)]


def _as_stored(cfg: ModelConfig, maps: list[FlatMap], present: set[str]) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint with tensors ``present`` must hold for ``cfg``, under the
    checkpoint's own names (on the generic path, names transformers renames on loading are
    looked up as stored: :mod:`flowtrain.model.generic.renames`), with its shape."""
    renames = model_renames(cfg, present)
    model_names = as_model_names(present, renames) if renames else present
    expected = _fused_experts_expected(cfg, _expected(maps, model_names), model_names)
    return {renames.get(n, n): shape for n, shape in expected.items()}


def model_renames(cfg: ModelConfig, present: set[str]) -> dict[str, str]:
    """``{the model's name: the checkpoint's}`` where a generic model's checkpoint names a tensor
    as transformers renames it on loading (empty on the native path)."""
    if not cfg.generic or cfg.hf_json is None:
        return {}
    from .generic.renames import checkpoint_renames

    return checkpoint_renames(str(json.loads(cfg.hf_json).get("model_type")), present)


def as_model_names(present: set[str], renames: dict[str, str]) -> set[str]:
    """The checkpoint names ``present`` as the model names them."""
    back = {ckpt: model for model, ckpt in renames.items()}
    return {back.get(n, n) for n in present}


def _expected(maps: list[FlatMap], present: set[str]) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor the flat maps hold, by name, with its shape (a generic model's
    fused experts in whichever form the checkpoint with tensors ``present`` keeps them)."""
    return {name: shape for lay in maps for e in lay.entries for name, shape, _ in hub_form(e, present)}


def _fused_experts_expected(cfg: ModelConfig, expected: dict[str, tuple[int, ...]], present: set[str]
                            ) -> dict[str, tuple[int, ...]]:
    """``expected`` with each sparse layer's experts (and router) under the names transformers 5
    keeps in memory (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``, ``mlp.gate.weight``)
    where the checkpoint holds that form instead of the Hub's one tensor per expert
    (:func:`flowtrain.ckpt.hf.load_into` reads either)."""
    out = dict(expected)
    for lay in model_flat_maps(cfg)[1:-1]:
        if not any(e.stacked for e in lay.entries):
            continue
        gate, down, router = lay.entry("experts_gate"), lay.entry("experts_down"), lay.entry("router")
        prefix = f"model.layers.{lay.layer}.mlp"
        if gate.name.format(0) in present or f"{prefix}.experts.gate_up_proj" not in present:
            continue
        for key in ("experts_gate", "experts_up", "experts_down"):
            e = lay.entry(key)
            for i in range(e.shape[0]):
                del out[e.name.format(i)]
        out[f"{prefix}.experts.gate_up_proj"] = (gate.shape[0], 2 * gate.shape[1], gate.shape[2])
        out[f"{prefix}.experts.down_proj"] = down.shape
        if router.name not in present and f"{prefix}.gate.weight" in present:
            out[f"{prefix}.gate.weight"] = out.pop(router.name)
    return out


def _safetensors_header(file: Path) -> tuple[dict, int]:
    """``(header, bytes after it)`` of a safetensors file: an 8-byte little-endian length, then
    that many bytes of JSON. Only the header is read."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n > min(_MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(f"cannot read {file}: corrupt or truncated (header of {n:,} bytes "
                                      f"in a file of {size:,})")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"cannot read {file}: corrupt or truncated ({short_repr(str(e), 200)})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"cannot read {file}: corrupt or truncated (its header is not a JSON object)")
    return header, size - 8 - n


def _check_tensor(file: Path, name: str, info: Any, shape: tuple[int, ...], data_bytes: int) -> None:
    """One header entry against the shape the config implies (see :func:`check_weight_headers`)."""
    if info is None:
        raise CheckpointError(f"tensor {name!r} is missing from {file}")
    got = info.get("shape") if isinstance(info, dict) else None
    offsets = info.get("data_offsets") if isinstance(info, dict) else None
    if (not isinstance(got, list) or not all(type(x) is int and x >= 0 for x in got)
            or not isinstance(offsets, list) or len(offsets) != 2 or not all(type(x) is int for x in offsets)):
        raise CheckpointError(f"cannot read {file}: corrupt or truncated (the entry of {name!r} is malformed)")
    if tuple(got) != shape:
        raise CheckpointError(f"tensor {name!r} in {file} has shape {short_repr(tuple(got))}, but the config "
                              f"implies {shape}; does config.json belong to these weights?")
    dtype = info.get("dtype")
    if dtype not in _FLOAT_DTYPES:
        raise CheckpointError(f"tensor {name!r} in {file} is {short_repr(dtype)}, not a floating-point weight; "
                              f"flowtrain loads {', '.join(_FLOAT_DTYPES)} weights (convert quantized checkpoints)")
    begin, end = offsets
    if not 0 <= begin <= end <= data_bytes or end - begin != math.prod(shape) * _FLOAT_DTYPES[dtype]:
        raise CheckpointError(f"cannot read {file}: corrupt or truncated ({name!r} lies at bytes {begin}-{end} "
                              f"of {data_bytes:,})")
