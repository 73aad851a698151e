"""Predicted against measured: every benchmarked H200 and H100 run (docs/benchmarks.md), simulated with its settings.

The runs are a table checked in beside their results, ``docs/bench/measured_runs.json``: each
row names the run, the card it ran on (a machine file), its result line (``docs/bench/.../*.jsonl``,
written by ``flowtrain bench``: the model, shape, placement and slot budgets it ran with), the
command that ran it, its measured tokens/s, what else the simulator needs (``settings``) and the
error it is held to (``within``). The simulator gets exactly what ran (the placement through
``--resident``, the budgets as the engine enforced them) on the row's machine and predicts
tokens/s::

    for row in compare():      # python -m flowtrain.sim.validate prints the table
        row["run"], row["measured"], row["predicted"], row["error"], row["within"]

Each run is simulated with the attention kernel it ran, at the machine file's rate for that
kernel at the run's sequence length (``attention_tflops``): flash attention before cuDNN's became
``--attention-backend auto``'s choice on 2026-12-03 at 15:32 (the runs of 2026-12-02 and the
morning of 2026-12-03), cuDNN's after. A run without ``--gpu-mem`` is planned for the share of
the H200's memory that its planner took. The 262,144-token run saved the attention outputs of
the layers its trace shows (``save_attention``: its trace,
docs/bench/2026-12-03/saved-attention-8b256k-trace.json, says so in the tasks' ``phase``) and
offloaded the checkpoints it shows (``offload``); the simulator gets the same layers.

Two rows name what the simulator does not model (``not_modelled``) and are held to their miss:
the 10 GB card's allocator at its cap (the same step took 8.3 s with 1.75 GiB of room above its
peak, 9.3-9.9 s with 0.37: docs/bench/history/2026-12-05-predicted-vs-measured.md), and the
first mixture-of-experts run, whose expert backward added rows back with bf16 atomics and
unit-sized weight-gradient copies, both since removed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BENCH = Path(__file__).parents[2] / "docs" / "bench"

#: the table of measured runs: for each, its name, the card it ran on (a machine file), its
#: result file under docs/bench/ and how to pick its line (``result``, ``match``), its trace
#: where one is kept (``trace``, :mod:`flowtrain.sim.task_times`; ``tasks_within``: the error
#: its compute tasks' median times are held to, where the trace ran the code as it is), the command
#: that ran it, its measured tokens/s, what the simulator needs besides the result line
#: (``settings``), the error it is held to (``within``: 8%; 15% for the few runs that miss
#: it, docs/simulate.md says why) and, for a run the simulator is known to miss, what it does
#: not model (``not_modelled``; it must still miss). ``card`` is a shipped machine's name, or
#: a host's own machine file kept beside the results (``2026-12-07/gate12-h100-host.json``)
TABLE = BENCH / "measured_runs.json"
#: the keys of a run's extra arguments that are the simulator's (or the table's), not the planner's
_SIM_ONLY = ("attention_backend", "save_attention", "offload", "not_modelled", "within", "card", "trace", "tasks_within")


def table(path: Path = TABLE) -> list[dict]:
    """The measured runs (:data:`TABLE`), each a dict as the file holds it."""
    return json.loads(path.read_text())


def _extra(entry: dict) -> dict:
    extra = {k: tuple(v) if isinstance(v, list) else v for k, v in entry.get("settings", {}).items()}
    extra["within"] = entry["within"]
    extra["card"] = entry.get("card", "h200")
    if entry.get("not_modelled"):
        extra["not_modelled"] = entry["not_modelled"]
    for key in ("trace", "tasks_within"):  # its trace, kept under docs/bench/ (flowtrain.sim.task_times)
        if key in entry:
            extra[key] = entry[key]
    return extra


#: (name, result file, how to pick its line, extra arguments: the planner's, and of
#: :data:`_SIM_ONLY` the simulator's and the table's) of every run in :data:`TABLE`
RUNS = tuple((e["run"], e["result"], e["match"], _extra(e)) for e in table())


def measured_runs(bench: Path = BENCH) -> list[tuple[str, dict, dict]]:
    """(name, result line, extra arguments) of every run in :data:`RUNS` found in ``bench``."""
    out = []
    for name, file, match, extra in RUNS:
        path = bench / file
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if all(row.get(k) == v for k, v in match.items()):
                out.append((name, row, extra))
                break
    return out


def predict_run(row: dict, extra: dict, machine: str | None = None) -> dict:
    """Simulate one measured run with its recorded placement, slot budgets and attention kernel:
    its predicted and measured tokens/s, step time, busy lanes and bounding lane."""
    s = simulate_run(row, extra, machine).summary
    measured = row["tokens_per_s"]
    return {"not_modelled": extra.get("not_modelled"), "within": extra.get("within", 0.15),
            "predicted": round(s.tokens_per_s, 1), "measured": measured, "error": s.tokens_per_s / measured - 1,
            "step_seconds": round(s.step_seconds, 3), "measured_step_seconds": median_step(row),
            "busy_compute": round(s.busy_fraction.get("compute", 0.0), 3),
            "busy": {k: round(v, 3) for k, v in s.busy_fraction.items()},
            "measured_busy_compute": row["busy_fraction"].get("compute"),
            "lane_seconds": lane_seconds(row, s),
            "bound_by": max(((k, v) for k, v in s.critical_by_lane.items() if k != "wait"), key=lambda kv: kv[1])[0]}


def median_step(row: dict) -> float:
    """A result line's median step time (the upper one of an even count), seconds."""
    return sorted(row["step_seconds"])[len(row["step_seconds"]) // 2]


#: the lanes :func:`lane_seconds` sets side by side
LANES = ("compute", "h2d", "d2h", "cpu")


def lane_seconds(row: dict, summary: Any) -> dict[str, tuple[float, float]]:
    """Per lane of :data:`LANES`, the seconds it was busy in a step: ``(measured, predicted)``,
    each the lane's busy fraction times the step's time (the measured step the median of the
    run's). Where the two differ tells which work the simulator counts too fast or too slow,
    even when the step's time comes out right."""
    measured_step = median_step(row)
    return {lane: (row["busy_fraction"].get(lane, 0.0) * measured_step, summary.busy_fraction.get(lane, 0.0) * summary.step_seconds)
            for lane in LANES}


def simulate_run(row: dict, extra: dict, machine: str | None = None) -> Any:
    """The :class:`~flowtrain.sim.predict.Prediction` of one measured run (its result line
    ``row`` and table entry's ``extra``) on its card's machine file, or on ``machine``."""
    import msgspec
    import torch

    from ..model import preset
    from ..plan.memory import own_plan_card
    from ..plan.request import RunRequest
    from ..plan.planner import plan_run
    from .machine import load_machine
    from .predict import predict_shape, shape_of

    cfg = preset(row["model"])
    resident = ",".join(row["resident"]) or "none"
    card = extra.get("card", "h200")  # a shipped machine's name, or a host's machine file kept under docs/bench/
    m = load_machine(machine or (BENCH / card if card.endswith(".json") else card))
    # The runs of 2026-12-02 predate kept activations: every layer's backward ran its forward
    # again; later ones name their placement in ``extra``. The GPU is the H200's, and a run
    # without --gpu-mem planned for GPU_FILL of its free memory (the machine's gpu_mem_gib):
    # as a card for the planner, own_plan_card.
    settings = {"activations": "recompute", "order": row.get("order", "layer"),
                "gpu_mem": own_plan_card(m.gpu_mem_gib),
                **({"lora_state": row["lora_state"]} if "lora_state" in row else {}),  # as a LoRA run recorded it
                **{k: v for k, v in extra.items() if k not in _SIM_ONLY}}
    req = RunRequest(seq_len=row["seq_len"], batch_size=row["batch_size"], micro_batch_size=row["micro_batch_size"],
                     resident=resident, layout=row.get("layout", "auto"), host_mem=118.0,
                     lora_rank=row.get("lora_rank") or 0, grouped_experts=m.grouped_mm,
                     **settings)  # LoRA's default targets, as the runs took
    plan = plan_run(cfg, req, device=torch.device("cuda"), dtype=torch.bfloat16, policy=row["policy"], local_gpu=False)
    plan.budgets = dict(row["budgets"])  # as the engine enforced them in that run
    placed = {k: tuple(extra[k]) for k in ("save_attention", "offload") if k in extra}
    if placed:  # the layers the run saved attention outputs of and offloaded checkpoints of
        plan.spec = msgspec.structs.replace(plan.spec, **placed)
    shape = msgspec.structs.replace(shape_of(cfg, plan, req), attention_backend=extra.get("attention_backend", "auto"))
    return predict_shape(shape, plan, m, row["policy"], batch_size=req.batch_size)


def compare(machine: str | None = None) -> list[dict]:
    """Every run of :data:`TABLE`, predicted on its own card's machine file (or on ``machine``)."""
    return [{"run": name, **predict_run(row, extra, machine)} for name, row, extra in measured_runs()]


def holds(r: dict) -> bool:
    """A row of :func:`compare` is within the error it is held to; a row that names what the
    simulator does not model must still miss by more than that."""
    return abs(r["error"]) > r["within"] if r["not_modelled"] else abs(r["error"]) < r["within"]


def print_lanes(rows: list[dict]) -> None:
    """The ``--lanes`` table: per run, each lane's busy seconds a step, measured / predicted."""
    print("| run | error | " + " | ".join(f"{lane} s measured / predicted" for lane in LANES) + " |")
    print("| --- | --- |" + " --- |" * len(LANES))
    for r in rows:
        cells = [f"{m:.2f} / {q:.2f}" for m, q in (r["lane_seconds"][lane] for lane in LANES)]
        print(f"| {r['run']} | {r['error']:+.1%} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m flowtrain.sim.validate", description=__doc__.split("\n")[0])
    p.add_argument("--current", action="store_true", help="only the runs held to 8%%")
    p.add_argument("--lanes", action="store_true",
                   help="each lane's busy seconds a step, measured / predicted, instead of the error table")
    args = p.parse_args(argv)
    rows = [r for r in compare() if not args.current or r["within"] < 0.1]
    if args.lanes:
        print_lanes(rows)
        return 0
    print("| run | measured tok/s | predicted tok/s | error | held to | step s measured / predicted |"
          " compute busy measured / predicted | bound by |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['run']} | {r['measured']:,.0f} | {r['predicted']:,.0f} | {r['error']:+.1%} | "
              f"{'misses ' if r['not_modelled'] else ''}{r['within']:.0%} | "
              f"{r['measured_step_seconds']:.2f} / {r['step_seconds']:.2f} | "
              f"{r['measured_busy_compute']:.2f} / {r['busy_compute']:.2f} | {r['bound_by']}"
              + (f"; {r['not_modelled']}" if r["not_modelled"] else "") + " |")
    bad = [r["run"] for r in rows if not holds(r)]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} runs hold" + (f"; not: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
