"""Optimizer state on disk (``--state-dir``): the same weights, the state really there, less memory.

Each check runs real training steps on the CPU in fp32: with ``--disk-state all`` or
``moments`` the model after three steps is bit for bit the one trained without a state folder;
while the run trains, the folder holds at least 8 bytes per parameter (read from inside a
``write_state`` task, so there is no race with the run's start or end); a process that
moves its state to disk peaks lower in resident memory by at least half the bytes moved; and the
final model reads the masters on disk back one unit at a time into the same files as from memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file

from flowtrain.ckpt.checkpoints import CheckpointWriter, load_training_state
from flowtrain.graph import StepSpec, compile_step, compile_steps
from flowtrain.graph.tasks import ReadState, WriteState
from flowtrain.model import model_flat_maps
from flowtrain.model.presets import PRESETS
from flowtrain.plan.buffer_sizes import grad_chunks, staging_numel
from flowtrain.policy import natural_order
from flowtrain.runtime.trace import Instrument
from flowtrain.train.disk_state import FIELDS, StateStore, field_numel
from flowtrain.train.host_state import HostState
from flowtrain.train.run import TrainConfig, train

TINY = dict(model="tiny", steps=3, batch_size=4, micro_batch_size=2, seq_len=32, progress=False, device="cpu",
            save_dtype="fp32")


def _weights(tmp: Path, name: str, **kw) -> tuple[dict[str, torch.Tensor], list]:
    seen: list = []

    class Kinds(Instrument):
        def on_record(self, record) -> None:
            seen.append(record.task.kind)

    train(TrainConfig(**TINY, out=str(tmp / name), **kw), instruments=[Kinds()])
    return load_file(str(tmp / name / "model.safetensors")), seen


@pytest.mark.parametrize("mode", ["all", "moments"])
def test_three_steps_bit_identical(tmp_path, mode):
    base, kinds = _weights(tmp_path, "base")
    assert "read_state" not in kinds
    disk, kinds = _weights(tmp_path, mode, state_dir=str(tmp_path / "state"), disk_state=mode)
    # every streamed unit's state went through the disk, every step (staged chunks: embed, head in pieces)
    assert kinds.count("read_state") == kinds.count("write_state") == kinds.count("cpu_adam") > 0
    assert base.keys() == disk.keys()
    for k in base:
        assert torch.equal(base[k], disk[k]), k
    assert not (tmp_path / "state").exists()  # the files and the folder the run made are gone


def test_state_folder_holds_the_state_while_training(tmp_path):
    state = tmp_path / "state"
    sizes: list[int] = []

    class Measure(Instrument):
        def on_record(self, record) -> None:  # a write_state has run: the files are there
            if record.task.kind == "write_state" and not sizes:
                sizes.append(sum(p.stat().st_blocks * 512 for p in state.rglob("*.state")))

    params = []
    train(TrainConfig(**TINY, state_dir=str(state), disk_state="all"), instruments=[Measure()],
          on_plan=lambda plan: params.append(plan.params))
    assert sizes and sizes[0] >= 8 * params[0], (sizes, params)


def test_compiled_reads_run_ahead_and_cross_steps():
    """The first ``disk_ahead`` reads open the step; every later one follows the write whose slot
    it takes; the next step's read of a unit waits for this step's write of it."""
    spec = StepSpec(layers=3, staged=True, disk=("embed", "layer.0", "layer.1", "layer.2", "head"), disk_ahead=2)
    order = natural_order(compile_step(spec))
    disk = [t for t in order if t.lane == "disk"]
    assert isinstance(order[0], ReadState) and isinstance(order[1], ReadState)
    assert [t.kind for t in disk[:4]] == ["read_state", "read_state", "write_state", "read_state"]
    two = compile_steps(spec, 2)
    w = WriteState(step=0, unit="layer", layer=1, chunk=0)
    r = ReadState(step=1, unit="layer", layer=1, chunk=0)
    assert two.has_edge(w, r)


def test_spec_refuses_disk_for_resident_units():
    from flowtrain.errors import ConfigError

    with pytest.raises(ConfigError, match="units on disk"):
        StepSpec(layers=2, resident=("head",), disk=("head",)).validate()


_MEMORY_CHILD = r"""
import json, sys, msgspec
from flowtrain.model.presets import PRESETS
from flowtrain.train.run import TrainConfig, train
PRESETS["disk-test"] = msgspec.structs.replace(PRESETS["tiny"], hidden_size=384, intermediate_size=1024, num_layers=32,
                                               num_heads=6, num_kv_heads=6, head_dim=64)
mode, state = sys.argv[1], sys.argv[2]
params = []
train(TrainConfig(model="disk-test", steps=2, batch_size=2, micro_batch_size=1, seq_len=16, progress=False,
                  device="cpu", undo_mem=0.0, state_dir=None if mode == "none" else state,
                  disk_state="none" if mode == "none" else mode), on_plan=lambda p: params.append(p.params))
hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"hwm": hwm, "params": params[0]}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_peak_memory_falls_by_half_the_state_moved(tmp_path):
    """A model of about 57M parameters in 32 layers, two steps: with its whole state on disk (12
    bytes per parameter moved; an fp32 compute copy of 4 stays, and two staging slots of a
    layer's state are added) the process peaks at least 6 bytes per parameter lower."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path.cwd()), os.environ.get("PYTHONPATH")]))}

    def peak(mode: str) -> dict:
        out = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, mode, str(tmp_path / f"state-{mode}")], env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    none, disk = peak("none"), peak("all")
    moved = 12 * disk["params"]
    assert none["hwm"] - disk["hwm"] >= moved / 2, (none, disk, moved)


def test_resume_is_bit_exact_with_and_without_the_tier(tmp_path):
    """Checkpoints hold the state on disk: a run with the tier saved at step 2, resumed with
    or without it, ends where three steps without a state folder end."""
    base, _ = _weights(tmp_path, "base")
    train(TrainConfig(**TINY, out=str(tmp_path / "tier"), save_every=2, state_dir=str(tmp_path / "s"),
                      disk_state="all"))
    ckpt = str(tmp_path / "tier" / "checkpoint-2")
    for name, kw in (("again", dict(state_dir=str(tmp_path / "s"), disk_state="all")), ("plain", {})):
        got, _ = _weights(tmp_path, name, resume=ckpt, **kw)
        for k in base:
            assert torch.equal(base[k], got[k]), (name, k)


def test_a_failing_write_ends_the_run_in_one_line_with_the_checkpoints_whole(tmp_path):
    env = {**os.environ, "FLOWTRAIN_FAULT": "write_state@step=2:raise"}
    env.pop("FLOWTRAIN_DEBUG", None)
    out = subprocess.run([sys.executable, "-m", "flowtrain.cli", "train", "--model", "tiny", "--batch-size", "4",
                          "--micro-batch-size", "2", "--seq-len", "32", "--device", "cpu", "--no-progress", "--steps",
                          "4", "--save-every", "1", "--out", str(tmp_path / "out"), "--state-dir",
                          str(tmp_path / "state"), "--disk-state", "all"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0
    errors = [line for line in out.stderr.splitlines() if line.startswith("flowtrain: error")]
    assert len(errors) == 1 and "write_state" in errors[0], out.stderr
    assert "Traceback" not in out.stderr
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert not (tmp_path / "state").exists()



def test_a_lora_run_refuses_a_state_folder_in_one_line(tmp_path, capsys):
    """A LoRA run keeps only its adapters' state: --state-dir would be silently unused, so it is
    refused in one line naming the flag, before anything is written."""
    from flowtrain.cli import main

    out = tmp_path / "out"
    code = main(["train", "--model", "tiny", "--steps", "1", "--batch-size", "2", "--micro-batch-size", "2",
                 "--seq-len", "32", "--device", "cpu", "--no-progress", "--lora-rank", "4",
                 "--state-dir", str(tmp_path / "state"), "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and "--state-dir" in err[0] and "LoRA" in err[0], err
    assert not out.exists() and not (tmp_path / "state").exists()


def test_a_state_folder_that_is_a_file_is_refused_in_one_line(tmp_path, capsys):
    """--state-dir naming a file ends the run in one line naming the flag, the file untouched
    and nothing written."""
    from flowtrain.cli import main

    state, out = tmp_path / "state", tmp_path / "out"
    state.write_text("not a folder")
    code = main(["train", "--model", "tiny", "--steps", "1", "--batch-size", "2", "--micro-batch-size", "2",
                 "--seq-len", "32", "--device", "cpu", "--no-progress", "--disk-state", "all",
                 "--state-dir", str(state), "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and "--state-dir" in err[0] and "is a file" in err[0], err
    assert state.read_text() == "not a folder" and not out.exists()


def _tier_and_plain(tmp_path: Path, layout: str, intermediate: int) -> tuple[HostState, HostState]:
    """The same seeded model twice: in memory, and with the masters of the layers and the head and
    every unit's moments on disk (the embedding's master stays in memory). vocab 2048 makes the
    embedding and the head larger than a layer, so the staged layout takes them in chunks: of a
    4 KiB multiple with ``intermediate`` 170 (read in place), not with 172 (through a buffer)."""
    cfg = msgspec.structs.replace(PRESETS["tiny"], vocab_size=2048, intermediate_size=intermediate)
    layouts = model_flat_maps(cfg)
    stage_n = staging_numel(layouts)
    assert (stage_n % 1024 == 0) == (intermediate == 170), stage_n
    chunks = grad_chunks(layouts, (), stage_n) if layout == "staged" else {}
    assert layout == "full" or chunks, chunks
    disk = {lay.key: ("exp_avg", "exp_avg_sq") if lay.key == "embed" else FIELDS for lay in layouts}
    plain = HostState.create(cfg, pin=False, layout=layout, chunks=chunks)
    tier = HostState.create(cfg, pin=False, layout=layout, chunks=chunks, disk=disk)
    tier.attach_store(StateStore(tmp_path / "state", tier.disk_files()))
    plain.init_random(0)
    tier.init_random(0)
    return tier, plain


def _count_held_masters(monkeypatch) -> list[int]:
    """Record, at each read of a unit's master from disk, how many masters read before are still
    held (alive through any view of them)."""
    held: list[int] = []
    earlier: list[weakref.ref] = []
    read = HostState.from_disk

    def from_disk(self, u, *args, **kwargs):
        out = read(self, u, *args, **kwargs)
        if "master" in out:
            held.append(sum(r() is not None for r in earlier))
            m = out["master"]
            earlier.append(weakref.ref(m if m._base is None else m._base))  # a view's storage lives with its base
        return out

    monkeypatch.setattr(HostState, "from_disk", from_disk)
    return held


@pytest.mark.parametrize(("layout", "intermediate"), [("full", 172), ("staged", 172), ("staged", 170)])
def test_final_save_reads_the_masters_on_disk_one_unit_at_a_time(tmp_path, monkeypatch, layout, intermediate):
    """The final model holds one disk unit's master in memory at a time (each read only once the
    one before is let go), sharded or not, and its files are byte for byte those of the same
    model saved from memory; so do the weights exported tensor by tensor."""
    tier, plain = _tier_and_plain(tmp_path, layout, intermediate)
    try:
        held = _count_held_masters(monkeypatch)
        for shard in (None, 100_000):  # 100 kB: units cut across shards
            before = len(held)
            tier.save(tmp_path / f"tier-{shard}", max_shard_bytes=shard)
            assert len(held) - before == len(tier.units) - 1, held  # every master on disk, read once
            plain.save(tmp_path / f"plain-{shard}", max_shard_bytes=shard)
            files = sorted(p.name for p in (tmp_path / f"plain-{shard}").iterdir())
            assert files == sorted(p.name for p in (tmp_path / f"tier-{shard}").iterdir())
            assert (shard is None) == (files == ["config.json", "model.safetensors"]), files
            for name in files:
                assert (tmp_path / f"tier-{shard}" / name).read_bytes() == (tmp_path / f"plain-{shard}" / name).read_bytes()
        assert held and max(held) == 0, held

        held.clear()
        got = {}
        for name, t in tier.hf_tensors():  # the weights exported tensor by tensor: the same way
            got[name] = t.clone()
            del t
        assert held and max(held) == 0, held
        want = dict(plain.hf_tensors())
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    finally:
        assert tier.store is not None
        tier.store.close()


def _count_held_fields(monkeypatch) -> list[int]:
    """Record, at each read of a field of a unit from disk, how many fields read before are
    still held (alive through any view of them)."""
    held: list[int] = []
    earlier: list[weakref.ref] = []
    read = HostState.from_disk

    def from_disk(self, u, *args, **kwargs):
        out = read(self, u, *args, **kwargs)
        held.append(sum(r() is not None for r in earlier))
        for t in out.values():
            earlier.append(weakref.ref(t if t._base is None else t._base))
        return out

    monkeypatch.setattr(HostState, "from_disk", from_disk)
    return held


@pytest.mark.parametrize(("layout", "intermediate"), [("full", 172), ("staged", 172), ("staged", 170)])
def test_a_checkpoint_reads_the_state_on_disk_one_field_at_a_time(tmp_path, monkeypatch, layout, intermediate):
    """A checkpoint reads each field of a unit on disk back alone, just before it writes it, and
    lets it go before the next (master, exp_avg, exp_avg_sq); its files are byte for byte those of
    the same state saved from memory, and it loads back into the tier field by field."""
    tier, plain = _tier_and_plain(tmp_path, layout, intermediate)
    assert tier.store is not None
    try:
        gen = torch.Generator().manual_seed(1)
        for u, p in zip(tier.units, plain.units):  # moments not zero, so the files tell them apart
            moments = {k: torch.randn(u.flat_map.numel, generator=gen) for k in ("exp_avg", "exp_avg_sq")}
            tier.put_on_disk(u, {**moments, "master": p.master} if u.master_on_disk else moments)
            p.exp_avg.copy_(moments["exp_avg"])
            p.exp_avg_sq.copy_(moments["exp_avg_sq"])
        held = _count_held_fields(monkeypatch)
        roots = {}
        for name, state in (("tier", tier), ("plain", plain)):
            roots[name] = tmp_path / f"ckpt-{name}"
            writer = CheckpointWriter(roots[name], 2, state.cfg, state.flat_maps)
            for i, u in enumerate(state.units):
                writer.write_unit(i, state.saved_unit(u))
            writer.finish({"step": 2})
        on_disk = sum(len(u.disk_fields) for u in tier.units)
        assert len(held) == on_disk and max(held) == 0, held  # each field read once, alone
        files = sorted(p.name for p in (roots["plain"] / "checkpoint-2").iterdir())
        assert files == sorted(p.name for p in (roots["tier"] / "checkpoint-2").iterdir())
        for name in files:
            assert (roots["tier"] / "checkpoint-2" / name).read_bytes() == (roots["plain"] / "checkpoint-2" / name).read_bytes()

        for u in tier.units:  # the tier's files cleared, then filled back from the checkpoint
            tier.put_on_disk(u, {})
        load_training_state(roots["plain"] / "checkpoint-2", tier)
        for u, p in zip(tier.units, plain.units):
            back = {k: getattr(tier.saved_unit(u), k) for k in ("master", "exp_avg", "exp_avg_sq")}
            assert all(torch.equal(back[k], getattr(p, k)) for k in back), u.flat_map.key
    finally:
        tier.store.close()


@pytest.mark.parametrize(("layout", "intermediate"), [("full", 172), ("staged", 172), ("staged", 170)])
def test_a_unit_reads_back_what_was_put_on_disk(tmp_path, layout, intermediate):
    """Every field of every unit on disk comes back whole, chunk by chunk, in place or through a
    buffer; asked for the master only, only the master is read."""
    tier, _ = _tier_and_plain(tmp_path, layout, intermediate)
    assert tier.store is not None
    try:
        gen = torch.Generator().manual_seed(0)
        for u in tier.disk_units:
            put = {k: torch.randn(u.flat_map.numel, generator=gen) for k in u.disk_fields}
            tier.put_on_disk(u, put)
            back = tier.from_disk(u)
            assert back.keys() == put.keys() and all(torch.equal(back[k], put[k]) for k in put), u.flat_map.key
            before = tier.store.read_bytes
            master = tier.from_disk(u, ("master",))
            assert list(master) == (["master"] if u.master_on_disk else []), u.flat_map.key
            assert tier.store.read_bytes - before == (4 * sum(
                field_numel(f.n) for (key, _), f in tier.store.files.items() if key == u.flat_map.key)
                if u.master_on_disk else 0)
    finally:
        tier.store.close()
