"""Calling transformers' modules over flowtrain's weights: the generic path's layer math.

A :class:`GenericCalls` holds, for one device, what every call shares: the
:func:`~flowtrain.model.generic.skeleton.skeleton` and its buffers moved to the device. Each of
its calls is ``torch.func.functional_call`` over the model's own module with the weights given
as views of a flat buffer, so the same module serves every layer's weights in any slot:

- :meth:`GenericCalls.stem` runs the decoder's own forward with its layers replaced by recorders
  that stop it at the final norm. What it yields is exactly what transformers hands each layer:
  layer 0's input (the embedding, scaled where the model scales it) and each layer's keyword
  arguments (its mask: full, sliding, chunked, or none for linear-attention and state-space
  layers; rotary tables; positions). Packed documents are told by positions that restart at
  each document, which transformers turns into block-causal masks.
- :meth:`GenericCalls.layer` runs decoder layer ``i`` with those arguments.
- :meth:`GenericCalls.head_loss_and_grads` runs the final norm and the causal LM's own output
  step (its logit scaling or soft-capping included) over a chunk of tokens at a time, with
  the cross-entropy transformers' loss computes (fp32 logits, summed over non-ignored targets).

Backward passes are autograd through the same calls.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from .skeleton import Skeleton

__all__ = ["GenericCalls", "Stem"]

IGNORE_INDEX = -100


class _Stop(Exception):
    """Raised by the stand-in final norm: the stem has seen every layer's arguments."""


class _StandIn(nn.Module):
    """A module standing in for ``real`` in a copy of the model: an attribute it lacks is the
    real one's (a decoder reads ``attention_type`` of its layers, Falcon-H1's causal LM
    ``lm_head_multiplier`` of its decoder)."""

    def __init__(self, real: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_real", real)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_real"), name)


class _Recorder(_StandIn):
    """Stands in for decoder layer ``index`` in the stem: keeps its input (layer 0's) and its
    keyword arguments, hands the input on unchanged."""

    def __init__(self, layer: nn.Module, index: int, sink: list[Any]) -> None:
        super().__init__(layer)
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_sink", sink)
        # what the decoder indexes the layer's output as: a tuple (hidden, ...) or the tensor
        returns = str(inspect.signature(type(layer).forward).return_annotation).lower()
        object.__setattr__(self, "_as_tuple", "tuple" in returns)

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if args:
            raise TypeError(f"{type(self._real).__name__} is called with positional arguments beyond the "
                            "hidden states; the generic layer path passes keywords only")
        if self._index == 0:
            self._sink.append(hidden_states)
        self._sink.append(kwargs)
        return (hidden_states,) if self._as_tuple else hidden_states  # type: ignore[return-value]


class _StopAtNorm(nn.Module):
    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        raise _Stop


class _GivenHidden(_StandIn):
    """Stands in for the decoder in the causal LM's forward: the final norm of the hidden
    states it is handed as ``inputs_embeds``."""

    def __init__(self, decoder: nn.Module, norm_attr: str) -> None:
        super().__init__(decoder)
        self.norm_attr = norm_attr
        self._modules[norm_attr] = decoder.get_submodule(norm_attr)

    def forward(self, *args: Any, inputs_embeds: Tensor, **kwargs: Any) -> Any:
        from transformers.modeling_outputs import MoeModelOutputWithPast

        return MoeModelOutputWithPast(last_hidden_state=getattr(self, self.norm_attr)(inputs_embeds))


class _LoraLinear(nn.Module):
    """A linear map with a LoRA adapter, run as PEFT runs it unmerged:
    ``x W^T + b + scale (x A^T) B^T``, the adapter cast to the input's dtype (as
    :func:`flowtrain.model.lora.project` runs a native layer's). Its parameters are the map's
    own (``weight``, ``bias``) and ``lora_A``, ``lora_B``; ``lora_scale`` a buffer: all given
    by the call."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.lora_A = nn.Parameter(torch.empty(0, device="meta"))
        self.lora_B = nn.Parameter(torch.empty(0, device="meta"))
        self.register_buffer("lora_scale", torch.empty((), device="meta"))

    def forward(self, x: Tensor) -> Tensor:
        dt = x.dtype
        scale: Tensor = self.get_buffer("lora_scale")
        y = F.linear(x, self.weight, self.bias)
        return y + F.linear(F.linear(x, self.lora_A.to(dt)), self.lora_B.to(dt)) * scale.to(dt)


def _with_adapters(layer: nn.Module, modules: tuple[str, ...]) -> nn.Module:
    """A copy of ``layer`` (parameters on meta: no memory) whose linear maps ``modules`` carry
    adapters."""
    layer = copy.deepcopy(layer)
    for name in modules:
        parent_name, _, child = name.rpartition(".")
        parent = layer.get_submodule(parent_name) if parent_name else layer
        base = parent.get_submodule(child)
        if not isinstance(base, nn.Linear):
            raise ValueError(f"LoRA adapts linear maps; {name} is a {type(base).__name__}")
        setattr(parent, child, _LoraLinear(base))
    return layer


class Stem:
    """One micro-batch's stem output: layer 0's input and every layer's keyword arguments."""

    def __init__(self, hidden: Tensor, layer_kwargs: list[dict[str, Any]]) -> None:
        self.hidden = hidden
        self.layer_kwargs = layer_kwargs


def _tail(name: str, prefix: str) -> str:
    return name[len(prefix) + 1:] if prefix else name


class GenericCalls:
    """The generic path's calls on one device; see the module docstring."""

    def __init__(self, sk: Skeleton, device: torch.device, adapted: dict[int, tuple[str, ...]] | None = None) -> None:
        self.sk = sk
        self.device = device
        #: the layers as called: the skeleton's, or copies whose maps ``adapted[i]`` carry LoRA adapters
        self.layers = [_with_adapters(layer, adapted[i]) if adapted and adapted.get(i) else layer
                       for i, layer in enumerate(sk.layers)]
        self.adapted = adapted or {}
        dec = sk.decoder
        layers_attr = _tail(sk.layers_name, sk.decoder_name)
        self._layers_attr = layers_attr
        #: each layer's buffers on the device (rarely any), by layer
        self._layer_buffers = [{n: b.to(device) for n, b in layer.named_buffers()} for layer in sk.layers]
        #: the decoder's own buffers (rotary frequencies, embedding scales) on the device
        self._decoder_buffers = {n: b.to(device) for n, b in dec.named_buffers()
                                 if not n.startswith(layers_attr + ".")}
        self._embed_names = [_tail(n, sk.decoder_name) for _, n, _ in sk.units[0]]
        self._embed_keys = [k for k, _, _ in sk.units[0]]
        # the causal LM's output step with the decoder replaced by the final norm alone
        lm = copy.copy(sk.model)
        lm._modules = dict(sk.model._modules)
        decoder_attr = sk.decoder_name.split(".")[0]
        if "." in sk.decoder_name or decoder_attr not in lm._modules:
            raise ValueError(f"the decoder {sk.decoder_name} is not a child of {type(sk.model).__name__}")
        lm._modules[decoder_attr] = _GivenHidden(dec, sk.norm_attr)
        self._head_module = lm
        self._norm_name = f"{decoder_attr}.{sk.norm_attr}.weight"
        self._lm_head_name = f"{sk.output_name}.weight"

    # ---------------------------------------------------------------- stem
    def _stem_module(self, sink: list[Any]) -> nn.Module:
        dec = copy.copy(self.sk.decoder)
        dec._modules = dict(self.sk.decoder._modules)
        dec._modules[self._layers_attr] = nn.ModuleList(
            [_Recorder(layer, i, sink) for i, layer in enumerate(self.sk.layers)])
        dec._modules[self.sk.norm_attr] = _StopAtNorm()
        return dec

    def stem(self, ids: Tensor, positions: Tensor | None, embed: Mapping[str, Tensor]) -> Stem:
        """Layer 0's input and each layer's arguments for token ids (batch, seq); ``positions``
        (each token's position in its document) where rows hold packed documents. Under
        autograd where ``embed``'s tensors require grad."""
        sink: list[Any] = []
        params = {name: embed[key] for name, key in zip(self._embed_names, self._embed_keys)}
        params.update(self._decoder_buffers)
        kwargs: dict[str, Any] = {"input_ids": ids, "use_cache": False}
        if positions is not None:
            kwargs["position_ids"] = positions
        try:
            functional_call(self._stem_module(sink), params, (), kwargs, strict=False)
        except _Stop:
            pass
        if len(sink) != len(self.sk.layers) + 1:
            raise RuntimeError(f"the stem of {type(self.sk.model).__name__} saw {len(sink) - 1} of "
                               f"{len(self.sk.layers)} layers")
        return Stem(sink[0], sink[1:])

    # ---------------------------------------------------------------- layers
    def layer(self, i: int, x: Tensor, w: Mapping[str, Tensor], kwargs: dict[str, Any],
              router: tuple[type[nn.Module], Callable[[Any], None]] | None = None) -> Tensor:
        """Decoder layer ``i`` over ``x`` (batch, seq, hidden) with weights ``w`` (its
        parameters by their names in the layer; with LoRA also ``{map}.lora_A``, ``{map}.lora_B``
        and ``lora_scale``) and the stem's arguments for it. ``router``: ``(class, call)``, the
        call made with the output of each of the layer's modules of that class (the
        load-balancing loss reads the routing from it)."""
        params = {k: v for k, v in w.items() if k != "lora_scale"}
        params.update(self._layer_buffers[i])
        for module in self.adapted.get(i, ()):  # LoRA's scale, one 0-d tensor, for each adapted map
            params[f"{module}.lora_scale"] = w["lora_scale"]
        hooks = [] if router is None else [m.register_forward_hook(lambda _m, _in, out: router[1](out))
                                           for m in self.layers[i].modules() if isinstance(m, router[0])]
        try:
            out = functional_call(self.layers[i], params, (x,), kwargs, strict=True)
        finally:
            for hook in hooks:
                hook.remove()
        return out[0] if isinstance(out, tuple) else out

    # ---------------------------------------------------------------- head
    def logits(self, h: Tensor, norm_w: Tensor, head_w: Tensor) -> Tensor:
        """The causal LM's logits for hidden states ``h`` (batch, tokens, hidden)."""
        params = {self._norm_name: norm_w, self._lm_head_name: head_w}
        out = functional_call(self._head_module, params, (), {"inputs_embeds": h}, strict=False)
        return out.logits

    def head_loss_and_grads(self, hidden: Tensor, norm_w: Tensor, head_w: Tensor, targets: Tensor,
                            scale: float | Tensor, chunk_tokens: int, weight_grads: bool = True
                            ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """``(loss_sum, d_hidden, d_norm_w, d_head_w)`` as
        :func:`flowtrain.model.functional.head_loss_and_grads` returns them, one chunk of
        ``chunk_tokens`` tokens at a time (``scale`` a number or one weight per token)."""
        x = hidden.reshape(-1, hidden.shape[-1])
        t = targets.reshape(-1)
        per_token = scale.reshape(-1) if isinstance(scale, Tensor) else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        d_x = torch.empty_like(x)
        d_norm = torch.zeros_like(norm_w, dtype=torch.float32) if weight_grads else None
        d_head = torch.zeros_like(head_w) if weight_grads else None
        nw = norm_w.detach().requires_grad_(weight_grads)
        hw = head_w.detach().requires_grad_(weight_grads)
        for start in range(0, x.shape[0], chunk_tokens):
            with torch.enable_grad():
                xc = x[start:start + chunk_tokens].detach().requires_grad_(True)
                tc = t[start:start + chunk_tokens]
                logits = self.logits(xc[None], nw, hw)[0].float()
                if per_token is None:
                    ce = F.cross_entropy(logits, tc, ignore_index=IGNORE_INDEX, reduction="sum")
                    weighted = ce * scale
                else:
                    terms = F.cross_entropy(logits, tc, ignore_index=IGNORE_INDEX, reduction="none")
                    ce, weighted = terms.sum(), (terms * per_token[start:start + chunk_tokens]).sum()
                inputs = [xc, nw, hw] if weight_grads else [xc]
                grads = torch.autograd.grad(weighted, inputs)
            loss += ce.detach()
            d_x[start:start + chunk_tokens] = grads[0]
            if d_norm is not None and d_head is not None:
                d_norm += grads[1].float()
                d_head += grads[2]
        return loss, d_x.view_as(hidden), (d_norm.to(norm_w.dtype) if d_norm is not None else None), d_head

    @torch.no_grad()
    def head_token_logprobs(self, hidden: Tensor, norm_w: Tensor, head_w: Tensor, targets: Tensor,
                            chunk_tokens: int) -> Tensor:
        """Each target's log-probability, ``targets``' shape, fp32, 0 where ignored."""
        x = hidden.reshape(-1, hidden.shape[-1])
        t = targets.reshape(-1)
        out = torch.zeros(t.shape, dtype=torch.float32, device=hidden.device)
        for start in range(0, x.shape[0], chunk_tokens):
            logits = self.logits(x[start:start + chunk_tokens][None], norm_w, head_w)[0].float()
            out[start:start + chunk_tokens] = -F.cross_entropy(logits, t[start:start + chunk_tokens],
                                                               ignore_index=IGNORE_INDEX, reduction="none")
        return out.view(targets.shape)

    @torch.no_grad()
    def head_loss(self, hidden: Tensor, norm_w: Tensor, head_w: Tensor, targets: Tensor, chunk_tokens: int) -> Tensor:
        """The summed cross-entropy over non-ignored targets (fp32 scalar)."""
        x = hidden.reshape(-1, hidden.shape[-1])
        t = targets.reshape(-1)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, x.shape[0], chunk_tokens):
            logits = self.logits(x[start:start + chunk_tokens][None], norm_w, head_w)[0].float()
            loss += F.cross_entropy(logits, t[start:start + chunk_tokens], ignore_index=IGNORE_INDEX, reduction="sum")
        return loss
