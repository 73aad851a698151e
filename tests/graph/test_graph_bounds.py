"""A graph too large to build in reasonable memory and time is refused before a task is built.

``flowtrain graph --micro-batches 100000000`` died of a MemoryError after 53 s, and ``--layers
1000000`` ran on. A step's graph holds a ``forward`` and a ``backward`` task per layer pass
(layer x micro-batch), and up to six more: :data:`MAX_LAYER_PASSES` bounds the passes, checked
by integer arithmetic in :meth:`StepSpec.validate` (so ``compile_step``, the planner and
``flowtrain graph`` share it) and over ``--steps`` in ``compile_steps``. The command-line tests
run in a child whose address space is capped at 3 GiB: a refusal after building would die of a
MemoryError instead. Nothing is timed.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest

from flowtrain.errors import ConfigError
from flowtrain.graph.compiler import MAX_LAYER_PASSES, StepSpec, compile_step, compile_steps

ADDRESS_SPACE = 3 << 30
HANG_GUARD_S = 300


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))
    resource.setrlimit(resource.RLIMIT_CPU, (HANG_GUARD_S, HANG_GUARD_S))


def refused(tmp_path, *args: str) -> str:
    """``flowtrain graph ARGS`` in a 3 GiB child: its one line, exit status 2, nothing written."""
    out = tmp_path / "g.json"
    env = {k: v for k, v in os.environ.items() if k != "FLOWTRAIN_DEBUG"}
    proc = subprocess.run([sys.executable, "-m", "flowtrain", "graph", *args, "--out", str(out)], capture_output=True,
                          text=True, env=env, preexec_fn=_limited, timeout=HANG_GUARD_S)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not out.exists()
    return lines[0]


@pytest.mark.parametrize("args, says", [
    (("--layers", "2", "--micro-batches", "100000000"),
     "--layers 2 x --micro-batches 100,000,000 is 200,000,000 layer passes"),
    (("--layers", "1000000"), "--layers 1,000,000 x --micro-batches 1 is 1,000,000 layer passes"),
    (("--layers", "4", "--micro-batches", "2", "--steps", "100000"),
     "--layers 4 x --micro-batches 2 x 100,000 steps is 800,000 layer passes"),
])
def test_graph_refuses_a_graph_too_large_in_one_line(tmp_path, args, says):
    line = refused(tmp_path, *args)
    assert line.startswith(f"flowtrain: error: {says}"), line
    assert f"more than the {MAX_LAYER_PASSES:,} one graph may hold" in line


def test_the_bound_is_checked_before_building():
    at = StepSpec(layers=2, micro_batches=MAX_LAYER_PASSES // 2)
    assert at.validate() is at  # at the bound: accepted (not built here: it takes seconds)
    over = StepSpec(layers=2, micro_batches=MAX_LAYER_PASSES // 2 + 1)
    with pytest.raises(ConfigError, match="is 131,074 layer passes"):
        compile_step(over)
    with pytest.raises(ConfigError, match="x 2 steps is 262,144 layer passes"):
        compile_steps(at, 2)
    assert compile_steps(StepSpec(layers=2, micro_batches=2), 3).number_of_nodes() > 0
