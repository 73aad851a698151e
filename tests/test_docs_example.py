"""docs/concepts.md is executable: every ```python block runs, top to bottom, in one namespace,
in a scratch directory. A failing block fails this test with its number and first line."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest

from flowtrain.policy import POLICIES

DOC = Path(__file__).resolve().parents[1] / "docs" / "concepts.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_concepts_example_runs(tmp_path, monkeypatch):
    blocks = python_blocks(DOC.read_text())
    assert len(blocks) >= 6
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "concepts_md"}
    before = dict(POLICIES)
    try:
        for number, block in enumerate(blocks, 1):
            code = compile(block, f"{DOC.name}[block {number}]", "exec")
            try:
                exec(code, namespace)
            except Exception as exc:
                first = block.strip().splitlines()[0]
                pytest.fail(f"block {number} of {DOC.name} ({first!r}) raised {type(exc).__name__}: {exc}")
    finally:
        POLICIES.clear()
        POLICIES.update(before)
    # The example really wrote a custom policy, ran it, and left a trace behind.
    assert "ZigZag" in namespace and namespace["ZigZag"].name == "zigzag"
    assert (tmp_path / "trace.json").stat().st_size > 0
    assert not [t for t in threading.enumerate() if t.name.startswith("flowtrain-")]
