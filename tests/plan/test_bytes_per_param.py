"""One "bytes per parameter" figure, with what it includes, the same everywhere: ``flowtrain
plan``'s header and its JSON, ``--layout``'s help, the README, the largest-model hint."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from flowtrain.cli import main
from flowtrain.plan.buffer_sizes import LAYOUT_STATE_BYTES, STATE_BYTES_PER_PARAM, state_bytes_text

README = Path(__file__).resolve().parents[2] / "README.md"
PLAN = ["plan", "--model", "llama-8b", "--seq-len", "4096", "--batch-size", "16", "--micro-batch-size", "2",
        "--gpu-mem", "10", "--host-mem", "200", "--device", "cuda"]


def test_the_figures_are_the_layouts_state():
    assert LAYOUT_STATE_BYTES == {"staged": 12, "full": 16, "stream-bf16": 14}
    assert STATE_BYTES_PER_PARAM == LAYOUT_STATE_BYTES["staged"]
    assert state_bytes_text("staged") == "12 host bytes per parameter: fp32 master weight, Adam m and v"


@pytest.mark.parametrize("layout", ["staged", "full", "stream-bf16"])
def test_plan_header_json_and_help_say_the_same_figure(capsys, layout):
    extra = ["--layout", layout] + (["--grad-clip", "1.0"] if layout == "full" else [])
    main([*PLAN, *extra])
    header = capsys.readouterr().out.splitlines()[0]
    assert f"layout {layout} ({state_bytes_text(layout)})" in header, header
    main([*PLAN, *extra, "--json"])
    assert json.loads(capsys.readouterr().out)["state_bytes_per_param"] == LAYOUT_STATE_BYTES[layout]
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    helped = " ".join(capsys.readouterr().out.split()).replace("stream- bf16", "stream-bf16")  # argparse wraps at "-"
    assert f"{layout} ({state_bytes_text(layout)}" in helped


def test_the_hint_and_the_readme_use_it(capsys):
    main([*PLAN[:-4], "--host-mem", "64", "--lora-rank", "16", "--device", "cuda"])
    readme = " ".join(README.read_text().split())
    assert "12 host bytes per parameter" in readme and "12.3 bytes" not in readme
    figures = re.findall(r"([\d.]+) (?:host )?(?:B|bytes)(?:/| per )param", readme)
    assert set(figures) <= {"12", "16", "14", "2"}, figures
