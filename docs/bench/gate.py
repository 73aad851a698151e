"""The GPU gate's verdict: each gate job's result against its recorded baseline.

``bash docs/bench/h200.sh gate`` runs the GPU tests and the gate's benchmarks, each appending one
JSON line to ``$OUT/results.jsonl``, then calls this script::

    python3 docs/bench/gate.py $OUT/results.jsonl docs/bench/gate-baseline.json

It prints one line per job and exits 1 if any job failed, ran out of memory, ran more than
``SLOWER`` below its baseline tokens/s (the baseline of the card the results ran on: the
top-level ``jobs`` are the H200's, ``cards`` holds others by a part of their name, such as
``"H100"``), allocated more GPU memory than its plan, was planned more
than ``PLAN_ERROR`` away from what it measured, or (where the baseline names a bound) took more
device memory as a whole process than the card it stands for allows. A job of the gate with no
line in the results failed too. ``--record COMMIT`` writes the measured numbers as the new
baseline instead (after a change that is meant to move them; say why in the commit).

Standard library only: it runs on the GPU machine's own Python.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

#: a run this much below its baseline tokens/s fails the gate (run-to-run noise is about 2%)
SLOWER = 0.07
#: planned GPU memory may differ from the measured peak by this much (of the measured peak)
PLAN_ERROR = 0.10


def load_results(path: Path) -> dict[str, dict]:
    """The last result line of each job (a job run twice counts its last run)."""
    out: dict[str, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            out[row["job"]] = row
    return out


def card_of(results: dict[str, dict]) -> str | None:
    """The GPU the benchmarks ran on, as ``flowtrain bench`` names it (``None`` if no job says)."""
    return next((row["gpu"] for row in results.values() if row.get("gpu")), None)


def baseline_for(baseline: dict, card: str | None) -> dict:
    """The baseline section for ``card``: the entry of ``cards`` whose key is part of its name,
    else the top level (the H200's). A section has ``commit`` and ``jobs``."""
    for key, section in baseline.get("cards", {}).items():
        if card and key in card:
            return section
    return baseline


def check(job: str, row: dict | None, base: dict) -> list[str]:
    """What is wrong with one job's result; empty if it passes."""
    if row is None:
        return ["no result (the job did not run)"]
    if row.get("failed"):
        return [f"failed: {row.get('error', 'see log.txt')}"]
    if job == "tests":
        return [f"{row.get('failures', '?')} GPU tests failed"] if row.get("failures") or not row.get("passed") else []
    bad = []
    tok, want = row.get("tokens_per_s"), base.get("tokens_per_s")
    if want and (tok is None or tok < (1 - SLOWER) * want):
        bad.append(f"{tok} tok/s is more than {SLOWER:.0%} below the baseline {want}")
    peak, planned = row.get("gpu_peak_gib"), row.get("planned_gpu_gib")
    if peak is not None and planned is not None:
        if peak > planned:
            bad.append(f"allocated {peak} GiB, more than the {planned} GiB planned")
        elif planned - peak > PLAN_ERROR * peak:
            bad.append(f"planned {planned} GiB, more than {PLAN_ERROR:.0%} above the {peak} GiB measured")
    bound, whole = base.get("process_gib_max"), row.get("gpu_process_peak_gib")
    if bound is not None and (whole is None or whole > bound):
        bad.append(f"the process took {whole} GiB of the device, over its bound of {bound} GiB")
    return bad


def line(job: str, row: dict | None, base: dict, bad: list[str]) -> str:
    row = row or {}
    if job == "tests":
        got = f"{row.get('passed', 0)} passed, {row.get('failures', 0)} failed"
    else:
        tok, want, tflops = row.get("tokens_per_s"), base.get("tokens_per_s"), row.get("model_tflops")
        ratio = f" ({tok / want:.3f}x)" if tok and want else ""
        # the baseline's model TFLOP/s in the run's own count (the same FLOPs a token)
        then = f" ({want * tflops / tok:.1f} TFLOP/s)" if tok and want and tflops else ""
        got = (f"{tok} tok/s{ratio} vs {want}{then}, {tflops} TFLOP/s, GPU {row.get('gpu_peak_gib')} "
               f"of {row.get('planned_gpu_gib')} GiB planned, process {row.get('gpu_process_peak_gib')} GiB")
        if row.get("gpu_alloc_retries"):
            got += f", {row['gpu_alloc_retries']} allocator retries"
    return f"{'PASS' if not bad else 'FAIL'} {job}: {got}" + "".join(f"\n     - {b}" for b in bad)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("baseline", type=Path)
    ap.add_argument("--record", metavar="COMMIT", help="write these results as the new baseline")
    args = ap.parse_args(argv)
    whole = json.loads(args.baseline.read_text())
    results = load_results(args.results)
    card = card_of(results)
    baseline = baseline_for(whole, card)
    jobs = baseline["jobs"]
    if args.record:
        for job, row in results.items():
            if job in jobs and job != "tests" and not row.get("failed"):
                jobs[job]["tokens_per_s"] = row["tokens_per_s"]
        baseline["commit"] = args.record
        args.baseline.write_text(json.dumps(whole, indent=1) + "\n")
        print(f"recorded {args.baseline} at {args.record}")
    failed = 0
    for job, base in jobs.items():
        bad = check(job, results.get(job), base)
        failed += bool(bad)
        print(line(job, results.get(job), base, bad))
    print(f"gate: {len(jobs) - failed} passed, {failed} failed on {card or 'an unnamed card'} "
          f"(baseline {baseline.get('commit', '?')})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
