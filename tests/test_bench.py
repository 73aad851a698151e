"""``flowtrain bench --scheduler``: a small run end to end, and the DAG size it picks."""

from __future__ import annotations

import asyncio
import json

import pytest

from flowtrain.bench import spec_for
from flowtrain.cli import main
from flowtrain.graph import compile_step


@pytest.mark.parametrize("tasks", [50, 1000, 10_000])
def test_the_dag_has_about_the_requested_number_of_tasks(tasks):
    spec = spec_for(tasks, 8)
    assert spec.micro_batches == 8
    per_layer = 2 * 8 + 5
    assert abs(compile_step(spec).number_of_nodes() - tasks) <= per_layer


def test_bench_scheduler_prints_and_writes_json(tmp_path, capsys):
    out = tmp_path / "sched.json"
    policy_before = asyncio.get_event_loop_policy()
    argv = ["bench", "--scheduler", "--tasks", "300", "--repeat", "2", "--policy", "sequential",
            "--policy", "lookahead", "--json", str(out)]
    assert main(argv) == 0
    assert asyncio.get_event_loop_policy() is policy_before, "uvloop must not leak out of the benchmark"
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["benchmark"] == "scheduler" and result["repeat"] == 2
    assert result["loop"] == "uvloop"
    assert abs(result["graph"]["tasks"] - 300) <= 21
    assert result["step_graph"] == {"layers": 100, "micro_batches": 8, "tasks": 2133, "edges": 5970}
    assert list(result["results"]) == ["sequential", "lookahead"]
    for policy, r in result["results"].items():
        assert len(r["runs_s"]) == len(r["step_runs_s"]) == 2
        assert r["us_per_task"] > 0 and r["us_per_task_min"] <= r["us_per_task"]
        assert f"{policy} " in printed
    assert result["machine"]["cpus"] >= 1


def test_bench_needs_a_mode_and_sane_numbers(capsys):
    with pytest.raises(SystemExit):
        main(["bench"])
    assert "--scheduler" in capsys.readouterr().err
    assert main(["bench", "--scheduler", "--tasks", "0"]) == 2
    assert capsys.readouterr().err == "flowtrain: error: --tasks must be at least 1 (got 0)\n"


def test_bench_refuses_an_output_it_could_not_write_before_it_runs(tmp_path, capsys):
    missing = tmp_path / "no" / "such"
    assert main(["bench", "--scheduler", "--tasks", "50", "--json", str(missing / "r.json")]) == 2
    err = capsys.readouterr().err
    assert err == f"flowtrain: error: --json {missing / 'r.json'}: its folder {missing} does not exist; create it first\n"
    argv = ["bench", "--model", "tiny", "--device", "cpu", "--seq-len", "16", "--batch-size", "2", "--micro-batch-size", "2",
            "--steps", "2", "--warmup", "1"]
    assert main([*argv, "--trace", str(tmp_path)]) == 2
    assert "is a folder; give a file name, e.g." in capsys.readouterr().err
    assert not any(tmp_path.iterdir()), "nothing was written"


def test_a_model_bench_says_when_host_memory_grew(tmp_path):
    """The result marks the process's peak resident memory when the plan was made and at the end
    of every step, and its resident memory then: where a run's host peak comes from."""
    out = tmp_path / "r.json"
    assert main(["bench", "--model", "tiny", "--device", "cpu", "--seq-len", "64", "--batch-size", "4",
                 "--micro-batch-size", "2", "--steps", "3", "--warmup", "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    peaks, resident = r["host_peak_by_step_gib"], r["host_resident_by_step_gib"]
    assert len(peaks) == len(resident) == 3  # the warm-up step too
    assert r["host_peak_at_plan_gib"] <= peaks[0] and peaks == sorted(peaks) and peaks[-1] <= r["host_peak_gib"]
    assert all(0 < now <= peak + 0.01 for now, peak in zip(resident, peaks))
    parts = r["host_rss_parts_gib"]  # the last step's resident memory by kind adds up to it
    assert set(parts) == {"anon", "file", "shmem", "anon_huge"} and parts["anon"] > 0 and parts["file"] > 0
    assert abs(parts["anon"] + parts["file"] + parts["shmem"] - resident[-1]) <= 0.05
    assert 0 <= parts["anon_huge"] <= parts["anon"]
    assert r["transparent_hugepages"] in ("always", "madvise", "never")
    assert set(r["host_rss_parts_at_plan_gib"]) == set(parts)
    mapped = r["host_mapped_gib"]  # the named mappings holding the most: torch's own library among them
    assert any("libtorch" in name for name in mapped), mapped
    assert list(mapped.values()) == sorted(mapped.values(), reverse=True)
    assert 0 < sum(mapped.values()) <= resident[-1] and not any(name.startswith("[") for name in mapped)
    full = r["gc_full_by_step"]  # Python's full collections, step by step (warm-up included)
    assert len(full) == 3 and all(g["count"] >= 0 and 0 <= g["longest_ms"] <= g["ms"] for g in full)


def test_a_model_bench_walks_the_page_tables_only_outside_the_measured_steps(monkeypatch):
    """The resident memory by kind and the largest mappings (``smaps``, a walk over every resident
    page, on the event loop) are read when the plan is made and after the last step, never at the
    end of a step the next one overlaps; the cheap per-step marks are read every step."""
    from flowtrain.bench import training_speed
    from flowtrain.bench.collections_timer import FullCollections

    calls: list[str] = []

    def record(name, real):
        def wrapped(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(FullCollections, "mark", record("step", FullCollections.mark))
    for name in ("_rss_parts_gib", "_largest_mappings_gib", "_rss_gib"):
        monkeypatch.setattr(training_speed, name, record(name, getattr(training_speed, name)))
    assert main(["bench", "--model", "tiny", "--device", "cpu", "--seq-len", "32", "--batch-size", "2",
                 "--micro-batch-size", "1", "--steps", "4", "--warmup", "1"]) == 0
    steps = [i for i, c in enumerate(calls) if c == "step"]
    assert len(steps) == 4 and calls.count("_rss_gib") == 4
    walks = [i for i, c in enumerate(calls) if c in ("_rss_parts_gib", "_largest_mappings_gib")]
    assert [calls[i] for i in walks] == ["_rss_parts_gib", "_rss_parts_gib", "_largest_mappings_gib"]
    assert walks[0] < steps[0] and walks[1] > steps[-1], calls


def test_asked_to_the_bench_walks_the_memory_map_every_step(tmp_path, monkeypatch):
    """--walk-memory-map-each-step puts the walk back at the end of every step, on the event
    loop, to measure what it costs: one walk a step (the last step's read serves for the end
    too), and the parts of each step in the result."""
    from flowtrain.bench import training_speed

    calls: list[str] = []
    real = training_speed._rss_parts_gib

    def counted():
        calls.append("walk")
        return real()

    monkeypatch.setattr(training_speed, "_rss_parts_gib", counted)
    out = tmp_path / "r.json"
    assert main(["bench", "--model", "tiny", "--device", "cpu", "--seq-len", "32", "--batch-size", "2",
                 "--micro-batch-size", "1", "--steps", "3", "--warmup", "1", "--walk-memory-map-each-step",
                 "--json", str(out)]) == 0
    assert len(calls) == 1 + 3  # the plan's, then one a step
    r = json.loads(out.read_text())
    by_step = r["host_rss_parts_by_step_gib"]
    assert len(by_step) == 3 and by_step[-1] == r["host_rss_parts_gib"]
    assert all(set(p) == {"anon", "file", "shmem", "anon_huge"} and p["anon"] > 0 for p in by_step)
    plain = tmp_path / "plain.json"
    assert main(["bench", "--model", "tiny", "--device", "cpu", "--seq-len", "32", "--batch-size", "2",
                 "--micro-batch-size", "1", "--steps", "3", "--warmup", "1", "--json", str(plain)]) == 0
    assert json.loads(plain.read_text())["host_rss_parts_by_step_gib"] is None


def test_full_collections_are_timed_in_the_step_they_ran():
    """A full collection counts in the step it ran in, with its time; a step without one has none;
    a collection of a younger generation is not counted; leaving stops the timing."""
    import gc

    from flowtrain.bench.collections_timer import FullCollections

    def cycles(n: int) -> None:
        for _ in range(n):
            a: list = []
            a.append(a)

    gc.disable()  # only the collections asked for below: none triggered by allocating
    try:
        with FullCollections() as full:
            cycles(10_000)
            gc.collect()  # full
            full.mark()
            gc.collect(0)
            full.mark()
        gc.collect()  # after leaving: not counted
    finally:
        gc.enable()
    (n1, t1, most1), (n2, t2, most2) = full.by_step
    assert n1 == 1 and 0 < most1 == t1 and (n2, t2, most2) == (0, 0.0, 0.0)


def test_the_pinned_host_memory_torch_holds_is_read_from_its_allocator():
    """On a GPU the result carries what torch's pinned allocator holds (bytes in GiB, blocks);
    a torch without the count adds nothing rather than failing the run."""
    from types import SimpleNamespace

    from flowtrain.bench.training_speed import _pinned_by_torch

    stats = {"allocated_bytes.current": 3 * 2**29, "num_host_alloc": 31, "allocated_bytes.peak": 2**31}
    counted = SimpleNamespace(cuda=SimpleNamespace(host_memory_stats=lambda: stats))
    result = _pinned_by_torch(counted)
    assert result["host_pinned_by_torch_gib"] == 1.5 and result["host_pinned_by_torch_blocks"] == 31
    assert set(result["host_pin_in_place_failed"]) == {"ranges", "gib"}
    assert _pinned_by_torch(SimpleNamespace(cuda=SimpleNamespace())) == {}
