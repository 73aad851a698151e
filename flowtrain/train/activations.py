"""What one task of a step leaves on the device for another: the activation store.

A layer's forward leaves its output for the layer above; the loss leaves the gradient of the
last hidden state for the top layer's backward, which leaves the gradient of its input for the
layer below; a kept layer leaves its forward graph for its backward; a layer that saves its
attention output leaves the record its rebuild replays. Each hand-off is keyed by ``(step,
layer, micro_batch)`` and has one producer and one consumer, so the store is a set of typed
tables with two verbs::

    store.inputs.put((s, i + 1, m), y)        # forward of layer i: the input of layer i + 1
    x = store.inputs.take((s, i + 1, m))      # its consumer; take removes it
    x = store.inputs.peek((s, i, m))          # a checkpoint: read by the recompute, taken by backward

A ``put`` over a value that is still there, or a ``take`` of one that is not, is a bug in the
step graph or its program, and says which table and key. At the end of every step the store
holds nothing of it (:meth:`ActivationStore.check_empty`, called by the program's
``end_step``): a tensor left behind would be device memory no plan counted, growing every step.
Tables are safe to use from the lane threads at once (each hand-off is one task's).
"""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

import torch

from ..model.saved_attention import AttentionRecord
from .kept import Kept

__all__ = ["ActivationStore", "Key", "Table"]

#: ``(step, layer, micro_batch)``; layer ``-1`` is the embedding's output gradient, layer
#: ``num_layers`` the last hidden state
Key = tuple[int, int, int]
V = TypeVar("V")


class Table(Generic[V]):
    """One kind of hand-off: values by :data:`Key`, each put once and taken once."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._values: dict[Key, V] = {}
        self._lock = threading.Lock()

    def put(self, key: Key, value: V) -> None:
        with self._lock:
            if key in self._values:
                raise RuntimeError(f"activation store: {self.name} {key} put twice (its consumer has not taken it)")
            self._values[key] = value

    def take(self, key: Key) -> V:
        with self._lock:
            try:
                return self._values.pop(key)
            except KeyError:
                raise RuntimeError(f"activation store: {self.name} {key} taken before it was put") from None

    def take_if_present(self, key: Key) -> V | None:
        with self._lock:
            return self._values.pop(key, None)

    def peek(self, key: Key) -> V:
        with self._lock:
            try:
                return self._values[key]
            except KeyError:
                raise RuntimeError(f"activation store: {self.name} {key} read before it was put") from None

    def keys_of(self, step: int) -> list[Key]:
        with self._lock:
            return sorted(k for k in self._values if k[0] == step)

    def __len__(self) -> int:
        return len(self._values)


class ActivationStore:
    """Every table of one step program: ``inputs`` (a layer's input, or the last hidden state
    the loss reads), ``grads`` (the gradient of a layer's output), ``kept`` (a kept layer's
    forward graph), ``attention`` (a layer's saved attention output) and ``eval_inputs`` (the
    same as ``inputs`` for a held-out loss, which has no backward)."""

    def __init__(self) -> None:
        self.inputs: Table[torch.Tensor] = Table("input")
        self.grads: Table[torch.Tensor] = Table("output gradient")
        self.kept: Table[Kept] = Table("kept forward")
        self.attention: Table[AttentionRecord] = Table("saved attention")
        self.eval_inputs: Table[torch.Tensor] = Table("held-out input")

    def tables(self, evaluation: bool = False) -> tuple[Table, ...]:
        """The training step's tables, or with ``evaluation`` the held-out loss's."""
        return (self.eval_inputs,) if evaluation else (self.inputs, self.grads, self.kept, self.attention)

    def held(self, step: int, evaluation: bool = False) -> dict[str, list[Key]]:
        """What the store still holds of ``step`` (or of its evaluation), by table (empty
        tables left out)."""
        return {t.name: keys for t in self.tables(evaluation) if (keys := t.keys_of(step))}

    def check_empty(self, step: int, evaluation: bool = False) -> None:
        """Raise if anything of ``step`` (or of its evaluation) is still held once it has ended."""
        left = self.held(step, evaluation)
        if left:
            what = "the evaluation after step" if evaluation else "step"
            raise AssertionError(f"activation store: {what} {step} ended holding {left}")

    def __len__(self) -> int:
        return sum(len(t) for t in (*self.tables(), *self.tables(evaluation=True)))
