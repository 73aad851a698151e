"""A Hugging Face model's structure without its weights: the generic layer path's template.

For an architecture flowtrain has no layer math of its own for, the generic path runs
transformers' own modules. :func:`skeleton` builds the model once from its ``config.json``
with every *parameter* on the meta device (no memory, no values) and every *buffer* real
(rotary frequencies, embedding scales: values computed from the config), then finds its parts
the way transformers does, never from a table per family:

- the input embedding (``get_input_embeddings()``) and the decoder's layer list (the one
  ``nn.ModuleList`` of ``num_hidden_layers`` modules, inside the decoder),
- the final norm (the decoder's one other module with parameters) and the output embedding
  (``get_output_embeddings()``), which may be the input embedding itself (tied),

and refuses, in one line naming the part, a model it cannot run::

    sk = skeleton(json.load(open("config.json")))
    sk.layers[3]                     # transformers' decoder layer 3, parameters on meta
    sk.units[1]                      # layer 0's (key, checkpoint name, shape) triples

The weights live in flowtrain's flat buffers; the modules are only called over them
(:mod:`flowtrain.model.generic.calls`, ``torch.func.functional_call``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flowtrain.errors import ConfigError

__all__ = ["Skeleton", "UnitSpec", "skeleton"]

#: one unit's tensors: (key the program reads, checkpoint name, shape)
UnitSpec = tuple[tuple[str, str, tuple[int, ...]], ...]


@dataclass(frozen=True)
class Skeleton:
    """The model built on the meta device and where its parts are."""

    model: nn.Module                 # the ...ForCausalLM, parameters on meta, buffers real
    decoder: nn.Module               # the module that holds the layers (``model.model``)
    decoder_name: str                # its qualified name in ``model`` ("model")
    layers: nn.ModuleList            # the decoder layers, in order
    layers_name: str                 # "model.layers"
    embed_name: str                  # the input embedding's qualified name ("model.embed_tokens")
    norm_attr: str                   # the final norm's attribute on the decoder ("norm")
    output_name: str                 # the output embedding's qualified name ("lm_head")
    tied: bool                       # whether the output embedding's weight is the input's
    units: tuple[UnitSpec, ...]      # embed, each layer, head: what the flat maps hold

    @property
    def norm_name(self) -> str:
        """The final norm's qualified name ("model.norm")."""
        return f"{self.decoder_name}.{self.norm_attr}".lstrip(".")

    @property
    def head_name(self) -> str | None:
        """The output embedding's qualified name where it holds its own weight; None when tied."""
        return None if self.tied else self.output_name


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """While inside, every parameter a module registers moves to the meta device (the
    ``init_empty_weights`` idea): building a 70B model costs no memory, while buffers, which
    modules compute from the config, keep their values."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError("the generic layer path runs transformers' modules: pip install 'flowtrain[generic]' "
                          "(transformers 5)") from None
    return transformers


def hf_config_object(d: dict[str, Any]) -> Any:
    """transformers' config object for a ``config.json`` dict, and its architecture's class."""
    tf = _transformers()
    archs = d.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    model_type = d.get("model_type")
    if not isinstance(arch, str) or not arch.endswith("ForCausalLM"):
        raise ConfigError(f"architecture {arch!r}: the generic layer path trains decoder-only ...ForCausalLM models")
    cls = getattr(tf, arch, None)
    if cls is None:
        raise ConfigError(f"unsupported architecture {arch!r}: neither flowtrain's native families nor transformers "
                          f"{tf.__version__} have it; upgrade transformers, or add a family (docs/concepts.md)")
    try:
        config_class = tf.CONFIG_MAPPING[model_type]
        # config.json spells infinities as {"__float__": "Infinity"}; transformers reads them so
        decode = getattr(config_class, "_decode_special_floats", lambda obj: obj)
        config = config_class.from_dict(decode(dict(d)))
    except (KeyError, ValueError, TypeError) as e:
        raise ConfigError(f"config.json of {arch}: transformers cannot read it ({str(e).splitlines()[0][:200]})") from None
    return cls, config


def _refuse_dropout(config: Any, arch: str) -> None:
    for key, value in sorted(config.to_dict().items()):
        if "dropout" in key and isinstance(value, float) and value > 0:
            raise ConfigError(f"config.json of {arch} sets {key} {value}; the generic layer path trains without "
                              f"dropout (set it to 0.0)")


def _layer_list(model: nn.Module, count: int, arch: str) -> tuple[str, nn.ModuleList]:
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == count
             and n.rsplit(".", 1)[-1] == "layers"]
    if len(lists) != 1:
        raise ConfigError(f"{arch}: the generic layer path found {len(lists)} decoder layer lists of "
                          f"num_hidden_layers {count} modules named 'layers'; it needs exactly one")
    return lists[0]


def _qualified(model: nn.Module, target: nn.Module) -> str:
    for name, module in model.named_modules():
        if module is target:
            return name
    raise ConfigError(f"{type(model).__name__}: a part is not one of its modules")


def _build(d_json: str) -> Skeleton:
    d = json.loads(d_json)
    cls, config = hf_config_object(d)
    arch = cls.__name__
    _refuse_dropout(config, arch)
    with _parameters_on_meta(), torch.device("cpu"):
        try:
            model = cls(config)
        except Exception as e:  # any failure of a foreign constructor is the config's
            raise ConfigError(f"{arch}: transformers cannot build it from config.json ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200]})") from None
    model.eval()  # no dropout: a recompute must reproduce its forward exactly
    layers_name, layers = _layer_list(model, config.num_hidden_layers, arch)
    decoder_name = layers_name.rpartition(".")[0]
    decoder = model.get_submodule(decoder_name) if decoder_name else model
    embedding = model.get_input_embeddings()
    embed_name = _qualified(model, embedding)
    head = model.get_output_embeddings()
    if head is None:
        raise ConfigError(f"{arch}: the generic layer path found no output embedding (lm_head)")
    tied = head.weight is embedding.weight
    output_name = _qualified(model, head)
    norm_attr = _final_norm(decoder, layers, embedding, arch)
    sk = Skeleton(model, decoder, decoder_name, layers, layers_name, embed_name, norm_attr, output_name, tied, ())
    _refuse_strays(model, {embed_name, layers_name, sk.norm_name, sk.head_name}, arch)
    units = _units(embedding, embed_name, layers, layers_name, decoder.get_submodule(norm_attr), sk.norm_name, head,
                   sk.head_name, arch)
    return dataclasses.replace(sk, units=units)


def _final_norm(decoder: nn.Module, layers: nn.Module, embedding: nn.Module, arch: str) -> str:
    others = [n for n, m in decoder.named_children()
              if m is not layers and m is not embedding and any(True for _ in m.parameters())]
    if len(others) != 1:
        raise ConfigError(f"{arch}: the generic layer path needs one final norm beside the embedding and the "
                          f"layers; the decoder has {others or 'none'}")
    return others[0]


def _refuse_strays(model: nn.Module, parts: set[str | None], arch: str) -> None:
    for name, _ in model.named_parameters():
        if not any(p and (name == p or name.startswith(p + ".")) for p in parts):
            raise ConfigError(f"{arch}: parameter {name} is outside the embedding, the layers, the final norm and "
                              "the head; the generic layer path cannot place it")


def _units(embedding: nn.Module, embed_name: str, layers: nn.ModuleList, layers_name: str,
           norm: nn.Module, norm_name: str, head: nn.Module, head_name: str | None, arch: str) -> tuple[UnitSpec, ...]:
    embed = [("embed_tokens" if n == "weight" else n, f"{embed_name}.{n}", tuple(p.shape))
             for n, p in embedding.named_parameters()]
    norms = list(norm.named_parameters())
    if [n for n, _ in norms] != ["weight"]:
        raise ConfigError(f"{arch}: the final norm {norm_name} has parameters {[n for n, _ in norms]}; the generic "
                          "layer path takes a norm with one weight")
    head_spec = [("norm", f"{norm_name}.weight", tuple(norms[0][1].shape))]
    if head_name is not None:
        if [n for n, _ in head.named_parameters()] != ["weight"]:
            raise ConfigError(f"{arch}: the output embedding {head_name} has a bias; the generic layer path "
                              "takes a head with one weight")
        head_spec.append(("lm_head", f"{head_name}.weight", tuple(head.get_parameter("weight").shape)))
    per_layer = [tuple((n, f"{layers_name}.{i}.{n}", tuple(p.shape)) for n, p in layer.named_parameters())
                 for i, layer in enumerate(layers)]
    return (tuple(embed), *per_layer, tuple(head_spec))


@functools.lru_cache(maxsize=4)
def _cached(d_json: str) -> Skeleton:
    return _build(d_json)


def skeleton(d: dict[str, Any] | str) -> Skeleton:
    """The skeleton of the model ``config.json`` (a dict, or its JSON text) describes; built
    once per config and shared (it holds no weights). :class:`ConfigError` naming the part
    when the generic layer path cannot run the model."""
    return _cached(d if isinstance(d, str) else json.dumps(d, sort_keys=True))
