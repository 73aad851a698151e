"""Training checkpoints on disk: written unit by unit while training goes on, read back exactly.

A checkpoint is a folder ``ROOT/checkpoint-STEP`` (``STEP`` optimizer steps done), laid out
like a Hugging Face Trainer checkpoint, so ``AutoModelForCausalLM.from_pretrained`` opens it::

    checkpoint-4/
      config.json                              the model config, as save_hf writes it
      model-00001-of-00004.safetensors         unit 1 (embed): fp32 masters, HF names
      ...                                      one shard per unit: embed, layers, head
      model.safetensors.index.json             HF's sharded index (total_size, weight_map)
      optimizer-00001-of-00004.safetensors     unit 1: exp_avg, exp_avg_sq (flat), step (and a
                                               sparse layer that skips idle experts: expert_steps)
      ...
      trainer_state.json                       the caller's dict (data position, rng, ...)
      manifest.json                            size and sha256 of every other file; last

Writing is one task per unit, on any thread and in any order, while other units train on;
``finish`` then writes the small files and renames the folder into place::

    writer = CheckpointWriter(root, step=4, cfg=state.cfg, flat_maps=state.flat_maps)
    for i, unit in enumerate(state.units):      # or concurrently, one thread per unit
        writer.write_unit(i, unit)
    path = writer.finish({"step": 4, "data": ...}, extra_files=tokenizer_files(model_dir))
    ...
    trainer_state, path = read_checkpoint(root)        # newest complete one, verified
    load_training_state(path, state)                   # masters, moments, step counts

Phases of a save and what a crash at each leaves behind:

1. ``CheckpointWriter(...)`` makes ``ROOT/.checkpoint-STEP.tmp-XXXX``. Killed from here to the
   rename below: only that hidden folder, which :func:`remove_stale` deletes.
2. ``write_unit``: two safetensors files per unit, streamed piece by piece (a unit resident on
   a device comes to the host one piece at a time), hashed as written, fsynced. Each of the
   unit's master, ``exp_avg`` and ``exp_avg_sq`` is taken from the unit only as its turn to be
   written comes, and let go after it: a unit whose state is on disk reads each back then, so
   one of its fields is in memory at a time.
3. ``finish``: index, config, trainer state, extra files, then ``manifest.json``; the folder is
   fsynced. A folder without a manifest is never taken for a checkpoint.
4. Rename into ``ROOT/checkpoint-STEP``. An existing one is first moved aside to
   ``ROOT/.checkpoint-STEP.old-XXXX`` and deleted only once the new one is in place; killed in
   between, :func:`remove_stale` moves it back.

**Lineage.** Runs that resume from one another form a line of training; one ``--out`` may hold
several lines (resume from ``checkpoint-2`` while ``checkpoint-4`` of the first run is still
there, and the two go separate ways). Each run has a random id, and ``trainer_state.json``
records it with the ids of the runs it descends from, each with the last step taken from it
(:class:`Lineage`). So the folder tells which checkpoints are on a run's line, and:

- :func:`prune` with a lineage counts and deletes only checkpoints on that line (the run's own,
  and its ancestors as the limit needs), never another line's, never the one just written;
- :func:`latest_checkpoint` of a folder takes the newest checkpoint only if every other one is
  on its line; otherwise the folder holds diverged lines, and it refuses, naming their newest
  checkpoints, instead of silently continuing one of them.

A checkpoint without lineage (written before it existed) still loads; such checkpoints count
as one old run whose line is ordered by step number, which is how they were always treated.

The step count is stored once per unit, so a checkpoint written under one gradient chunking,
host layout (staged, full, stream-bf16) or residency resumes under any other.

Concurrency contract: a unit must not be updated while ``write_unit`` reads it (make the save
of unit ``u`` after step ``s`` depend on ``u``'s Adam of step ``s``, and ``u``'s Adam of step
``s + 1`` on the save). ``finish`` and ``abort`` run after every ``write_unit`` has returned.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import secrets
import shutil
import tempfile
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from safetensors import SafetensorError, safe_open

from ..errors import CheckpointError
from ..model import FlatMap, ModelConfig
from ..model.flat_map import hub_tensors
from .adapter_files import ADAPTER_CONFIG
from .hf import CONFIG_NAME, INDEX_NAME, fsync_dir, handed_out, hf_config_text, unit_tensors, write_safetensors
from .saved_state import RestorableState, SavedUnit

__all__ = [
    "FORMAT_VERSION",
    "CheckpointWriter",
    "Lineage",
    "is_leftover",
    "latest_checkpoint",
    "load_training_state",
    "prune",
    "read_checkpoint",
    "remove_stale",
]

FORMAT = "flowtrain-checkpoint"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
TRAINER_STATE_NAME = "trainer_state.json"

_FINAL = re.compile(r"checkpoint-(\d+)")
# Hidden folders of this module: a save in progress (tmp), an overwritten checkpoint waiting
# to be deleted (old), a pruned one being deleted (del).
_HIDDEN = re.compile(r"\.checkpoint-(\d+)\.(tmp|old|del)-[A-Za-z0-9_]+")
_READ_PIECE = 1 << 24  # elements (load) or bytes (hashing) per piece: bounds temporaries
_Unit = TypeVar("_Unit", bound=SavedUnit)  # the units of the state a checkpoint fills


def all_finite(t: torch.Tensor, piece: int = 1 << 24) -> bool:
    """Whether every element of ``t`` is finite, checked in pieces (the bool temporary stays
    small)."""
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(flat[lo : lo + piece]).all()) for lo in range(0, flat.numel(), piece))


def model_file(index: int, n: int) -> str:
    """Name of unit ``index``'s (0-based) weight shard among ``n`` units."""
    return f"model-{index + 1:05d}-of-{n:05d}.safetensors"


def optimizer_file(index: int, n: int) -> str:
    """Name of unit ``index``'s (0-based) optimizer shard among ``n`` units."""
    return f"optimizer-{index + 1:05d}-of-{n:05d}.safetensors"


def step_of(unit: SavedUnit) -> int:
    """The unit's Adam step count; every gradient chunk must have taken the same number."""
    counts = sorted({int(s.item()) for s in unit.steps})
    if len(counts) != 1:
        raise CheckpointError(
            f"{unit.flat_map.key}: its gradient chunks have taken different numbers of Adam steps "
            f"({', '.join(map(str, counts))}); save only between optimizer steps"
        )
    return counts[0]


# ---------------------------------------------------------------------- lineage


@dataclass(frozen=True)
class Lineage:
    """A run's line of training: its own id and, oldest first, ``(run id, last step)`` of each
    run it descends from. Stored in ``trainer_state.json`` under ``"lineage"``::

        line = Lineage.start(parent_state)   # a new run: a fresh id, the parent's line + parent
        state["lineage"] = line.to_json()
        line.owns(run_id, step)              # is that checkpoint on this line?

    A checkpoint without lineage has run id None (see the module docstring).
    """

    run: str | None
    ancestors: tuple[tuple[str | None, int], ...] = ()
    parent: str | None = None  # the checkpoint resumed from, for people reading the file

    @classmethod
    def start(cls, parent_state: dict | None = None, parent: str | os.PathLike[str] | None = None) -> "Lineage":
        """A new run's line: a fresh id, descending from the checkpoint whose trainer state is
        ``parent_state`` (none: a run from scratch or from a pretrained model)."""
        run = secrets.token_hex(8)
        if not parent_state:
            return cls(run)
        up = cls.of(parent_state)
        return cls(run, (*up.ancestors, (up.run, int(parent_state["step"]))),
                   None if parent is None else os.path.abspath(parent))

    @classmethod
    def of(cls, trainer_state: dict) -> "Lineage":
        """The line a checkpoint's trainer state records; run None for one without lineage."""
        d = trainer_state.get("lineage") if isinstance(trainer_state, dict) else None
        if not isinstance(d, dict):
            return cls(None)
        try:
            ancestors = tuple((None if r is None else str(r), int(s)) for r, s in d["ancestors"])
            return cls(str(d["run"]), ancestors, d.get("parent"))
        except (TypeError, KeyError, ValueError, AttributeError):
            return cls(None)

    def owns(self, run: str | None, step: int) -> bool:
        """Whether the checkpoint of ``step`` written by run ``run`` is on this line."""
        return run == self.run or any(run == r and step <= last for r, last in self.ancestors)

    def to_json(self) -> dict:
        return {"run": self.run, "parent": self.parent, "ancestors": [list(a) for a in self.ancestors]}


def _lineage_of(ckpt: Path) -> Lineage:
    """The line ``ckpt`` was written on (run None: unreadable, or written without lineage; a
    checkpoint that is chosen is verified later, so this may be lenient)."""
    try:
        return Lineage.of(json.loads((ckpt / TRAINER_STATE_NAME).read_text()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return Lineage(None)


def _run_of(ckpt: Path) -> str | None:
    return _lineage_of(ckpt).run


def _named(ckpt: Path) -> str:
    parent = _lineage_of(ckpt).parent
    return ckpt.name + (f" (resumed from {Path(parent).name})" if parent else "")


# ---------------------------------------------------------------------- writing


class CheckpointWriter:
    """Builds ``root/checkpoint-{step}`` in a hidden temporary folder; see the module docstring.

    ``write_unit`` may be called from several threads at once, for different units, in any
    order. Use as a context manager to abort on an exception::

        with CheckpointWriter(root, step, cfg, flat_maps) as writer:
            ...
            writer.finish(trainer_state)
    """

    def __init__(self, root: str | os.PathLike[str], step: int, cfg: ModelConfig,
                 flat_maps: Sequence[FlatMap], source_config: dict | None = None,
                 adapter_config: str | None = None) -> None:
        """``source_config``: the ``config.json`` of the model the run started from, which the
        checkpoint's ``config.json`` keeps key for key but for the dtype (fp32); without one,
        flowtrain writes its own (:func:`~flowtrain.ckpt.hf.hf_config_text`). With LoRA the
        flat maps are the adapters' and ``adapter_config`` the text of their PEFT
        ``adapter_config.json``, which the checkpoint keeps beside the base's ``config.json``."""
        if step < 0:
            raise ValueError(f"CheckpointWriter: step must not be negative (got {step})")
        self.root = Path(root)
        self.step = step
        self.cfg = cfg
        self.flat_maps = list(flat_maps)
        self.source_config = source_config
        self.adapter_config = adapter_config
        self.final = self.root / f"checkpoint-{step}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self.tmp = Path(tempfile.mkdtemp(prefix=f".checkpoint-{step}.tmp-", dir=self.root))
        except OSError as e:
            raise CheckpointError(f"cannot create a checkpoint folder in {str(self.root)!r}: {e}") from e
        self._lock = threading.Lock()
        self._busy: set[int] = set()
        self._files: dict[str, tuple[int, str]] = {}  # name -> (bytes, sha256)
        self._units: dict[int, int] = {}  # unit index -> bytes of its weights (for the index)
        self._closed = False

    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def __repr__(self) -> str:
        return f"<CheckpointWriter {self.final.name} {len(self._units)}/{len(self.flat_maps)} units>"

    def write_unit(self, index: int, unit: SavedUnit) -> None:
        """Write unit ``index``'s weight and optimizer shards. Thread-safe across units."""
        n = len(self.flat_maps)
        layout = self.flat_maps[index] if 0 <= index < n else None
        if layout is None or unit.flat_map != layout:
            raise ValueError(f"write_unit: unit {index} ({unit.flat_map.key}) is not unit {index} of this model")
        with self._lock:
            if self._closed:
                raise ValueError(f"write_unit: {self.final.name} was already finished or aborted")
            if index in self._busy or index in self._units:
                raise ValueError(f"write_unit: unit {layout.key} is already being written")
            self._busy.add(index)
        try:
            step = step_of(unit)
            described = torch.empty(layout.numel, device="meta")  # the files' headers; the data comes just in time
            weights = unit_tensors(described, layout)
            counts = [("step", torch.tensor(float(step)))]
            if unit.expert_steps is not None:  # a layer that skips idle experts: each expert's count
                counts.append(("expert_steps", unit.expert_steps.cpu().clone()))
            moments = [("exp_avg", described), ("exp_avg_sq", described), *counts]
            written = {}
            for name, tensors, data in ((model_file(index, n), weights, _weight_data(unit, layout)),
                                        (optimizer_file(index, n), moments, _moment_data(unit, layout, counts))):
                try:
                    written[name] = write_safetensors(self.tmp / name, tensors, torch.float32,
                                                      metadata={"unit": layout.key}, data=data)
                except OSError as e:
                    raise CheckpointError(f"cannot write {self.tmp / name}: {e}") from e
            with self._lock:
                self._files.update(written)
                self._units[index] = sum(t.numel() for _, t in weights) * 4
        finally:
            with self._lock:
                self._busy.discard(index)

    def finish(self, trainer_state: dict, extra_files: Iterable[str | os.PathLike[str]] = ()) -> Path:
        """Write the small files and the manifest, then rename into ``root/checkpoint-{step}``.

        ``extra_files`` (tokenizer files, ...) are copied in by their base names. Returns the
        final path. On failure the temporary folder is removed and an existing checkpoint of
        the same step is left as it was.
        """
        with self._lock:
            if self._closed:
                raise ValueError(f"finish: {self.final.name} was already finished or aborted")
            missing = [lay.key for i, lay in enumerate(self.flat_maps) if i not in self._units]
            if missing or self._busy:
                raise CheckpointError(
                    f"{self.final.name} is incomplete: unit(s) {', '.join(missing)} not written; "
                    f"call write_unit for every unit and wait for them before finish"
                )
            self._closed = True
        try:
            self._write_small_files(trainer_state, extra_files)
            manifest = {"format": FORMAT, "version": FORMAT_VERSION, "step": self.step,
                        "files": {name: {"size": size, "sha256": sha}
                                  for name, (size, sha) in sorted(self._files.items())}}
            _write_file(self.tmp / MANIFEST_NAME, json.dumps(manifest, indent=2).encode() + b"\n")
            fsync_dir(self.tmp)
            self._rename_into_place()
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        return self.final

    def abort(self) -> None:
        """Remove the temporary folder; nothing else is touched. Safe to call twice."""
        with self._lock:
            self._closed = True
        shutil.rmtree(self.tmp, ignore_errors=True)

    # ------------------------------------------------------------------ finish's phases

    def _write_small_files(self, trainer_state: dict, extra_files: Iterable[str | os.PathLike[str]]) -> None:
        n = len(self.flat_maps)
        weight_map = {name: model_file(i, n) for i, lay in enumerate(self.flat_maps) for e in lay.entries
                      for name, _, _ in hub_tensors(e)}
        index = {"metadata": {"total_size": sum(self._units.values())}, "weight_map": weight_map}
        small = {
            INDEX_NAME: json.dumps(index, indent=2, sort_keys=True) + "\n",
            CONFIG_NAME: hf_config_text(self.cfg, torch.float32, self.source_config),
            TRAINER_STATE_NAME: json.dumps(trainer_state, indent=2) + "\n",
        }
        if self.adapter_config is not None:
            small[ADAPTER_CONFIG] = self.adapter_config
        try:
            for name, text in small.items():
                self._files[name] = _write_file(self.tmp / name, text.encode())
            for src in map(Path, extra_files):
                if src.name in self._files or src.name == MANIFEST_NAME:
                    raise CheckpointError(f"extra file {str(src)!r} would replace the checkpoint's own {src.name}")
                if not src.is_file():
                    raise CheckpointError(f"extra file {str(src)!r} does not exist or is not a file")
                self._files[src.name] = _copy_file(src, self.tmp / src.name)
        except OSError as e:
            raise CheckpointError(f"cannot write {self.final.name} in {str(self.root)!r}: {e}") from e

    def _rename_into_place(self) -> None:
        aside = None
        try:
            if self.final.exists():
                aside = self.root / f".checkpoint-{self.step}.old-{secrets.token_hex(4)}"
                os.replace(self.final, aside)
            try:
                os.replace(self.tmp, self.final)
            except BaseException:
                if aside is not None:
                    os.replace(aside, self.final)  # put the old one back
                    aside = None
                raise
            fsync_dir(self.root)
        except OSError as e:
            raise CheckpointError(f"cannot move {self.final.name} into place in {str(self.root)!r}: {e}") from e
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)


def _weight_data(unit: SavedUnit, layout: FlatMap) -> Iterator[torch.Tensor]:
    """The weight file's tensors in order: the unit's master taken at the first (for a unit whose
    state is on disk, read back then) and no longer referenced here once its last is handed out."""
    yield from handed_out([t for _, t in unit_tensors(unit.master, layout)])


def _moment_data(unit: SavedUnit, layout: FlatMap, counts: list[tuple[str, torch.Tensor]]) -> Iterator[torch.Tensor]:
    """The optimizer file's tensors in order, each moment taken (read back, for a unit on disk)
    only as it is written, so one of them is in memory at a time; then the step counts."""
    yield unit.exp_avg[: layout.numel]
    yield unit.exp_avg_sq[: layout.numel]
    for _, t in counts:
        yield t


def _write_file(path: Path, data: bytes) -> tuple[int, str]:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return len(data), hashlib.sha256(data).hexdigest()


def _copy_file(src: Path, dst: Path) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while block := fin.read(_READ_PIECE):
            fout.write(block)
            digest.update(block)
            size += len(block)
        fout.flush()
        os.fsync(fout.fileno())
    return size, digest.hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_READ_PIECE):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------- the root folder


def checkpoint_steps(root: str | os.PathLike[str]) -> list[int]:
    """The steps of the complete checkpoints in folder ``root`` (none if it is no folder)."""
    return [step for step, _ in _complete(Path(root))] if Path(root).is_dir() else []


def _complete(root: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of the complete checkpoints in ``root``, oldest first."""
    found = []
    for p in root.iterdir():
        m = _FINAL.fullmatch(p.name)
        if m and p.is_dir() and (p / MANIFEST_NAME).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def is_leftover(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder that :func:`remove_stale` deletes: a save or a prune that a
    killed run left unfinished (``.checkpoint-N.tmp-*``, ``.checkpoint-N.del-*``). An overwritten
    checkpoint moved aside (``.old-*``) is no leftover: it is moved back."""
    m = _HIDDEN.fullmatch(Path(path).name)
    return m is not None and m.group(2) != "old" and Path(path).is_dir()


def remove_stale(root: str | os.PathLike[str]) -> list[Path]:
    """Clean up after a killed run: delete this module's hidden temporary folders in ``root``.

    An overwritten checkpoint that was moved aside (``.checkpoint-N.old-*``) while its
    replacement never arrived is moved back to ``checkpoint-N`` instead. Call this before
    starting writers in ``root``, never while one is running. Returns the paths deleted.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    removed = []
    for p in sorted(root.iterdir()):
        m = _HIDDEN.fullmatch(p.name)
        if not m or not p.is_dir():
            continue
        final = root / f"checkpoint-{m.group(1)}"
        if m.group(2) == "old" and not final.exists() and (p / MANIFEST_NAME).is_file():
            os.replace(p, final)
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    fsync_dir(root)
    return removed


def prune(root: str | os.PathLike[str], keep: int, lineage: Lineage | None = None,
          protect: str | os.PathLike[str] | None = None) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints in ``root`` (newest by step
    number: checkpoint-10 is newer than checkpoint-9). Returns the paths deleted.

    With ``lineage``, only checkpoints on that line are counted and deleted: another run's line
    in the same folder is left whole. ``protect`` (the checkpoint just written) is never
    deleted."""
    if keep < 0:
        raise ValueError(f"prune: keep must not be negative (got {keep})")
    root = Path(root)
    if not root.is_dir():
        return []
    found = _complete(root)
    if lineage is not None:
        found = [(step, p) for step, p in found if lineage.owns(_run_of(p), step)]
    kept = None if protect is None else Path(protect).resolve()
    doomed = [p for _, p in found[: max(0, len(found) - keep)] if p.resolve() != kept]
    for p in doomed:
        # Renamed first, so a run killed mid-delete leaves a hidden folder, not half a checkpoint.
        gone = root / f".{p.name}.del-{secrets.token_hex(4)}"
        os.replace(p, gone)
        shutil.rmtree(gone, ignore_errors=True)
    return doomed


def latest_checkpoint(path: str | os.PathLike[str]) -> Path:
    """``path`` itself if it is a complete checkpoint, else the newest complete
    ``checkpoint-N`` inside it. Folders without a manifest (unfinished saves) are skipped.

    The newest is taken only when every other checkpoint there is on its line (:class:`Lineage`):
    a folder holding lines that diverged is refused, naming each line's newest checkpoint, so
    the caller passes the one to continue."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(
            f"checkpoint {str(p)!r} does not exist or is not a folder; pass a checkpoint-N folder "
            f"or the folder that holds them"
        )
    if (p / MANIFEST_NAME).is_file():
        return p
    if _FINAL.fullmatch(p.name):
        raise CheckpointError(
            f"{str(p)!r} is incomplete (no {MANIFEST_NAME}: its save never finished); pass an "
            f"earlier checkpoint-N or the folder that holds them"
        )
    found = _complete(p)
    if not found:
        raise CheckpointError(
            f"{str(p)!r} holds no complete checkpoint (a checkpoint-N folder with a {MANIFEST_NAME}); "
            f"pass a checkpoint-N folder or the folder that holds them"
        )
    newest = found[-1][1]
    line = _lineage_of(newest)
    others = [q for step, q in found[:-1] if not line.owns(_run_of(q), step)]
    if others:
        other = others[-1]  # the newest checkpoint not on the newest's line: its line's head
        raise CheckpointError(
            f"{str(p)!r} holds runs that went separate ways: {_named(newest)} and {_named(other)} are not on "
            f"one line of training; pass the checkpoint to continue, {str(newest)!r} or {str(other)!r}"
        )
    return newest


# ---------------------------------------------------------------------- reading


def read_checkpoint(path: str | os.PathLike[str], verify: bool = True) -> tuple[dict, Path]:
    """Check a checkpoint against its manifest and return ``(trainer_state, its path)``.

    ``path`` is as for :func:`latest_checkpoint`. Every file must be present with its size;
    with ``verify`` its sha256 is checked too (reads every byte). A mismatch names the file.
    """
    ckpt = latest_checkpoint(path)
    manifest_path = ckpt / MANIFEST_NAME
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        assert isinstance(files, dict)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AssertionError, RecursionError) as e:
        raise CheckpointError(f"{manifest_path} is not a valid checkpoint manifest ({_short(e)})") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{manifest_path}: format {manifest.get('format')!r} version {manifest.get('version')!r}; "
            f"this flowtrain reads {FORMAT!r} version {FORMAT_VERSION}"
        )
    for name, want in files.items():
        file = ckpt / name
        if Path(name).name != name or not isinstance(want, dict) or not {"size", "sha256"} <= set(want):
            raise CheckpointError(f"{manifest_path}: bad entry {_short(name)}: {_short(want)}")
        if not file.is_file():
            raise CheckpointError(f"{ckpt.name}/{name} is missing; the checkpoint is incomplete")
        size = file.stat().st_size
        if size != want["size"]:
            raise CheckpointError(
                f"{ckpt.name}/{name} has {size} bytes, the manifest says {want['size']}: truncated or replaced"
            )
        if verify and _sha256(file) != want["sha256"]:
            raise CheckpointError(f"{ckpt.name}/{name} does not match its sha256 in the manifest: corrupt")
    try:
        state = json.loads((ckpt / TRAINER_STATE_NAME).read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"cannot read {ckpt.name}/{TRAINER_STATE_NAME} ({_short(e)})") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int) or not isinstance(state.get("settings", {}), dict):
        raise CheckpointError(f"{ckpt.name}/{TRAINER_STATE_NAME} is not a trainer state (it needs an integer "
                              "\"step\" and a \"settings\" object)")
    return state, ckpt


def _short(value: object, most: int = 120) -> str:
    """``repr(value)`` cut to ``most`` characters: a garbage file makes one short line."""
    text = repr(value)
    return text if len(text) <= most else text[: most - 3] + "..."



def load_training_state(path: str | os.PathLike[str], state: RestorableState[_Unit]) -> Path:
    """Fill every trained unit of ``state`` from a checkpoint: masters (through
    :func:`load_into`), Adam moments and step counts, in place (resident units on their device);
    then refresh the compute / streaming copies. Returns the checkpoint's path. With LoRA the
    trained units are the adapters: a LoRA checkpoint holds them, and the base comes from the
    model the run started from (loaded into ``state`` before this).

    Refuses, naming the file and tensor, a checkpoint whose units or shapes differ from the
    model's or that holds NaN or inf. Call :func:`read_checkpoint` first to check the files.
    """
    ckpt = latest_checkpoint(path)
    units = state.trained
    n = len(units)
    found = sorted(ckpt.glob("optimizer-*-of-*.safetensors"))
    expected = [optimizer_file(i, n) for i in range(n)]
    if [f.name for f in found] != expected:
        raise CheckpointError(
            f"{ckpt.name} holds {len(found)} optimizer shard(s) ({found[0].name if found else 'none'}, ...), "
            f"but the model has {n} units ({expected[0]}, ...); it was saved for another model"
        )
    for i, unit in enumerate(units):  # check every header before touching the state
        _check_header(ckpt / expected[i], unit.flat_map)
    state.load_checkpoint(ckpt, units)  # masters, refused if not finite
    for i, unit in enumerate(units):
        _load_moments(ckpt / expected[i], state, unit)
    state.refresh_copies()
    return ckpt


def _check_header(file: Path, layout: FlatMap) -> None:
    where = f"{file.parent.name}/{file.name}"
    try:
        with safe_open(str(file), framework="pt") as f:
            unit = (f.metadata() or {}).get("unit")
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read {where}: corrupt or truncated ({e})") from e
    if unit != layout.key:
        raise CheckpointError(f"{where} holds unit {unit}, the model's unit there is {layout.key}")
    for name, want in (("exp_avg", (layout.numel,)), ("exp_avg_sq", (layout.numel,))):
        if shapes.get(name) != want:
            raise CheckpointError(
                f"{where}: {name} of {layout.key} has shape {shapes.get(name)}, the model needs {want}; "
                f"it was saved for another model"
            )
    if "step" not in shapes or math.prod(shapes["step"]) != 1:
        raise CheckpointError(f"{where}: no step count for {layout.key} (a 1-element 'step' tensor)")


def _load_moments(file: Path, state: RestorableState[_Unit], unit: _Unit) -> None:
    """Copy exp_avg and exp_avg_sq piece by piece (bounded host memory), one after the other
    (a unit whose state is on disk has one of them in memory at a time), and set every chunk's
    step count."""
    where, key, numel = f"{file.parent.name}/{file.name}", unit.flat_map.key, unit.flat_map.numel
    try:
        with safe_open(str(file), framework="pt") as f:
            for name in ("exp_avg", "exp_avg_sq"):
                src = f.get_slice(name)
                with state.filling(unit, name) as dst:  # on disk: written back after
                    for lo in range(0, numel, _READ_PIECE):
                        hi = min(numel, lo + _READ_PIECE)
                        piece = src[lo:hi]
                        if not all_finite(piece):
                            raise CheckpointError(f"{where}: {name} of {key} holds NaN or inf")
                        dst[lo:hi].copy_(piece)
            step = float(f.get_tensor("step").reshape(-1)[0])
            experts = f.get_tensor("expert_steps").float() if "expert_steps" in f.keys() else None
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read {where}: corrupt or truncated ({e})") from e
    if not math.isfinite(step) or step < 0 or step != round(step):
        raise CheckpointError(f"{where}: step of {key} is {step}, not a step count")
    for s in unit.steps:
        s.fill_(step)
    _load_expert_steps(where, unit, step, experts)


def _load_expert_steps(where: str, unit: SavedUnit, step: float, saved: torch.Tensor | None) -> None:
    """A sparse layer's per-expert step counts (``saved``, read from ``where``), where the run
    that saved it skipped idle experts; a run that does not skip them can resume only where
    every expert kept up."""
    key = unit.flat_map.key
    if saved is not None and (saved.dim() != 1 or not all_finite(saved) or bool((saved < 0).any())
                              or bool((saved != saved.round()).any()) or bool((saved > step).any())):
        raise CheckpointError(f"{where}: expert_steps of {key} are not step counts of its experts")
    if unit.expert_steps is None:
        if saved is not None and bool((saved != step).any()):
            raise CheckpointError(f"{where}: some experts of {key} took fewer steps than the layer (the run skipped "
                                  f"idle experts); resume it with --skip-idle-experts")
        return
    if saved is None:
        unit.expert_steps.fill_(step)
    elif saved.numel() != unit.expert_steps.numel():
        raise CheckpointError(f"{where}: expert_steps of {key} count {saved.numel()} experts, the model has "
                              f"{unit.expert_steps.numel()}")
    else:
        unit.expert_steps.copy_(saved)
