"""``flowtrain graph``: compile one step and write it as node-link JSON.

``--layers`` x ``--micro-batches`` x ``--steps`` is bounded by
:data:`~flowtrain.graph.spec.MAX_LAYER_PASSES` (131,072 layer passes, about a gigabyte and half
a minute of building at most), refused in one line before a task is built.
"""

from __future__ import annotations

import argparse

from ..errors import ConfigError
from ..graph.compiler import StepSpec, compile_steps
from ..graph.export import write_graph
from ..plan.buffer_sizes import state_bytes_text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, required=True, help="decoder layers")
    p.add_argument("--micro-batches", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--checkpoint-every", type=int, default=1, help="keep a layer input every K layers (recompute between)")
    p.add_argument("--order", choices=["layer", "micro"], default="layer", help="layer-major or micro-batch-major")
    p.add_argument("--tied", action="store_true", help="tied input and output embeddings")
    p.add_argument("--grad-clip", action="store_true", help="include the global gradient norm before Adam")
    p.add_argument("--resident", default="", metavar="UNITS",
                   help="comma-separated units kept on the device with their Adam there (embed, head, layer.N)")
    p.add_argument("--staged", action="store_true", help="gradients leave through host staging slots (the staged layout, "
                   f"{state_bytes_text('staged')})")
    p.add_argument("--grad-chunks", action="append", default=[], metavar="UNIT=N",
                   help="with --staged: a unit whose gradient passes in N staging chunks (repeatable)")
    p.add_argument("--keep", default="", metavar="LAYERS",
                   help="comma-separated layers whose activations stay for backward (no recompute), e.g. 2,3")
    p.add_argument("--offload", default="", metavar="LAYERS",
                   help="comma-separated layers whose input checkpoint waits in host memory for backward, e.g. 0,1")
    p.add_argument("--save-attention", default="", metavar="LAYERS",
                   help="comma-separated layers whose attention output stays for the rebuild before backward, e.g. 0,1")
    p.add_argument("--processes", type=int, default=1, metavar="N",
                   help="data parallel: N processes of a node sharing the host state (reduce_grad, sync_step)")
    p.add_argument("--lora", action="store_true",
                   help="LoRA: the model frozen, each layer's adapters resident and trained (gpu_adam adapter)")
    p.add_argument("--host-adapters", action="store_true",
                   help="with --lora: the adapters in host memory, fetched with their layer, updated by cpu_adam")
    p.add_argument("--skip-idle-experts", default="", metavar="LAYERS",
                   help="comma-separated sparse layers that skip idle experts: their recompute and backward fetches "
                        "follow their forwards' routing (train's --skip-idle-experts names every sparse layer)")
    p.add_argument("--steps", type=int, default=1, help="consecutive steps, linked by cpu_adam -> next fetch")
    p.add_argument("--out", required=True, help="output JSON file")


#: how ``graph`` spells the fields of :class:`StepSpec` that are not ``--`` + their name
_FLAGS = {"share": "--processes", "full_layout": "the full layout (leave out --staged)"}


def flag_of(field: str) -> str | None:
    """``graph``'s flag for a :class:`StepSpec` field (its errors name fields); None for a name
    that is no field of it."""
    if field in _FLAGS:
        return _FLAGS[field]
    return "--" + field.replace("_", "-") if field in StepSpec.__struct_fields__ else None


def _chunks(items: list[str]) -> dict[str, int]:
    out = {}
    for item in items:
        unit, _, n = item.partition("=")
        if not n.isdigit():
            raise ConfigError(f"--grad-chunks takes UNIT=N, like embed=4 (got {item!r})")
        out[unit] = int(n)
    return out


def _layers(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{flag} takes layer numbers separated by commas, like 2,3 (got {text!r})") from None


def run(args: argparse.Namespace) -> int:
    spec = StepSpec(
        layers=args.layers,
        micro_batches=args.micro_batches,
        checkpoint_every=args.checkpoint_every,
        order=args.order,
        tied=args.tied,
        grad_clip=args.grad_clip,
        resident=tuple(u for u in args.resident.split(",") if u),
        staged=args.staged,
        grad_chunks=_chunks(args.grad_chunks),
        keep=_layers(args.keep, "--keep"),
        offload=_layers(args.offload, "--offload"),
        save_attention=_layers(args.save_attention, "--save-attention"),
        reduce=args.processes > 1,
        share=args.processes,
        lora=args.lora,
        host_adapters=args.host_adapters,
        skip_idle_experts=_layers(args.skip_idle_experts, "--skip-idle-experts"),
    ).validate()
    graph = compile_steps(spec, args.steps)
    write_graph(args.out, graph)
    print(f"wrote {args.out}: {graph.number_of_nodes()} tasks, {graph.number_of_edges()} edges")
    return 0
