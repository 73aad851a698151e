"""From a memory plan to a predicted step: the bridge between the planner and the simulator.

The planner (:mod:`flowtrain.plan.planner`) decides placement, layout and slot budgets; this
module turns a plan and a model into a :class:`~flowtrain.sim.costs.Shape`, runs the plan's
steps on the virtual clock under the same policy the trainer would use (the policy's order
with the plan's budgets, ``WithBudgets``), and summarizes them::

    plan = plan_run(cfg, req, device=torch.device("cuda"), dtype=torch.bfloat16)
    pred = predict(cfg, plan, req, load_machine("h200"))
    pred.summary.tokens_per_s, pred.records    # records: one list per simulated step

A DPO run's reference pass (``--objective dpo``: every sequence's log-probability under the
initial weights, before the first step) is predicted the same way, as the trainer runs it: the
forward-only graph of an evaluation (:func:`~flowtrain.graph.evaluation.compile_eval`), a
step's rows at a time, each graph waited for before the next::

    ref = predict_reference_pass(pred.shape, plan, machine, batch_size=16, rows=64)
    ref.seconds, ref.seconds_per_pair             # 64 sequences: 4 graphs of 16

It imports the model's layout code (which imports torch) only inside :func:`shape_of`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..graph.evaluation import compile_eval
from ..policy import WithBudgets, resolve_policy
from ..runtime.trace import TaskRecord
from .clock import VirtualRun
from .costs import CostModel, Shape
from .machine import Machine
from .report import Summary, summarize


class Prediction(msgspec.Struct, kw_only=True):
    summary: Summary
    records: list[list[TaskRecord]]
    shape: Shape
    machine: str


class ReferencePass(msgspec.Struct, kw_only=True):
    """The predicted time of a DPO run's reference pass: one forward-only graph per
    ``rows_per_pass`` sequences of the data (a step's), each waited for before the next."""

    rows_per_pass: int
    #: seconds of one graph of ``rows_per_pass`` sequences
    pass_seconds: float
    #: the data's sequences and the seconds of the whole pass over them (their full graphs and
    #: the last, shorter one, simulated at its size); None where the data is not known
    rows: int | None = None
    seconds: float | None = None

    @property
    def seconds_per_pair(self) -> float:
        """Seconds per preference pair (two sequences) of a full graph."""
        return self.pass_seconds * 2 / self.rows_per_pass


def _eval_graph_seconds(shape: Shape, plan: Any, machine: Machine, policy: Any, micro_batches: int) -> float:
    """Seconds of one forward-only graph of ``micro_batches`` micro-batches, from idle lanes to
    the host's knowing that its last task has ended."""
    sim = VirtualRun(CostModel(machine, shape), WithBudgets(resolve_policy(policy), plan.budgets),
                     cpu_workers=shape.adam_workers)
    records = sim.run(compile_eval(plan.spec, 0, micro_batches))
    return max(r.end for r in records) + sim.sync


def predict_reference_pass(shape: Shape, plan: Any, machine: Machine, policy: Any = "double_buffer", *,
                           batch_size: int, rows: int | None = None) -> ReferencePass:
    """The reference pass of a DPO run of ``plan`` on ``machine``, ``shape`` that of its step's
    prediction (:attr:`Prediction.shape`), as ``flowtrain.train.loop`` runs it: forward-only
    graphs of ``batch_size`` sequences (a whole step's, on every process: each computes the
    reference of all the data) in micro-batches of ``shape.micro_batch_size``, simulated with the
    plan's budgets under ``policy``; with ``rows``, the whole pass over that many sequences."""
    mbs = shape.micro_batch_size
    full = _eval_graph_seconds(shape, plan, machine, policy, -(-batch_size // mbs))
    if rows is None:
        return ReferencePass(rows_per_pass=batch_size, pass_seconds=full)
    passes, rest = divmod(rows, batch_size)
    last = _eval_graph_seconds(shape, plan, machine, policy, -(-rest // mbs)) if rest else 0.0
    return ReferencePass(rows_per_pass=batch_size, pass_seconds=full, rows=rows, seconds=passes * full + last)


def shape_of(cfg: Any, plan: Any, req: Any, adam_workers: int = 1, world: int = 1, nodes: int = 1) -> Shape:
    """The :class:`Shape` of model ``cfg`` (a ``ModelConfig``) run under ``plan`` for ``req``."""
    from ..model import model_flat_maps
    from ..model.config import MLP_CHUNK_TOKENS
    from ..model.counts import model_flops_per_token

    from ..plan.adapters import adapter_active_numel, adapter_active_outputs, adapter_inputs, layer_adapter_numels

    layouts = model_flat_maps(cfg)
    numel = {lay.key: lay.numel for lay in layouts}
    numel.update({f"adapter.{i}": n for i, n in enumerate(layer_adapter_numels(cfg, req))})  # with LoRA
    adapters = adapter_active_numel(cfg, req) if getattr(req, "lora_rank", 0) else 0
    layer_numel = max((lay.numel for lay in layouts if lay.unit == "layer"), default=0)
    compute_bytes = 2 if plan.device == "cuda" else 4
    # a sparse layer's experts cost about a dense MLP as wide as the k experts a token runs through
    sparse = bool(cfg.moe and cfg.sparse_layers())
    intermediate = cfg.num_experts_per_tok * cfg.moe_intermediate_size if sparse else cfg.intermediate_size
    return Shape(hidden=cfg.hidden_size, intermediate=intermediate, layers=cfg.num_layers,
                 heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, vocab=cfg.vocab_size,
                 seq_len=req.seq_len, micro_batch_size=req.micro_batch_size, layer_numel=layer_numel, numel=numel,
                 chunk_tokens=plan.chunk_tokens,
                 compute_bytes=compute_bytes,
                 fetch_bytes=compute_bytes if adapters else 2 if plan.layout == "stream-bf16" else 4,
                 refresh=plan.layout == "stream-bf16", grad_chunks=dict(plan.spec.grad_chunks),
                 adam_workers=adam_workers, world=world, nodes=nodes,
                 attention_backend=getattr(req, "attention_backend", "auto"),
                 experts=cfg.num_experts if sparse else 0, experts_per_token=cfg.num_experts_per_tok if sparse else 0,
                 owned=plan.spec.owned_by(0), adapter_params=adapters,  # the simulated process is the node's first
                 lora_rank=getattr(req, "lora_rank", 0) or 0,
                 adapter_outputs=adapter_active_outputs(cfg, req) if adapters else 0.0,
                 adapter_inputs=adapter_inputs(cfg, req) if adapters else 0,
                 disk_master=frozenset(k for k, fields in plan.disk.items() if "master" in fields),
                 flops_per_token=model_flops_per_token(cfg, req.seq_len, adapters or None),
                 mlp_pieces=_mlp_pieces(req.micro_batch_size * req.seq_len, MLP_CHUNK_TOKENS) if not (sparse or adapters) else 0)


def _mlp_pieces(tokens: int, piece: int) -> int:
    """The pieces a dense MLP of ``tokens`` tokens a micro-batch runs in (0: one compiled pass)."""
    return -(-tokens // piece) if tokens > piece else 0


def predict_shape(shape: Shape, plan: Any, machine: Machine, policy: Any = "double_buffer", *,
                  batch_size: int, steps: int = 3) -> Prediction:
    """Simulate ``steps`` steps of ``plan`` (its spec and budgets) for a given :class:`Shape`."""
    costs = CostModel(machine, shape)
    sim = VirtualRun(costs, WithBudgets(resolve_policy(policy), plan.budgets), cpu_workers=shape.adam_workers)
    records = sim.run_steps(plan.spec, steps=steps)
    summary = summarize(records, batch_size * shape.seq_len, shape.flops_per_token, sim.cause)
    return Prediction(summary=summary, records=records, shape=shape, machine=machine.name)


def predict(cfg: Any, plan: Any, req: Any, machine: Machine, policy: Any = "double_buffer", *,
            adam_workers: int = 1, steps: int = 3, world: int = 1, nodes: int = 1) -> Prediction:
    """Predict the steady step of ``plan`` for model ``cfg`` and request ``req`` on ``machine``.
    With ``world`` data-parallel processes (on ``nodes`` nodes), ``plan`` and ``req`` are one
    process's (its share of the batch) and the prediction is for all of them together: every
    process runs the same step, its gradients summed over the others' (``reduce_grad``)."""
    return predict_shape(shape_of(cfg, plan, req, adam_workers, world, nodes), plan, machine, policy,
                         batch_size=req.batch_size * world, steps=steps)
