"""Every config.json a run writes keeps the source model's, key for key, but for the dtype.

A Qwen2 model written by transformers has keys flowtrain does not model (``layer_types``, a
``max_window_layers`` of 28 on a 2-layer model, ``use_sliding_window`` false, the transformers
version) and here one nobody knows. Checkpoints once wrote flowtrain's own config instead,
dropping ``layer_types`` and setting ``max_window_layers`` to the number of layers; a resume
whose source folder was gone then carried that into the final model. Now each checkpoint's
config.json and the final model's equal the source's, with ``dtype``/``torch_dtype`` as saved
(fp32 in checkpoints, the final model's dtype there).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from flowtrain.cli import main

transformers = pytest.importorskip("transformers")

DTYPE_KEYS = ("torch_dtype", "dtype")
EXTRA = {"flowtrain_test_unknown": {"kept": [1, 2.5, None]}}
RUN = ["--batch-size", "4", "--micro-batch-size", "2", "--seq-len", "16", "--device", "cpu", "--no-progress",
       "--byte-tokenizer"]


@pytest.fixture
def source(tmp_path) -> Path:
    d = tmp_path / "qwen"
    config = transformers.Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=88, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(d)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["layer_types"] == ["full_attention"] * 2 and cfg["max_window_layers"] == 28  # the case reported
    (d / "config.json").write_text(json.dumps({**cfg, **EXTRA}, indent=2))
    return d


def assert_kept(written: Path, source: Path, dtype: str) -> None:
    new, old = json.loads((written / "config.json").read_text()), json.loads((source / "config.json").read_text())
    assert {k: v for k, v in new.items() if k not in DTYPE_KEYS} == {k: v for k, v in old.items() if k not in DTYPE_KEYS}
    assert [k for k in DTYPE_KEYS if k in new] == [k for k in DTYPE_KEYS if k in old]  # no dtype key added
    assert all(new[k] == dtype for k in DTYPE_KEYS if k in new), new


def test_checkpoints_and_the_final_model_keep_every_key_of_the_source_config(source, tmp_path):
    out = tmp_path / "out"
    assert main(["train", *RUN, "--model", str(source), "--steps", "2", "--save-every", "1", "--out", str(out)]) == 0
    for ckpt in ("checkpoint-1", "checkpoint-2"):
        assert_kept(out / ckpt, source, "float32")
    assert_kept(out, source, "float32")
    # the checkpoint still loads as the same model, through flowtrain and through transformers
    transformers.AutoModelForCausalLM.from_pretrained(out / "checkpoint-2")


def test_a_resume_without_the_source_folder_keeps_it_too(source, tmp_path):
    """The checkpoint's own config.json is what a resume keeps once the source folder is gone."""
    out = tmp_path / "out"
    assert main(["train", *RUN, "--model", str(source), "--steps", "4", "--save-every", "2", "--out", str(out)]) == 0
    kept = tmp_path / "kept"
    shutil.copytree(source, kept)
    shutil.rmtree(source)
    assert main(["train", *RUN, "--steps", "4", "--save-every", "3", "--resume", str(out / "checkpoint-2"),
                 "--out", str(out)]) == 0
    assert_kept(out / "checkpoint-3", kept, "float32")
    assert_kept(out, kept, "float32")
