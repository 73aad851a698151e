"""Training checkpoints: exact round trips across layouts, atomic saves, and refusals.

A checkpoint of the tiny model (4 units: embed, layer.0, layer.1, head) is written unit by
unit and read back into states of other layouts, residencies and gradient chunkings; every
master, moment and step count must come back bit for bit. Crash safety is checked by
failing a save at each phase and looking at what is left in the root folder.
"""

from __future__ import annotations

import json
import os
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import pytest
import torch

from flowtrain.ckpt import checkpoints as ck
from flowtrain.ckpt import hf as model_ckpt
from flowtrain.ckpt.checkpoints import (
    CheckpointWriter,
    latest_checkpoint,
    load_training_state,
    prune,
    read_checkpoint,
    remove_stale,
)
from flowtrain.errors import CheckpointError
from flowtrain.model import bind, preset
from flowtrain.train.host_state import HostState

CFG = preset("tiny")


def make_state(cfg=CFG, *, layout="full", resident=(), chunks=None, dtype=torch.float32, seed=0, filled=True):
    """A state with random masters and random non-zero Adam state (padding included)."""
    state = HostState.create(cfg, pin=False, layout=layout, resident=resident, device="cpu", dtype=dtype,
                             chunks=chunks)
    if filled:
        state.init_random(seed)
        g = torch.Generator().manual_seed(seed + 1)
        for i, u in enumerate(state.units):
            u.exp_avg.copy_(torch.randn(u.exp_avg.numel(), generator=g))
            u.exp_avg_sq.copy_(torch.rand(u.exp_avg_sq.numel(), generator=g))
            for s in u.steps:
                s.fill_(7 + seed)
    return state


def save(state, root, step, trainer_state=None, **kwargs):
    writer = CheckpointWriter(root, step, state.cfg, state.flat_maps)
    for i, u in enumerate(state.units):
        writer.write_unit(i, u)
    return writer.finish(trainer_state or {"step": step}, **kwargs)


def assert_same(a: HostState, b: HostState) -> None:
    for ua, ub in zip(a.units, b.units):
        key = ua.flat_map.key
        assert torch.equal(ua.master, ub.master), key
        assert torch.equal(ua.exp_avg, ub.exp_avg), key
        assert torch.equal(ua.exp_avg_sq, ub.exp_avg_sq), key
        assert {float(s) for s in ub.steps} == {float(s) for s in ua.steps}, key


def hidden(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


# ---------------------------------------------------------------------- round trips

CASES = {
    # name: (writer's state kwargs, reader's state kwargs)
    "staged-chunked->full": (dict(layout="staged", chunks={"embed": 3, "layer.0": 2}), dict(layout="full")),
    "full-resident->stream-bf16-chunked": (
        dict(layout="full", resident=("embed", "head")),
        dict(layout="stream-bf16", resident=("layer.0",), chunks={"embed": 2, "layer.1": 4}, dtype=torch.bfloat16),
    ),
    "stream-bf16->staged-resident": (
        dict(layout="stream-bf16", chunks={"layer.0": 2}, dtype=torch.bfloat16),
        dict(layout="staged", resident=("embed", "layer.1", "head"), chunks={"layer.0": 3}, dtype=torch.bfloat16),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_is_exact_across_layouts(tmp_path, case):
    wkw, rkw = CASES[case]
    src = make_state(**wkw)
    info = {"step": 3, "data": {"epoch": 0, "index": 12}, "rng": [1, 2, 3]}
    path = save(src, tmp_path, 3, info)
    assert path == tmp_path / "checkpoint-3" and hidden(tmp_path) == []
    dst = make_state(filled=False, **rkw)
    trainer_state, found = read_checkpoint(tmp_path)
    assert trainer_state == info and found == path
    assert load_training_state(found, dst) == path
    assert_same(src, dst)
    for u in dst.units:  # the compute / streaming copies follow the loaded masters
        for copy in (u.compute, u.stream):
            if copy is not None:
                assert torch.equal(copy, u.master.to(copy.dtype)), u.flat_map.key


def test_concurrent_writes_in_shuffled_order_and_small_pieces(tmp_path, monkeypatch):
    monkeypatch.setattr(model_ckpt, "_WRITE_PIECE", 100)  # every tensor streams in many pieces
    monkeypatch.setattr(ck, "_READ_PIECE", 77)  # and loads in many pieces
    src = make_state(layout="staged", resident=("layer.1",), chunks={"embed": 4}, seed=3)
    order = list(range(len(src.units)))
    random.Random(0).shuffle(order)
    writer = CheckpointWriter(tmp_path, 12, CFG, src.flat_maps)
    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(lambda i: writer.write_unit(i, src.units[i]), order))
    writer.finish({"step": 12})
    dst = make_state(filled=False)
    read_checkpoint(tmp_path)
    load_training_state(tmp_path, dst)
    assert_same(src, dst)


@pytest.mark.parametrize("tied", [False, True])
def test_loads_in_transformers(tmp_path, tied):
    from transformers import AutoModelForCausalLM

    cfg = msgspec.structs.replace(CFG, tie_word_embeddings=tied)
    state = make_state(cfg, resident=("layer.0",))
    path = save(state, tmp_path, 1)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    model = AutoModelForCausalLM.from_pretrained(path)
    params = model.state_dict()
    n = 0
    for u in state.units:
        for e in u.flat_map.entries:
            assert torch.equal(params[e.name], bind(u.master, u.flat_map)[e.key]), e.name
            n += e.numel
    assert index["metadata"]["total_size"] == 4 * n
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_extra_files_are_copied_and_listed(tmp_path):
    tok = tmp_path / "tokenizer.json"
    tok.write_text('{"tokenizer": true}')
    path = save(make_state(), tmp_path / "run", 2, extra_files=[tok])
    assert (path / "tokenizer.json").read_text() == tok.read_text()
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["version"] == ck.FORMAT_VERSION and manifest["step"] == 2
    assert set(manifest["files"]) == {p.name for p in path.iterdir()} - {"manifest.json"}


# ---------------------------------------------------------------------- refusals


@pytest.fixture
def saved(tmp_path):
    return save(make_state(), tmp_path, 4)


def test_corrupt_byte_is_caught_by_verify(saved):
    f = saved / "optimizer-00002-of-00004.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0x40
    f.write_bytes(bytes(data))
    read_checkpoint(saved, verify=False)  # same size: only the hash can tell
    with pytest.raises(CheckpointError, match="checkpoint-4/optimizer-00002-of-00004.safetensors .*sha256"):
        read_checkpoint(saved)


def test_truncated_or_missing_file(saved):
    f = saved / "model-00003-of-00004.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="model-00003-of-00004.safetensors has 100 bytes"):
        read_checkpoint(saved, verify=False)
    with pytest.raises(CheckpointError, match="model-00003-of-00004.safetensors.*corrupt or truncated"):
        load_training_state(saved, make_state(filled=False))
    (saved / "trainer_state.json").unlink()
    f.unlink()
    with pytest.raises(CheckpointError, match=r"checkpoint-4/(trainer_state.json|model-00003.*) is missing"):
        read_checkpoint(saved, verify=False)


@pytest.mark.parametrize("field", ["exp_avg", "exp_avg_sq"])
def test_nan_in_adam_state_is_refused(tmp_path, field):
    state = make_state()
    getattr(state.units[2], field)[5] = float("nan")
    path = save(state, tmp_path, 4)
    needle = f"checkpoint-4/optimizer-00003-of-00004.safetensors: {field} of layer.1 holds NaN or inf"
    with pytest.raises(CheckpointError, match=needle):
        load_training_state(path, make_state(filled=False))


def test_inf_in_master_is_refused(tmp_path):
    state = make_state()
    state.units[-1].master[0] = float("inf")
    path = save(state, tmp_path, 4)
    with pytest.raises(CheckpointError, match=r"checkpoint-4: the weight model.norm.weight \(head\) holds NaN or inf"):
        load_training_state(path, make_state(filled=False))


def test_a_hugging_face_model_with_nan_weights_is_refused(tmp_path):
    """Not only checkpoints: any --model folder whose weights hold NaN would only spread it."""
    state = make_state()
    state.units[1].master[3] = float("nan")
    state.save(tmp_path / "model")
    with pytest.raises(CheckpointError, match=r"model: the weight model.layers.0.\S+ \(layer.0\) holds NaN or inf"):
        make_state(filled=False).load_checkpoint(tmp_path / "model")


def test_other_model_is_refused(saved):
    deeper = msgspec.structs.replace(CFG, num_layers=3)
    with pytest.raises(CheckpointError, match="holds 4 optimizer shard.*model has 5 units"):
        load_training_state(saved, make_state(deeper, filled=False))
    wider = msgspec.structs.replace(CFG, intermediate_size=180)
    with pytest.raises(CheckpointError, match=r"optimizer-00002-of-00004.safetensors: exp_avg of layer.0 has shape"):
        load_training_state(saved, make_state(wider, filled=False))


def test_unequal_chunk_steps_and_missing_units_are_refused(tmp_path):
    state = make_state(chunks={"embed": 2})
    state.units[0].steps[1].fill_(99)
    with CheckpointWriter(tmp_path, 1, CFG, state.flat_maps) as writer:
        with pytest.raises(CheckpointError, match="embed: its gradient chunks have taken different.*7, 99"):
            writer.write_unit(0, state.units[0])
        writer.write_unit(1, state.units[1])
        with pytest.raises(CheckpointError, match="incomplete: unit.s. embed, layer.1, head not written"):
            writer.finish({})
        writer.abort()
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------- crash safety


def test_failed_write_then_abort_keeps_previous_checkpoint(saved, monkeypatch):
    root = saved.parent
    real = model_ckpt._write_tensor
    calls = []

    def failing(f, t, dtype, digest):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        real(f, t, dtype, digest)

    monkeypatch.setattr(model_ckpt, "_write_tensor", failing)
    state = make_state(seed=5)
    writer = CheckpointWriter(root, 4, CFG, state.flat_maps)
    with pytest.raises(CheckpointError, match="No space left"):
        for i, u in enumerate(state.units):
            writer.write_unit(i, u)
    writer.abort()
    writer.abort()
    assert [p.name for p in root.iterdir()] == ["checkpoint-4"]
    dst = make_state(filled=False)
    read_checkpoint(root)
    load_training_state(root, dst)
    assert_same(make_state(), dst)


def test_overwrite_keeps_old_until_new_is_in_place(saved, monkeypatch):
    root = saved.parent
    real = os.replace
    seen = []

    def spy(src, dst):
        src, dst = Path(src), Path(dst)
        if dst == saved:  # the new one moves in: the old must still be complete, aside
            aside = [p for p in root.iterdir() if ".checkpoint-4.old-" in p.name]
            seen.append(len(aside) == 1 and (aside[0] / "manifest.json").is_file())
        real(src, dst)

    monkeypatch.setattr(ck.os, "replace", spy)
    newer = make_state(seed=9)
    save(newer, root, 4, {"step": 4, "run": 2})
    monkeypatch.undo()
    assert seen == [True] and hidden(root) == []
    dst = make_state(filled=False)
    assert read_checkpoint(root)[0] == {"step": 4, "run": 2}
    load_training_state(root, dst)
    assert_same(newer, dst)


def test_failed_rename_puts_old_checkpoint_back(saved, monkeypatch):
    root = saved.parent
    real = os.replace

    def failing(src, dst):
        if Path(src).name.startswith(".checkpoint-4.tmp-"):
            raise OSError(5, "I/O error")
        real(src, dst)

    monkeypatch.setattr(ck.os, "replace", failing)
    with pytest.raises(CheckpointError, match="cannot move checkpoint-4 into place.*I/O error"):
        save(make_state(seed=9), root, 4, {"step": 4, "run": 2})
    monkeypatch.undo()
    assert [p.name for p in root.iterdir()] == ["checkpoint-4"]
    assert read_checkpoint(root)[0] == {"step": 4}


def test_remove_stale(tmp_path):
    killed = CheckpointWriter(tmp_path, 8, CFG, make_state(filled=False).flat_maps)  # never finished
    (tmp_path / ".checkpoint-3.old-ab12").mkdir()  # moved aside, replacement never arrived
    (tmp_path / ".checkpoint-3.old-ab12" / "manifest.json").write_text("{}")
    (tmp_path / "checkpoint-5").mkdir()
    (tmp_path / ".checkpoint-5.old-cd34").mkdir()  # replacement in place: delete
    (tmp_path / ".checkpoint-6.del-ef56").mkdir()  # pruned mid-delete
    for keep in (".other", "checkpoint-7.tmp-x", ".checkpoint-x.tmp-1"):
        (tmp_path / keep).mkdir()
    removed = remove_stale(tmp_path)
    assert sorted(p.name for p in removed) == [".checkpoint-5.old-cd34", ".checkpoint-6.del-ef56", killed.tmp.name]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".checkpoint-x.tmp-1", ".other", "checkpoint-3", "checkpoint-5", "checkpoint-7.tmp-x"]
    killed.abort()  # nothing left to remove: still fine


def fake_checkpoints(root: Path, complete, incomplete=()):
    """Folders that look finished (a manifest) or not; enough for the root-folder functions."""
    for n in complete:
        (root / f"checkpoint-{n}").mkdir(parents=True)
        (root / f"checkpoint-{n}" / "manifest.json").write_text("{}")
    for n in incomplete:
        (root / f"checkpoint-{n}").mkdir(parents=True)


def test_prune_keeps_newest_by_number(tmp_path):
    fake_checkpoints(tmp_path, complete=[2, 9, 10, 100], incomplete=[11])
    (tmp_path / "notes").mkdir()
    (tmp_path / "checkpoint-1").write_text("a file, not ours")
    removed = prune(tmp_path, 2)
    assert [p.name for p in removed] == ["checkpoint-2", "checkpoint-9"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-1", "checkpoint-10", "checkpoint-100", "checkpoint-11", "notes"]
    assert prune(tmp_path, 5) == []


def test_latest_checkpoint(tmp_path):
    fake_checkpoints(tmp_path, complete=[9, 10], incomplete=[12])
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-10"
    assert latest_checkpoint(tmp_path / "checkpoint-9") == tmp_path / "checkpoint-9"
    with pytest.raises(CheckpointError, match="checkpoint-12' is incomplete.*pass an earlier"):
        latest_checkpoint(tmp_path / "checkpoint-12")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no complete checkpoint.*pass a checkpoint-N folder"):
        latest_checkpoint(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="does not exist"):
        latest_checkpoint(tmp_path / "missing")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_resident_and_pinned_round_trip(tmp_path, monkeypatch):
    """Resident units come off the GPU piece by piece; loading fills them on the GPU."""
    monkeypatch.setattr(model_ckpt, "_WRITE_PIECE", 1000)
    src = make_state(layout="stream-bf16", chunks={"embed": 2}, dtype=torch.bfloat16)
    gpu = HostState.create(CFG, pin=True, layout="staged", resident=("layer.0", "head"), device="cuda",
                           dtype=torch.bfloat16)
    load_training_state(save(src, tmp_path / "a", 1), gpu)
    assert gpu.units[1].master.is_cuda and gpu.units[1].steps[0].is_cuda
    back = make_state(filled=False)
    load_training_state(save(gpu, tmp_path / "b", 1), back)
    assert_same(src, back)
    assert torch.equal(gpu.units[1].compute.cpu(), src.units[1].master.to(torch.bfloat16))
