"""docs/api.md is executable: its ```python blocks run top to bottom in one namespace, in a
scratch directory, and really train, resume, schedule and trace."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from test_docs_example import python_blocks

DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def test_api_page_runs(tmp_path, monkeypatch):
    blocks = python_blocks(DOC.read_text())
    assert len(blocks) == 4
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "api_md"}
    for number, block in enumerate(blocks, 1):
        try:
            exec(compile(block, f"{DOC.name}[block {number}]", "exec"), namespace)
        except Exception as exc:
            pytest.fail(f"block {number} of {DOC.name} raised {type(exc).__name__}: {exc}")
    assert sorted(p.name for p in (tmp_path / "tuned").glob("checkpoint-*")) == ["checkpoint-6"]
    assert (tmp_path / "tuned" / "model.safetensors").exists() and (tmp_path / "trace.json").stat().st_size > 0
    assert not [t for t in threading.enumerate() if t.name.startswith("flowtrain-")]


def test_a_policy_object_goes_into_checkpoints_by_name(tmp_path):
    import json

    from flowtrain.policy import resolve_policy
    from flowtrain.train import TrainConfig, train

    train(TrainConfig(model="tiny", steps=2, batch_size=4, micro_batch_size=2, seq_len=32, device="cpu",
                      progress=False, out=str(tmp_path / "o"), save_every=2, policy=resolve_policy("lookahead")))
    state = json.loads((tmp_path / "o" / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["settings"]["policy"].endswith(":Lookahead")
