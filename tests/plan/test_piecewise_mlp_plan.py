"""The plan of a layer whose MLP runs in pieces (more than ``MLP_CHUNK_TOKENS`` tokens a
micro-batch) against what such a run allocated: Qwen2.5-7B's shape at 79 x 1,024 tokens a
micro-batch on an H100, whose GPU peak report (``flowtrain bench --gpu-peak-report``) is kept in
docs/bench/2026-12-06/."""

from __future__ import annotations

import json
from pathlib import Path

from flowtrain.cli import main
from flowtrain.model.config import MLP_CHUNK_TOKENS
from flowtrain.model.presets import preset
from flowtrain.plan.memory import layer_work_bytes

BENCH = Path(__file__).parents[2] / "docs" / "bench" / "2026-12-06"
ARGS = ["--model", "qwen2.5-7b", "--seq-len", "1024", "--batch-size", "158", "--micro-batch-size", "79",
        "--host-mem", "118"]


def test_the_plan_bounds_the_peak_a_run_in_pieces_allocated(capsys):
    """Planned for the H100 from a computer without one, the run places what it placed and plans
    at or above the allocator's peak, within 1% of it."""
    report = json.loads((BENCH / "ft7bpeak-h100-peak.json").read_text())
    run = next(r for r in map(json.loads, (BENCH / "megatrain5-h100-results.jsonl").read_text().splitlines())
               if r.get("model") == "qwen2.5-7b")
    assert main(["plan", *ARGS, "--machine", "h100-sxm", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["resident"] == run["resident"] and plan["budgets"] == run["budgets"]
    planned = plan["gpu_total"] / 2**30
    assert report["allocator_peak_gib"] <= planned <= 1.01 * report["allocator_peak_gib"]


def test_past_the_piece_length_the_mlp_stops_growing_and_the_count_never_drops():
    """Past the piece length one piece is alive at a time: the count grows per token by the
    layer's saved tensors alone (the MLP's piece and the attention buffers, whichever is larger,
    stay the same while the piece is larger), less than below it by at least the MLP's three
    intermediates a token; and a micro-batch one token past the piece length plans no less."""
    for name in ("qwen2.5-7b", "llama-8b", "llama-3b"):
        cfg = preset(name)
        p = MLP_CHUNK_TOKENS

        def work(tokens: int) -> int:
            return layer_work_bytes(cfg, tokens, 2, compiled=True)

        above = (work(2 * p) - work(p + p // 2)) / (p // 2)
        below = (work(p) - work(p // 2)) / (p // 2)
        assert below - above >= 2 * 3 * cfg.intermediate_size, name
        assert work(p + 1) >= work(p), name
