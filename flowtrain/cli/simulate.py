"""``flowtrain simulate``: how fast a training run would be, without running it.

Takes ``flowtrain plan``'s arguments, plans the run for ``--machine`` (its GPU and host memory
unless ``--gpu-mem``/``--host-mem`` say otherwise), simulates a few steps on the virtual clock
with the real scheduler and policy, and prints the predicted tokens/s, model TFLOP/s, step
time, how busy each lane is and the critical chain::

    flowtrain simulate --model llama-8b --seq-len 4096 --batch-size 16 --micro-batch-size 4 --machine h200
    flowtrain simulate --model qwen-14b ... --machine gh200 --json --trace sim.json   # viz opens sim.json

``--device`` is ignored (the machine is the device); ``--precision`` applies as on a GPU.
``--gpu-mem``/``--host-mem`` below the machine's cap the plan as train's do; above it they ask
"what if this machine had more memory?": the prediction is for a machine that does not exist,
and the output says so in a line of its own (``what_if`` in ``--json``), naming both sizes.
The run's settings are checked as ``flowtrain train`` checks them (``--adam-workers`` 0 is
refused here as there), and ``--steps`` is bounded as ``flowtrain graph --steps`` is.
With ``--state-dir`` the plan keeps what host memory cannot hold of the optimizer state on disk
(``flowtrain plan`` shows what), and the prediction has the disk lane's reads and writes, at the
machine file's disk rates (``--disk-gbs`` in their place); the output adds the disk tier's
bytes and what the step needs of the disk (``disk_io`` in ``--json``)::

    flowtrain simulate --machine rtx3080-10gb --model llama-8b --seq-len 4096 --batch-size 4 \
        --micro-batch-size 2 --gpu-mem 10 --host-mem 32 --state-dir /nvme/state

With ``--objective dpo`` it also predicts the reference pass such a run makes before its first
step, forward only over every pair of ``--data`` (per pair without it), as the simulator
predicts any forward-only graph (``reference_pass`` in ``--json``; see ``flowtrain plan``).

Machines: a shipped name (``flowtrain simulate --list-machines`` names them) or a machine file
(``flowtrain probe`` writes one for the machine it runs on).
"""

from __future__ import annotations

import argparse
import json

from .flags import add_config_flags
from .plan import PLAN_FIELDS
from .train import flag_of

__all__ = ["SIMULATE_FIELDS", "add_arguments", "flag_of", "run", "what_if"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .plan import add_arguments as add_plan_arguments

    add_plan_arguments(p)  # the same run description as `flowtrain plan` (and its --machine)
    p.set_defaults(machine="h200")
    add_config_flags(p, ["steps", "adam_workers"], defaults={"steps": 3}, grouped=False, helps={
        "steps": "steps to simulate (the first has nothing to overlap with)",
        "adam_workers": "CPU Adam jobs at once, as flowtrain train's",
    })
    a = p.add_argument
    a("--trace", default=None, metavar="FILE", help="write the simulated trace (Chrome JSON, opens in flowtrain viz)")
    a("--list-machines", action=_ListMachines, nargs=0, help="list the shipped machines and exit")


class _ListMachines(argparse.Action):
    """Prints the shipped machines during parsing (like --help, before required arguments)."""

    def __call__(self, parser, namespace, values, option_string=None):
        from ..sim.machine import load_machine, machine_names

        for name in machine_names():
            m = load_machine(name)
            print(f"{name:<12} {m.description}  [{m.source.split(':')[0]}]")
        parser.exit()


#: the fields of ``TrainConfig`` that ``simulate`` takes: plan's, and the steps and CPU Adam
#: workers, each checked as train checks it
SIMULATE_FIELDS = (*PLAN_FIELDS, "steps", "adam_workers")


def what_if(args: argparse.Namespace, machine) -> list[str]:  # machine: a Machine
    """Where ``--gpu-mem`` or ``--host-mem`` give the machine more memory than its file says it
    has: one line each, naming both sizes (the prediction is for a machine that does not exist)."""
    out = []
    for flag, given, has, what in (("--gpu-mem", args.gpu_mem, machine.gpu_mem_gib, "GPU"),
                                   ("--host-mem", args.host_mem, machine.host_mem_gib, "host memory")):
        if given is not None and given > has:
            out.append(f"what-if: {flag} {given:g} GiB is more than the {has:g} GiB of {machine.name}'s {what}: the "
                       f"plan and the prediction are for that machine with {given:g} GiB, which it does not have")
    return out


def _check_steps(args: argparse.Namespace, plan) -> None:  # plan: a Plan
    """The simulated steps hold at most as many layer passes as one graph may
    (:data:`~flowtrain.graph.spec.MAX_LAYER_PASSES`, ``flowtrain graph --steps``'s bound; the
    simulator keeps every step's records), and always the 2 steps a steady step needs."""
    from ..errors import ConfigError
    from ..graph.spec import MAX_LAYER_PASSES

    per_step = plan.spec.layers * plan.spec.micro_batches
    most = max(2, MAX_LAYER_PASSES // per_step)
    if args.steps > most:
        raise ConfigError(
            f"{{steps}} {args.steps:,} of {plan.spec.micro_batches:,} micro-batches through {plan.spec.layers:,} layers "
            f"are {args.steps * per_step:,} layer passes to simulate, more than the {MAX_LAYER_PASSES:,} a graph may "
            f"hold: give at most {{steps}} {most:,}", named=True)


def run(args: argparse.Namespace) -> int:
    from ..errors import ConfigError
    from ..sim.machine import load_machine
    from .plan import plan_for

    if args.steps < 2:
        raise ConfigError(f"{{steps}} must be at least 2 to see a steady step (got {args.steps})", named=True)
    machine = load_machine(args.machine)
    if args.disk_gbs is not None:
        from ..sim.machine import with_disk_rate

        machine = with_disk_rate(machine, args.disk_gbs)
    cfg, req, plan, _, _, predictions = plan_for(args, machine, with_predictions=True, fields=SIMULATE_FIELDS)
    if not plan.fits:
        raise ConfigError(f"on {machine.name}: {plan.refusal()}")
    _check_steps(args, plan)
    notes = what_if(args, machine)
    # the planner may have predicted this plan already, choosing the order or the memory settings
    pred = predictions.prediction(req, plan, machine, adam_workers=args.adam_workers, steps=args.steps,
                                  world=req.processes, nodes=args.nnodes)
    if args.trace:
        from ..runtime.trace import write_chrome_trace

        write_chrome_trace(args.trace, [r for recs in pred.records for r in recs],
                           meta={"policy": args.policy, "model": args.model, "simulated": True, "machine": machine.name})
    out = {"model": args.model, "machine": machine.name, "machine_source": machine.source,
           "processes": req.processes, "nodes": args.nnodes,
           **pred.summary.to_dict(), "plan": {"layout": plan.layout, "resident": list(plan.spec.resident),
                                              "budgets": plan.budgets, "gpu_gib": round(plan.gpu_total / 2**30, 2),
                                              "host_gib": round(plan.host_total / 2**30, 2),
                                              "host_gib_per_node": round(plan.host_node_total / 2**30, 2),
                                              "placement_choice": plan.memory_choice}}
    if notes:
        out["what_if"] = notes
    disk = None
    if plan.disk_tier:
        from .plan import disk_report

        disk = disk_report(args, cfg, req, plan, machine, pred.summary)
        out["disk_io"] = disk[1]
    reference = None
    if args.objective == "dpo":
        from ..sim.predict import predict_reference_pass
        from .plan import reference_report

        ref = predict_reference_pass(pred.shape, plan, machine, args.policy, batch_size=req.batch_size * req.processes,
                                     rows=req.reference_rows if args.data is not None else None)
        reference = reference_report(args, req, ref)
        out["reference_pass"] = reference[1]
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        from ..sim.report import format_summary

        for line in notes:
            print(line)
        res = plan.spec.resident
        print(format_summary(pred.summary, header=(
            f"{args.model} on {machine.name} ({machine.description}): layout {plan.layout}, "
            f"resident {len(res)} units, slots {plan.budgets}, GPU {plan.gpu_total / 2**30:.1f} GiB, "
            f"host {plan.host_total / 2**30:.1f} GiB"
            + (f" ({plan.memory_choice})" if plan.memory_choice else ""))))
        if reference:
            print(reference[0])
        if disk:
            print("\n".join(disk[0]))
    return 0
