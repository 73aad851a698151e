"""Data parallel training: torchrun processes over gloo, each with its share of the micro-batches.

The real test starts ``torchrun --standalone --nproc-per-node 2 -m flowtrain train`` on the CPU
and compares the weights it saves with one process trained on the same global batch.

Each torchrun takes seconds to start: the default tier runs one policy and placement; the slow
tier runs the other policies and placements, the refusals, the checkpoints, the signal and the
host memory of two processes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flowtrain.cli import main
from flowtrain.errors import ConfigError
from flowtrain.graph.compiler import StepSpec, compile_step
from flowtrain.graph.tasks import OffloadGrad, ReduceGrad
from flowtrain.train.distributed import World, world_from_env

RUN = ["--model", "tiny", "--steps", "3", "--batch-size", "8", "--micro-batch-size", "2", "--seq-len", "32",
       "--device", "cpu", "--precision", "fp32", "--lr", "1e-3", "--no-progress"]


def torchrun(tmp_path: Path, out: str, *extra: str, n: int = 2, run: list[str] = RUN) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           "-m", "flowtrain", "train", *run, "--out", str(tmp_path / out), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)


def assert_same_models(one: Path, two: Path) -> None:
    """The models two runs wrote hold the same tensors, each to 1e-5 relative."""
    a, b = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    assert a.keys() == b.keys()
    for name, ref in a.items():
        err = float((b[name] - ref).norm() / ref.norm())
        assert err <= 1e-5, f"{name}: relative error {err:.2e}"


RESIDENT = ["--resident", "embed,head,layer.1"]
SLOW = pytest.mark.slow


@pytest.mark.parametrize("policy, clip, placement", [
    ("double_buffer", [], []), pytest.param("double_buffer", ["--grad-clip", "0.5"], [], marks=SLOW),
    pytest.param("sequential", [], [], marks=SLOW), pytest.param("sequential", ["--grad-clip", "0.5"], [], marks=SLOW),
    pytest.param("double_buffer", [], RESIDENT, marks=SLOW),
    pytest.param("double_buffer", ["--grad-clip", "0.5"], RESIDENT, marks=SLOW),
], ids=["double_buffer", "double_buffer-clip", "sequential", "sequential-clip", "resident", "resident-clip"])
def test_two_processes_train_the_weights_of_one_with_the_same_global_batch(tmp_path, policy, clip, placement):
    assert main(["train", *RUN, "--out", str(tmp_path / "one"), "--policy", policy, *clip, *placement]) == 0
    proc = torchrun(tmp_path, "two", "--policy", policy, *clip, *placement, "--trace", str(tmp_path / "trace.json"),
                     "--metrics", str(tmp_path / "metrics.jsonl"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_models(tmp_path / "one", tmp_path / "two")
    # rank 0 reports once, for the whole batch; each rank traces its own share
    assert proc.stdout.count("done: 3 steps") == 1
    assert proc.stdout.count("processes  2 (torchrun), each running 4 of the 8 sequences of a step; "
                             "the node's 2 processes share one host copy of the state") == 1
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
    for trace in (tmp_path / "trace.json", tmp_path / "trace.rank1.json"):
        text = trace.read_text()
        assert "reduce_grad L1" in text and "forward L0 m1" in text and "forward L0 m2" not in text
        assert "sync_step" in text  # the processes share one host copy of the state


def test_each_streamed_unit_is_summed_over_the_processes_before_it_leaves():
    g = compile_step(StepSpec(layers=2, micro_batches=2, staged=True, tied=True, reduce=True))
    reduces = [t for t in g if isinstance(t, ReduceGrad)]
    assert sorted((t.unit, t.layer) for t in reduces) == [("embed", None), ("head", None), ("layer", 0), ("layer", 1)]
    for t in g:
        if isinstance(t, OffloadGrad):
            assert any(isinstance(p, ReduceGrad) and (p.unit, p.layer) == (t.unit, t.layer) for p in g.predecessors(t))
    for r in reduces:  # after every micro-batch's gradient of the unit
        writers = {p.kind for p in g.predecessors(r)}
        assert writers & {"backward", "loss", "embed_backward"}
    # a resident unit is summed too, before the step's gate (found_inf) and its gpu_adam
    g = compile_step(StepSpec(layers=2, micro_batches=2, staged=True, resident=("layer.0",), reduce=True))
    (total,) = [t for t in g if isinstance(t, ReduceGrad) and t.layer == 0]
    gate = next(t for t in g if t.kind == "found_inf")
    assert g.has_edge(total, gate) and all(p.kind == "backward" for p in g.predecessors(total))


def test_a_process_takes_its_consecutive_share_of_the_micro_batches():
    mbs = list(range(8))
    assert [World(rank=r, size=4).share(mbs) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ConfigError, match="do not split over 3 processes"):
        World(rank=0, size=3).share(mbs)
    assert world_from_env({}) == World()
    assert world_from_env({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}) == World(rank=1, size=2, local_rank=1, local_size=2)
    with pytest.raises(ConfigError, match="RANK 2 is not a process"):
        world_from_env({"WORLD_SIZE": "2", "RANK": "2"})


@SLOW  # in-process: test_data_parallel_sim.py::test_a_batch_the_processes_cannot_share_is_refused
@pytest.mark.parametrize("extra, needle", [
    (["--batch-size", "6"], "does not split into 2 processes"),
    (["--micro-batch-size", "8"], "does not split into 2 processes"),
])
def test_a_batch_or_placement_the_processes_cannot_share_ends_in_one_line(tmp_path, extra, needle):
    proc = torchrun(tmp_path, "bad", *extra)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("flowtrain: error:")]
    assert errors and needle in errors[0], proc.stderr[-2000:]
    assert not (tmp_path / "bad" / "model.safetensors").exists()


def test_without_torchrun_it_is_one_process(monkeypatch):
    """No torchrun: one process, no process group, every micro-batch its own."""
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    world = world_from_env()
    assert not world.parallel and world.leader and world.share([1, 2, 3]) == [1, 2, 3]
    assert not torch.distributed.is_initialized()


@SLOW  # one process: test_signals.py::test_signal_with_checkpoints_saves_then_resumes
def test_a_signal_stops_every_process_after_the_same_step_and_rank_0_saves_it(tmp_path):
    """Ctrl-C to torchrun reaches every process; they agree at the next step boundary, finish
    the steps in flight (none waits in an all-reduce the others left), and rank 0 writes the
    last step's checkpoint: one line, no error, every checkpoint whole."""
    import json
    import signal
    import time

    out, metrics = tmp_path / "out", tmp_path / "m.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "flowtrain",
           "train", *RUN[:2], "--batch-size", "8", "--micro-batch-size", "2", "--seq-len", "32", "--device", "cpu",
           "--no-progress", "--steps", "100000", "--save-every", "1000", "--out", str(out), "--metrics", str(metrics)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    hang_guard = time.monotonic() + 300  # only ever reached if the run hangs before its third step
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None, proc.communicate()
        if time.monotonic() > hang_guard:
            proc.kill()
            raise AssertionError(f"hang guard: no third metrics line; {proc.communicate()}")
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)  # a hang guard: the processes stop at the next step boundary
    lines = [x for x in err.splitlines() if x.startswith("flowtrain:")]
    assert len(lines) == 1 and "stopped by SIGINT after step" in lines[0] and "saved to" in lines[0], err[-2000:]
    last = json.loads(metrics.read_text().splitlines()[-1])["step"]
    saved = out / f"checkpoint-{last}"  # both count steps from 1
    assert (saved / "trainer_state.json").exists() and not list(out.glob(".*"))
    assert not (out / "model.safetensors").exists()  # the run did not finish


@SLOW
def test_a_checkpoint_of_two_processes_resumes_on_one(tmp_path):
    """Every process holds the whole state and the data order is the global batch's, so a
    checkpoint written under torchrun continues on another number of processes: 4 steps on two,
    resumed for 2 more on one, end where 6 steps on one do."""
    base = [a for a in RUN if a not in ("--steps", "3")]
    assert main(["train", *base, "--steps", "6", "--out", str(tmp_path / "one")]) == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "flowtrain",
           "train", *base, "--steps", "4", "--save-every", "2", "--out", str(tmp_path / "two")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert main(["train", *base, "--steps", "6", "--resume", str(tmp_path / "two"), "--out", str(tmp_path / "two")]) == 0
    one, resumed = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    for name, ref in one.items():
        assert float((resumed[name] - ref).norm() / ref.norm()) <= 1e-5, name


@SLOW  # its graph edges: test_the_streamed_units_are_dealt_to_the_processes_of_a_node_and_a_barrier_ends_the_step
def test_a_checkpoint_written_mid_run_from_the_shared_state_resumes_exactly_on_two(tmp_path):
    """Rank 0 writes step 2's checkpoint from the node's shared state while the next step runs
    and the other process owns half the units (the edges that keep the owner's step-3 update of
    a unit behind its write are checked on the graph below). Resumed on two processes, whose
    shared state every process fills from the checkpoint, 6 steps end where 6 steps on one do."""
    base = [a for a in RUN if a not in ("--steps", "3")]
    assert main(["train", *base, "--steps", "6", "--out", str(tmp_path / "one")]) == 0
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "flowtrain",
           "train", *base, "--steps"]
    proc = subprocess.run([*run, "4", "--save-every", "2", "--out", str(tmp_path / "two")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = subprocess.run([*run, "6", "--resume", str(tmp_path / "two" / "checkpoint-2"), "--out", str(tmp_path / "again")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    one, resumed = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    for name, ref in one.items():
        assert float((resumed[name] - ref).norm() / ref.norm()) <= 1e-5, name


def test_the_streamed_units_are_dealt_to_the_processes_of_a_node_and_a_barrier_ends_the_step():
    """Sharing the state: each streamed unit has one owner among the node's processes (round
    robin over the streamed units), a ``sync_step`` follows every ``cpu_adam`` and
    ``verify_step``, and the next step's fetches and this step's saves wait for it."""
    from flowtrain.graph import add_saves, save_edges
    from flowtrain.graph.compiler import cross_step_edges
    from flowtrain.graph.tasks import CpuAdam, Fetch, SaveUnit, SyncStep, VerifyStep

    spec = StepSpec(layers=4, micro_batches=2, staged=True, reduce=True, share=3, resident=("layer.1",)).validate()
    streamed = [("embed", None), ("layer", 0), ("layer", 2), ("layer", 3), ("head", None)]
    assert [spec.owner(*u) for u in streamed] == [0, 1, 2, 0, 1]
    g = compile_step(spec, 0)
    (sync,) = [t for t in g if isinstance(t, SyncStep)]
    before = {t for t in g if isinstance(t, (CpuAdam, VerifyStep))}
    assert before and before <= set(g.predecessors(sync))
    saves = add_saves(g, spec)
    assert all(g.has_edge(sync, s) for s in saves if isinstance(s, SaveUnit))
    nxt = compile_step(spec, 1)
    edges = set(cross_step_edges(g, nxt, spec))
    assert all((sync, t) in edges for t in nxt if isinstance(t, Fetch))
    held = {(a.unit, a.layer, b.kind) for a, b in save_edges(saves, nxt)}
    assert ("layer", 2, "reduce_grad") in held and ("layer", 2, "cpu_adam") in held
    with pytest.raises(ConfigError, match="share"):
        StepSpec(layers=2, share=2).validate()  # sharing needs the gradients summed


def test_processes_sharing_the_state_plan_the_node_once():
    """The plan counts the shared state (master, Adam) once per node and each process's own
    buffers once per process; ``--undo-mem`` is the node's."""
    from flowtrain.model import preset
    from flowtrain.plan.request import RunRequest
    from flowtrain.plan.planner import plan_run

    cfg = preset("tiny")
    undo = 0.001  # GiB: less than a step of tiny's updates, so the budget is what is held
    one = plan_run(cfg, RunRequest(seq_len=32, batch_size=4, micro_batch_size=2, undo_mem=undo),
                   device=torch.device("cpu"), dtype=torch.float32)
    two = plan_run(cfg, RunRequest(seq_len=32, batch_size=4, micro_batch_size=2, undo_mem=undo, processes=2, share=2),
                   device=torch.device("cpu"), dtype=torch.float32)
    shared = one.host["master"] + one.host["adam"]
    assert two.host["master"] + two.host["adam"] == shared
    assert two.host_node_total == shared + 2 * (two.host_total - shared)
    assert 0 < two.host["undo_record"] <= undo * 2**30 / 2 < one.host["undo_record"] <= undo * 2**30
    assert one.host_node_total == one.host_total


def _pss(pid: int) -> dict[str, int]:
    """A process's proportional set sizes in bytes (shared pages split among their users)."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key, *rest = line.split()
            if key in ("Pss:", "Pss_Shmem:"):
                out[key[:-1]] = int(rest[0]) * 1024
    except OSError:
        pass
    return out


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return kids


def _peak_pss(cmd: list[str], cwd: Path) -> tuple[int, dict[str, int], str]:
    """Run torchrun's ``cmd``; the largest sum over its worker processes of their PSS, sampled
    every 20 ms, with that sample's parts."""
    import time

    log = cwd / "torchrun.log"
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd)
        best: dict[str, int] = {"Pss": 0}
        while proc.poll() is None:
            total: dict[str, int] = {}
            for kid in _children(proc.pid):
                for k, v in _pss(kid).items():
                    total[k] = total.get(k, 0) + v
            if total.get("Pss", 0) > best["Pss"]:
                best = total
            time.sleep(0.02)
    return proc.returncode, best, log.read_text()


@SLOW  # minutes: a 2.4 GB state trained by one process, then by two
@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="PSS is read from Linux's /proc")
def test_two_processes_on_a_node_take_about_the_host_memory_of_one(tmp_path):
    """The fp32 master and Adam state exist once per node: the second process adds its own
    working memory (torch, buffers: under a GiB) to the peak host memory of the node (PSS, so
    shared pages count once), never a second copy of the state (2.4 GB here). The bound, three quarters of the state,
    sits near halfway between the two, so a loaded machine's noise in either run cannot cross it.
    ``--host-mem`` is given, so the plan (and whether it is refused) does not depend on what this
    machine has free now."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512, '
        '"intermediate_size": 1536, "num_hidden_layers": 64, "num_attention_heads": 8, "num_key_value_heads": 2, '
        '"vocab_size": 8192, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": true}')
    # made in a process of its own: this one stays small (a child started later would inherit
    # its peak resident size as the start of its own ru_maxrss)
    make = ("import sys, torch; from flowtrain.train.host_state import HostState; "
            "from flowtrain.model.model_dir import read_config; "
            "s = HostState.create(read_config(sys.argv[1]), pin=False); s.init_random(0); "
            "s.save(sys.argv[1], torch.bfloat16); print(sum(u.flat_map.numel for u in s.units))")
    made = subprocess.run([sys.executable, "-c", make, str(model)], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    state_bytes = 12 * int(made.stdout.split()[-1])  # master, m and v in fp32
    shm_before = set(Path("/dev/shm").glob("flowtrain-*")) if Path("/dev/shm").is_dir() else set()
    peaks = {}
    for n in (1, 2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", "-m",
               "flowtrain", "train", "--model", str(model), "--byte-tokenizer", "--seq-len", "64", "--batch-size", "4",
               "--micro-batch-size", "1", "--steps", "2", "--device", "cpu", "--no-progress", "--host-mem", "64"]
        rc, peaks[n], out = _peak_pss(cmd, tmp_path)
        assert rc == 0, out[-3000:]
    assert peaks[2].get("Pss_Shmem", 0) >= 0.95 * state_bytes  # the state lives in shared memory
    assert peaks[1]["Pss"] >= state_bytes
    added = peaks[2]["Pss"] - peaks[1]["Pss"]
    assert added <= 0.75 * state_bytes, (added, state_bytes, peaks[1], peaks[2])
    if Path("/dev/shm").is_dir():  # the files were unlinked once mapped: nothing is left behind
        assert set(Path("/dev/shm").glob("flowtrain-*")) == shm_before


@pytest.mark.parametrize("extra", [[], pytest.param(["--lora-state", "host", "--grad-clip", "0.5"], marks=SLOW)],
                         ids=["adapters-on-device", "adapters-in-host-memory-clip"])
def test_two_processes_train_the_adapters_of_one(tmp_path, extra):
    """LoRA under torchrun: each process keeps its own frozen base and adapters, the adapters'
    gradient is summed over the processes (``reduce_grad``) before their AdamW, and the adapters
    end as one process's on the same global batch."""
    lora = ["--lora-rank", "4", *extra]
    assert main(["train", *RUN, "--out", str(tmp_path / "one"), *lora]) == 0
    proc = torchrun(tmp_path, "two", *lora, "--trace", str(tmp_path / "trace.json"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = load_file(tmp_path / "one" / "adapter_model.safetensors")
    two = load_file(tmp_path / "two" / "adapter_model.safetensors")
    assert one.keys() == two.keys()
    for name, ref in one.items():
        err = float((two[name] - ref).norm() / ref.norm())
        assert err <= 1e-5, f"{name}: relative error {err:.2e}"
    assert proc.stdout.count("done: 3 steps") == 1 and "share one host copy" not in proc.stdout
    assert "reduce_grad adapter L1" in (tmp_path / "trace.json").read_text()


def test_two_processes_train_the_dpo_weights_of_one(tmp_path):
    """DPO under torchrun: each process computes the reference of every pair before the first
    step, trains its share of the step's pairs (whole pairs: a micro-batch is one pair here), the
    loss averaged over the whole step's pairs, and the weights and the step's rewards end as one
    process's on the same global batch."""
    pytest.importorskip("transformers")
    from test_dpo import make_pairs
    from test_train_vs_hf import make_checkpoint

    make_checkpoint(tmp_path / "model")
    make_pairs(tmp_path / "pairs.jsonl")  # 12 pairs: 3 steps of 4
    dpo = ["--model", str(tmp_path / "model"), "--data", str(tmp_path / "pairs.jsonl"), "--objective", "dpo",
           "--steps", "3", "--batch-size", "8", "--micro-batch-size", "2", "--seq-len", "16", "--no-shuffle",
           "--device", "cpu", "--precision", "fp32", "--lr", "0.01", "--lr-schedule", "constant",
           "--warmup-steps", "0", "--no-progress"]
    assert main(["train", *dpo, "--out", str(tmp_path / "one"), "--metrics", str(tmp_path / "one.jsonl")]) == 0
    proc = torchrun(tmp_path, "two", "--metrics", str(tmp_path / "two.jsonl"), run=dpo)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_models(tmp_path / "one", tmp_path / "two")
    assert proc.stdout.count("reference log-probabilities of 12 pairs computed") == 1  # rank 0 says it
    assert proc.stdout.count("done: 3 steps") == 1
    one, two = ([json.loads(x) for x in (tmp_path / f"{n}.jsonl").read_text().splitlines()] for n in ("one", "two"))
    assert len(one) == len(two) == 3
    for a, b in zip(one, two):
        for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)


@pytest.mark.parametrize("resident", [[], pytest.param(["--resident", "layer.2"], marks=SLOW)],
                         ids=["streamed", "resident"])
def test_two_processes_skip_the_experts_idle_in_the_whole_batch(tmp_path, resident):
    """``--skip-idle-experts`` under torchrun: an expert is idle only where no process's
    micro-batch reached it (the counts are summed with the gradient), each expert's step count
    lives in the node's shared state, and the weights end as one process's on the same batch."""
    from test_idle_experts import _setup

    _setup(tmp_path, "qwen3-moe")
    moe = ["--model", str(tmp_path / "model"), "--data", str(tmp_path / "data.jsonl"), "--steps", "3",
           "--batch-size", "4", "--micro-batch-size", "1", "--seq-len", "12", "--device", "cpu", "--precision", "fp32",
           "--no-progress", "--no-packing", "--skip-idle-experts", "--save-every", "3", *resident]
    assert main(["train", *moe, "--out", str(tmp_path / "one")]) == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "flowtrain", "train", *moe, "--out", str(tmp_path / "two")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    for name, ref in one.items():
        err = float((two[name] - ref).norm() / ref.norm())
        assert err <= 1e-5, f"{name}: relative error {err:.2e}"
    layer0 = "checkpoint-3/optimizer-00002-of-00005.safetensors"
    a, b = load_file(tmp_path / "one" / layer0), load_file(tmp_path / "two" / layer0)
    assert torch.equal(a["expert_steps"], b["expert_steps"]) and float(a["expert_steps"].min()) < 3


@SLOW
def test_two_processes_train_the_experts_adapters_of_one(tmp_path):
    """LoRA over a mixture of experts' router and experts under torchrun: every expert's adapter
    gradient summed over the processes, the adapters as one process's on the same batch."""
    from test_idle_experts import _setup

    _setup(tmp_path, "qwen3-moe")
    moe = ["--model", str(tmp_path / "model"), "--data", str(tmp_path / "data.jsonl"), "--steps", "3",
           "--batch-size", "4", "--micro-batch-size", "1", "--seq-len", "12", "--device", "cpu", "--precision", "fp32",
           "--no-progress", "--no-packing", "--lora-rank", "2", "--lora-state", "host"]
    assert main(["train", *moe, "--out", str(tmp_path / "one")]) == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "flowtrain", "train", *moe, "--out", str(tmp_path / "two")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = load_file(tmp_path / "one" / "adapter_model.safetensors")
    two = load_file(tmp_path / "two" / "adapter_model.safetensors")
    assert one.keys() == two.keys() and any(".experts." in k for k in one)
    for name, ref in one.items():
        err = float((two[name] - ref).norm() / ref.norm())
        assert err <= 1e-5, f"{name}: relative error {err:.2e}"
