"""Checks on a training run's settings: its numbers, its compile backend, the paths it will
write, and how its fields go together and with the model.

Part of :mod:`flowtrain.train.config` (declaration in ``run_config.py``, defaults in
``defaults.py``, these checks, flags in ``flowtrain/cli/flags.py``). A run should not fail
after an hour of training because ``--trace`` names a folder, nor end in a traceback because
of ``--lr nan``. These checks run before any weight is read or a byte is allocated
(:func:`flowtrain.train.trainer.prepare`, and ``flowtrain plan``'s ``checked_request``), and
refuse with one :class:`~flowtrain.errors.ConfigError` line that names the field (the command
line spells it as its flag) and says what it accepts::

    check_fields(cfg)                   # --lr must be a finite number >= 0 (got nan)
    check_compile_backend(cfg.compile)  # --compile 'nosuch' is not a torch.compile backend; ...
    check_inputs_kept(cfg, resume)      # --metrics d.jsonl is --data d.jsonl, which this run reads; ...
    check_output_paths(cfg.out, cfg.overwrite, cfg.trace, cfg.metrics)
    check_with_model(cfg, mcfg)         # --skip-idle-experts is for a mixture of experts: ...

:func:`check_fields` asks each field's declaration first (:func:`~.settings.check_values`:
types, bounds, choices), then what a declaration cannot say; :func:`check_with_model` comes
once the model's config.json is read.

What the paths must allow, and why:

- ``--out`` is a folder: the model is written into a temporary folder beside it and renamed into
  place, and checkpoints go to ``OUT/checkpoint-STEP``. So it must not be a file; if it exists,
  it and its parent must be writable, and it must be empty unless ``overwrite`` or the run
  resumes from a checkpoint inside it (a killed run's unfinished saves, ``.checkpoint-N.tmp-*``,
  do not count: the run removes them); if it does not exist, its nearest existing ancestor
  must be a writable folder (the folders are created when the model is saved, not here).
- ``--trace`` and ``--metrics`` are files opened as they are: not folders, not the same file,
  and their folder must already exist and be writable (nothing creates it).

"Writable" is asked twice: ``os.access`` (which says yes to root for any folder), then by
creating and removing a uniquely named probe file, which catches read-only file systems. The
module imports torch only to list compile backends, and only for a non-trivial name.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import ConfigError
from . import defaults
from .run_config import lora_spec
from .settings import check_values

if TYPE_CHECKING:
    from ...model.config import ModelConfig
    from .run_config import TrainConfig

__all__ = ["check_compile_backend", "check_fields", "check_inputs_kept", "check_output_file", "check_output_paths",
           "check_with_model"]

#: integer fields with an upper bound too: (name -> a function giving the bound, and why)
_INT_MAXIMA = {
    # Each worker is a thread running AdamW on a unit; more threads than cores only contend,
    # and 100,000 of them would take the process's address space in stacks.
    "adam_workers": (lambda: max(256, 4 * (os.cpu_count() or 1)), "the larger of 256 and 4 per CPU"),
}
_SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.manual_seed accepts
_TRIVIAL_BACKENDS = ("auto", "none", "eager")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_fields(cfg: TrainConfig) -> None:
    """Refuse any field of a :class:`TrainConfig` that its declaration does not accept (a
    number NaN, infinite, of the wrong type or out of range; a choice not among its values:
    :func:`flowtrain.train.config.settings.check_values`), then what a declaration cannot say: upper
    bounds, the seed's range, the betas, and a micro-batch that does not divide the batch.
    Each error names the field; the command line spells it as its flag."""
    check_values(cfg)
    for name, (bound, why) in _INT_MAXIMA.items():
        if getattr(cfg, name) > bound():
            raise ConfigError(f"{{{name}}} must be at most {bound()} ({why}) (got {getattr(cfg, name)})", named=True)
    _check_betas(cfg.betas)
    if not (_is_int(cfg.seed) and _SEED_RANGE[0] <= cfg.seed <= _SEED_RANGE[1]):
        raise ConfigError(f"{{seed}} must be an integer from -2**63 to 2**64-1 (got {cfg.seed!r})", named=True)
    if cfg.batch_size % cfg.micro_batch_size:
        raise ConfigError(f"{{micro_batch_size}} {cfg.micro_batch_size} does not divide {{batch_size}} "
                          f"{cfg.batch_size}", named=True)


def _check_betas(betas: Any) -> None:
    ok = (isinstance(betas, (tuple, list)) and len(betas) == 2
          and all(_is_number(b) and math.isfinite(b) and 0.0 <= b < 1.0 for b in betas))
    if not ok:
        shown = ",".join(map(str, betas)) if isinstance(betas, (tuple, list)) else repr(betas)
        raise ConfigError(f"{{betas}} must be two numbers in [0, 1) like 0.9,0.999 (got {shown})", named=True)


def _check_lora(cfg: TrainConfig, mcfg: ModelConfig) -> None:
    """How the LoRA flags go together, and with the model (:meth:`LoraSpec.check_model`)."""
    given = [f for f, off in (("lora_alpha", None), ("lora_targets", None), ("lora_dropout", None),
                              ("lora_gate_up_rank", None), ("lora_rslora", None), ("merge", False),
                              ("lora_state", "auto"))
             if getattr(cfg, f) != off]
    if not cfg.lora:
        if given:
            raise ConfigError(f"{{{given[0]}}} is for LoRA: give {{lora_rank}} R (or {{adapter}} DIR) with it",
                              named=True)
        return
    if cfg.adapter is not None and cfg.resume is not None:  # (a resumed run's settings are filled in by now)
        raise ConfigError("{resume} continues the checkpoint's own adapters: leave out {adapter}", named=True)
    if cfg.adapter is not None and (cfg.lora_rank is not None or [g for g in given if g not in ("merge", "lora_state")]):
        raise ConfigError("{adapter} brings its own rank, alpha, scaling, targets and dropout: leave out "
                          "{lora_rank}, {lora_alpha}, {lora_rslora}, {lora_targets}, {lora_gate_up_rank} and "
                          "{lora_dropout}", named=True)
    spec = lora_spec(cfg)
    if spec is not None:
        try:
            spec.check_model(mcfg)
            spec.check_rank(mcfg)  # a rank no adapted map can use (an --adapter file's is PEFT's own)
        except ValueError as e:
            flags = (str(e).replace("LoRA targets", "{lora_targets}").replace("LoRA target", "{lora_targets}")
                     .replace("LoRA dropout", "{lora_dropout}").replace("LoRA gate-and-up rank", "{lora_gate_up_rank}")
                     .replace("LoRA rank", "{lora_rank}"))
            raise ConfigError(flags, named=True) from None
    if cfg.merge and not cfg.out:
        raise ConfigError("{merge} writes the merged model to {out}: give {out} DIR", named=True)


def check_with_model(cfg: TrainConfig, mcfg: ModelConfig) -> None:
    """What the fields' own declarations cannot say (those are checked first, by
    :func:`check_fields`): how fields go together, and with the model ``mcfg`` (a sequence
    within its positions, LoRA targets it has, skipped experts it has)."""
    if defaults.seq_len_given(cfg.seq_len):  # else the data decides, within the model's positions
        mcfg.check_seq_len(cfg.seq_len)
    _check_lora(cfg, mcfg)
    if cfg.skip_idle_experts and not mcfg.sparse_layers():
        raise ConfigError("{skip_idle_experts} is for a mixture of experts: the model has no layer with experts",
                          named=True)
    if cfg.skip_idle_experts and cfg.lora:
        raise ConfigError("{skip_idle_experts} is for training the whole model: LoRA leaves every expert frozen",
                          named=True)
    if cfg.progress not in (None, True, False, "lines"):
        raise ConfigError(f"{{progress}} must be None, True, False or 'lines' (got {cfg.progress!r})", named=True)
    if (cfg.eval_data is None) != (cfg.eval_every is None):
        given, missing = ("{eval_data}", "{eval_every} N") if cfg.eval_data is not None else ("{eval_every}", "{eval_data} FILE")
        raise ConfigError(f"{given} needs {missing}: give both (held-out loss every N steps) or neither", named=True)
    if cfg.save_every is not None and not cfg.out:
        raise ConfigError("{save_every} writes OUT/checkpoint-STEP folders: give {out} OUT", named=True)
    if cfg.resume is None and cfg.out and Path(cfg.out).is_dir():
        # A new run beside an earlier run's checkpoints: its own would mix with them, and with
        # --overwrite alone they would stay beside a model they are not of, for a later --resume
        # to continue over it.
        old = sorted(p.name for p in Path(cfg.out).glob("checkpoint-*"))
        if old:
            raise ConfigError(
                f"{{out}} {cfg.out} holds checkpoints of an earlier run ({', '.join(old[-3:])}); continue it with "
                f"{{resume}} {cfg.out}, remove them, or write this run to another {{out}}", named=True
            )


def check_compile_backend(name: str | None) -> None:
    """Refuse a ``--compile`` name that torch.compile does not know, listing those it does.
    ``auto``, ``none`` and ``eager`` (and None) pass without importing torch._dynamo."""
    if name is None or name in _TRIVIAL_BACKENDS:
        return
    import torch._dynamo

    if isinstance(name, str) and name in torch._dynamo.list_backends(exclude_tags=()):
        return
    # The default listing leaves out debug backends (aot_eager, ...), which are accepted too.
    shown = ", ".join([*_TRIVIAL_BACKENDS, *torch._dynamo.list_backends()])
    raise ConfigError(
        f"{{compile}} {name!r} is not a torch.compile backend; choose {shown} "
        "(debug backends such as aot_eager work too)", named=True)


def check_output_paths(out: str | os.PathLike[str] | None, overwrite: bool,
                       trace: str | os.PathLike[str] | None, metrics: str | os.PathLike[str] | None,
                       resume: str | os.PathLike[str] | None = None) -> None:
    """Refuse, before anything is loaded, any path the run could not write at its end (see the
    module docstring for the rules). Creates nothing but short-lived probe files."""
    files = [(flag, Path(p)) for flag, p in (("--trace", trace), ("--metrics", metrics)) if p]
    named = [*([("--out", Path(out))] if out else []), *files]
    for i, (flag_a, a) in enumerate(named):
        for flag_b, b in named[i + 1:]:
            if _real(a) == _real(b):
                raise ConfigError(f"{flag_a} and {flag_b} both name {a}; give each its own path")
    if out:
        _check_out(Path(out), overwrite, None if resume is None else Path(resume))
    for flag, path in files:
        check_output_file(flag, path)


def _real(p: Path) -> Path:
    return Path(os.path.realpath(p))


def _inside(p: Path, folder: Path) -> bool:
    """Whether ``p`` is ``folder`` or below it, symlinks resolved."""
    p, folder = _real(p), _real(folder)
    return p == folder or folder in p.parents


def check_inputs_kept(cfg: TrainConfig, resume: str | os.PathLike[str] | None = None) -> None:
    """Refuse, in one line and before anything is written, an output path that would write over
    or into something the run reads. The outputs are ``--out`` (a folder), ``--metrics`` and
    ``--trace``; the inputs are ``--data``, ``--eval-data``, ``--model`` (a folder), ``--adapter``,
    ``--tokenizer`` and ``resume``, the checkpoint folder being resumed (resolved: with
    ``--resume RUN``, RUN's newest ``checkpoint-N``). An output that is an input, lies inside one
    or holds one is refused, symbolic links and relative paths resolved; only inputs that exist
    count (a missing one is refused where it is read).

    One case is no overlap: ``--out RUN`` holding the resumed ``RUN/checkpoint-N`` itself. The
    run writes the final model's files at the top of RUN and checkpoints of later steps beside
    the old ones (one it would replace is refused by ``prepare``), never into ``checkpoint-N``:
    that is how a run goes on in its own folder (``--resume RUN --out RUN``)."""
    inputs = [(flag, _real(Path(p))) for flag, p in (
        ("--data", cfg.data), ("--eval-data", cfg.eval_data), ("--model", cfg.model), ("--adapter", cfg.adapter),
        ("--tokenizer", cfg.tokenizer), ("--resume", resume)) if p is not None and os.path.exists(p)]
    outputs = [(flag, p, _real(Path(p))) for flag, p in (("--out", cfg.out), ("--metrics", cfg.metrics),
                                                         ("--trace", cfg.trace)) if p]
    for out_flag, given, o in outputs:
        for in_flag, i in inputs:
            if in_flag == "--resume" and out_flag == "--out" and o == i.parent:
                continue  # --resume RUN --out RUN: later checkpoints go beside it, none into it
            what = f"{i}, the checkpoint this run resumes from" if in_flag == "--resume" else \
                f"{in_flag} {i}, which this run reads"
            if o == i:
                where, fix = "is", "another path"
            elif i in o.parents:
                where, fix = "lies inside", "a path outside it"
            elif o in i.parents:
                where, fix = "holds", "a folder that does not hold it"
            else:
                continue
            raise ConfigError(f"{out_flag} {given} {where} {what}; writing there would change it: give {out_flag} {fix}")


def _check_out(out: Path, overwrite: bool, resume: Path | None) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{{out}} {out} is a file; give a folder to write the model into (created if missing)", named=True)
    if not out.exists():
        _check_creatable("--out", out)
        return
    try:
        entries = list(out.iterdir())
    except OSError as e:
        raise ConfigError(f"{{out}} {out} cannot be read ({e.strerror})", named=True) from None
    if entries:  # (checkpoints imports torch: only where there is something to look at)
        from ...ckpt.checkpoints import is_leftover

        # a killed run's unfinished save is no content: the run removes it once it holds --out
        entries = [p for p in entries if not is_leftover(p)]
    non_empty = bool(entries)
    if non_empty and not overwrite and not (resume is not None and _inside(resume, out)):
        raise ConfigError(f"{{out}} {out} exists and is not empty; choose another directory or add {{overwrite}}", named=True)
    _check_writable("--out", out, out)  # checkpoints are written inside it
    _check_writable("--out", out, Path(os.path.abspath(out)).parent)  # the model is renamed in beside it


#: a file name to suggest where a flag's path names a folder
_EXAMPLE_NAMES = {"--trace": "trace.json", "--metrics": "metrics.jsonl"}


def check_output_file(flag: str, path: str | os.PathLike[str]) -> None:
    """Refuse a file that ``flag`` names if the run could not write it at its end: a folder, a
    missing or read-only folder, a read-only file (the rules of ``--trace``)."""
    path = Path(path)
    if path.is_dir():
        example = path / _EXAMPLE_NAMES.get(flag, "report.json")
        raise ConfigError(f"{flag} {path} is a folder; give a file name, e.g. {example}")
    parent = Path(os.path.abspath(path)).parent
    if not parent.exists():
        _check_creatable(flag, path)  # refuses a path under a file or in a read-only tree first
        raise ConfigError(f"{flag} {path}: its folder {parent} does not exist; create it first")
    if not parent.is_dir():
        raise ConfigError(f"{flag} {path}: {parent} is a file, so nothing can be written under it")
    _check_writable(flag, path, parent)
    if path.exists() and not os.access(path, os.W_OK):
        raise ConfigError(f"{flag} {path} exists and is read-only; choose another file or make it writable")


def _check_creatable(flag: str, path: Path) -> None:
    """``path`` does not exist: its nearest existing ancestor must be a folder we may write in."""
    for ancestor in Path(os.path.abspath(path)).parents:
        if ancestor.exists():
            break
    if not ancestor.is_dir():
        raise ConfigError(f"{flag} {path}: {ancestor} is a file, so no folder can be made under it")
    _check_writable(flag, path, ancestor)


def _check_writable(flag: str, path: Path, folder: Path) -> None:
    """A file can be created in ``folder``: ask os.access, then try it (root passes os.access
    for read-only folders; a read-only file system still refuses the probe)."""
    why = None
    if not os.access(folder, os.W_OK | os.X_OK):
        why = "permission denied"
    else:
        try:
            fd, probe = tempfile.mkstemp(prefix=".flowtrain-probe-", dir=folder)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            why = e.strerror or str(e)
    if why is not None:
        where = "" if _real(folder) == _real(path) else f" (in {folder})"
        raise ConfigError(f"{flag} {path} cannot be written{where}: {why}; choose a writable location")
