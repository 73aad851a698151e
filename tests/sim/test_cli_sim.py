"""``flowtrain simulate``, ``flowtrain probe`` and ``flowtrain plan --machine`` from the command line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from flowtrain.cli import main

W1 = ["--model", "llama-3b", "--seq-len", "4096", "--batch-size", "4", "--micro-batch-size", "4", "--host-mem", "110"]


def test_simulate_json_has_the_numbers_and_a_trace_viz_opens(tmp_path, capsys):
    trace = tmp_path / "sim.json"
    assert main(["simulate", *W1, "--machine", "h200", "--json", "--trace", str(trace)]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("tokens_per_s", "model_tflops", "step_seconds", "busy_fraction", "critical_chain"):
        assert key in out
    assert out["tokens_per_s"] == pytest.approx(4 * 4096 / out["step_seconds"], rel=1e-3)
    assert set(out["busy_fraction"]) >= {"compute", "h2d", "d2h", "cpu"}
    from flowtrain.viz.load import load_input

    loaded = load_input(trace)
    assert len(loaded.tasks) > 100 and {"compute", "h2d"} <= {t.lane for t in loaded.tasks}


def test_simulate_text_and_a_run_that_does_not_fit(capsys):
    assert main(["simulate", *W1, "--machine", "rtx4090"]) == 0
    text = capsys.readouterr().out
    for words in ("on rtx4090", "predicted:", "tokens/s", "busy fraction", "critical chain"):
        assert words in text
    big = ["--model", "llama-8b", "--seq-len", "4096", "--batch-size", "16", "--micro-batch-size", "16"]
    assert main(["simulate", *big, "--machine", "rtx3080-10gb"]) == 2
    assert "does not fit" in capsys.readouterr().err


def test_a_slower_machine_predicts_a_slower_step(capsys):
    """The same plan on both (recomputed activations: with ``auto`` the A100's plan would keep
    some, which is another plan)."""
    speeds = {}
    for m in ("h200", "a100-80gb"):
        assert main(["simulate", *W1, "--machine", m, "--json", "--resident", "none", "--activations", "recompute"]) == 0
        speeds[m] = json.loads(capsys.readouterr().out)["tokens_per_s"]
    assert speeds["a100-80gb"] < 0.6 * speeds["h200"]


def test_plan_with_a_machine_says_which_configuration_is_fastest_and_why(capsys):
    argv = ["plan", "--model", "llama-1b", "--seq-len", "2048", "--batch-size", "4", "--micro-batch-size", "1",
            "--host-mem", "64", "--gpu-mem", "40", "--device", "cuda"]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert "fastest predicted" not in plain  # without --machine, plan is what it was
    assert main([*argv, "--machine", "h200", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    best, asked = out["fastest"]["best"], out["fastest"]["asked"]
    assert best["fits"] and best["tokens_per_s"] >= asked["tokens_per_s"]
    assert all(c["tokens_per_s"] <= best["tokens_per_s"] for c in out["fastest"]["tried"] if c["fits"])
    assert main([*argv, "--machine", "h200"]) == 0
    text = capsys.readouterr().out
    assert "fastest predicted on h200" in text and ("bound by" in text)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="plans for another machine from one without a GPU")
def test_plan_for_a_machine_from_a_computer_without_a_gpu_uses_that_machines_memory(capsys):
    """From a laptop, ``plan --machine`` plans for that machine's GPU and host memory (as simulate
    does, and filling its card as the machine's own plan would), not for this computer's CPU;
    --gpu-mem still says otherwise."""
    from flowtrain.plan.memory import GPU_FILL
    from flowtrain.sim.machine import load_machine

    argv = ["plan", "--model", "llama-1b", "--seq-len", "1024", "--batch-size", "8", "--json"]
    assert main(argv) in (0, 1)  # fits or not in this computer's memory
    here = json.loads(capsys.readouterr().out)
    assert here["device"] == "cpu" and "fastest" not in here
    for name in ("h200", "rtx4090"):
        assert main([*argv, "--machine", name]) in (0, 1)
        there = json.loads(capsys.readouterr().out)
        m = load_machine(name)
        assert there["device"] == "cuda" and there["fastest"]["best"]["fits"] == there["fits"]
        # as that machine's own plan fills its card without --gpu-mem: GPU_FILL of what is free
        assert there["gpu_limit"] == pytest.approx(GPU_FILL * m.gpu_mem_gib * 2**30, rel=1e-3)
        assert 0.8 * m.host_mem_gib * 2**30 < there["host_limit"] <= m.host_mem_gib * 2**30
    assert main([*argv, "--machine", "h200", "--gpu-mem", "10"]) == 0
    assert json.loads(capsys.readouterr().out)["gpu_limit"] < 10 * 2**30


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="plans for another machine from one without a GPU")
@pytest.mark.parametrize("machine, grouped", [("h200", True), ("gh200", True), ("rtx4090", False), ("a100-80gb", False)])
def test_a_plan_for_a_machine_counts_a_mixture_of_experts_as_its_gpu_runs_them(machine, grouped, capsys):
    """The grouped experts run where the GPU has grouped GEMMs (compute capability 9.0): the
    machine file says so, and a plan for that machine counts a sparse layer's work as they hold
    it (one stacked weight's gradient), elsewhere as the loop holds it; this computer, without a
    GPU, decides neither."""
    from flowtrain.model import preset
    from flowtrain.plan.memory import layer_work_bytes
    from flowtrain.sim.machine import load_machine

    assert load_machine(machine).grouped_mm is grouped
    argv = ["plan", "--model", "qwen3-moe-12l", "--seq-len", "4096", "--batch-size", "16", "--micro-batch-size", "2",
            "--gpu-mem", "10", "--host-mem", "118", "--machine", machine, "--json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    counts = {g: layer_work_bytes(preset("qwen3-moe-12l"), 2 * 4096, 2, True, grouped=g) for g in (True, False)}
    assert counts[True] < counts[False] and plan["gpu"]["layer_work"] == counts[grouped]
    assert main([*argv, "--device", "cuda"]) == 0  # the machine's GPU, named: the same plan
    assert json.loads(capsys.readouterr().out)["gpu"] == plan["gpu"]


def test_plan_with_a_machine_weighs_activations_choices_by_predicted_time(capsys):
    """On a GPU where the checkpoints of 16 sequences only just fit beside the state, the choice
    weighs recompute, offload and kept layers: the request to recompute (its slots shrunk to
    fit) is slower than the fastest choice the model predicts, which it names."""
    argv = ["plan", "--model", "llama-8b", "--seq-len", "4096", "--batch-size", "16", "--micro-batch-size", "2",
            "--host-mem", "118", "--gpu-mem", "24", "--device", "cuda", "--resident", "none",
            "--activations", "recompute", "--machine", "h200", "--json"]
    assert main(argv) == 0
    fastest = json.loads(capsys.readouterr().out)["fastest"]
    tried = fastest["tried"]
    assert fastest["asked"]["fits"] and fastest["best"]["tokens_per_s"] > fastest["asked"]["tokens_per_s"]
    choices = {c["settings"]["activations"] for c in tried}
    assert {"auto", "recompute", "offload", "keep"} <= choices
    fitting = [c for c in tried if c["fits"]]
    best = max(fitting, key=lambda c: c["tokens_per_s"])
    assert best["settings"]["activations"] != "recompute"
    assert f"--activations {best['settings']['activations']}" in best["flags"]


def test_probe_on_a_machine_without_a_gpu_measures_the_cpu_and_says_so(tmp_path, capsys):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this test is for a machine without a GPU")
    out = tmp_path / "here.json"
    assert main(["probe", "--quick", "--extends", "h200", "--out", str(out), "--disk-dir", str(tmp_path)]) == 0
    assert "CPU only" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["cpu_adam_gparams"] > 0 and "matmul_tflops" not in data and "probe" in data["source"]
    assert main(["simulate", *W1, "--machine", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["machine"] == data["name"]


@pytest.mark.parametrize("argv", [["simulate", "--help"], ["probe", "--help"]], ids=" ".join)
def test_help_imports_no_torch(argv):
    code = ("import sys\nfrom flowtrain.cli import main\ntry:\n    main(%r)\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules)" % (argv,))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == "False", proc.stderr


def test_list_machines_needs_no_run_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["simulate", "--list-machines"])
    assert "gh200" in capsys.readouterr().out


def _model_of_100_layers(tmp_path):
    """docs/simulate's 70B Llama shape with 100 layers: 16 micro-batches make ~11,000 tasks in
    three simulated steps."""
    from pathlib import Path

    config = json.loads((Path(__file__).parents[2] / "docs/simulate/llama-70b/config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 100}))
    return ["--model", str(tmp_path), "--seq-len", "4096", "--batch-size", "16", "--micro-batch-size", "1",
            "--host-mem", "2048", "--machine", "h200", "--json"]


def test_simulate_of_100_layers_compiles_each_step_shape_once(tmp_path, monkeypatch, capsys):
    """Planning (every placement tried, and every micro-batch size) and three simulated steps,
    in-process. The planner sizes hundreds of candidate plans for 100 layers; it took 2.5 s
    while it compiled the step graph (~30 ms for 100 layers x 16 micro-batches) for each
    candidate. Counted instead of timed: the planner compiles each step shape once, far fewer
    graphs than it sizes candidates, and the simulator compiles the three steps it simulates."""
    import msgspec

    from flowtrain.plan import planner as plan
    from flowtrain.sim import clock

    monkeypatch.setattr(plan, "_policy_budgets", plan._BudgetCache())  # nothing cached by earlier tests
    compiled, candidates, simulated = [], [], []
    real_compile, real_make, real_step = plan.compile_step, plan._make, clock.compile_step
    monkeypatch.setattr(plan, "compile_step", lambda spec: compiled.append(msgspec.json.encode(spec)) or real_compile(spec))
    monkeypatch.setattr(plan, "_make", lambda *a, **kw: candidates.append(a) or real_make(*a, **kw))
    monkeypatch.setattr(clock, "compile_step", lambda spec, step=0: simulated.append(step) or real_step(spec, step=step))
    assert main(["simulate", *_model_of_100_layers(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plan"]["layout"] == "staged" and out["tokens_per_s"] > 0
    assert len(compiled) == len(set(compiled)) > 0, "a step shape was compiled twice"
    assert 4 * len(compiled) < len(candidates), (len(compiled), len(candidates))  # not one graph per candidate
    assert simulated == [0, 1, 2]


def test_simulate_of_100_layers_end_to_end_in_a_fresh_process(tmp_path):
    """The whole command in its own process: it plans and simulates without importing torch
    (which took ~1 s of ~2.1 s on a 2-core machine; ~1.0 s without, see docs/simulate.md)."""
    code = ("import sys\nfrom flowtrain.cli import main\nrc = main(%r)\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch', file=sys.stderr)\nsys.exit(rc)"
            % (["simulate", *_model_of_100_layers(tmp_path)],))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["tokens_per_s"] > 0
    assert proc.stderr.strip().splitlines()[-1] == "no torch", proc.stderr


def test_simulate_is_not_capped_by_a_gpu_of_this_machine(monkeypatch, capsys):
    """simulate plans for --machine's GPU: a small GPU here (2 GiB free) changes nothing."""
    import torch

    assert main(["simulate", *W1, "--machine", "h200", "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * 2**30, 80 * 2**30))
    assert main(["simulate", *W1, "--machine", "h200", "--json"]) == 0
    beside_a_small_gpu = json.loads(capsys.readouterr().out)
    assert beside_a_small_gpu["plan"] == alone["plan"] and alone["plan"]["gpu_gib"] > 2


@pytest.mark.parametrize("command", ["simulate", "plan"])
def test_a_machine_run_without_seq_len_takes_the_default(command, capsys):
    """Without ``--seq-len`` the run takes the default length (128 for a token stream); the
    placement a machine's plan weighs by prediction is keyed by the request, which holds it as a
    plain int."""
    args = [command, "--model", "llama-3b", "--batch-size", "4", "--host-mem", "110", "--machine", "h200", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    if command == "simulate":
        assert out["tokens_per_s"] == pytest.approx(4 * 128 / out["step_seconds"], rel=1e-3)
    else:
        assert out["seq_len"] == 128


def test_plan_with_a_machine_where_nothing_fits_names_no_fastest(capsys):
    """Where no configuration fits the machine, plan says so instead of naming a fastest one at
    0 tokens/s, and exits 1 as for any plan that does not fit."""
    argv = ["plan", "--model", "qwen3-moe-12l", "--seq-len", "4096", "--batch-size", "1", "--host-mem", "20",
            "--machine", "rtx3080-10gb"]
    assert main(argv) == 1
    text = capsys.readouterr().out
    assert "no configuration tried fits on rtx3080-10gb" in text and "fastest predicted" not in text


@pytest.mark.parametrize("model, seq", [("llama-8b", 4096), ("qwen3-moe-12l", 4096), ("gemma3-1b", 2048)])
def test_simulate_reports_the_model_flops_of_the_convention(model, seq, capsys):
    """The simulator's FLOPs per token are the one count every report uses
    (flowtrain.model.counts): the input embedding left out, attention at heads x head_dim."""
    from flowtrain.model.counts import model_flops_per_token
    from flowtrain.model.presets import PRESETS

    assert main(["simulate", "--model", model, "--seq-len", str(seq), "--batch-size", "2", "--micro-batch-size", "1",
                 "--host-mem", "500", "--machine", "h200", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    want = model_flops_per_token(PRESETS[model], seq)
    assert out["model_flops_per_token"] == pytest.approx(want, rel=1e-6)
    assert out["model_tflops"] == pytest.approx(out["tokens_per_s"] * want / 1e12, abs=0.06)


TINY = ["--model", "tiny", "--seq-len", "64", "--batch-size", "2", "--micro-batch-size", "1"]


@pytest.mark.parametrize("workers, says", [
    ("0", "--adam-workers must be at least 1 (got 0)"),
    ("100000000", "--adam-workers must be at most"),
])
def test_simulate_checks_adam_workers_as_train_does(capsys, workers, says):
    """``--adam-workers 0`` ended in ``ValueError: task cpu_adam head c0 takes no slot`` and 10**8
    predicted 0 tokens/s with exit status 0; train refuses both, and simulate now shares its check."""
    assert main(["train", *TINY, "--adam-workers", workers]) == 2
    train_says = capsys.readouterr().err.strip()
    assert main(["simulate", *TINY, "--adam-workers", workers]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and err[0] == train_says, (err, train_says)


def test_simulate_says_where_memory_is_a_what_if(capsys):
    """``--gpu-mem 1000`` on a 10 GB card planned 130 GiB there and predicted twice its speed
    without a word. Memory above the machine's is a what-if the output names; below it, a cap as
    in train, with nothing to say."""
    argv = ["simulate", *TINY, "--machine", "rtx3080-10gb"]
    assert main([*argv, "--gpu-mem", "1000", "--host-mem", "100"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("what-if: --gpu-mem 1000 GiB is more than the 10 GiB of rtx3080-10gb's GPU: the plan and the "
                        "prediction are for that machine with 1000 GiB, which it does not have")
    assert not lines[1].startswith("what-if") and "predicted:" in "\n".join(lines)
    assert main([*argv, "--host-mem", "1000", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["what_if"] == ["what-if: --host-mem 1000 GiB is more than the 128 GiB of rtx3080-10gb's host memory: "
                              "the plan and the prediction are for that machine with 1000 GiB, which it does not have"]
    assert main([*argv, "--gpu-mem", "8", "--host-mem", "64", "--json"]) == 0
    assert "what_if" not in json.loads(capsys.readouterr().out)
    assert main([*argv, "--gpu-mem", "8"]) == 0
    assert "what-if" not in capsys.readouterr().out


def test_simulate_bounds_its_steps_as_graph_does(capsys):
    assert main(["simulate", *TINY, "--steps", "100000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--steps 100,000 of 2 micro-batches through 2 layers are 400,000 layer passes" in err[0]
    assert "give at most --steps 32,768" in err[0]
