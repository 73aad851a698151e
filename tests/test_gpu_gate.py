"""The GPU gate's verdict (docs/bench/gate.py), on result lines written here: what passes, what
fails and why, and that the gate runs every job its baseline names."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
BENCH = ROOT / "docs" / "bench"


def _gate():
    spec = importlib.util.spec_from_file_location("gate", BENCH / "gate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(job, **kw):
    return {"job": job, "tokens_per_s": 1000.0, "gpu_peak_gib": 9.5, "planned_gpu_gib": 10.0,
            "gpu_process_peak_gib": 11.0, "model_tflops": 100.0, **kw}


def _verdict(tmp_path, rows, jobs):
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "baseline.json").write_text(json.dumps({"commit": "test", "jobs": jobs}))
    return _gate().main([str(tmp_path / "results.jsonl"), str(tmp_path / "baseline.json")])


def test_a_gate_whose_jobs_hold_passes(tmp_path, capsys):
    rows = [{"job": "tests", "passed": 5, "failures": 0}, _row("w1", tokens_per_s=940.0)]
    assert _verdict(tmp_path, rows, {"tests": {}, "w1": {"tokens_per_s": 1000}}) == 0
    assert "gate: 2 passed, 0 failed" in capsys.readouterr().out


def test_the_baseline_is_shown_in_the_runs_flops_count(tmp_path, capsys):
    """The baseline records tokens/s; its model TFLOP/s are printed in the count the run reports,
    so a change of the count moves both."""
    rows = [_row("w1", tokens_per_s=1100.0, model_tflops=440.0)]
    assert _verdict(tmp_path, rows, {"w1": {"tokens_per_s": 1000}}) == 0
    assert "1100.0 tok/s (1.100x) vs 1000 (400.0 TFLOP/s), 440.0 TFLOP/s" in capsys.readouterr().out


@pytest.mark.parametrize("row, base, why", [
    (_row("w1", tokens_per_s=920.0), {"tokens_per_s": 1000}, "below the baseline"),
    (_row("w1", gpu_peak_gib=10.5), {"tokens_per_s": 1000}, "more than the 10.0 GiB planned"),
    (_row("w1", gpu_peak_gib=8.0), {"tokens_per_s": 1000}, "above the 8.0 GiB measured"),
    (_row("w1", gpu_process_peak_gib=9.8), {"tokens_per_s": 1000, "process_gib_max": 9.5}, "over its bound"),
    ({"job": "w1", "failed": True, "error": "CUDA out of memory"}, {"tokens_per_s": 1000}, "out of memory"),
    (_row("w2"), {"tokens_per_s": 1000}, "did not run"),
], ids=["slower", "over its plan", "planned too high", "process too large", "failed", "missing"])
def test_each_way_a_job_fails(tmp_path, capsys, row, base, why):
    assert _verdict(tmp_path, [row], {"w1": base}) == 1
    out = capsys.readouterr().out
    assert "FAIL w1" in out and why in out


def test_the_gate_runs_every_job_its_baseline_names():
    script = (BENCH / "h200.sh").read_text()
    ran = re.search(r"GATE=1; set -- (.*)", script).group(1).split()
    baseline = json.loads((BENCH / "gate-baseline.json").read_text())["jobs"]
    assert [j for j in ran if j != "info"] == list(baseline)
    for job in baseline:  # each is a job the script knows
        assert re.search(rf"^\s+{re.escape(job)}\)", script, re.M), job


def _needs_gpu(source: str) -> tuple[bool, bool]:
    """``(has a test that runs only with a GPU, every such test is marked gpu)`` of a test file:
    a test skipped without CUDA is one, by marker or by a skip condition of its own."""
    only = re.findall(r"skipif\(not (?:torch\.)?cuda\.is_available\(\)", source)
    marked = re.findall(r"pytest\.mark\.gpu\b", source)
    return bool(only or marked), len(marked) >= len(only)


def test_the_gate_runs_every_test_that_needs_a_gpu():
    """A GPU test outside the gate's `tests` job never runs: CI has no GPU. Each file with one is
    in GPU_FILES (run whole) or in GPU_MARKED (its tests marked gpu run), and a file in
    GPU_MARKED marks every GPU test it has."""
    script = (BENCH / "h200.sh").read_text()
    lists = {name: re.search(rf'^{name}="([^"]*)"', script, re.M).group(1).split() for name in ("GPU_FILES", "GPU_MARKED")}
    assert "$GPU_FILES" in script and "-m gpu $GPU_MARKED" in script
    for name in (p for files in lists.values() for p in files):
        assert (ROOT / name).is_file(), f"{name} is named in h200.sh but does not exist"
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        name = str(path.relative_to(ROOT))
        needs, all_marked = _needs_gpu(path.read_text())
        if not needs:
            continue
        assert name in lists["GPU_FILES"] or name in lists["GPU_MARKED"], f"{name} has GPU tests the gate does not run"
        if name in lists["GPU_MARKED"]:
            assert all_marked, f"{name}: a GPU test is not marked gpu, so -m gpu leaves it out"


def test_results_from_another_card_meet_that_cards_baseline(tmp_path, capsys):
    """An H100 plans to its own memory: its results are judged against the H100's numbers, not
    the H200's, and results naming no card in ``cards`` against the top level."""
    jobs = {"w1": {"tokens_per_s": 1000}}
    baseline = {"commit": "h200", "jobs": jobs, "cards": {"H100": {"commit": "h100", "jobs": {"w1": {"tokens_per_s": 800}}}}}
    (tmp_path / "baseline.json").write_text(json.dumps(baseline))
    for gpu, want in (("NVIDIA H100 80GB HBM3", 0), ("NVIDIA H200", 1)):
        (tmp_path / "results.jsonl").write_text(json.dumps(_row("w1", tokens_per_s=820.0, gpu=gpu)) + "\n")
        assert _gate().main([str(tmp_path / "results.jsonl"), str(tmp_path / "baseline.json")]) == want
        assert f"on {gpu} (baseline {'h100' if want == 0 else 'h200'})" in capsys.readouterr().out


def test_recording_on_a_card_writes_only_that_cards_baseline(tmp_path):
    baseline = {"commit": "h200", "jobs": {"w1": {"tokens_per_s": 1000}},
                "cards": {"H100": {"commit": "h100", "jobs": {"w1": {"tokens_per_s": 800}}}}}
    (tmp_path / "baseline.json").write_text(json.dumps(baseline))
    (tmp_path / "results.jsonl").write_text(json.dumps(_row("w1", tokens_per_s=850.0, gpu="NVIDIA H100 PCIe")) + "\n")
    _gate().main([str(tmp_path / "results.jsonl"), str(tmp_path / "baseline.json"), "--record", "new"])
    saved = json.loads((tmp_path / "baseline.json").read_text())
    assert saved["jobs"]["w1"]["tokens_per_s"] == 1000 and saved["commit"] == "h200"
    assert saved["cards"]["H100"] == {"commit": "new", "jobs": {"w1": {"tokens_per_s": 850.0}}}


def _bench_jobs(script: str) -> list[tuple[str, list[str]]]:
    """Each ``bench NAME ARGS`` job of h200.sh with its arguments as bash passes them: ``$W`` as
    the script sets it, ``${VAR:-default}`` at its default, ``$(seq ...)`` run, ``$OUT`` a folder."""
    w = re.search(r'^W="([^"]*)"', script, re.M).group(1)
    jobs = []
    for name, args in re.findall(r"(?<![\w$-])bench ([a-z0-9]+) ([^;\n]*);;", script):
        words = subprocess.run(["bash", "-c", 'eval "set -- $1"; printf "%s\\0" "$@"', "-", args],
                               env={"W": w, "OUT": "/out", "PATH": os.environ["PATH"]},
                               capture_output=True, text=True, check=True).stdout
        jobs.append((name, words.split("\0")[:-1]))
    return jobs


def test_every_bench_job_of_the_gpu_script_takes_flags_flowtrain_bench_has():
    """The script's jobs run only on a GPU machine, where a misspelt flag costs a device call:
    each must parse with ``flowtrain bench``'s own arguments."""
    from flowtrain.bench import add_arguments

    jobs = _bench_jobs((BENCH / "h200.sh").read_text())
    assert len(jobs) > 30 and {"w1", "8b10o", "w1walk", "8b10owalk"} <= {name for name, _ in jobs}
    parser = argparse.ArgumentParser(prog="flowtrain bench", exit_on_error=False)
    add_arguments(parser)
    for name, args in jobs:
        try:
            parser.parse_args(args)
        except (argparse.ArgumentError, SystemExit) as exc:
            raise AssertionError(f"h200.sh job {name}: {args}: {exc}") from exc
