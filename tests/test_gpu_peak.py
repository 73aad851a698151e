"""``flowtrain bench --gpu-peak-report``: the replay of an allocator trace to its peak, the groups
of what was alive then, the report file, and the flag's refusals. The replay reads the trace
format of ``torch.cuda.memory._snapshot``; one test records a real run on a GPU (skipped
without one)."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowtrain.bench import gpu_peak
from flowtrain.cli import main

RUNTIME = {"filename": "/site/flowtrain/runtime/lanes.py", "line": 40, "name": "_work"}
PROGRAM = {"filename": "/site/flowtrain/train/program/layers.py", "line": 300, "name": "run_forward"}
MLP = {"filename": "/site/flowtrain/model/mlp.py", "line": 20, "name": "swiglu"}
TORCH = {"filename": "/usr/lib/python3/site-packages/torch/nn/functional.py", "line": 7, "name": "silu"}


def _trace(ops, before: list[int]):
    """Allocator events for ``ops``: ("alloc", size), ("free", k: the k-th live block, modulo),
    ("free_before", k: the k-th block allocated before the record). A free is requested, and
    completed after the next operation (as for a block another stream still used); its address
    is reused only then, as the allocator reuses blocks."""
    events, live, spare, pending, next_addr = [], [], [], [], 10_000
    old = [(1000 + i, s) for i, s in enumerate(before)]
    for op, n in ops:
        done, pending = pending[:-1], pending[-1:]  # those requested before the last operation
        events += [{"action": "free_completed", "addr": a, "size": size} for a, size in done if a is not None]
        spare += [a for a, _ in done if a is not None]
        pending.append((None, 0))  # this operation's place in the queue
        if op == "alloc":
            if spare:
                addr = spare.pop()
            else:
                addr, next_addr = next_addr, next_addr + 1
            live.append((addr, n))
            events.append({"action": "alloc", "addr": addr, "size": n, "frames": [MLP, PROGRAM]})
        elif op == "free" and live:
            addr, size = live.pop(n % len(live))
            events.append({"action": "free_requested", "addr": addr, "size": size})
            pending[-1] = (addr, size)
        elif op == "free_before" and old:
            addr, size = old.pop(n % len(old))
            events.append({"action": "free_requested", "addr": addr, "size": size})
        events.append({"action": "segment_alloc", "addr": 1, "size": 1 << 20})  # not an allocation
    return events


def _allocated_after_each(events, base):
    """Bytes allocated after each event, from each block's lifetime [alloc, first free of its
    address after it): the same quantity as the replay, computed from intervals."""
    n = len(events)
    totals = [base] * n
    for i, e in enumerate(events):
        if e["action"] == "free_requested":
            if not any(x["action"] == "alloc" and x["addr"] == e["addr"] for x in events[:i]):
                for j in range(i, n):  # a block from before the record
                    totals[j] -= e["size"]
        if e["action"] != "alloc":
            continue
        end = next((j for j in range(i + 1, n) if events[j]["action"] == "free_requested"
                    and events[j]["addr"] == e["addr"]), n)
        for j in range(i, end):
            totals[j] += e["size"]
    return totals


ops = st.lists(st.tuples(st.sampled_from(["alloc", "alloc", "free", "free_before"]), st.integers(1, 1 << 30)),
               max_size=40)


@settings(max_examples=200, deadline=None)
@given(ops=ops, before=st.lists(st.integers(1, 1 << 30), max_size=4))
def test_the_replay_finds_the_most_allocated_moment_and_what_was_alive(ops, before):
    events = _trace(ops, before)
    base = sum(before)
    totals = _allocated_after_each(events, base)
    peak = gpu_peak.peak_of(events, base)
    assert peak.bytes == max([base, *totals])
    if peak.at >= 0:
        assert totals[peak.at] == peak.bytes and peak.bytes > max([base, *totals[:peak.at]])
        alive = gpu_peak.alive_at_peak(events, peak.at)
        assert sum(e["size"] for e in alive) + peak.before == peak.bytes
        rep = gpu_peak.report(events, base, {}, None)
        assert sum(g["bytes"] for g in rep["alive"]) == peak.bytes
        for g in rep["alive"]:  # a group's sizes: at most SIZES_LISTED of them, each of its blocks
            assert sum(n for _, n in g["sizes"]) <= g["blocks"]
            assert len(g["sizes"]) == min(gpu_peak.SIZES_LISTED, len({e["size"] for e in alive})) or g["site"] == gpu_peak.BEFORE
        assert rep["peak_allocation"]["site"] == "flowtrain/model/mlp.py:20 swiglu"
    else:
        assert peak.bytes == peak.before == base


def test_a_site_is_the_innermost_flowtrain_frame_and_via_the_task_that_asked():
    outer = [RUNTIME, {"filename": "/site/flowtrain/train/run.py", "line": 9, "name": "train"},
             {"filename": "/site/flowtrain/cli/__init__.py", "line": 3, "name": "main"}]
    dispatch = {"filename": "/site/flowtrain/train/program/core.py", "line": 120, "name": "__call__"}
    assert gpu_peak.site_of([TORCH, MLP, PROGRAM, dispatch, *outer]) == ("flowtrain/model/mlp.py:20 swiglu",
                                                                        "flowtrain/train/program/layers.py:300 run_forward")
    assert gpu_peak.site_of([PROGRAM, dispatch, *outer]) == ("flowtrain/train/program/layers.py:300 run_forward",
                                                             "flowtrain/train/program/core.py:120 __call__")
    assert gpu_peak.site_of([PROGRAM, RUNTIME]) == ("flowtrain/train/program/layers.py:300 run_forward", None)
    assert gpu_peak.site_of([MLP, *outer]) == ("flowtrain/model/mlp.py:20 swiglu", None)
    assert gpu_peak.site_of([TORCH]) == ("torch: torch/nn/functional.py:7 silu", None)
    assert gpu_peak.site_of([]) == (gpu_peak.NO_STACK, None)


def test_a_compiled_buffer_is_named_by_the_source_line_of_its_graph_node():
    generated = {"filename": "/tmp/torchinductor_root/xy/cxy.py", "line": 88, "name": "call"}
    traced = {**generated, "fx_node_name": "mm_3", "fx_original_trace":
              '  File "/site/flowtrain/model/layer.py", line 50, in decoder_layer\n    h = mlp(x)\n'
              '  File "/site/flowtrain/model/mlp.py", line 21, in swiglu\n    return down(act)\n'}
    assert gpu_peak.site_of([traced, PROGRAM]) == ("compiled: flowtrain/model/mlp.py:21 swiglu",
                                                   "flowtrain/train/program/layers.py:300 run_forward")
    assert gpu_peak.site_of([{**generated, "fx_node_name": "mm_3"}]) == ("compiled: graph node mm_3", None)
    assert gpu_peak.site_of([generated, PROGRAM])[0] == "compiled: cxy.py:88 call"


def test_the_report_groups_largest_first_and_keeps_the_plan_and_an_out_of_memory():
    slot = {"filename": "/site/flowtrain/train/program/slots.py", "line": 210, "name": "__init__"}
    events = [{"action": "alloc", "addr": 1, "size": 3 << 30, "frames": [slot]},
              {"action": "alloc", "addr": 2, "size": 3 << 30, "frames": [slot]},
              {"action": "alloc", "addr": 3, "size": 1 << 30, "frames": [MLP, PROGRAM]},
              {"action": "alloc", "addr": 4, "size": 1 << 29, "frames": []},
              {"action": "oom", "size": 5 << 30, "device_free": 1 << 20},
              {"action": "free_requested", "addr": 3, "size": 1 << 30}]
    rep = gpu_peak.report(events, 1 << 28, {"allocated_peak": 8 << 30, "requested_peak": 8 << 30},
                          {"weight_slots": 6 << 30, "layer_work": 1 << 30})
    assert rep["peak_gib"] == 7.75 and rep["peak_event"] == 3
    assert [(g["site"], g["gib"], g["blocks"], g["sizes"]) for g in rep["alive"]] == [
        ("flowtrain/train/program/slots.py:210 __init__", 6.0, 2, [[3072.0, 2]]),
        ("flowtrain/model/mlp.py:20 swiglu", 1.0, 1, [[1024.0, 1]]),
        (gpu_peak.NO_STACK, 0.5, 1, [[512.0, 1]]),
        (gpu_peak.BEFORE, 0.25, 0, [])]
    assert rep["out_of_memory"] == {"mib": 5120.0, "device_free_mib": 1.0}
    assert rep["planned_gpu_gib"] == 7.0 and rep["planned_gpu_items_gib"]["weight_slots"] == 6.0
    text = gpu_peak.format_report(rep, most=2)
    assert "(2 x 3072 MiB)" in text
    assert "replayed 7.75 GiB" in text and "planned 7.00" in text and "in 2 more groups" in text
    assert "out of memory: 5120.0 MiB" in text


def test_a_group_lists_the_block_sizes_that_hold_most_of_its_bytes():
    sizes = [1 << 20] * 10 + [64 << 20] + [3 << 20] * 4 + [5 << 20] * 2 + [7, 8, 9, 10, 11]
    events = [{"action": "alloc", "addr": i, "size": n, "frames": []} for i, n in enumerate(sizes)]
    (group,) = gpu_peak.report(events, 0, {}, None)["alive"]
    assert group["blocks"] == len(sizes) and group["largest"] == 64 << 20
    assert group["sizes"] == [[64.0, 1], [3.0, 4], [1.0, 10], [5.0, 2], [0.0, 1], [0.0, 1]]


def test_a_report_is_written_whole_or_not_at_all(tmp_path):
    path = tmp_path / "peak.json"
    gpu_peak.write_report(path, {"peak_gib": 1.5})
    assert json.loads(path.read_text()) == {"peak_gib": 1.5}
    with pytest.raises(TypeError):
        gpu_peak.write_report(path, {"peak_gib": object()})
    assert json.loads(path.read_text()) == {"peak_gib": 1.5}, "a failed write left the old report as it was"
    assert [p.name for p in tmp_path.iterdir()] == ["peak.json"], "no temporary file left behind"


def test_the_flag_refuses_a_cpu_run_and_an_unwritable_file_before_training(tmp_path, capsys):
    argv = ["bench", "--model", "tiny", "--seq-len", "16", "--batch-size", "2", "--micro-batch-size", "2",
            "--steps", "2", "--warmup", "1"]
    out = tmp_path / "peak.json"
    assert main([*argv, "--device", "cpu", "--gpu-peak-report", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--gpu-peak-report" in err and "CPU" in err
    assert not out.exists()
    if torch.cuda.is_available():
        assert main([*argv, "--device", "cuda", "--gpu-peak-report", str(tmp_path / "no" / "peak.json")]) == 2
        assert "does not exist" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.filterwarnings("ignore:Attempting to run cuBLAS")
def test_a_recorded_gpu_run_replays_to_the_allocators_own_peak(tmp_path, capsys):
    out = tmp_path / "peak.json"
    assert main(["bench", "--model", "tiny", "--seq-len", "64", "--batch-size", "4", "--micro-batch-size", "2",
                 "--steps", "2", "--warmup", "1", "--device", "cuda", "--gpu-peak-report", str(out)]) == 0
    rep = json.loads(out.read_text())
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["gpu_peak_report"] == str(out) and result["gpu_peak_replayed_gib"] == rep["peak_gib"]
    # the trace records requested sizes, freed when asked: at most the allocator's (rounded) peak,
    # and near its count of requested bytes, which it keeps until a free completes
    assert rep["peak_bytes"] <= rep["allocator_peak_bytes"]
    assert rep["peak_bytes"] >= 0.95 * rep["allocator_requested_peak_bytes"]
    assert rep["events"] > 0 and rep["alive"]
    assert any(g["site"].startswith("flowtrain/train/program/") for g in rep["alive"]), rep["alive"]
    assert "planned_gpu_gib" in rep
