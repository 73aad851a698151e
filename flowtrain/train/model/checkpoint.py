"""Read and write Hugging Face checkpoints straight from and into flat unit buffers.

A model directory holds ``config.json`` and either ``model.safetensors`` or a sharded
``model.safetensors.index.json`` plus its shards. Loading copies one tensor at a time into
:func:`~flowtrain.train.model.layout.bind` views, so the model is never in memory twice;
saving streams each tensor's bytes to disk in the safetensors format, for the same reason::

    cfg = read_config("Llama-3.2-1B")
    layouts = model_layouts(cfg)
    flats = [torch.empty(lay.numel) for lay in layouts]
    load_into("Llama-3.2-1B", cfg, layouts, flats)
    ...
    save_hf("out", cfg, layouts, flats, dtype=torch.bfloat16)   # from_pretrained("out") works

Problems with the files (missing, truncated, wrong shapes) raise
:class:`~flowtrain.errors.CheckpointError` naming the file and tensor.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from flowtrain.errors import CheckpointError
from flowtrain.train.model.config import ModelConfig
from flowtrain.train.model.layout import Entry, UnitLayout, bind

__all__ = ["hf_config_text", "load_into", "read_config", "save_hf", "unit_tensors", "write_safetensors"]

log = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

_ST_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
}
_HF_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float64: "float64",
}
_WRITE_PIECE = 1 << 24  # elements converted/copied per write: bounds temporaries


def read_config(model_dir: str | os.PathLike[str]) -> ModelConfig:
    """The :class:`ModelConfig` of a Hugging Face model directory."""
    path = Path(model_dir)
    if not path.is_dir():
        raise CheckpointError(f"model directory {str(path)!r} does not exist or is not a directory")
    cfg_path = path / CONFIG_NAME
    if not cfg_path.is_file():
        raise CheckpointError(
            f"{str(path)!r} has no {CONFIG_NAME}; point at a Hugging Face model directory"
        )
    try:
        d = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {cfg_path}: {e}") from e
    return ModelConfig.from_hf(d)


# ---------------------------------------------------------------------- loading


def _weight_files(path: Path, names: Sequence[str]) -> dict[Path, list[str]]:
    """Which file holds each expected tensor, grouped by file."""
    index_path = path / INDEX_NAME
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            assert isinstance(weight_map, dict)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError,
                AssertionError) as e:
            raise CheckpointError(f"{index_path} is not a valid safetensors index: {e!r}") from e
        files: dict[Path, list[str]] = {}
        for name in names:
            if name not in weight_map:
                raise CheckpointError(f"tensor {name!r} is missing from {index_path}")
            files.setdefault(path / weight_map[name], []).append(name)
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"shard {str(file)!r} named in {index_path} does not exist")
        return files
    single = path / WEIGHTS_NAME
    if single.is_file():
        return {single: list(names)}
    hint = " (found pytorch_model.bin: re-save it as safetensors)" if (
        path / "pytorch_model.bin").exists() else ""
    raise CheckpointError(f"{str(path)!r} has neither {WEIGHTS_NAME} nor {INDEX_NAME}{hint}")


def _harmless(name: str, cfg: ModelConfig) -> bool:
    """Extra tensors that are expected in some checkpoints and safe to skip quietly."""
    return name.endswith("rotary_emb.inv_freq") or (
        cfg.tie_word_embeddings and name == "lm_head.weight"
    )


def load_into(
    model_dir: str | os.PathLike[str],
    cfg: ModelConfig,
    layouts: Sequence[UnitLayout],
    flats: Sequence[Tensor],
) -> None:
    """Copy every checkpoint tensor into its view of ``flats[k]``, cast to that flat's dtype.

    Every tensor ``layouts`` describes must be present with its shape; extra tensors are
    skipped (with a log line, except rotary ``inv_freq`` buffers and a tied model's head).
    """
    if len(flats) != len(layouts):
        raise ValueError(f"load_into: {len(layouts)} layouts but {len(flats)} flat buffers")
    path = Path(model_dir)
    if not path.is_dir():
        raise CheckpointError(f"model directory {str(path)!r} does not exist or is not a directory")
    targets: dict[str, tuple[Entry, Tensor]] = {}
    for layout, flat in zip(layouts, flats):
        views = bind(flat, layout)
        for e in layout.entries:
            targets[e.name] = (e, views[e.key])

    for file, names in _weight_files(path, list(targets)).items():
        try:
            with safe_open(str(file), framework="pt") as f:
                present = set(f.keys())
                for name in names:
                    if name not in present:
                        raise CheckpointError(f"tensor {name!r} is missing from {file}")
                    entry, view = targets[name]
                    shape = tuple(f.get_slice(name).get_shape())
                    if shape != entry.shape:
                        raise CheckpointError(
                            f"tensor {name!r} in {file} has shape {shape}, but the config "
                            f"implies {entry.shape}; does config.json belong to these weights?"
                        )
                    view.copy_(f.get_tensor(name))
                extra = sorted(n for n in present - set(targets) if not _harmless(n, cfg))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read {file}: corrupt or truncated ({e})") from e
        if extra:
            log.warning("%s: ignoring %d unexpected tensor(s): %s", file, len(extra),
                        ", ".join(extra[:5]) + (" ..." if len(extra) > 5 else ""))


# ---------------------------------------------------------------------- saving


def save_hf(
    out_dir: str | os.PathLike[str],
    cfg: ModelConfig,
    layouts: Sequence[UnitLayout],
    flats: Sequence[Tensor],
    dtype: torch.dtype = torch.float32,
) -> None:
    """Write ``config.json`` and ``model.safetensors`` (tensors in ``dtype``) to ``out_dir``.

    The weights go through :func:`write_safetensors`, which streams each tensor in pieces,
    so no second copy of the model is made whatever ``dtype`` is. A stale
    ``model.safetensors.index.json`` is removed so the directory holds one consistent model.
    """
    if dtype not in _ST_DTYPES:
        raise CheckpointError(
            f"cannot save in {dtype}; choose one of {', '.join(map(str, _ST_DTYPES))}"
        )
    if len(flats) != len(layouts):
        raise ValueError(f"save_hf: {len(layouts)} layouts but {len(flats)} flat buffers")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tensors: list[tuple[str, Tensor]] = []
    for layout, flat in zip(layouts, flats):
        tensors += unit_tensors(flat, layout)
    if cfg.tie_word_embeddings:
        tensors = [(name, t) for name, t in tensors if name != "lm_head.weight"]

    tmp = out / (WEIGHTS_NAME + ".partial")
    try:
        write_safetensors(tmp, tensors, dtype)
        os.replace(tmp, out / WEIGHTS_NAME)
        (out / INDEX_NAME).unlink(missing_ok=True)
        (out / CONFIG_NAME).write_text(hf_config_text(cfg, dtype))
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"cannot write a checkpoint to {str(out)!r}: {e}") from e


def hf_config_text(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> str:
    """The ``config.json`` text of ``cfg`` for weights stored in ``dtype``."""
    hf = cfg.to_hf()
    hf["torch_dtype"] = hf["dtype"] = _HF_DTYPE_NAMES[dtype]
    return json.dumps(hf, indent=2, sort_keys=True) + "\n"


def unit_tensors(flat: Tensor, layout: UnitLayout) -> list[tuple[str, Tensor]]:
    """``(checkpoint name, view)`` of every tensor of one unit, in layout order."""
    views = bind(flat, layout)
    return [(e.name, views[e.key]) for e in layout.entries]


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Sequence[tuple[str, Tensor]],
    dtype: torch.dtype | None = None,
    metadata: dict[str, str] | None = None,
) -> tuple[int, str]:
    """Write one safetensors file holding ``tensors``; return its size in bytes and sha256.

    The file is written by hand: an 8-byte little-endian header length, a JSON header of
    names, dtypes, shapes and byte ranges, then each tensor's bytes in order. Each tensor is
    streamed in pieces of at most 16M elements, cast to ``dtype`` (``None``: its own) and
    copied to the host piece by piece if it lives on a device, so no second copy of the
    tensors is made. The hash is computed from the same pieces as they are written, and the
    file is fsynced before returning. ``tensors`` must be contiguous (``bind`` views are).
    """
    header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name, t in tensors:
        dt = dtype or t.dtype
        if dt not in _ST_DTYPES:
            raise CheckpointError(
                f"cannot save {name} in {dt}; choose one of {', '.join(map(str, _ST_DTYPES))}"
            )
        size = t.numel() * torch.empty((), dtype=dt).element_size()
        header[name] = {"dtype": _ST_DTYPES[dt], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned

    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in (struct.pack("<Q", len(blob)), blob):
            f.write(chunk)
            digest.update(chunk)
        for _, t in tensors:
            _write_tensor(f, t, dtype or t.dtype, digest)
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(blob) + offset, digest.hexdigest()


def _write_tensor(f, t: Tensor, dtype: torch.dtype, digest) -> None:  # noqa: ANN001 (binary file)
    """Stream ``t``'s elements, as ``dtype`` and little-endian, to the open file ``f``."""
    flat = t.reshape(-1)  # a view: bind() entries are contiguous
    for start in range(0, flat.numel(), _WRITE_PIECE):
        piece = flat[start : start + _WRITE_PIECE]
        piece = piece.to(device="cpu", dtype=dtype).contiguous()
        data = piece.view(torch.uint8).numpy().data
        f.write(data)
        digest.update(data)
