"""``flowtrain plan`` and ``flowtrain simulate`` of a DPO run count its reference pass: the pairs
of ``--data`` as train reads them, the host memory of their reference log-probabilities (in the
host total), and in ``simulate`` the pass's predicted time, the simulator's forward-only graph
once per step's sequences, so linear in the pairs. A run of any other objective prints what it
printed before: no such entry."""

from __future__ import annotations

import json

import pytest

from flowtrain.cli import main
from flowtrain.train.config.run_config import TrainConfig
from flowtrain.train.prepare import prepare

#: 8 sequences a step (4 pairs), micro-batches of 2 pairs
RUN = ["--model", "tiny", "--seq-len", "32", "--batch-size", "8", "--micro-batch-size", "4", "--host-mem", "64"]


@pytest.fixture(autouse=True)
def _data_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWTRAIN_CACHE", str(tmp_path / "cache"))


def pairs_file(path, n):
    rows = [{"prompt_input_ids": [1 + i % 50, 7], "chosen_input_ids": [3, 4, 2], "rejected_input_ids": [5, 2]}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_json(capsys, *argv) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_counts_the_pairs_train_computes_the_reference_of(tmp_path, capsys):
    data = pairs_file(tmp_path / "prefs.jsonl", 10)  # 2.5 steps' pairs: the last pass is shorter
    plan = run_json(capsys, "plan", *RUN, "--objective", "dpo", "--data", str(data))
    ref = plan["reference_pass"]
    assert (ref["pairs"], ref["sequences"], ref["passes"], ref["sequences_per_pass"]) == (10, 20, 3, 8)
    assert ref["host_bytes"] == plan["host"]["reference_logps"] == 20 * 4 and ref["in_host_total"]
    assert main(["train", *RUN, "--objective", "dpo", "--data", str(data), "--steps", "1", "--device", "cpu",
                 "--no-progress"]) == 0
    assert "reference log-probabilities of 10 pairs computed in" in capsys.readouterr().out
    run = prepare(TrainConfig(model="tiny", data=str(data), objective="dpo", seq_len=32, batch_size=8,
                              micro_batch_size=4, steps=1, device="cpu", host_mem=64))
    assert run.plan.host["reference_logps"] == 20 * 4  # train plans what plan said

    # without --data: the same pass per pair, nothing in the host total; the rest of the plan alike
    bare = run_json(capsys, "plan", *RUN, "--objective", "dpo")
    assert bare["reference_pass"]["pairs"] is None and bare["reference_pass"]["host_bytes_per_pair"] == 8
    assert "reference_logps" not in bare["host"] and not bare["reference_pass"]["in_host_total"]
    assert plan["host_total"] - bare["host_total"] == 20 * 4
    assert main(["plan", *RUN, "--objective", "dpo", "--data", str(data)]) == 0
    line, = [x for x in capsys.readouterr().out.splitlines() if x.startswith("reference pass")]
    assert line.startswith(f"reference pass (DPO): 10 pairs of {data}, forward only before step 1 in 3 passes of 8 "
                           "sequences; their log-probabilities take 80 B of host memory")


def test_simulate_predicts_the_reference_pass_linear_in_the_pairs(tmp_path, capsys):
    sim = ["simulate", *RUN, "--objective", "dpo", "--machine", "h200"]
    out = {n: run_json(capsys, *sim, "--data", str(pairs_file(tmp_path / f"p{n}.jsonl", n)))["reference_pass"]
           for n in (8, 16, 32)}
    assert [out[n]["pairs"] for n in out] == [8, 16, 32]
    per_pair = out[8]["seconds_per_pair"]
    assert per_pair > 0
    for n, ref in out.items():
        assert ref["seconds"] == pytest.approx(n * per_pair, rel=1e-4)
        assert ref["seconds_per_pair"] == per_pair and ref["seconds_per_1000_pairs"] == pytest.approx(1000 * per_pair)
    # 10 pairs: two passes of 4 and one of 2, shorter than a full one
    ten = run_json(capsys, *sim, "--data", str(pairs_file(tmp_path / "p10.jsonl", 10)))["reference_pass"]
    assert ten["passes"] == 3 and 2 * out[8]["seconds_per_pass"] < ten["seconds"] < 3 * out[8]["seconds_per_pass"]
    # without data: the rate alone, the same
    bare = run_json(capsys, *sim)["reference_pass"]
    assert bare["seconds"] is None and bare["seconds_per_pair"] == per_pair
    # a forward-only pass costs less than the training step over the same sequences
    step = run_json(capsys, *sim)["step_seconds"]
    assert out[8]["seconds_per_pass"] < step
    assert main(sim) == 0
    assert sum(x.startswith("reference pass (DPO): one forward-only pass") for x in capsys.readouterr().out.splitlines()) == 1


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_a_run_of_another_objective_has_no_reference_pass(command, capsys):
    argv = [command, *RUN, *(["--machine", "h200"] if command == "simulate" else [])]
    for objective in ([], ["--objective", "sft"]):
        out = run_json(capsys, *argv, *objective)
        assert "reference_pass" not in out and "reference_logps" not in out.get("host", {})
        assert main([*argv, *objective]) == 0
        assert "reference" not in capsys.readouterr().out
