"""How ``flowtrain`` starts: ``--help`` of every command imports no torch (which costs seconds),
``flowtrain viz`` runs without it, ``flowtrain train``'s parser defaults are ``TrainConfig``'s,
and a missing optional dependency is one line naming the install command.

The startup tests assert on imports, not on time: each runs in a fresh interpreter, which
reports whether torch (or matplotlib) ended up in ``sys.modules``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import pytest

from flowtrain.cli import build_parser, main
from flowtrain.cli.train import config_from_args
from flowtrain.train.config import defaults
from flowtrain.train.run import TrainConfig

# calls flowtrain.cli.main with argv[1:] (a JSON list of argv lists), then prints which heavy
# modules are loaded
PROBE = """
import json, sys
from flowtrain.cli import main
for argv in json.loads(sys.argv[1]):
    try:
        main(argv)
    except SystemExit:
        pass
print(json.dumps({m: m in sys.modules for m in ("torch", "matplotlib")}))
"""


def probe(*argvs: list[str], importtime: bool = False) -> tuple[dict, str]:
    """Run ``argvs`` through ``main`` in a fresh interpreter: (heavy modules loaded, stderr)."""
    flags = ["-X", "importtime"] if importtime else []
    proc = subprocess.run([sys.executable, *flags, "-c", PROBE, json.dumps(argvs)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1]), proc.stderr


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["graph", "--help"], ["plan", "--help"],
                                  ["viz", "--help"], ["bench", "--help"]], ids=" ".join)
def test_help_imports_no_torch(argv):
    loaded, importtime = probe(argv, importtime=True)
    assert loaded == {"torch": False, "matplotlib": False}
    imported = {line.split("|")[-1].strip() for line in importtime.splitlines() if line.startswith("import time:")}
    assert "flowtrain.cli" in imported and "torch" not in imported


def test_module_entry_point_help_imports_no_torch():
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "flowtrain.cli", "train", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--micro-batch-size" in proc.stdout
    # -X importtime lists what import statements load (not importlib.import_module, which loads
    # the command's module); torch would be loaded by a statement somewhere below it
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "flowtrain.train.config.defaults" in imported and "torch" not in imported


def test_viz_runs_without_torch(tmp_path):
    g, html = str(tmp_path / "g.json"), str(tmp_path / "r.html")
    loaded, _ = probe(["graph", "--layers", "2", "--out", g], ["viz", g, "--out", html])
    assert loaded == {"torch": False, "matplotlib": False}
    assert "<html" in (tmp_path / "r.html").read_text()


def test_only_the_chosen_command_gets_its_arguments():
    parser = build_parser("graph")
    assert parser.parse_args(["graph", "--layers", "2", "--out", "g.json"]).layers == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["plan", "--model", "tiny"])  # a bare subparser: no --model yet


def test_train_defaults_are_train_configs():
    """flowtrain/train/config/defaults.py and TrainConfig's field defaults say the same, and so does
    the parser: no flags at all give ``TrainConfig()``."""
    fields = {f.name: f.default for f in msgspec.structs.fields(TrainConfig)}
    for name, value in vars(defaults).items():
        if name.isupper() and name.lower() in fields:
            assert fields[name.lower()] == value, name
    # the optimizer's defaults depend on the weights' source: unset (None) until the run decides
    assert defaults.FROM_SCRATCH.keys() == defaults.FINE_TUNE.keys()
    assert all(fields[name] is None for name in defaults.FINE_TUNE)
    args = build_parser("train").parse_args(["train"])
    assert config_from_args(args) == TrainConfig()


def test_png_without_matplotlib_is_one_line(monkeypatch, tmp_path, capsys):
    assert main(["graph", "--layers", "2", "--out", str(tmp_path / "g.json")]) == 0
    capsys.readouterr()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ModuleNotFoundError
    argv = ["viz", str(tmp_path / "g.json"), "--out", str(tmp_path / "r.html"), "--png", str(tmp_path / "p.png")]
    assert main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [
        "flowtrain: error: --png needs matplotlib: pip install 'flowtrain[viz]'"]
    assert not (tmp_path / "r.html").exists() and not (tmp_path / "p.png").exists()  # refused before writing
