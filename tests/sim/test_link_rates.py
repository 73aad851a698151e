"""flowtrain.sim.link_rates: copies classed by how much the other direction overlapped them, and
the shipped machine files' device-to-host rate as the kept traces measure it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowtrain.sim.link_rates import copy_rates, kept_shares, main, medians
from flowtrain.sim.machine import load_machine

BENCH = Path(__file__).parents[2] / "docs" / "bench"


def _copy(kind, lane, ts, dur, nbytes, step=1):
    return {"ph": "X", "ts": ts, "dur": dur, "args": {"kind": kind, "lane": lane, "step": step, "bytes": nbytes}}


def test_copies_are_classed_by_the_other_directions_overlap(tmp_path):
    """An offload alone (100 MB in 2 ms: 50 GB/s), one a fetch overlaps throughout, one it
    overlaps for half, a small copy and a first-step copy left out."""
    events = [
        _copy("offload_grad", "d2h", 0, 2000, 100e6),
        _copy("offload_grad", "d2h", 10_000, 4000, 100e6),
        _copy("fetch", "h2d", 9_000, 6000, 120e6),
        _copy("offload_grad", "d2h", 14_000, 2000, 100e6),
        _copy("offload_act", "d2h", 30_000, 100, 1e6),
        _copy("offload_grad", "d2h", 40_000, 1000, 100e6, step=0),
        {"ph": "X", "ts": 0, "dur": 50_000, "args": {"kind": "backward", "lane": "compute", "step": 1}},
    ]
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    rates = copy_rates(trace)
    assert rates[("offload_grad", "alone")] == [pytest.approx(50.0)]
    assert rates[("offload_grad", "shared")] == [pytest.approx(25.0)]
    assert rates[("offload_grad", "part")] == [pytest.approx(50.0)]  # the fetch ends half-way through it
    assert rates[("fetch", "part")] == [pytest.approx(20.0)]
    assert ("offload_act", "alone") not in rates  # under 50 MB


@pytest.mark.parametrize("machine, traces", [("h200", "2026-12-0[234]/*-trace.json"), ("h100-sxm", "2026-12-06/*-trace.json")])
def test_the_machine_files_d2h_rate_is_the_kept_traces_lone_offloads(machine, traces):
    found = sorted(BENCH.glob(traces))
    assert len(found) >= 7
    _, over = medians(found)
    assert load_machine(machine).d2h_gbps == pytest.approx(over[("offload_grad", "alone")], abs=0.5)


def test_the_command_prints_a_table_and_refuses_what_is_not_a_trace(tmp_path, capsys):
    assert main([str(p) for p in sorted(BENCH.glob("2026-12-06/gate6-h100-*-trace.json"))]) == 0
    out = capsys.readouterr().out
    assert "| median of the traces |" in out and "offload_grad alone" in out
    assert main([str(tmp_path / "missing.json")]) == 2
    assert "no such trace" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"rows": []}')
    assert main([str(bad)]) == 2
    assert "not a flowtrain trace" in capsys.readouterr().err


def test_each_direction_keeps_its_share_of_its_lone_rate(tmp_path):
    """Two traces: the offloads beside a fetch keep 0.5 and 0.9 of the lone ones', the fetches
    beside an offload 0.8 in the one trace that has both kinds; medians over the traces."""
    def trace(name, alone_d2h, shared_d2h, fetch_alone=None, fetch_shared=None):
        events = [_copy("offload_grad", "d2h", 0, 100e6 / alone_d2h / 1e3, 100e6),
                  _copy("fetch", "h2d", 10_000, 8000, 100e6),
                  _copy("offload_grad", "d2h", 11_000, 100e6 / shared_d2h / 1e3, 100e6)]
        if fetch_alone:  # a lone fetch, and one an offload overlaps throughout
            events += [_copy("fetch", "h2d", 30_000, 100e6 / fetch_alone / 1e3, 100e6),
                       _copy("offload_grad", "d2h", 39_000, 10_000, 100e6),
                       _copy("fetch", "h2d", 40_000, 100e6 / fetch_shared / 1e3, 100e6)]
        path = tmp_path / name
        path.write_text(json.dumps({"traceEvents": events}))
        return path

    per, _ = medians([trace("a.json", 50.0, 25.0), trace("b.json", 50.0, 45.0, 40.0, 32.0)])
    kept = kept_shares(per)
    assert kept["d2h"] == (pytest.approx(0.7), 2)
    assert kept["h2d"] == (pytest.approx(0.8), 1)


@pytest.mark.parametrize("machine", ["h200", "h100-sxm"])
def test_the_machine_files_duplex_rate_is_what_the_kept_traces_keep_of_each_direction(machine):
    """Both cards sit on the same PCIe 5 link, so their kept traces are taken together."""
    found = sorted(BENCH.glob("2026-12-0[2-7]/*-trace.json"))
    assert len(found) >= 18
    per, _ = medians(found)
    kept = kept_shares(per)
    m = load_machine(machine)
    assert m.duplex_gbps == pytest.approx(kept["d2h"][0] * m.d2h_gbps + kept["h2d"][0] * m.h2d_gbps, abs=0.5)
