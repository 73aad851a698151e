"""docs/bench/anchor_bf16.py over a trainer shaped as the baseline trainer is: its own build
must be the one the trainer's ``main`` uses (it once replaced the class in a copy of the
trainer's names, and every anchor was built by the trainer itself), and what it builds must be
the model transformers builds, in bf16, with the same rotary tables and weights from the same
distribution."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).parents[1] / "docs" / "bench" / "anchor_bf16.py"

# The baseline trainer's structure: module-level model_class() and make_config(), and a main()
# that builds through model_class() as run_gpu does. Its own build is fp32 on the CPU.
TRAINER = '''
import json, os, sys
import torch
import transformers

SIZE = sys.argv[2]

def make_config():
    return transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                    max_position_embeddings=128, attention_bias=SIZE == "bias")

def model_class():
    return transformers.LlamaForCausalLM

def main():
    cfg = make_config()
    model = model_class()(cfg)
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(make_config())
    params = dict(model.named_parameters())
    report = {
        "dtypes": sorted({str(p.dtype) for p in params.values()}),
        "buffers_equal": all(torch.equal(b, dict(reference.named_buffers())[k]) for k, b in model.named_buffers()),
        "buffer_names": sorted(k for k, _ in model.named_buffers()),
        "norms_one": all(bool((p == 1).all()) for k, p in params.items() if k.endswith("norm.weight")),
        "biases_zero": all(bool((p == 0).all()) for k, p in params.items() if k.endswith("bias")),
        "stds": sorted(round(float(p.float().std()), 3) for p in params.values() if p.dim() == 2),
        "loss": float(model(input_ids=torch.arange(16)[None], labels=torch.arange(16)[None]).loss),
    }
    print(json.dumps(report))
'''


@pytest.mark.parametrize("size", ["plain", "bias"])
def test_the_trainer_builds_through_anchor_bf16(tmp_path, size):
    (tmp_path / "llama_train.py").write_text(TRAINER)
    out = tmp_path / "out"
    out.mkdir()
    run = subprocess.run([sys.executable, str(SCRIPT), "gpu", size, "16", "1", "1"], cwd=tmp_path,
                         capture_output=True, text=True, env={**os.environ, "OUT": str(out)}, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["dtypes"] == ["torch.bfloat16"]  # the script's build, not the trainer's fp32 one
    assert report["buffer_names"] and report["buffers_equal"]  # the rotary tables, computed again
    assert report["norms_one"] and report["biases_zero"]
    assert all(0.015 < s < 0.025 for s in report["stds"]), report["stds"]  # N(0, initializer_range 0.02)
    assert 0 < report["loss"] < 20
    phases = (out / f"anchor_bf16-{size}-phases.txt").read_text()
    assert "model built" in phases and "done" in phases
