"""Read and write Hugging Face checkpoints straight from and into flat unit buffers.

A model directory holds ``config.json`` and either ``model.safetensors`` or a sharded
``model.safetensors.index.json`` plus its shards. Loading copies one tensor at a time into
:func:`~flowtrain.model.flat_map.bind` views, so the model is never in memory twice;
saving streams each tensor's bytes to disk in the safetensors format, for the same reason (a unit
not in memory, given as a function that reads it, is read when its tensors are written and let go
after them)::

    cfg = read_config("Llama-3.2-1B")
    layouts = model_flat_maps(cfg)
    flats = [torch.empty(lay.numel) for lay in layouts]
    load_into("Llama-3.2-1B", cfg, layouts, flats)
    ...
    save_hf("out", cfg, layouts, flats, dtype=torch.bfloat16)   # from_pretrained("out") works

Saving writes ``model.safetensors``, or above ``max_shard_bytes`` the sharded form that
``save_pretrained`` writes, and can keep the source checkpoint's ``config.json`` as it was.

Problems with the files (missing, truncated, wrong shapes) raise
:class:`~flowtrain.errors.CheckpointError` naming the file and tensor.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from flowtrain.errors import CheckpointError, FlowtrainError
from flowtrain.model.config import ModelConfig
from flowtrain.model.model_dir import CONFIG_NAME, as_model_names, model_renames, read_config  # CONFIG_NAME, read_config: re-exported
from flowtrain.model.flat_map import FlatMap, bind, hub_form, hub_tensors
from ..model.hf_config import from_hf, to_hf

__all__ = ["checkpoint_dtype", "handed_out", "hf_config_text", "load_into", "read_config", "save_hf",
           "saved_tensors", "shard_tensors", "unit_tensors", "write_safetensors"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
SHARD_NAME = "model-{:05d}-of-{:05d}.safetensors"
SHARD_GLOB = "model-*-of-*.safetensors"

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
_DTYPE_BY_HF_NAME = {name: dt for dt, name in _HF_DTYPE_NAMES.items() if dt != torch.float64}
_DTYPE_BY_ST_NAME = {name: dt for dt, name in _ST_DTYPES.items() if dt != torch.float64}
_WRITE_PIECE = 1 << 24  # elements converted/copied per write: bounds temporaries


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
    layouts: Sequence[FlatMap],
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
    targets: dict[str, tuple[tuple[int, ...], Callable[[Tensor], Any]]] = {}
    fused = any(e.parts for lay in layouts for e in lay.entries)
    stored = _checkpoint_names(path) if fused or cfg.generic else set()
    renames = model_renames(cfg, stored)  # names transformers renames on loading (generic path)
    present = as_model_names(stored, renames) if renames else stored
    for layout, flat in zip(layouts, flats):
        views = bind(flat, layout)
        for e in layout.entries:
            for name, shape, index in hub_form(e, present):
                view = views[e.key] if index is None else views[e.key][index]
                targets[renames.get(name, name)] = (shape, view.copy_)
    if any(e.stacked for lay in layouts for e in lay.entries):
        _accept_fused_experts(path, layouts, flats, targets)

    for file, names in _weight_files(path, list(targets)).items():
        try:
            with safe_open(str(file), framework="pt") as f:
                present = set(f.keys())
                for name in names:
                    if name not in present:
                        raise CheckpointError(f"tensor {name!r} is missing from {file}")
                    want, copy = targets[name]
                    shape = tuple(f.get_slice(name).get_shape())
                    if shape != want:
                        raise CheckpointError(
                            f"tensor {name!r} in {file} has shape {shape}, but the config "
                            f"implies {want}; does config.json belong to these weights?"
                        )
                    copy(f.get_tensor(name))
                extra = sorted(n for n in present - set(targets) if not _harmless(n, cfg))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read {file}: corrupt or truncated ({e})") from e
        if extra:
            log.warning("%s: ignoring %d unexpected tensor(s): %s", file, len(extra),
                        ", ".join(extra[:5]) + (" ..." if len(extra) > 5 else ""))


def _checkpoint_names(path: Path) -> set[str]:
    """The tensor names a model directory holds (its index's, or its single file's)."""
    index_path = path / INDEX_NAME
    try:
        if index_path.is_file():
            weight_map = json.loads(index_path.read_text()).get("weight_map")
            return set(weight_map) if isinstance(weight_map, dict) else set()
        if (path / WEIGHTS_NAME).is_file():
            with safe_open(str(path / WEIGHTS_NAME), framework="pt") as f:
                return set(f.keys())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError, SafetensorError):
        pass  # reported, with the file named, when the weights are read
    return set()


def _accept_fused_experts(path: Path, layouts: Sequence[FlatMap], flats: Sequence[Tensor],
                          targets: dict[str, tuple[tuple[int, ...], Callable[[Tensor], Any]]]) -> None:
    """Where a checkpoint holds a sparse layer's experts as transformers 5 keeps them in memory
    (``model.layers.N.mlp.experts.gate_up_proj`` (E, 2 inter, hidden), gate rows first, and
    ``...experts.down_proj`` (E, hidden, inter), the router as ``mlp.gate.weight``) rather than
    the Hub's one tensor per expert, read those instead: ``targets`` is rewritten in place."""
    present = _checkpoint_names(path)
    for layout, flat in zip(layouts, flats):
        if layout.layer is None or not any(e.stacked for e in layout.entries):
            continue
        gate, up, down, router = (layout.entry(k) for k in ("experts_gate", "experts_up", "experts_down", "router"))
        prefix = f"model.layers.{layout.layer}.mlp"
        fused_up, fused_down = f"{prefix}.experts.gate_up_proj", f"{prefix}.experts.down_proj"
        if hub_tensors(gate)[0][0] in present or fused_up not in present:
            continue
        views = bind(flat, layout)
        for e in (gate, up, down):
            for name, _, _ in hub_tensors(e):
                del targets[name]
        inter = gate.shape[1]

        def copy_gate_up(t: Tensor, g: Tensor = views[gate.key], u: Tensor = views[up.key], n: int = inter) -> None:
            g.copy_(t[:, :n])
            u.copy_(t[:, n:])

        targets[fused_up] = ((gate.shape[0], 2 * inter, gate.shape[2]), copy_gate_up)
        targets[fused_down] = (down.shape, views[down.key].copy_)
        if router.name not in present and f"{prefix}.gate.weight" in present:
            targets[f"{prefix}.gate.weight"] = targets.pop(router.name)


# ---------------------------------------------------------------------- saving


def save_hf(
    out_dir: str | os.PathLike[str],
    cfg: ModelConfig,
    layouts: Sequence[FlatMap],
    flats: Sequence[Tensor | Callable[[], Tensor]],
    dtype: torch.dtype = torch.float32,
    *,
    max_shard_bytes: int | None = None,
    source_config: dict[str, Any] | None = None,
) -> None:
    """Write ``config.json`` and the weights (tensors in ``dtype``) to ``out_dir``.

    Weights of at most ``max_shard_bytes`` (``None``: no limit) go to one ``model.safetensors``;
    more are split, as ``save_pretrained(max_shard_size=...)`` does, into
    ``model-00001-of-0000N.safetensors`` files filled greedily in model order plus
    ``model.safetensors.index.json`` (:func:`shard_tensors`). Every file goes through
    :func:`write_safetensors`, which streams each tensor in pieces, so no second copy of the
    model is made whatever ``dtype`` is. Weight files of a differently saved model already in
    ``out_dir`` are removed, so the directory holds one consistent model.

    A unit's entry of ``flats`` may be a function that gives its flat buffer (a unit whose
    weights are not in memory: the masters of the disk tier): it is called when the unit's
    first tensor is written and the buffer let go after its last, so such units are in memory
    one at a time, and the files are the same as from the buffers themselves.

    ``source_config`` (the ``config.json`` dict of the checkpoint trained from) is written back
    with only the dtype changed; without it the config comes from ``cfg`` (:func:`hf_config_text`).
    """
    if dtype not in _ST_DTYPES:
        raise CheckpointError(
            f"cannot save in {dtype}; choose one of {', '.join(map(str, _ST_DTYPES))}"
        )
    if len(flats) != len(layouts):
        raise ValueError(f"save_hf: {len(layouts)} layouts but {len(flats)} flat buffers")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tensors: list[tuple[str, Tensor]] = []  # a unit given as a function: meta tensors, for the headers
    for layout, flat in zip(layouts, flats):
        tensors += saved_tensors(cfg, flat if isinstance(flat, Tensor) else torch.empty(layout.numel, device="meta"),
                                 layout)
    shards = shard_tensors(tensors, dtype, max_shard_bytes)
    data = _saved_data(cfg, layouts, flats)
    names = [WEIGHTS_NAME] if len(shards) == 1 else [
        SHARD_NAME.format(i + 1, len(shards)) for i in range(len(shards))]

    tmp = out / "weights.partial"
    try:
        for name, shard in zip(names, shards):
            write_safetensors(tmp, shard, dtype, data=islice(data, len(shard)))
            os.replace(tmp, out / name)
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(_nbytes(t, dtype) for _, t in tensors)},
                     "weight_map": {t: name for name, shard in zip(names, shards) for t, _ in shard}}
            (out / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        keep = {*names, INDEX_NAME} if len(shards) > 1 else {WEIGHTS_NAME}
        for p in [out / WEIGHTS_NAME, out / INDEX_NAME, *out.glob(SHARD_GLOB)]:
            if p.name not in keep:
                p.unlink(missing_ok=True)
        (out / CONFIG_NAME).write_text(hf_config_text(cfg, dtype, source_config))
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"cannot write a checkpoint to {str(out)!r}: {e}") from e


def saved_tensors(cfg: ModelConfig, flat: Tensor, layout: FlatMap) -> list[tuple[str, Tensor]]:
    """The tensors of one unit a saved model holds, by the Hub's names: all of them but a tied
    ``lm_head.weight``."""
    return [(name, t) for name, t in unit_tensors(flat, layout)
            if not (cfg.tie_word_embeddings and name == "lm_head.weight")]


def handed_out(items: list[_T]) -> Iterator[_T]:
    """Each of ``items`` in order, taken out of the list as it is handed out (the list ends
    empty), so that nothing here still refers to an item once its consumer lets it go: views
    of a buffer read back for the occasion free it after the last one is written."""
    items.reverse()
    while items:
        yield items.pop()


def _saved_data(cfg: ModelConfig, layouts: Sequence[FlatMap],
                flats: Sequence[Tensor | Callable[[], Tensor]]) -> Iterator[Tensor]:
    """The tensors :func:`save_hf` writes, in order, a unit's buffer taken (for a function:
    called) at its first tensor and no longer referenced here once its last is handed out."""
    for layout, flat in zip(layouts, flats):
        yield from handed_out([t for _, t in saved_tensors(cfg, flat if isinstance(flat, Tensor) else flat(), layout)])


def shard_tensors(
    tensors: Sequence[tuple[str, Tensor]], dtype: torch.dtype | None, max_shard_bytes: int | None
) -> list[list[tuple[str, Tensor]]]:
    """``tensors`` cut, in order, into shards of at most ``max_shard_bytes`` of data as ``dtype``.

    Greedy, like transformers: a tensor that would overflow the current shard starts the next
    one. A tensor is never split, so one larger than the limit gets a shard of its own. The
    limit counts tensor bytes only (as the index's ``total_size`` does), not headers.
    """
    if max_shard_bytes is not None and max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive (got {max_shard_bytes})")
    shards: list[list[tuple[str, Tensor]]] = [[]]
    size = 0
    for name, t in tensors:
        n = _nbytes(t, dtype)
        if max_shard_bytes is not None and shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += n
    return shards


def _nbytes(t: Tensor, dtype: torch.dtype | None) -> int:
    return t.numel() * torch.empty((), dtype=dtype or t.dtype).element_size()


def hf_config_text(
    cfg: ModelConfig, dtype: torch.dtype = torch.float32, source: dict[str, Any] | None = None
) -> str:
    """The ``config.json`` text of ``cfg`` for weights stored in ``dtype``.

    With ``source``, the config of the checkpoint trained from, that config is kept as it was
    (architectures, rope settings, token ids, keys flowtrain does not know) and only its dtype
    changes; should it not describe ``cfg``, flowtrain's values of the keys it knows win.
    """
    if source is None:
        hf = to_hf(cfg)
        hf["torch_dtype"] = hf["dtype"] = _HF_DTYPE_NAMES[dtype]
        return json.dumps(hf, indent=2, sort_keys=True) + "\n"
    hf = dict(source)
    try:
        same = from_hf(source) == cfg
    except FlowtrainError:
        same = False
    if not same:
        log.warning("the source config.json does not describe the model saved; "
                    "writing flowtrain's values for the keys it knows")
        hf.update(to_hf(cfg))
    keys = [k for k in ("torch_dtype", "dtype") if k in hf] or ["torch_dtype", "dtype"]
    for k in keys:
        hf[k] = _HF_DTYPE_NAMES[dtype]
    return json.dumps(hf, indent=2) + "\n"


def checkpoint_dtype(model_dir: str | os.PathLike[str]) -> torch.dtype | None:
    """The floating dtype a Hugging Face checkpoint stores its weights in, or None if unknown.

    ``config.json``'s ``torch_dtype`` (transformers 4) or ``dtype`` (5) if it names fp32, bf16
    or fp16; else the dtype holding most elements in the first weight file's header.
    """
    path = Path(model_dir)
    try:
        d = json.loads((path / CONFIG_NAME).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        d = {}
    for key in ("torch_dtype", "dtype"):
        name = d.get(key) if isinstance(d, dict) else None
        if isinstance(name, str) and name.removeprefix("torch.") in _DTYPE_BY_HF_NAME:
            return _DTYPE_BY_HF_NAME[name.removeprefix("torch.")]
    try:
        if (path / WEIGHTS_NAME).is_file():
            file = path / WEIGHTS_NAME
        else:  # sharded: the first shard stands for all
            file = path / min(json.loads((path / INDEX_NAME).read_text())["weight_map"].values())
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, UnicodeDecodeError, ValueError, KeyError, TypeError, IndexError):
        return None
    elements: dict[torch.dtype, int] = {}
    for info in header.values() if isinstance(header, dict) else ():
        dt = _DTYPE_BY_ST_NAME.get(str(info.get("dtype"))) if isinstance(info, dict) else None
        if dt is not None and isinstance(info.get("shape"), list):
            elements[dt] = elements.get(dt, 0) + math.prod(info["shape"])
    return max(elements, key=elements.__getitem__) if elements else None


def unit_tensors(flat: Tensor, layout: FlatMap) -> list[tuple[str, Tensor]]:
    """``(checkpoint name, view)`` of every tensor of one unit, in layout order, with the Hub's
    names: a stacked entry (a sparse layer's experts) as one tensor per expert."""
    views = bind(flat, layout)
    return [(name, views[e.key] if index is None else views[e.key][index])
            for e in layout.entries for name, _, index in hub_tensors(e)]


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (new files, renames) durable; a no-op where unsupported."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Sequence[tuple[str, Tensor]],
    dtype: torch.dtype | None = None,
    metadata: dict[str, str] | None = None,
    *,
    data: Iterable[Tensor] | None = None,
) -> tuple[int, str]:
    """Write one safetensors file holding ``tensors``; return its size in bytes and sha256.

    The file is written by hand: an 8-byte little-endian header length, a JSON header of
    names, dtypes, shapes and byte ranges, then each tensor's bytes in order. Each tensor is
    streamed in pieces of at most 16M elements, cast to ``dtype`` (``None``: its own) and
    copied to the host piece by piece if it lives on a device, so no second copy of the
    tensors is made. The hash is computed from the same pieces as they are written, and the
    file is fsynced before returning. ``tensors`` must be contiguous (``bind`` views are).

    With ``data``, ``tensors`` only describe the file (names, shapes, dtypes: meta tensors do)
    and ``data`` gives each one's elements in the same order, taken as it is written and not
    held after: so the caller can bring each from elsewhere just in time.
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
        source = iter(data) if data is not None else (t for _, t in tensors)
        for name, described in tensors:
            given = next(source, None)
            if given is None or given.shape != described.shape:
                raise ValueError(f"write_safetensors: no data of the shape {tuple(described.shape)} for {name}")
            _write_tensor(f, given, dtype or described.dtype, digest)
            del given  # not held while the next one is brought
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(blob) + offset, digest.hexdigest()


def _write_tensor(f, t: Tensor, dtype: torch.dtype, digest) -> None:  # f: a binary file
    """Stream ``t``'s elements, as ``dtype`` and little-endian, to the open file ``f``."""
    flat = t.reshape(-1)  # a view: bind() entries are contiguous
    for start in range(0, flat.numel(), _WRITE_PIECE):
        piece = flat[start : start + _WRITE_PIECE]
        piece = piece.to(device="cpu", dtype=dtype).contiguous()
        data = piece.view(torch.uint8).numpy().data
        f.write(data)
        digest.update(data)
