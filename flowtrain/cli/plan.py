"""``flowtrain plan``: the memory plan of a training run, without running it.

Prints where every byte would live (host: master, Adam, gradients, staging, ...; GPU: weight
slots, gradient accumulators, resident units, checkpoints, activations, loss chunks), whether
the run fits, the largest micro-batch that fits, and what would make it fit. ``flowtrain
train`` follows the same plan and refuses a run that does not fit before allocating anything::

    flowtrain plan --model llama-8b --seq-len 4096 --batch-size 16 --micro-batch-size 4
    flowtrain plan --model llama-8b --seq-len 4096 --batch-size 2 --micro-batch-size 1 --gpu-mem 10 --json

Without a GPU here, ``--device cuda`` (the default when ``--gpu-mem`` is given) plans for one
on paper; with no ``--gpu-mem`` either, the GPU side is reported without a limit. With
``--machine`` it plans for that machine's GPU and memory (as ``flowtrain simulate`` does),
counting a mixture of experts as that GPU runs its experts.

With ``--state-dir`` it also shows the disk tier: which units' Adam moments and fp32 masters
live in the folder, the bytes there, and the disk bandwidth a step needs (the bytes read and
written each step over the step time the simulator predicts on ``--machine``, or on this GPU's
machine model) against what the disk gives (``--disk-gbs``, else the machine file's rates,
which ``flowtrain probe --state-dir DIR`` measures)::

    flowtrain plan --model llama-8b --seq-len 4096 --batch-size 2 --micro-batch-size 2 --gpu-mem 10 \
        --host-mem 32 --state-dir /nvme/state --machine rtx3080-10gb

With ``--objective dpo`` it also counts the reference pass that such a run makes before its first
step (:func:`reference_report`): the pairs of ``--data`` it covers, read as train reads them,
and the host memory their reference log-probabilities take, which the host total includes;
without ``--data``, the pass per pair (``reference_pass`` in ``--json``)::

    flowtrain plan --model llama-8b --objective dpo --data prefs.jsonl --seq-len 4096 --batch-size 16 \
        --micro-batch-size 2 --gpu-mem 10
"""

from __future__ import annotations

import argparse
import json

import msgspec

from ..train.config import defaults
from .flags import add_config_flags, config_values
from .train import MEMORY_FIELDS, flag_of

__all__ = ["PLAN_FIELDS", "add_arguments", "checked_request", "flag_of", "format_plan", "plan_for", "reference_report",
           "run"]

# The planner and the trainer import torch: they are imported where the command runs, so that
# ``flowtrain plan --help`` stays instant.

#: the fields of ``TrainConfig`` that ``plan`` (and ``simulate``) take, with train's flags,
#: defaults and checks
PLAN_FIELDS = ("model", "data", "data_columns", "tokenizer", "byte_tokenizer", "seq_len", "batch_size",
               "micro_batch_size", "order", "grad_clip", "precision", "device", "policy", "attention_backend", "layer_path",
               *MEMORY_FIELDS, "lora_rank", "lora_targets", "lora_state", "skip_idle_experts",
               "state_dir", "disk_state", "disk_gbs", "objective")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_flags(p, PLAN_FIELDS, required=["model"], grouped=False, helps={
        "model": "Hugging Face model directory or preset",
        "order": "micro-batch order (auto: micro where predicted faster on this GPU or on --machine)",
        "grad_clip": "plan for exact gradient clipping at this norm (the full layout)",
        "device": "auto: cuda if this machine has one or --gpu-mem is given, else cpu",
        "seq_len": "tokens per sequence; default: as train's, from --data (its longest example, rounded up to a "
                   "multiple of 64) or 128 for text and without --data",
        "data": "the training data, to plan at the length train would take from it (read through the data cache, "
                "so train does not tokenise it again); default: none, --seq-len or 128",
        "objective": "the run's objective, as train's; dpo: also count the reference pass before the first step "
                     "(the pairs of --data, the host memory of their reference log-probabilities; simulate: its time)",
    })
    a = p.add_argument
    a("--nproc-per-node", type=int, default=1, metavar="N",
      help="data-parallel processes per node (torchrun's): the plan is one process's, with its share of the batch")
    a("--nnodes", type=int, default=1, metavar="M", help="nodes of --nproc-per-node processes each")
    a("--json", action="store_true", help="print the plan as JSON")
    # The choice by predicted time (flowtrain.sim): a separate step after the memory plan.
    a("--machine", default=None, metavar="NAME|FILE",
      help="also pick, among configurations that fit, the fastest predicted on this machine (flowtrain "
           "simulate); from a computer without a GPU, plan for that machine's GPU and memory")


def checked_request(args: argparse.Namespace, gpu_mem: float | None, host_mem: float | None,
                    fields: tuple[str, ...] = PLAN_FIELDS) -> tuple:
    """``(model config, model folder, request, processes)`` of the run ``args`` describe, checked
    as ``flowtrain train`` checks it (the same ``TrainConfig`` and checks, so plan and simulate
    accept and refuse exactly what train does); with ``--nproc-per-node``/``--nnodes`` the
    request is one process's share of the batch and of the node's host memory. ``fields``: the
    ``TrainConfig`` fields the command takes (``simulate`` adds ``steps`` and ``adam_workers``),
    each checked as train checks it. No torch."""
    from ..errors import ConfigError
    from ..plan.buffer_sizes import check_units_fit
    from ..plan.request import run_request
    from ..train.config.checks import check_fields, check_with_model
    from ..train.distributed import local_share
    from ..train.config.run_config import TrainConfig, load_model_config

    tc = TrainConfig(**{**config_values(args, fields), "gpu_mem": gpu_mem, "host_mem": host_mem})
    check_fields(tc)
    if tc.objective != "sft":  # (imports torch)
        from ..train.prepare import check_objective

        check_objective(tc, needs_data=False)  # a plan may describe a DPO run per pair
    cfg, model_dir = load_model_config(args.model, tc.layer_path)
    cfg.validate()
    check_units_fit(cfg, host_mem, None if gpu_mem is None else int(gpu_mem * 2**30))  # before sizing anything
    rows = 0
    if tc.data is not None:  # the length train would take from the data, and its rows (this reads it: torch)
        from ..train.prepare import data_rows

        seq_len, rows = data_rows(tc, cfg, model_dir)
        tc = msgspec.structs.replace(tc, seq_len=seq_len)
    check_with_model(tc, cfg)
    if args.nproc_per_node < 1 or args.nnodes < 1:
        raise ConfigError(f"--nproc-per-node and --nnodes must be at least 1 (got {args.nproc_per_node}, {args.nnodes})")
    processes = args.nproc_per_node * args.nnodes
    local = local_share(tc, processes)
    reference_rows = rows if tc.objective == "dpo" else 0  # DPO: every process keeps the whole data's reference
    return (cfg, model_dir, run_request(local, model_dir, processes, share=args.nproc_per_node,
                                        reference_rows=reference_rows), processes)


def plan_for(args: argparse.Namespace, machine, with_predictions: bool = False,  # machine: a Machine
             fields: tuple[str, ...] = PLAN_FIELDS) -> tuple:
    """The model, request and memory plan of ``args`` on ``machine``: plan's checks (of the
    ``TrainConfig`` ``fields`` the command takes: :func:`checked_request`), then
    ``plan_and_choose`` for a GPU with the machine's memory unless --gpu-mem/--host-mem say otherwise
    (never capped by a GPU of the machine this runs on: the plan is for ``machine``); what
    ``flowtrain simulate`` predicts the speed of. With ``with_predictions``, also the planner's
    :class:`~flowtrain.sim.order_choice.Predictions`."""
    from ..plan.memory import Precision, Target, own_plan_card
    from ..sim.choose_plan import plan_and_choose
    from ..sim.order_choice import Predictions
    from ..train.config.run_config import precision_bytes

    gpu_mem = args.gpu_mem if args.gpu_mem is not None else own_plan_card(machine.gpu_mem_gib)
    host_mem = args.host_mem if args.host_mem is not None else machine.host_mem_gib
    cfg, _, req, _ = checked_request(args, gpu_mem, host_mem, fields)
    req = msgspec.structs.replace(req, grouped_experts=machine.grouped_mm)  # its GPU's, not this computer's
    device = Target("cuda")  # the machine's GPU, planned for without torch
    dtype = Precision(precision_bytes(args.precision, device.type))
    predictions = Predictions(cfg, args.policy)
    plan = plan_and_choose(cfg, req, device=device, dtype=dtype, policy=args.policy, local_gpu=False, machine=machine,
                           predictions=predictions)
    req = msgspec.structs.replace(req, order=plan.spec.order)  # --order auto, as decided for the machine
    return (cfg, req, plan, device, dtype, predictions) if with_predictions else (cfg, req, plan, device, dtype)


def run(args: argparse.Namespace) -> int:
    import torch

    machine = None
    if args.machine is not None:
        from ..sim.machine import load_machine

        machine = load_machine(args.machine)
    if machine is not None and args.disk_gbs is not None:
        from ..sim.machine import with_disk_rate

        machine = with_disk_rate(machine, args.disk_gbs)
    if machine is not None and args.device in ("auto", "cuda") and not torch.cuda.is_available():
        req, plan, choice, cfg, predict_on = _plan_elsewhere(args, machine)  # for that machine, from one without its GPU
    else:
        req, plan, choice, cfg, predict_on = _plan_here(args, machine)
    disk = disk_report(args, cfg, req, plan, predict_on) if plan.disk_tier else None
    reference = reference_report(args, req) if args.objective == "dpo" else None
    if args.json:
        print(json.dumps({"model": args.model, "seq_len": req.seq_len, **plan.to_dict(),
                          **({"disk_io": disk[1]} if disk else {}),
                          **({"reference_pass": reference[1]} if reference else {}),
                          **({"fastest": choice.to_dict()} if choice else {})}, indent=1))
    else:
        if args.data is not None and not defaults.seq_len_given(args.seq_len):
            print(f"seq-len {req.seq_len}, as train takes it from {args.data}")
        print(format_plan(args.model, plan))
        if reference:
            print(reference[0])
        if disk:
            print("\n".join(disk[0]))
        if args.host_mem is None:
            from ..plan.memory import host_memory_note

            print(host_memory_note(plan.host_limit))
        if choice:
            print(choice.explain())
    return 0 if plan.fits else 1


def _plan_here(args: argparse.Namespace, machine):  # machine: a Machine
    """The plan on this machine's device (its GPU's free memory a cap too); with ``machine``, the
    fastest configuration that fits as the simulator predicts it there. Returns ``(request, Plan,
    Choice, model config, machine to predict the step on)``."""
    import torch

    from ..sim.choose_plan import plan_and_choose
    from ..train.prepare import resolve_dtype

    cfg, _, req, processes = checked_request(args, args.gpu_mem, args.host_mem)
    if args.device == "auto":
        device = torch.device("cuda" if (torch.cuda.is_available() or args.gpu_mem is not None) else "cpu")
    else:
        device = torch.device(args.device)
    dtype = resolve_dtype(args.precision, device)
    if device.type != "cuda":
        machine = None  # a plan for the CPU: no GPU to predict
    plan = plan_and_choose(cfg, req, device=device, dtype=dtype, policy=args.policy, machine=machine)
    choice = None
    if machine is not None and processes == 1:  # the fastest that fits, as the simulator predicts on --machine
        from ..sim.choose import choose_fastest

        resolved = msgspec.structs.replace(req, order=plan.spec.order)  # --order auto, decided above
        choice = choose_fastest(cfg, resolved, machine, args.policy, device=device, dtype=dtype)
    predict_on = machine
    if predict_on is None and device.type == "cuda" and plan.disk:
        from ..sim.order_choice import this_gpu_machine

        predict_on = this_gpu_machine()
        if predict_on is not None and args.disk_gbs is not None:
            from ..sim.machine import with_disk_rate

            predict_on = with_disk_rate(predict_on, args.disk_gbs)
    return msgspec.structs.replace(req, order=plan.spec.order), plan, choice, cfg, predict_on


def _plan_elsewhere(args: argparse.Namespace, machine):  # machine: a Machine; returns as _plan_here
    """The plan for ``machine`` from a computer without a GPU: its GPU and host memory unless
    --gpu-mem/--host-mem say otherwise, as ``flowtrain simulate`` plans, and the fastest
    configuration that fits there."""
    from ..sim.choose import choose_fastest

    cfg, req, plan, device, dtype = plan_for(args, machine)
    processes = args.nproc_per_node * args.nnodes
    choice = (choose_fastest(cfg, req, machine, args.policy, device=device, dtype=dtype, local_gpu=False)
              if processes == 1 else None)
    return req, plan, choice, cfg, machine


def disk_report(args: argparse.Namespace, cfg, req, plan, machine, summary=None) -> tuple[list[str], dict]:
    """The disk tier of ``plan`` (a run with ``--state-dir``): lines for the text and the
    ``disk_io`` entry of ``--json``. What lives in the folder and how much, the bytes read and
    written each step, and, where the step is predicted (``machine``, a fitting plan), the
    bandwidth that needs against what the disk gives (``--disk-gbs``, else ``machine``'s) and
    whether the disk sets the step (most of the prediction's critical chain on the disk lane);
    ``summary``: the prediction already made (``flowtrain simulate``'s)."""
    from ..plan.disk import disk_traffic, unit_ranges
    from ..plan.memory import GiB

    t = disk_traffic(cfg, plan)
    out: dict = {"state_dir": args.state_dir, "disk_state": args.disk_state, "bytes": t.held,
                 "read_bytes_per_step": t.read, "written_bytes_per_step": t.written,
                 "moments": list(t.moments), "masters": list(t.masters)}
    lines = [f"disk tier (--state-dir {args.state_dir}, --disk-state {args.disk_state}):"]
    if not plan.disk:
        lines.append("  nothing on disk: host memory holds the whole state"
                     + (" (LoRA and data-parallel runs keep no state on disk)" if plan.spec.lora or plan.spec.share > 1
                        else ""))
        return lines, out
    lines.append(f"  moments on disk  {unit_ranges(t.moments)} ({len(t.moments)} units)")
    lines.append(f"  masters on disk  {unit_ranges(t.masters)} ({len(t.masters)} units)")
    lines.append(f"  on disk          {t.held / GiB:8.2f} GiB; each step reads {t.read / GiB:.2f} GiB and writes "
                 f"{t.written / GiB:.2f} GiB")
    if args.disk_gbs is not None:
        read_gbps = write_gbps = args.disk_gbs
        given = f"--disk-gbs {args.disk_gbs:g}"
    elif machine is not None:
        read_gbps, write_gbps = machine.disk_read_gbps, machine.disk_write_gbps
        given = f"{machine.name}'s disk"
    else:
        read_gbps = write_gbps = None
        given = None
    if summary is None and machine is not None and plan.fits and req.processes == 1:
        from ..sim.predict import predict

        summary = predict(cfg, plan, req, machine, args.policy).summary
    step_s = summary.step_seconds if summary is not None else None
    if read_gbps is not None and write_gbps is not None:
        busy = t.seconds(read_gbps, write_gbps)
        out.update(read_gbps=read_gbps, write_gbps=write_gbps, disk_seconds_per_step=round(busy, 4))
        rates = f"{given} gives {read_gbps:g} GB/s read, {write_gbps:g} GB/s write"
        if step_s is not None:
            need = t.needs_gbps(step_s)
            chain = sum(summary.critical_by_lane.values()) or 1.0
            on_chain = summary.critical_by_lane.get("disk", 0.0) / chain
            keeps = on_chain < 0.5
            out.update(step_seconds=round(step_s, 4), needs_gbps=round(need, 3), disk_keeps_up=keeps,
                       disk_busy_fraction=round(summary.busy_fraction.get("disk", 0.0), 4),
                       disk_share_of_critical_chain=round(on_chain, 4))
            lines.append(f"  bandwidth        needs {need:.2f} GB/s at the step of {step_s:.1f} s predicted on "
                         f"{machine.name}; {rates}: busy {busy:.1f} s a step, "
                         + ("hidden behind the GPU's work" if keeps else
                            f"THE DISK SETS THE STEP ({on_chain:.0%} of its critical chain; a faster disk or "
                            "more --host-mem shortens it)"))
        else:
            lines.append(f"  bandwidth        {rates}: {busy:.1f} s of disk work per step, which steps shorter than "
                         "that wait for (give --machine to predict the step)")
    else:
        lines.append("  bandwidth        give --disk-gbs N or --machine (flowtrain probe --state-dir DIR measures the "
                     "disk) to compare with what the step needs")
    return lines, out


def reference_report(args: argparse.Namespace, req, reference=None) -> tuple[str, dict]:  # reference: a ReferencePass
    """A DPO run's reference pass (``--objective dpo``): one line for the text and the
    ``reference_pass`` entry of ``--json``. Before the first step every process runs the model
    forward only over all of the data's pairs, a step's sequences (``--batch-size``) at a time,
    and keeps each sequence's reference log-probability in host memory, fp32: the pairs as
    train reads them from ``--data`` (``req.reference_rows``), their bytes, which the plan's host
    total counts; without ``--data``, the same per pair. ``reference``: the simulator's
    prediction of the pass (``flowtrain simulate``), which adds its seconds."""
    from ..plan.memory import REFERENCE_BYTES_PER_ROW, reference_host_bytes
    from ..viz.steps import fmt_bytes

    rows = req.reference_rows if args.data is not None else None
    per_pass = req.batch_size * req.processes  # the whole step's sequences (req: one process's share)
    processes = req.processes
    out: dict = {"pairs": None if rows is None else rows // 2, "sequences": rows,
                 "sequences_per_pass": per_pass, "micro_batch_size": req.micro_batch_size,
                 "passes": None if rows is None else -(-rows // per_pass),
                 "host_bytes": None if rows is None else reference_host_bytes(req),
                 "host_bytes_per_pair": 2 * REFERENCE_BYTES_PER_ROW, "in_host_total": rows is not None,
                 "processes": processes}
    if rows is None:
        what = f"one forward-only pass over all of --data's pairs before step 1, {per_pass} sequences at a time"
    else:
        what = (f"{rows // 2:,} pairs of {args.data}, forward only before step 1 in {out['passes']:,} passes of "
                f"{per_pass} sequences")
    if reference is not None:
        per_pair = reference.seconds_per_pair
        out.update(seconds=None if reference.seconds is None else _digits(reference.seconds),
                   seconds_per_pass=_digits(reference.pass_seconds), seconds_per_pair=_digits(per_pair),
                   seconds_per_1000_pairs=_digits(1000 * per_pair))
        rate = f"{per_pair:.3g} s a pair, {1000 * per_pair:,.0f} s per 1,000 pairs"
        what += (f", predicted {rate}" if reference.seconds is None
                 else f", predicted {reference.seconds:,.1f} s ({rate})")
    if rows is None:
        what += f"; {2 * REFERENCE_BYTES_PER_ROW} bytes of host memory a pair (--data counts the pairs)"
    else:
        what += f"; their log-probabilities take {fmt_bytes(out['host_bytes'])} of host memory, in the host total"
    if processes > 1:
        what += f"; each of the {processes} processes runs and keeps all of it"
    return f"reference pass (DPO): {what}", out


def _digits(x: float) -> float:
    """``x`` to 6 significant digits (a small model's pass takes milliseconds)."""
    return float(f"{x:.6g}")


def _gib(n: int | None) -> str:
    from ..plan.memory import GiB

    return "no limit" if n is None else f"{n / GiB:8.2f} GiB"


def format_plan(model: str, plan) -> str:  # plan: a Plan
    from ..plan.memory import GiB
    from ..train.summary import describe_activations

    count = f"{plan.params / 1e9:.2f} B" if plan.params >= 1e8 else f"{plan.params / 1e6:.2f} M"
    from ..plan.buffer_sizes import state_bytes_text

    what = (f"LoRA over the frozen base ({plan.state_bytes_per_param:.2f} host bytes per parameter: the base in the "
            "compute dtype, the adapters' state)" if plan.spec.lora
            else f"layout {plan.layout} ({state_bytes_text(plan.layout)})")
    lines = [f"{model}: {count} parameters, {what}, device {plan.device}"]
    res = plan.spec.resident
    device = "GPU" if plan.device == "cuda" else "device"  # on the CPU, "resident" means in its own memory
    adapters = ("the adapters are in host memory, fetched with their layer, CPU AdamW" if plan.spec.host_adapters
                else "the adapters are, with their Adam")
    where = (f"base units resident on the {device} ({adapters})" if plan.spec.lora
             else f"resident on the {device} (Adam there)")
    lines.append(f"{where}: {', '.join(res) if res else 'none'}")
    lines.append(f"micro-batch order: {plan.spec.order}" + (f" ({plan.order_choice})" if plan.order_choice else ""))
    lines.append(f"activations: {describe_activations(plan.spec)}")
    if plan.memory_choice:
        lines.append(f"memory: {plan.memory_choice}")
    lines.append(f"slots: {plan.budgets}; loss chunk {plan.chunk_tokens} tokens"
                 + (f"; staged gradient chunks {plan.spec.grad_chunks}" if plan.spec.grad_chunks and not plan.spec.lora
                    else ""))
    for title, part, total, limit, ok in (("host", plan.host, plan.host_total, plan.host_limit, plan.host_fits),
                                          ("GPU", plan.gpu, plan.gpu_total, plan.gpu_limit, plan.gpu_fits)):
        lines.append(f"{title if title == 'host' or plan.device == 'cuda' else 'device'} memory:")
        for k, v in part.items():
            if v:
                lines.append(f"  {k:<16}{v / GiB:8.2f} GiB")
        if title == "host" and plan.device == "cpu":
            lines.append(f"  {'(device items)':<16}{plan.gpu_total / GiB:8.2f} GiB  (on the CPU they are host memory)")
        if title == "host" and plan.spec.share > 1:
            lines.append(f"  {'one process':<16}{total / GiB:8.2f} GiB (master and adam shared by the node's "
                         f"{plan.spec.share} processes)")
            total = plan.host_node_total
        elif title == "host" and plan.node_processes > 1:
            lines.append(f"  {'one process':<16}{total / GiB:8.2f} GiB (each of the node's {plan.node_processes} "
                         f"processes keeps its own)")
            total = plan.host_node_total
        lines.append(f"  {'total':<16}{total / GiB:8.2f} GiB of {_gib(limit).strip()} usable: "
                     + ("fits" if ok else "DOES NOT FIT"))
    mb = plan.max_micro_batch
    lines.append(f"largest micro-batch that fits: {mb if mb is not None else 'none (not even 1)'}")
    if not plan.fits:
        lines.append("to make it fit: " + "; ".join(plan.suggestions or ["use a smaller model"]))
    return "\n".join(lines)
