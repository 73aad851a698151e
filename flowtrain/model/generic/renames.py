"""Checkpoint names transformers renames on loading, on the generic path.

Some checkpoints on the Hub name their tensors otherwise than the model transformers builds
keeps them: Mixtral's ``block_sparse_moe`` is ``mlp`` in memory, a text model saved inside a
vision-language one carries ``model.language_model.`` where the text model has ``model.``.
transformers renames them as it loads (its ``conversion_mapping``: the renaming rules of the
config's ``model_type``); the generic path reads such a checkpoint the same way. Given the names
a checkpoint holds, :func:`checkpoint_renames` says which of the model's names each one is::

    checkpoint_renames("mixtral", present)   # {"model.layers.0.mlp.gate.weight": "model.layers.0.block_sparse_moe.gate.weight", ...}

:func:`flowtrain.model.model_dir.model_renames` asks it for a model's checkpoint; checking the
headers and loading look each tensor up under the checkpoint's name.

Only renamings apply here (a name for a name); the rules that fuse one checkpoint tensor per
expert into a stacked weight are read by :attr:`flowtrain.model.flat_map.Entry.parts`. The
written model keeps transformers' in-memory names, which ``from_pretrained`` loads as they are.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

__all__ = ["checkpoint_renames"]


@functools.lru_cache(maxsize=32)
def _renamings(model_type: str) -> tuple:
    """transformers' renaming rules of ``model_type`` (none where its version has no such API)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return ()
    return tuple(rule for rule in get_checkpoint_conversion_mapping(model_type) or []
                 if type(rule).__name__ != "WeightConverter")


def checkpoint_renames(model_type: str, present: Iterable[str]) -> dict[str, str]:
    """``{the model's name: the checkpoint's name}`` for each of the ``present`` checkpoint names
    that transformers renames on loading a ``model_type`` model (names it keeps are left out)."""
    rules = _renamings(model_type)
    if not rules:
        return {}
    from transformers.core_model_loading import apply_renamings

    out = {}
    for name in present:
        renamed = apply_renamings(name, list(rules))
        if renamed != name:
            out[renamed] = name
    return out
