"""The model's math as the program calls it: embedding, decoder layers, head, and their backward.

A part chosen once per run (:func:`layer_runner`), so that no task body asks which layer path
the model is on:

- :class:`NativeLayerRunner` (the native path): a decoder layer is a pure function of its input, its
  weights, the rotary tables and the config. It holds the tables (one set per rotary base: Gemma
  3's sliding layers have their own), each packed micro-batch's documents on the device with the
  tables gathered at each token's position, and the layer function, eager or compiled by
  ``torch.compile``.
- :class:`GenericLayerRunner` (the generic path, :mod:`flowtrain.model.generic`):
  transformers' own modules over the same weights. The embedding runs the decoder's own stem,
  which also yields every layer's arguments (masks, rotary tables) for the micro-batch.

Both answer :class:`LayerRunner`'s calls::

    runner = layer_runner(cfg, seq_len, device, dtype, compile_backend=None)
    x = runner.embed("train", step, m, ids, docs, embed_weights)
    y = runner.run("train", step, i, m, x, weights)
    loss_sum, dx, dnorm, dhead = runner.head_loss_and_grads(h, norm_w, head_w, targets, scale, chunk)
    runner.embed_backward(step, m, dx, embed_grads)
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ...model import (decoder_layer, default_chunk_tokens, embed, head_loss, head_loss_and_grads, head_token_logprobs,
                      rope_tables)
from ...model.attention import Documents, rotary_for
from ...model.config import ModelConfig
from ...model.flat_map import FlatMap
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
    """The calls the program makes of the model's math, and what the two kinds share: the
    config, the device, and whether the embedding takes a gradient (not under LoRA: then nothing
    stays for an embedding backward)."""

    def __init__(self, cfg: ModelConfig, device: torch.device, embed_trains: bool) -> None:
        self.cfg = cfg
        self.device = device
        self.non_blocking = device.type == "cuda"
        self.embed_trains = embed_trains

    def embed(self, data: str, s: int, m: int, ids: torch.Tensor, docs: Documents | None,
              w: dict[str, torch.Tensor]) -> torch.Tensor:
        """Layer 0's input for micro-batch ``m``'s token ids (on the device) of the ``data``
        (``"train"`` or ``"eval"``, held-out) of step ``s``; what its layers and the embedding's
        backward need stays until :meth:`forget`."""
        raise NotImplementedError

    def embed_backward(self, s: int, m: int, dx: torch.Tensor, g: dict[str, torch.Tensor]) -> None:
        """Add one micro-batch's embedding gradient, from its input gradient ``dx``, into ``g``."""
        raise NotImplementedError

    def forget(self, data: str, s: int, m: int) -> None:
        """Drop what micro-batch ``m`` of ``data`` left on the device for its layers."""
        raise NotImplementedError

    def tables(self) -> dict[str, dict[tuple, Any]]:
        """What the runner holds per micro-batch, by name; keys ``(data, step, micro_batch)``,
        or ``(step, micro_batch)`` for what only training micro-batches leave."""
        return {}

    def held(self, step: int, data: str = "train") -> dict[str, list[tuple]]:
        """The keys still held of ``step``'s micro-batches of ``data``, by table (empty ones
        left out)."""
        def of_step(key: tuple) -> bool:
            return key[:2] == (data, step) if len(key) == 3 else data == "train" and key[0] == step

        return {name: keys for name, table in self.tables().items() if (keys := [k for k in table if of_step(k)])}

    def check_empty(self, step: int, evaluation: bool = False) -> None:
        """Raise if anything of ``step`` (or of its evaluation) is still held once it has ended:
        whichever task used a micro-batch's ids, documents or arguments last has to drop them,
        or every step would leave them behind on the device."""
        left = self.held(step, "eval" if evaluation else "train")
        if left:
            what = "the evaluation after step" if evaluation else "step"
            raise AssertionError(f"layer runner: {what} {step} ended holding {left}")

    def run(self, data: str, s: int, i: int, m: int, x: torch.Tensor, w: Any,
            router: RouterTap | None = None) -> torch.Tensor:
        """Decoder layer ``i`` of micro-batch ``m`` of ``data`` of step ``s`` over ``x`` with
        weights ``w`` (and, for a native mixture of experts, the tap its routing goes to)."""
        raise NotImplementedError

    def head_loss_and_grads(self, h: torch.Tensor, norm_w: torch.Tensor, head_w: torch.Tensor,
                            targets: torch.Tensor, scale: float | torch.Tensor, chunk_tokens: int | None,
                            weight_grads: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                         torch.Tensor | None]:
        """Final norm, head and cross-entropy, forward and backward: ``(loss_sum, d_hidden,
        d_norm_w, d_head_w)`` as :func:`flowtrain.model.functional.head_loss_and_grads` returns
        them."""
        raise NotImplementedError

    def head_loss(self, h: torch.Tensor, norm_w: torch.Tensor, head_w: torch.Tensor, targets: torch.Tensor,
                  chunk_tokens: int | None) -> torch.Tensor:
        """The summed cross-entropy of held-out tokens (fp32 scalar)."""
        raise NotImplementedError

    def head_token_logprobs(self, h: torch.Tensor, norm_w: torch.Tensor, head_w: torch.Tensor, targets: torch.Tensor,
                            chunk_tokens: int | None) -> torch.Tensor:
        """Each target's log-probability, ``targets``' shape, fp32, 0 where ignored."""
        raise NotImplementedError


class NativeLayerRunner(LayerRunner):
    """The native path: rotary tables, documents and flowtrain's own layer function."""

    def __init__(self, cfg: ModelConfig, seq_len: int, device: torch.device, dtype: torch.dtype,
                 compile_backend: str | None, embed_trains: bool = True) -> None:
        super().__init__(cfg, device, embed_trains)
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

    def embed(self, data: str, s: int, m: int, ids: torch.Tensor, docs: Documents | None,
              w: dict[str, torch.Tensor]) -> torch.Tensor:
        if data == "train" and self.embed_trains:  # the ids, for the embedding's backward
            self.dev_ids[(s, m)] = ids
        self.place_documents(data, s, m, docs)
        return embed(ids, w["embed_tokens"], self.embed_multiplier)

    def embed_backward(self, s: int, m: int, dx: torch.Tensor, g: dict[str, torch.Tensor]) -> None:
        ids = self.dev_ids.pop((s, m))  # scattered into the rows they looked up
        self.forget("train", s, m)
        if self.embed_multiplier is not None:  # the multiplier, rounded as the forward used it
            dx = dx * torch.tensor(self.embed_multiplier, dtype=dx.dtype, device=dx.device)
        if self.cfg.pad_token_id is not None:
            # transformers' nn.Embedding(padding_idx=pad_token_id): looking up the padding
            # token's row adds nothing to its gradient (a tied head's part still does).
            dx = dx.masked_fill((ids == self.cfg.pad_token_id)[..., None], 0)
        g["embed_tokens"].index_add_(0, ids.reshape(-1), dx.reshape(-1, dx.shape[-1]).float())

    def forget(self, data: str, s: int, m: int) -> None:
        self.dev_docs.pop((data, s, m), None)

    def tables(self) -> dict[str, dict[tuple, Any]]:
        return {"token ids": self.dev_ids, "documents": self.dev_docs}

    def head_loss_and_grads(self, h: torch.Tensor, norm_w: torch.Tensor, head_w: torch.Tensor,
                            targets: torch.Tensor, scale: float | torch.Tensor, chunk_tokens: int | None,
                            weight_grads: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                         torch.Tensor | None]:
        return head_loss_and_grads(h, norm_w, head_w, targets, self.cfg.rms_norm_eps, scale, chunk_tokens,
                                   plus_one=self.cfg.family.gemma, weight_grads=weight_grads)

    def head_loss(self, h: torch.Tensor, norm_w: torch.Tensor, head_w: torch.Tensor, targets: torch.Tensor,
                  chunk_tokens: int | None) -> torch.Tensor:
        return head_loss(h, norm_w, head_w, targets, self.cfg.rms_norm_eps, chunk_tokens,
                         plus_one=self.cfg.family.gemma)

    def head_token_logprobs(self, h: torch.Tensor, norm_w: torch.Tensor, head_w: torch.Tensor, targets: torch.Tensor,
                            chunk_tokens: int | None) -> torch.Tensor:
        return head_token_logprobs(h, norm_w, head_w, targets, self.cfg.rms_norm_eps, chunk_tokens,
                                   plus_one=self.cfg.family.gemma)

    def place_documents(self, data: str, s: int, m: int, docs: Documents | None) -> None:
        """Move a packed micro-batch's documents to the device with its rotary tables gathered
        at each token's position; every layer of the micro-batch reads them (:meth:`run`)."""
        if docs is not None:
            dev = docs.to(self.device, non_blocking=self.non_blocking)
            self.dev_docs[(data, s, m)] = (dev, {k: rotary_for(cos, sin, dev) for k, (cos, sin) in self.rope.items()})

    def run(self, data: str, s: int, i: int, m: int, x: torch.Tensor, w: Any,
            router: RouterTap | None = None) -> torch.Tensor:
        # the micro-batch's documents and rotary tables, the layer's window
        docs, rope = self.dev_docs.get((data, s, m), (None, self.rope))
        cos, sin = rope[self.cfg.layer_rope_local(i)]
        if router is not None:
            return self.layer_fn(x, w, cos, sin, self.cfg, docs, self.cfg.layer_window(i), router)
        return self.layer_fn(x, w, cos, sin, self.cfg, docs, self.cfg.layer_window(i))


class GenericLayerRunner(LayerRunner):
    """The generic path's calls (:mod:`flowtrain.model.generic.calls`), with what each
    micro-batch's stem left for its layers: their arguments, and for the embedding's backward
    its graph (only where the embedding trains: LoRA's base takes no gradient). ``adapted``:
    by layer, the linear maps that carry LoRA adapters."""

    def __init__(self, cfg: ModelConfig, device: torch.device, compile_backend: str | None,
                 adapted: dict[int, tuple[str, ...]] | None = None, embed_trains: bool = True) -> None:
        from ...model.generic.calls import GenericCalls
        from ...model.generic.routing import load_balance_of
        from ...model.generic.skeleton import skeleton

        assert cfg.hf_json is not None
        super().__init__(cfg, device, embed_trains)
        self.calls = GenericCalls(skeleton(cfg.hf_json), device, adapted)
        #: each micro-batch's layer arguments, by (data, step, micro-batch)
        self.layer_kwargs: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
        #: each training micro-batch's stem output under autograd and the embedding's leaves,
        #: for the embedding's backward (an embedding's backward reads the token ids, not the
        #: weights, so no slot stays for it)
        self.stem_graphs: dict[tuple[int, int], tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}
        self.layer_fn = self.calls.layer if compile_backend is None else torch.compile(
            self.calls.layer, backend=compile_backend, dynamic=False)
        #: the load-balancing loss transformers adds for this model (None: none), whose routers
        #: a training forward's router tap reads
        self.balance = load_balance_of(cfg.hf_json)

    def embed(self, data: str, s: int, m: int, ids: torch.Tensor, docs: Documents | None,
              w: dict[str, torch.Tensor]) -> torch.Tensor:
        positions = docs.positions.to(self.device, non_blocking=self.non_blocking) if docs is not None else None
        training = data == "train" and self.embed_trains
        with torch.set_grad_enabled(training):
            leaves = {k: v.detach().requires_grad_(training) for k, v in w.items()}
            stem = self.calls.stem(ids, positions, leaves)
        self.layer_kwargs[(data, s, m)] = stem.layer_kwargs
        if training:
            self.stem_graphs[(s, m)] = (stem.hidden, leaves)
        return stem.hidden.detach()

    def embed_backward(self, s: int, m: int, dx: torch.Tensor, g: dict[str, torch.Tensor]) -> None:
        hidden, leaves = self.stem_graphs.pop((s, m))
        self.forget("train", s, m)
        grads = torch.autograd.grad(hidden, list(leaves.values()), dx, allow_unused=True)
        for key, grad in zip(leaves, grads):
            if grad is not None:
                g[key].add_(grad.float())

    def forget(self, data: str, s: int, m: int) -> None:
        self.layer_kwargs.pop((data, s, m), None)

    def tables(self) -> dict[str, dict[tuple, Any]]:
        return {"layer arguments": self.layer_kwargs, "embedding graphs": self.stem_graphs}

    def head_loss_and_grads(self, h: torch.Tensor, norm_w: torch.Tensor, head_w: torch.Tensor,
                            targets: torch.Tensor, scale: float | torch.Tensor, chunk_tokens: int | None,
                            weight_grads: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                         torch.Tensor | None]:
        chunk = chunk_tokens or default_chunk_tokens(head_w.shape[0])
        return self.calls.head_loss_and_grads(h, norm_w, head_w, targets, scale, chunk, weight_grads)

    def head_loss(self, h: torch.Tensor, norm_w: torch.Tensor, head_w: torch.Tensor, targets: torch.Tensor,
                  chunk_tokens: int | None) -> torch.Tensor:
        return self.calls.head_loss(h, norm_w, head_w, targets, chunk_tokens or default_chunk_tokens(head_w.shape[0]))

    def head_token_logprobs(self, h: torch.Tensor, norm_w: torch.Tensor, head_w: torch.Tensor, targets: torch.Tensor,
                            chunk_tokens: int | None) -> torch.Tensor:
        return self.calls.head_token_logprobs(h, norm_w, head_w, targets,
                                              chunk_tokens or default_chunk_tokens(head_w.shape[0]))

    def run(self, data: str, s: int, i: int, m: int, x: torch.Tensor, w: Any,
            router: RouterTap | None = None) -> torch.Tensor:
        kwargs = self.layer_kwargs[(data, s, m)][i]
        if router is None or self.balance is None:
            return self.layer_fn(i, x, w, kwargs)  # type: ignore[no-any-return]
        from ...model.generic.routing import routing_of

        spec = self.balance  # the layer's routers hand their routing to the tap
        return self.calls.layer(i, x, w, kwargs, (spec.router, lambda out: router(*routing_of(spec, out))))


def layer_runner(cfg: ModelConfig, seq_len: int, device: torch.device, dtype: torch.dtype,
                 compile_backend: str | None, adapters: list[FlatMap] | None = None) -> LayerRunner:
    """The runner of the model's layer path: native, or generic (transformers' modules), with
    LoRA's ``adapters`` (their flat maps, by layer) where the run trains them."""
    if not cfg.generic:
        return NativeLayerRunner(cfg, seq_len, device, dtype, compile_backend, embed_trains=adapters is None)
    adapted = None if adapters is None else {
        lay.layer: tuple(e.key.removesuffix(".lora_A") for e in lay.entries if e.key.endswith(".lora_A"))
        for lay in adapters if lay.layer is not None}
    return GenericLayerRunner(cfg, device, compile_backend, adapted, embed_trains=adapters is None)
