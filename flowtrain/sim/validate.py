"""Predicted against measured: every H200 run of docs/benchmarks.md, simulated with its settings.

Each run's result line (``docs/bench/.../*.jsonl``, written by ``flowtrain bench``) records the
model, shape, placement and slot budgets it ran with; the simulator gets exactly those (the
placement through ``--resident``, the budgets as the engine enforced them) on the ``h200``
machine and predicts tokens/s::

    for row in compare():      # the table in docs/simulate.md; tests/sim hold it to 15%
        row["run"], row["measured"], row["predicted"], row["error"]

Only W1's trace of 2026-12-02 was used to fit the cost model (docs/simulate.md); every other run
is a check.
"""

from __future__ import annotations

import json
from pathlib import Path

BENCH = Path(__file__).parents[2] / "docs" / "bench"

#: kept activations, as ``--activations auto`` planned them (the runs of 2026-12-02 recomputed)
_AUTO = {"activations": "auto"}
#: (name in docs/benchmarks.md, result file, how to pick its line, extra planner arguments)
RUNS = (
    ("llama-3b W1 (4 seq/step)", "2026-12-02/after-fix-8b10-w1-results.jsonl", {"job": "w1"}, {}),
    ("llama-3b W2 (16 seq/step)", "2026-12-02/w1-w2-results.jsonl", {"batch_size": 16}, {}),
    ("llama-8b, 16 seq/step, streamed", "2026-12-02/capacity-8b-14b-results.jsonl", {"model": "llama-8b"}, {}),
    ("qwen-14b, 8 seq/step", "2026-12-02/capacity-8b-14b-results.jsonl", {"model": "qwen-14b"}, {}),
    ("llama-8b under --gpu-mem 10", "2026-12-02/after-fix-8b10-w1-results.jsonl", {"job": "8b10"}, {"gpu_mem": 10.0}),
    ("llama-3b W1, Adam reordered, two weight slots", "2026-12-03/adam-order-two-weight-slots-results.jsonl",
     {"job": "w1"}, _AUTO),
    ("llama-3b W1, Adam reordered", "2026-12-03/adam-order-results.jsonl", {"job": "w1"}, _AUTO),
    ("llama-3b W2, micro-batch order", "2026-12-03/adam-order-results.jsonl", {"job": "w2m"}, _AUTO),
    ("llama-8b, 16 seq/step, micro-batch order", "2026-12-03/adam-order-results.jsonl", {"job": "8bm"}, _AUTO),
)


def measured_runs(bench: Path = BENCH) -> list[tuple[str, dict, dict]]:
    """(name, result line, extra planner arguments) of every run in :data:`RUNS` found in ``bench``."""
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


def predict_run(row: dict, extra: dict, machine: str = "h200") -> dict:
    """Simulate one measured run with its recorded placement and slot budgets."""
    import torch

    from ..train.model import preset
    from ..train.plan import RunRequest, plan_run
    from .machine import load_machine
    from .predict import predict

    cfg = preset(row["model"])
    resident = ",".join(row["resident"]) or "none"
    # The runs of 2026-12-02 predate kept activations: every layer's backward ran its forward
    # again; later ones name their placement in ``extra``. The GPU is the H200's.
    settings = {"activations": "recompute", "order": row.get("order", "layer"), "gpu_mem": 139.8, **extra}
    req = RunRequest(seq_len=row["seq_len"], batch_size=row["batch_size"], micro_batch_size=row["micro_batch_size"],
                     resident=resident, layout=row.get("layout", "auto"), host_mem=118.0, **settings)
    plan = plan_run(cfg, req, device=torch.device("cuda"), dtype=torch.bfloat16, policy=row["policy"], local_gpu=False)
    plan.budgets = dict(row["budgets"])  # as the engine enforced them in that run
    pred = predict(cfg, plan, req, load_machine(machine), row["policy"])
    s = pred.summary
    measured = row["tokens_per_s"]
    return {"predicted": round(s.tokens_per_s, 1), "measured": measured, "error": s.tokens_per_s / measured - 1,
            "step_seconds": round(s.step_seconds, 3), "measured_step_seconds": sorted(row["step_seconds"])[len(row["step_seconds"]) // 2],
            "busy_compute": round(s.busy_fraction.get("compute", 0.0), 3),
            "measured_busy_compute": row["busy_fraction"].get("compute"),
            "bound_by": max(((k, v) for k, v in s.critical_by_lane.items() if k != "wait"), key=lambda kv: kv[1])[0]}


def compare(machine: str = "h200") -> list[dict]:
    return [{"run": name, **predict_run(row, extra, machine)} for name, row, extra in measured_runs()]


if __name__ == "__main__":
    print("| run | measured tok/s | predicted tok/s | error | step s measured / predicted | compute busy measured / predicted | bound by |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in compare():
        print(f"| {r['run']} | {r['measured']:,.0f} | {r['predicted']:,.0f} | {r['error']:+.1%} | "
              f"{r['measured_step_seconds']:.2f} / {r['step_seconds']:.2f} | "
              f"{r['measured_busy_compute']:.2f} / {r['busy_compute']:.2f} | {r['bound_by']} |")
