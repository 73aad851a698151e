"""Where a run's model lands: ``--out``, written so that no moment of a crash loses anything.

The final model is written whole into a hidden temporary folder beside ``--out`` and flushed to
disk, then put in place:

- ``--out`` missing or empty: the folder is renamed onto it in one atomic step.
- ``--out`` holding a model (``--overwrite``) or this run's ``checkpoint-N`` folders: each new
  file replaces its old namesake atomically, so every file at ``--out`` is at all times
  either the old one or the new one, never partly written; old model files that the new model
  does not have (say, shards of a differently sharded model) are removed last.

A run killed with ``kill -9`` leaves its temporary folder behind; the next run with the same
``--out`` removes it (:func:`remove_stale_temp`)::

    path = save_final_model(state, "trained", tokenizer_dir=model_dir)
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .data import tokenizer_files
from .host_state import HostState

#: Files of a saved model in a Hugging Face folder (besides tokenizer files).
MODEL_FILE_GLOBS = ("config.json", "generation_config.json", "model.safetensors", "model-*-of-*.safetensors",
                    "model.safetensors.index.json")


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


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_final_model(state: HostState, out: str | Path, tokenizer_dir: Path | None) -> Path:
    """Write the model in Hugging Face format (+ the tokenizer's files) and put it at ``out``."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(out), dir=out.parent))
    try:
        state.save(tmp)
        for f in tokenizer_files(tokenizer_dir):
            shutil.copy2(f, tmp / f.name)
        fsync_tree(tmp)
        _place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _place(tmp: Path, out: Path) -> None:
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        os.replace(tmp, out)  # an empty folder is replaced too
        fsync_dir(out.parent)
        return
    new = {p.name for p in tmp.iterdir()}
    for name in sorted(new):
        os.replace(tmp / name, out / name)
    stale = {p for g in MODEL_FILE_GLOBS for p in out.glob(g) if p.name not in new}
    for p in stale:
        p.unlink()
    fsync_dir(out)
