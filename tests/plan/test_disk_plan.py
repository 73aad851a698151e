"""The disk tier in ``flowtrain plan`` and ``flowtrain probe``: what lives in ``--state-dir``,
the bytes there and moved each step, and the bandwidth a step needs against what the disk gives."""

from __future__ import annotations

import json

import pytest

from flowtrain.cli import main

#: llama-8b, 4 x 4096 on a 10 GB card in a 33 GB host (the least that fits it, with room for a
#: save's read-back): fits only with masters on disk too
DESK = ["--model", "llama-8b", "--seq-len", "4096", "--batch-size", "4", "--micro-batch-size", "2",
        "--gpu-mem", "10", "--host-mem", "33"]
#: the same with 64 GB: the moments of some layers on disk, every master in memory
DESK64 = [*DESK[:-1], "64"]
GB = 1e9


def _plan_json(capsys, *argv: str) -> dict:
    main(["plan", *argv, "--json"])
    return json.loads(capsys.readouterr().out)


def test_plan_json_without_state_dir_has_no_disk_entries(capsys):
    out = _plan_json(capsys, *DESK64)
    assert "disk" not in out and "disk_io" not in out


def test_plan_shows_what_lives_on_disk_and_the_bytes(tmp_path, capsys):
    out = _plan_json(capsys, *DESK, "--state-dir", str(tmp_path), "--disk-gbs", "5")
    io, disk = out["disk_io"], out["disk"]
    assert out["fits"]
    # every streamed unit's moments, and masters too, for 33 GB; the byte count is 4 per field and parameter
    assert set(io["moments"]) == set(disk) and io["masters"] and set(io["masters"]) <= set(io["moments"])
    assert io["bytes"] == io["read_bytes_per_step"] == io["written_bytes_per_step"]
    assert io["bytes"] >= 8 * 7.5e9 + 4 * len(io["masters"]) * 200e6
    assert io["read_gbps"] == io["write_gbps"] == 5
    assert io["disk_seconds_per_step"] == pytest.approx(2 * io["bytes"] / (5 * GB), rel=1e-3)
    assert "step_seconds" not in io  # no machine to predict the step on
    main(["plan", *DESK, "--state-dir", str(tmp_path), "--disk-gbs", "5"])
    text = capsys.readouterr().out
    assert "disk tier (--state-dir" in text and "moments on disk  head, layer.31-0, embed (34 units)" in text
    assert f"{io['bytes'] / 2**30:.2f} GiB" in text and "--disk-gbs 5 gives 5 GB/s read" in text


def test_plan_with_a_machine_gives_the_bandwidth_a_step_needs(tmp_path, capsys):
    out = _plan_json(capsys, *DESK64, "--state-dir", str(tmp_path), "--machine", "rtx3080-10gb")
    io = out["disk_io"]
    assert io["moments"] and not io["masters"]  # 64 GB holds every master, not every moment
    assert io["needs_gbps"] == pytest.approx((io["read_bytes_per_step"] + io["written_bytes_per_step"])
                                             / io["step_seconds"] / GB, rel=1e-3)
    from flowtrain.sim.machine import load_machine

    m = load_machine("rtx3080-10gb")
    assert (io["read_gbps"], io["write_gbps"]) == (m.disk_read_gbps, m.disk_write_gbps)
    assert io["disk_keeps_up"] is (io["disk_share_of_critical_chain"] < 0.5)
    # --disk-gbs stands for the machine's disk
    slow = _plan_json(capsys, *DESK64, "--state-dir", str(tmp_path), "--machine", "rtx3080-10gb",
                      "--disk-gbs", "0.5")["disk_io"]
    assert slow["read_gbps"] == slow["write_gbps"] == 0.5 and not slow["disk_keeps_up"]
    main(["plan", *DESK64, "--state-dir", str(tmp_path), "--machine", "rtx3080-10gb", "--disk-gbs", "0.5"])
    assert "THE DISK SETS THE STEP" in capsys.readouterr().out


def test_plan_asks_for_the_disk_rate_where_none_is_known(tmp_path, capsys):
    main(["plan", *DESK, "--state-dir", str(tmp_path)])
    assert "give --disk-gbs N or --machine" in capsys.readouterr().out


def test_nothing_on_disk_when_the_state_fits(tmp_path, capsys):
    out = _plan_json(capsys, *DESK[:-1], "200", "--state-dir", str(tmp_path))
    assert out["disk"] == {} and out["disk_io"]["bytes"] == 0
    main(["plan", *DESK[:-1], "200", "--state-dir", str(tmp_path)])
    assert "nothing on disk: host memory holds the whole state" in capsys.readouterr().out


def test_probe_measures_the_state_folders_disk(tmp_path):
    from flowtrain.sim.probe import _probe_disk

    notes: dict[str, str] = {}
    got = _probe_disk(notes, 16 * 2**20, 1, str(tmp_path))
    assert got["disk_read_gbps"] > 0 and got["disk_write_gbps"] > 0 and got["disk_queue_depth"] == 4
    assert str(tmp_path) in notes["disk_read_gbps"] and "16 MiB" in notes["disk_write_gbps"]
    assert list(tmp_path.iterdir()) == []  # the probe's file is gone


def test_probe_writes_the_disk_rates_into_the_machine_file(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("the CPU-only probe is quick; on a GPU machine it times the GPU too")
    out = tmp_path / "desk.json"
    state = tmp_path / "state"
    state.mkdir()
    assert main(["probe", "--quick", "--extends", "rtx3080-10gb", "--out", str(out), "--state-dir", str(state)]) == 0
    data = json.loads(out.read_text())
    assert data["disk_read_gbps"] > 0 and data["disk_write_gbps"] > 0 and str(state) in data["notes"]["disk_read_gbps"]
    from flowtrain.sim.machine import load_machine

    assert load_machine(out).disk_read_gbps == data["disk_read_gbps"]


def test_a_lora_run_keeps_nothing_on_disk_and_says_so(tmp_path, capsys):
    main(["plan", "--model", "tiny", "--device", "cpu", "--lora-rank", "4", "--state-dir", str(tmp_path)])
    assert "nothing on disk: host memory holds the whole state (LoRA and data-parallel" in capsys.readouterr().out
