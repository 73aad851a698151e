"""Where a run's model lands: ``--out``, written so that no moment of a crash loses anything.

The final model is written whole into a hidden temporary folder beside ``--out`` and flushed to
disk, then put in place:

- ``--out`` missing or empty: the folder is renamed onto it in one atomic step.
- ``--out`` holding anything else (a model, with ``--overwrite``; this run's ``checkpoint-N``
  folders; the run's lock file, :mod:`~flowtrain.ckpt.out_lock`, which ``flowtrain train``
  always holds there): each new file replaces its old namesake atomically, so every file at
  ``--out`` is at all times either the old one or the new one, never partly written; old model
  and tokenizer files that the new model does not have (say, shards of a differently sharded
  model) are removed last.

A run killed with ``kill -9`` leaves its temporary folder behind; the next run with the same
``--out`` removes it (:func:`remove_stale_temp`).

``--out`` may be a symbolic link. :func:`resolve_out` resolves it once, at the start, and every
write (temporary folders, renames, checkpoints, the lock) then happens in and beside the real
folder: a rename can neither replace a link by a folder nor cross file systems, and the
temporary folder must sit on the file system of its destination. A link that no folder can be
made at is refused before anything is loaded.

The model's files are replaced as a set: an old model's files that the new one does not have
(shards of another sharding, and tokenizer files: a model trained from a preset has none) are
removed, so no stale ``tokenizer.json`` is left to be read with the new weights. Other files
(the user's notes, ``checkpoint-N`` folders) are kept.

The folder is what a user fine-tuning a pretrained model expects of ``save_pretrained``: the
weights in the checkpoint's own dtype (``save_dtype="auto"``; or ``"fp32"``, ``"bf16"``,
``"fp16"``), cast piece by piece as they stream to disk; sharded with an index above
``max_shard_bytes`` (5 GB, transformers' default); the source ``config.json`` kept but for its
dtype; ``generation_config.json`` and the tokenizer's files copied::

    path = save_final_model(state, "trained", model_dir)                  # as --model was
    path = save_final_model(state, "trained", model_dir, save_dtype="fp32")
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..data.source import TOKENIZER_FILES, tokenizer_files
from ..errors import CheckpointError, ConfigError
from .hf import CONFIG_NAME, checkpoint_dtype, fsync_dir
from .saved_state import SavableModel

#: ``save_dtype`` names besides ``"auto"`` (the source checkpoint's dtype; fp32 without one).
SAVE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: Weights above this many bytes are sharded: transformers' ``max_shard_size="5GB"``.
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
GENERATION_CONFIG = "generation_config.json"

#: Files of a saved model in a Hugging Face folder (besides tokenizer files).
MODEL_FILE_GLOBS = ("config.json", "generation_config.json", "model.safetensors", "model-*-of-*.safetensors",
                    "model.safetensors.index.json")
#: What a new model replaces as a whole: its files, and the tokenizer's that travel with it.
REPLACED_GLOBS = (*MODEL_FILE_GLOBS, *TOKENIZER_FILES)


def resolve_out(out: str | os.PathLike[str] | None) -> str | None:
    """The real folder ``--out`` names (``os.path.realpath``), or None for None.

    Refuses, in one line, a link no folder can be made at: a loop, or a link to a missing
    path whose folder does not exist either (a link is followed, never extended into a tree of
    new folders; create the target's folder, or fix the link).
    """
    if out is None:
        return None
    try:
        real = os.path.realpath(out, strict=True)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ConfigError(f"{{out}} {out}: cannot follow its symbolic link ({e.strerror}); fix the link "
                              f"or give another {{out}}", named=True) from None
        real = os.path.realpath(out)  # missing, or under a file: the path checks say what is wrong
    for link in (p for p in (Path(out), *Path(out).parents) if p.is_symlink()):
        target = os.path.realpath(link)
        if not os.path.exists(target) and not os.path.isdir(os.path.dirname(target)):
            raise ConfigError(f"{{out}} {out}: {link} is a symbolic link to {target}, whose folder "
                              f"{os.path.dirname(target)} does not exist; create it, or fix the link", named=True)
    return real


def _temp_prefix(out: Path) -> str:
    return f".{out.name}.tmp-"


def remove_stale_temp(out: str | Path) -> None:
    """Remove temporary folders an earlier, killed run left beside ``out``."""
    out = Path(out)
    if out.parent.is_dir():
        for p in out.parent.glob(_temp_prefix(out) + "*"):
            shutil.rmtree(p, ignore_errors=True)


def fsync_tree(folder: Path) -> None:
    """Flush every file in ``folder`` and the folder itself to disk."""
    for p in folder.iterdir():
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(folder)


def resolve_save_dtype(save_dtype: str, source_dir: str | Path | None) -> torch.dtype:
    """The dtype to save in: ``save_dtype`` by name, or for ``"auto"`` the dtype of the
    checkpoint in ``source_dir`` (fp32 for none: a preset or random init)."""
    if save_dtype == "auto":
        return (checkpoint_dtype(source_dir) if source_dir is not None else None) or torch.float32
    if save_dtype not in SAVE_DTYPES:
        raise ConfigError(f"{{save_dtype}} must be one of auto, {', '.join(SAVE_DTYPES)} (got {save_dtype!r})", named=True)
    return SAVE_DTYPES[save_dtype]


def save_final_model(
    state: SavableModel,
    out: str | Path,
    tokenizer_dir: str | Path | None,
    *,
    source_dir: "str | Path | None | object" = "same",
    save_dtype: str = "auto",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    merge: bool = False,
    base_model: str | None = None,
) -> Path:
    """Write the model in Hugging Face format (+ the tokenizer's files) and put it at ``out``.

    ``source_dir`` is the checkpoint trained from (by default ``tokenizer_dir``, the ``--model``
    folder; ``None``: none): its ``config.json`` is kept but for the dtype, its
    ``generation_config.json`` copied and, for ``save_dtype="auto"``, its dtype used. Without one
    (presets, random init) the config is flowtrain's own and ``auto`` means fp32. A bad ``save_dtype`` or ``max_shard_bytes``
    raises :class:`ConfigError` before anything is written. With LoRA the folder holds the PEFT
    adapter (over ``base_model``) and the tokenizer's files, or with ``merge`` the merged model.
    """
    out = Path(out)
    if source_dir == "same":
        source_dir = tokenizer_dir
    source = Path(source_dir) if source_dir is not None else None  # type: ignore[arg-type]
    dtype = resolve_save_dtype(save_dtype, source)
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ConfigError(f"the shard size must be a positive number of bytes (got {max_shard_bytes!r})")
    source_config = read_source_config(source)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(out), dir=out.parent))
    try:
        state.save(tmp, dtype, max_shard_bytes=max_shard_bytes, source_config=source_config, merge=merge,
                   base_model=base_model)
        extra = tokenizer_files(tokenizer_dir)
        if source is not None and (source / GENERATION_CONFIG).is_file():
            extra.append(source / GENERATION_CONFIG)  # last: the source's wins over the tokenizer dir's
        for f in extra:
            shutil.copy2(f, tmp / f.name)
        fsync_tree(tmp)
        _place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def read_source_config(source: str | Path | None) -> dict[str, Any] | None:
    """The source checkpoint's ``config.json`` as a dict, or None where there is none: what the
    final model and every checkpoint keep, key for key, but for the dtype."""
    source = Path(source) if source is not None else None
    path = source / CONFIG_NAME if source is not None else None
    if path is None or not path.is_file():
        return None
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e
    if not isinstance(d, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(d).__name__}")
    return d


def _place(tmp: Path, out: Path) -> None:
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        os.replace(tmp, out)  # an empty folder is replaced too
        fsync_dir(out.parent)
        return
    new = {p.name for p in tmp.iterdir()}
    for name in sorted(new):
        os.replace(tmp / name, out / name)
    stale = {p for g in REPLACED_GLOBS for p in out.glob(g) if p.name not in new and p.is_file()}
    for p in stale:
        p.unlink()
    fsync_dir(out)
