"""Machine files: every shipped one loads, says where its numbers come from, and user files
may extend a shipped one; mistakes are errors that say what to fix."""

from __future__ import annotations

import json

import pytest

from flowtrain.errors import ConfigError
from flowtrain.sim.machine import load_machine, machine_names

ISSUE_MACHINES = {"h200", "h100-pcie", "h100-sxm", "gh200", "rtx4090", "rtx3080-10gb", "a100-40gb", "a100-80gb"}


def test_every_machine_the_issue_names_is_shipped_with_a_source():
    assert ISSUE_MACHINES <= set(machine_names())
    for name in machine_names():
        m = load_machine(name)
        assert m.name == name
        assert m.source.split(":")[0] in ("measured", "datasheet", "probe"), name
        assert m.duplex_gbps >= max(m.h2d_gbps, m.d2h_gbps)


def test_the_gh200_link_is_nvlink_c2c_not_pcie():
    assert load_machine("gh200").h2d_gbps > 4 * load_machine("h200").h2d_gbps


def test_a_file_extends_a_shipped_machine(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"name": "mine", "extends": "h200", "h2d_gbps": 20.0, "notes": {"h2d_gbps": "mine"}}))
    m = load_machine(str(path))
    assert m.h2d_gbps == 20.0 and m.matmul_tflops == load_machine("h200").matmul_tflops
    assert m.notes["h2d_gbps"] == "mine" and "cpu_adam_gparams" in m.notes


@pytest.mark.parametrize("content, words", [
    ({"name": "x", "h2d_gbps": -1.0}, "must be > 0"),
    ({"name": "x", "h2d_gbs": 1.0}, "h2d_gbs"),
    ({"name": "x", "h2d_gbps": 50.0, "duplex_gbps": 40.0}, "duplex_gbps"),
    ({"name": "x", "extends": "no-such-machine"}, "neither a file nor a shipped machine"),
])
def test_mistakes_are_config_errors(tmp_path, content, words):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ConfigError, match=words):
        load_machine(str(path))


def test_an_unknown_name_lists_the_shipped_ones():
    with pytest.raises(ConfigError, match="h200"):
        load_machine("h9000")
