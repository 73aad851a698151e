"""What every call of a decoder layer shares: rotary tables, documents, the layer function.

A decoder layer is a pure function of its input, its weights, the rotary tables and the
config. :class:`LayerRunner` holds the tables (one set per rotary base: Gemma 3's sliding
layers have their own), each packed micro-batch's documents on the device with the tables
gathered at each token's position, and the layer function, eager or compiled by
``torch.compile``; :meth:`LayerRunner.run` calls layer ``i`` of a micro-batch with them::

    runner = LayerRunner(cfg, seq_len, device, dtype, compile_backend=None)
    y = runner.run("train", step, i, m, x, weights)
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ...model import decoder_layer, rope_tables
from ...model.attention import Documents, rotary_for
from ...model.config import ModelConfig
from ...model.gemma import embed_multiplier
from ...model.moe import RouterTap


def _layer_function(compile_backend: str | None) -> Any:  # the layer, or torch.compile's wrapper of it
    """The decoder layer the program runs: as it is (eager), or compiled by ``torch.compile``
    with ``compile_backend`` (e.g. "inductor": norms, rotary and SwiGLU fuse)."""
    if compile_backend is None:
        return decoder_layer
    # Dynamo inspects .grad of the weights while tracing; where a weight is a view that is not a
    # leaf, torch warns about that access, harmlessly.
    warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
    return torch.compile(decoder_layer, backend=compile_backend, dynamic=False)


class LayerRunner:
    """What every call of a decoder layer shares, and the call itself."""

    def __init__(self, cfg: ModelConfig, seq_len: int, device: torch.device, dtype: torch.dtype,
                 compile_backend: str | None) -> None:
        self.cfg = cfg
        self.device = device
        self.non_blocking = device.type == "cuda"
        #: rotary (cos, sin) tables by "is this a Gemma 3 sliding layer" (its own base)
        self.rope = {local: rope_tables(cfg, seq_len, device, dtype, local)
                     for local in {False, any(map(cfg.layer_rope_local, range(cfg.num_layers)))}}
        self.embed_multiplier = embed_multiplier(cfg)
        #: the decoder layer, compiled by torch.compile (``compile_backend``, e.g. "inductor")
        #: so norms, rotary and SwiGLU fuse; forward, recompute and backward share it.
        self.layer_fn = _layer_function(compile_backend)
        #: each training micro-batch's token ids on the device, for the embedding's backward
        self.dev_ids: dict[tuple[int, int], torch.Tensor] = {}
        #: packed micro-batches' documents and their gathered rotary tables, by (data, step, mb): data "train" or "eval"
        self.dev_docs: dict[tuple[str, int, int], tuple[Documents, dict]] = {}

    def place_documents(self, data: str, s: int, m: int, docs: Documents | None) -> None:
        """Move a packed micro-batch's documents to the device with its rotary tables gathered
        at each token's position; every layer of the micro-batch reads them (:meth:`run`)."""
        if docs is not None:
            dev = docs.to(self.device, non_blocking=self.non_blocking)
            self.dev_docs[(data, s, m)] = (dev, {k: rotary_for(cos, sin, dev) for k, (cos, sin) in self.rope.items()})

    def run(self, data: str, s: int, i: int, m: int, x: torch.Tensor, w: Any,
            router: RouterTap | None = None) -> torch.Tensor:
        """Decoder layer ``i`` of micro-batch ``m`` of the ``data`` (``"train"`` or ``"eval"``,
        held-out) of step ``s``: its documents, rotary tables and window
        (and, for a mixture of experts, the tap its routing goes to)."""
        docs, rope = self.dev_docs.get((data, s, m), (None, self.rope))
        cos, sin = rope[self.cfg.layer_rope_local(i)]
        if router is not None:
            return self.layer_fn(x, w, cos, sin, self.cfg, docs, self.cfg.layer_window(i), router)
        return self.layer_fn(x, w, cos, sin, self.cfg, docs, self.cfg.layer_window(i))
