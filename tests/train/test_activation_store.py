"""The activation store: each hand-off between a step's tasks is put once and taken once, and a
step that ends with anything of it still held fails loudly instead of leaking device memory."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from flowtrain.train import program as program_module
from flowtrain.train.activations import ActivationStore, Table
from flowtrain.train.run import TrainConfig, train


def test_a_table_hands_each_value_over_once():
    t: Table[int] = Table("input")
    t.put((0, 1, 0), 7)
    with pytest.raises(RuntimeError, match=r"input \(0, 1, 0\) put twice"):
        t.put((0, 1, 0), 8)
    assert t.peek((0, 1, 0)) == 7 and len(t) == 1  # a checkpoint: read, still there
    assert t.take((0, 1, 0)) == 7 and len(t) == 0
    with pytest.raises(RuntimeError, match=r"input \(0, 1, 0\) taken before it was put"):
        t.take((0, 1, 0))
    assert t.take_if_present((0, 1, 0)) is None


def test_the_store_says_what_a_step_left_behind():
    store = ActivationStore()
    store.grads.put((3, 5, 1), torch.zeros(1))
    store.inputs.put((4, 0, 0), torch.zeros(1))  # the next step's: not step 3's business
    store.eval_inputs.put((3, 2, 0), torch.zeros(1))
    assert store.held(3) == {"output gradient": [(3, 5, 1)]}
    with pytest.raises(AssertionError, match=r"step 3 ended holding \{'output gradient': \[\(3, 5, 1\)\]\}"):
        store.check_empty(3)
    store.check_empty(4, evaluation=True)
    with pytest.raises(AssertionError, match="the evaluation after step 3"):
        store.check_empty(3, evaluation=True)


def _programs(monkeypatch) -> list:
    made = []
    init = program_module.StepProgram.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(program_module.StepProgram, "__init__", recording_init)
    return made


@pytest.mark.parametrize("placement", [dict(activations="recompute", checkpoint_every=2),
                                       dict(activations="recompute", checkpoint_every=1),
                                       dict(activations="keep"), dict(activations="offload"),
                                       dict(activations="attention")])
def test_every_placement_ends_each_step_with_nothing_held(tmp_path, monkeypatch, placement):
    made = _programs(monkeypatch)
    train(TrainConfig(steps=3, batch_size=4, micro_batch_size=2, device="cpu", progress=False,
                      out=str(tmp_path / "out"), **placement))
    (program,) = made
    assert len(program.store) == 0


def test_a_task_that_leaves_a_tensor_behind_fails_its_step(tmp_path, monkeypatch):
    loss = program_module.HANDLERS["loss"]

    def leaky_loss(program, task, ctx):
        loss(program, task, ctx)
        program.store.grads.put((task.step, 10_000, task.micro_batch), torch.zeros(1))  # nobody takes it

    monkeypatch.setitem(program_module.HANDLERS, "loss", leaky_loss)
    with pytest.raises(AssertionError, match=r"activation store: step 0 ended holding \{'output gradient'"):
        train(TrainConfig(steps=2, device="cpu", progress=False, out=str(tmp_path / "out")))


@pytest.mark.parametrize("mode", [
    dict(),  # full training: the embedding's backward drops a micro-batch's ids and documents
    dict(lora_rank=4),  # LoRA: no embedding backward; layer 0's backward drops them
    dict(lora_rank=4, lora_state="host"),
    dict(lora_rank=4, order="micro", policy="lookahead"),
    dict(lora_rank=4, data="rows"),  # packed examples: each micro-batch's documents and rotary tables
    dict(layer_path="generic"),  # transformers' layers: their arguments and the stem's graph
    dict(layer_path="generic", lora_rank=4),
    dict(eval_every=1),  # held-out micro-batches: the loss drops theirs
])
def test_every_mode_ends_each_step_with_no_micro_batch_left_in_the_layer_runner(tmp_path, monkeypatch, mode):
    """What a micro-batch leaves on the device for its layers (token ids, packed documents with
    their rotary tables, a generic layer's arguments) is dropped by whichever task uses it last,
    in every objective and layout; a step that ends with any of it held fails loudly
    (the program's end_step), so a leak of one per step cannot pass unseen."""
    made = _programs(monkeypatch)
    extra = {"eval_data": str(tmp_path / "held.txt")} if "eval_every" in mode else {}
    if extra:
        (tmp_path / "held.txt").write_text("held-out text to score after every step. " * 40)
    if mode.get("data") == "rows":  # short examples, several packed into each sequence
        rows = [{"prompt": f"question {i}?", "completion": f" answer {i}."} for i in range(64)]
        (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        mode = {**mode, "data": str(tmp_path / "rows.jsonl"), "seq_len": 64}
    train(TrainConfig(steps=3, batch_size=4, micro_batch_size=2, device="cpu", progress=False,
                      out=str(tmp_path / "out"), **mode, **extra))
    (program,) = made
    assert all(not table for table in program.layers.tables().values())
    assert program.layers.tables()  # the runner has tables to check


def test_a_runner_that_keeps_a_micro_batch_fails_its_step(tmp_path, monkeypatch):
    from flowtrain.train.program.layer_runner import NativeLayerRunner

    backward = NativeLayerRunner.embed_backward

    def keeping(self, s, m, dx, g):  # uses the ids, and keeps them
        ids = self.dev_ids[(s, m)]
        backward(self, s, m, dx, g)
        self.dev_ids[(s, m)] = ids

    monkeypatch.setattr(NativeLayerRunner, "embed_backward", keeping)
    with pytest.raises(AssertionError, match=r"layer runner: step 0 ended holding \{'token ids': \[\(0, 0\), \(0, 1\)\]\}"):
        train(TrainConfig(steps=2, device="cpu", progress=False, out=str(tmp_path / "out")))


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/status")
@pytest.mark.parametrize("mode", [("--lora-rank", "4"), ()])
def test_two_thousand_steps_hold_the_memory_of_two_hundred(tmp_path, mode):
    """The real command, resident memory read at step 200 and at step 2,000: what each step
    leaves behind would show as growth (a leak of a few KB a step, over 100 MiB here)."""
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "flowtrain.cli", "train", "--model", "tiny", "--steps", "2000",
                             "--batch-size", "2", "--micro-batch-size", "1", "--seq-len", "32", "--device", "cpu",
                             "--no-progress", "--metrics", str(metrics), *mode],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    rss = {}
    try:
        for step in (200, 1990):
            while not metrics.exists() or len(metrics.read_text().splitlines()) < step:
                assert proc.poll() is None, proc.communicate()[1]
                time.sleep(0.02)
            rss[step] = _rss_mib(proc.pid)
    finally:
        _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert rss[1990] - rss[200] < 40, rss
