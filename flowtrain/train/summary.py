"""The block a run prints before its first step: what will be trained, where, on what, and where
the results go, so that a wrong setting shows before hours are spent on it::

    model      qwen-0.5b: Qwen2ForCausalLM, 0.49 B parameters, random init, tied embeddings
    device     cuda (bf16 compute, fp32 master weights and Adam state)
    memory     layout staged; resident on the GPU: embed, head, layer.0-7; planned host 6.1 GiB, GPU 9.8 GiB
    activations layers 20-23 keep theirs; recompute from a checkpoint every layer
    data       corpus.txt: 1,204 sequences of 512 tokens, 402,113 target tokens; 200 steps cover 2.7 epochs
    steps      200 of 16 sequences (8,192 tokens, 2 micro-batches of 8, layer order); lr 3e-3 constant
    output     model to trained/; checkpoints every 50 steps to trained/checkpoint-STEP (keep 3)

For a file of examples the ``data`` line also says how many examples the sequences hold, where
the length came from, which rule found the assistant tokens of chat rows, and how many examples
longer than ``--seq-len`` were cut or dropped, with the target tokens they lost::

    data       chats.jsonl: 9,120 examples in 1,873 sequences of 1024 tokens (from the data: the longest
               example, 1,001 tokens, rounded up), 2,140,113 target tokens; loss on assistant turns by
               generation markers; every example within 1024 tokens; 200 steps cover 1.7 epochs
    data       chats.jsonl: 9,117 examples in 1,870 sequences of 512 tokens, 2,090,007 target tokens; loss
               on assistant turns by generation markers; examples longer than 512 tokens: 3 dropped (2,210
               target tokens); 200 steps cover 1.7 epochs
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..model.adapters import DEFAULT_TARGETS

if TYPE_CHECKING:
    from ..data.source import Sequences
    from .prepare import Run


def _spans(numbers: list[int] | tuple[int, ...]) -> list[str]:
    """``["0-7", "9"]`` for 0..7 and 9."""
    out: list[str] = []
    ordered = sorted(numbers)
    start = 0
    for k in range(1, len(ordered) + 1):
        if k == len(ordered) or ordered[k] != ordered[k - 1] + 1:  # a span ends at k - 1
            first, last = ordered[start], ordered[k - 1]
            out.append(f"{first}" if first == last else f"{first}-{last}")
            start = k
    return out


def _ranges(keys: tuple[str, ...]) -> str:
    """``embed, head, layer.0-7`` rather than eight layer names."""
    layers = [int(k.split(".")[1]) for k in keys if k.startswith("layer.")]
    parts = [k for k in keys if not k.startswith("layer.")] + [f"layer.{s}" for s in _spans(layers)]
    return ", ".join(parts) or "none"


def describe_activations(spec) -> str:  # spec: a StepSpec
    """Where each layer's activations wait for its backward, in a line: ``layers 11-31 save
    their attention output; checkpoints of layers 0-7 offloaded; recompute from a checkpoint
    every layer``."""
    parts = []
    if spec.keep:
        parts.append(f"layers {', '.join(_spans(spec.keep))} keep theirs")
    if spec.save_attention:
        parts.append(f"layers {', '.join(_spans(spec.save_attention))} save their attention output")
    if spec.offload:
        parts.append(f"checkpoints of layers {', '.join(_spans(spec.offload))} offloaded")
    if len(spec.keep) < spec.layers:
        parts.append("recompute from a checkpoint " + ("every layer" if spec.checkpoint_every == 1
                                                         else f"every {spec.checkpoint_every} layers"))
    return "; ".join(parts)


def _count(n: int, noun: str) -> str:
    """``1 sequence``, ``1,204 sequences``."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


#: how the loss finds a chat row's assistant tokens, by the rule the data was read with
_MASK_RULES = {
    "generation": "loss on assistant turns by generation markers",
    "turns": "loss on assistant turns found turn by turn (the chat template has no generation markers)",
}


def data_description(seqs: "Sequences") -> str:
    """What the sequences hold, for the ``data`` line: ``1,204 sequences of 512 tokens, 402,113
    target tokens``, and for a file of examples the examples (and the rows left out for having
    no target), the length's origin, the chat mask rule and the examples longer than seq_len cut
    or dropped (``flowtrain.data.source``)."""
    n, seq = seqs.input_ids.shape
    report = seqs.report
    targets = f"{seqs.num_targets():,} target tokens"
    if report.kind != "rows":
        return f"{_count(n, 'sequence')} of {seq} tokens, {targets}"
    origin = ""
    if report.seq_len_from_data:
        origin = (f" (from the data: the model's {seq} positions; the longest example has {report.longest:,} tokens)"
                  if report.capped else
                  f" (from the data: the longest held-out example, rounded up; the longest here has "
                  f"{report.longest:,} tokens)" if report.widened else
                  f" (from the data: the longest example, {report.longest:,} tokens, rounded up)")
    untrained = (f" ({_count(report.untrained, 'row')} with no trained tokens left out: the first at "
                 f"{report.first_untrained})" if report.untrained else "")
    parts = [f"{_count(report.examples, 'example')}{untrained} in {_count(n, 'sequence')} of {seq} tokens{origin}, "
             f"{targets}"]
    if report.mask in _MASK_RULES:
        parts.append(_MASK_RULES[report.mask])
    (cut, cut_lost), (dropped, dropped_lost) = report.cut, report.dropped
    long = ([f"{cut:,} cut ({cut_lost:,} target tokens lost)"] if cut else []) + (
        [f"{dropped:,} dropped ({dropped_lost:,} target tokens)"] if dropped else [])
    parts.append(f"examples longer than {seq} tokens: {', '.join(long)}" if long else f"every example within {seq} tokens")
    return "; ".join(parts)


def lora_params(run: "Run") -> int:
    """The parameters a LoRA run trains: every layer's adapters (not the padding between them)."""
    from ..model.adapters import adapter_flat_maps
    from .config.run_config import lora_spec

    spec = lora_spec(run.cfg)
    assert spec is not None
    return sum(e.numel for lay in adapter_flat_maps(run.mcfg, spec) for e in lay.entries)


def summary_lines(run: "Run") -> list[str]:
    cfg, m, plan = run.cfg, run.mcfg, run.plan
    gib = 1 << 30
    source = (f"resumed from {run.resume_from} (step {run.first_step})" if run.resume_from
              else f"weights from {run.model_dir}" if run.model_dir else "random init")
    n_params = m.num_parameters()
    size = f"{n_params / 1e9:.2f} B" if n_params >= 1e8 else f"{n_params / 1e6:.2f} M"
    lines = [
        f"model      {cfg.model or ('tiny' if run.model_dir is None else run.model_dir)}: {m.architecture}, "
        f"{size} parameters, {source}" + (", tied embeddings" if m.tie_word_embeddings else ""),
        f"device     {run.device} ({'fp32' if run.dtype == torch.float32 else 'bf16'} compute, "
        + (("the base frozen in it; fp32 adapters and their Adam state in host memory, fetched with their layer)"
            if plan.spec.host_adapters else "the base frozen in it; fp32 adapters and their Adam state on the device)")
           if cfg.lora else "fp32 master weights and Adam state)"),
        "memory     " + ("the frozen base in the compute dtype; " if cfg.lora else f"layout {plan.layout}; ") + (
            f"resident on the GPU: {_ranges(plan.spec.resident)}; planned host {plan.host_total / gib:.1f} GiB, "
            f"GPU {plan.gpu_total / gib:.1f} GiB" if plan.device == "cuda"
            else f"everything in host memory; planned {plan.host_total / gib:.1f} GiB")
        + (f" ({plan.memory_choice})" if plan.memory_choice else ""),
        f"activations {describe_activations(plan.spec)}",
    ]
    if cfg.lora:
        targets = [t for t in cfg.lora_targets or DEFAULT_TARGETS if t != "router" or m.sparse_layers()]  # as adapted
        experts = (f" (each expert's gate_up_proj at rank {cfg.lora_gate_up_rank})"
                   if m.sparse_layers() and "gate_proj" in targets and "up_proj" in targets else "")
        scaling = " (rsLoRA: scale alpha / sqrt(rank))" if cfg.lora_rslora else ""
        lines.append(f"lora       rank {cfg.lora_rank}, alpha {cfg.lora_alpha:g}{scaling} on {','.join(targets)}{experts}: "
                     f"{lora_params(run):,} trained parameters, "
                     + (f"from {cfg.adapter}" if cfg.adapter else f"resumed from {run.resume_from}" if run.resume_from
                        else "fresh (B zero: the base's outputs)"))
    world = getattr(run, "world", None)
    if world is not None and world.parallel:
        shared = (f"; the node's {plan.spec.share} processes share one host copy of the state, planned "
                  f"{plan.host_node_total / gib:.1f} GiB for the node" if plan.spec.share > 1 else "")
        lines.append(f"processes  {world.size} (torchrun), each running {cfg.batch_size // world.size} of the "
                     f"{cfg.batch_size} sequences of a step{shared}")
    n, seq = run.seqs.input_ids.shape
    epochs = cfg.steps * cfg.batch_size / max(n, 1)
    lines.append(f"data       {cfg.data or 'the bundled corpus'}: {data_description(run.seqs)}; "
                 f"{_count(cfg.steps, 'step')} cover{'s' if cfg.steps == 1 else ''} {epochs:.1f} epochs")
    eval_seqs = getattr(run, "eval_seqs", None)
    if eval_seqs is not None:
        lines.append(f"eval       {cfg.eval_data}: {_count(len(eval_seqs), 'sequence')}, "
                     f"{eval_seqs.num_targets():,} target tokens, every {cfg.eval_every} steps "
                     "and after the last")
    sched = f"{cfg.lr_schedule}" + (f" after {cfg.warmup_steps} warm-up steps" if cfg.warmup_steps else "")
    micro_batches = cfg.batch_size // cfg.micro_batch_size
    why = f", {plan.order_choice}" if plan.order_choice else ""
    order = f", {plan.spec.order} order{why}" if micro_batches > 1 else ""
    sequences = "1 sequence" if cfg.batch_size == 1 else f"{cfg.batch_size} sequences"
    pieces = "1 micro-batch" if micro_batches == 1 else f"{micro_batches} micro-batches"
    lines.append(f"steps      {cfg.steps} of {sequences} ({cfg.batch_size * seq:,} tokens, "
                 f"{pieces} of {cfg.micro_batch_size}{order}); "
                 f"lr {cfg.lr:g} {sched}, weight decay {cfg.weight_decay:g}"
                 + (" (none on norms and biases)" if cfg.weight_decay_skip == "norms-biases" else "")
                 + ("; experts no token is routed to are not updated" if cfg.skip_idle_experts else ""))
    if cfg.out:
        what = ("the merged model" if cfg.merge else "the PEFT adapter") if cfg.lora else "model"
        out = f"{what} to {cfg.out}"
        if cfg.save_every:
            out += (f"; checkpoints every {cfg.save_every} steps to {cfg.out}/checkpoint-STEP"
                    + (f" (keep {cfg.save_total_limit})" if cfg.save_total_limit else ""))
        else:
            out += "; no checkpoints (--save-every N keeps them)"
    else:
        out = "nothing is saved (no --out)"
    lines.append(f"output     {out}")
    return lines
