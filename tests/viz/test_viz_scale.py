"""Large traces and a light command: a 100,000-task page within 500 MB, and no torch to start."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from viz_helpers import simulated_records

from flowtrain.runtime import write_chrome_trace

# Peak memory from VmHWM: ru_maxrss would count the parent's pages the child had before exec.
MEASURE = """
import sys
from flowtrain.cli import main
rc = main(["viz", sys.argv[1], "--out", sys.argv[2]])
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(rc, int(hwm.split()[1]) * 1024)
"""


@pytest.mark.parametrize("steps, tasks", [(3, 11_000), pytest.param(27, 100_000, marks=pytest.mark.slow)],
                         ids=["11k-tasks", "100k-tasks"])
def test_a_large_trace_builds_a_page_of_every_task_within_500_mb(tmp_path, steps, tasks):
    """Simulated steps of a 100-layer model with 16 micro-batches, written by the real writer
    (flow arrows, counters); the whole command, from reading the file to writing the page, runs
    in its own process so that its peak memory is its own. The page holds every task."""
    records = simulated_records(layers=100, micro_batches=16, steps=steps)
    assert len(records) >= tasks
    trace, page = tmp_path / "big.json", tmp_path / "big.html"
    write_chrome_trace(trace, records, meta={"policy": "simulated"})
    out = subprocess.run([sys.executable, "-c", MEASURE, str(trace), str(page)], capture_output=True, text=True,
                         timeout=600)
    rc, peak = out.stdout.split()[-2:]
    assert rc == "0", out.stderr[-2000:]
    assert int(peak) < 500e6, int(peak) / 1e6
    data = page.read_text()
    assert f'data-tasks="{len(records)}"' in data


def test_viz_starts_without_torch(tmp_path):
    """Reading a trace and writing its page never imports torch (nor does --help)."""
    from viz_helpers import doc, ev

    trace = tmp_path / "t.json"
    trace.write_text(json.dumps(doc(ev("a", "compute", 0, 5, kind="forward"))))
    code = ("import sys\nfrom flowtrain.cli import main\n"
            f"rc = main(['viz', {str(trace)!r}, '--out', {str(tmp_path / 'r.html')!r}])\n"
            "print(rc, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split()[-2:] == ["0", "False"], out
    help_ = subprocess.run([sys.executable, "-c", "import sys\nfrom flowtrain.cli import main\n"
                            "try:\n    main(['viz', '--help'])\nexcept SystemExit:\n    pass\n"
                            "print('torch' in sys.modules)"], capture_output=True, text=True, timeout=120)
    assert help_.stdout.split()[-1] == "False", help_


def test_viz_imports_neither_the_runtime_nor_torch():
    """flowtrain.viz reads files: no module in it imports flowtrain.runtime or torch."""
    import ast
    from pathlib import Path

    import flowtrain.viz

    for path in Path(flowtrain.viz.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                assert not name.startswith(("torch", "flowtrain.runtime", "..runtime")), f"{path.name} imports {name}"
