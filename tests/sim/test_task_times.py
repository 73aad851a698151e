"""The simulator's task costs against the traces kept in docs/bench/ (flowtrain.sim.task_times):
a run whose trace ran the code as it is has each compute task's median time (a layer's forward
and backward, the loss, a layer's GPU AdamW) within the error its table entry names. A
deterministic computation over checked-in files, not a timing test."""

from __future__ import annotations

import pytest

from flowtrain.sim.task_times import compare_tasks, main, measured_medians, traced_runs
from flowtrain.sim.validate import BENCH, measured_runs

HELD = [(name, extra["tasks_within"]) for name, _, extra in measured_runs() if "tasks_within" in extra]
COMPUTE = {("forward", "layer"), ("backward", "layer"), ("loss", "head"), ("gpu_adam", "layer")}


def test_every_kept_trace_is_found_and_some_are_held():
    names = traced_runs()
    assert {name for name, _ in HELD} <= set(names)
    assert len(HELD) >= 5
    assert all(extra["trace"].endswith(".json") for _, _, extra in measured_runs() if "trace" in extra)


@pytest.mark.parametrize("name, within", HELD, ids=[n for n, _ in HELD])
def test_compute_tasks_take_their_predicted_time(name, within):
    rows = {(r["kind"], r["unit"]): r for r in compare_tasks(name)}
    held = COMPUTE & set(rows)
    assert {("forward", "layer"), ("backward", "layer"), ("loss", "head")} <= held
    off = {k: rows[k]["ratio"] - 1 for k in held}
    assert all(abs(v) < within for v in off.values()), off


def test_a_trace_median_is_of_the_steps_after_the_first(tmp_path):
    trace = tmp_path / "t.json"
    events = [{"ph": "X", "dur": d, "args": {"kind": "forward", "unit": "layer", "step": s}}
              for s, d in ((0, 9000.0), (1, 1000.0), (1, 3000.0), (2, 2000.0))]
    trace.write_text(__import__("json").dumps({"traceEvents": events + [{"ph": "M", "args": {}}]}))
    assert measured_medians(trace) == {("forward", "layer"): (0.002, 3)}


def test_the_command_line_names_a_run_it_cannot_compare(capsys):
    assert main(["no such run"]) == 2
    err = capsys.readouterr().err
    assert "no measured run named" in err and err.count("\n") == 1
    untraced = next(n for n, _, extra in measured_runs(BENCH) if "trace" not in extra)
    assert main([untraced]) == 2
    assert "keeps no trace" in capsys.readouterr().err
    assert main([HELD[0][0]]) == 0
    assert "| forward | layer |" in capsys.readouterr().out


def test_a_run_on_its_own_hosts_file_can_be_set_beside_the_shipped_one(capsys):
    """A run simulated on a host's own machine file (a CPU AdamW rate of its own) compares on the
    shipped file with ``--machine``: the GPU tasks' predictions stay, cpu_adam's scale with the
    rate; a machine that does not exist is one line and exit 2."""
    import json

    from flowtrain.sim.machine import load_machine

    entry = next(e for e in json.loads((BENCH / "measured_runs.json").read_text())
                 if e.get("card", "").endswith(".json") and "trace" in e)
    name, card = entry["run"], entry["card"]
    own = {(r["kind"], r["unit"]): r for r in compare_tasks(name)}
    shipped = {(r["kind"], r["unit"]): r for r in compare_tasks(name, machine="h100-sxm")}
    host, base = load_machine(BENCH / card), load_machine("h100-sxm")
    assert host.cpu_adam_gparams != base.cpu_adam_gparams
    adam = own[("cpu_adam", "layer")]
    assert shipped[("cpu_adam", "layer")]["predicted_ms"] == pytest.approx(
        adam["predicted_ms"] * host.cpu_adam_gparams / base.cpu_adam_gparams, rel=1e-3)
    assert shipped[("forward", "layer")]["predicted_ms"] == own[("forward", "layer")]["predicted_ms"]
    assert main(["--machine", "no-such-machine", name]) == 2
    err = capsys.readouterr().err
    assert "no-such-machine" in err and err.count("\n") == 1
