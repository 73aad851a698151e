"""Inputs that could exhaust the process are refused in one line, naming what to fix.

- ``--adam-workers`` is bounded (the larger of 256 and 4 per CPU): 100,000 threads is a typo.
- A ``--data`` row nested too deeply for Python's JSON parser is refused naming its file and
  line, not with a RecursionError traceback; a nested list where ids belong, likewise.
- A chat template is foreign code run on every row: one that recurses without end, or builds a
  string of more than 64 Mi characters (``*``, ``+``, ``~``, or its output), fails that row in
  one line naming it.
- Integer or bool tensors in a model's safetensors are refused for floating-point weights,
  naming the tensor, before anything is loaded (they would be cast silently).
- JSON files of a model folder nested too deeply (config.json, a manifest.json) give one line.

Objects and messages are checked, never times.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from flowtrain.data.files import read_jsonl
from flowtrain.data.source import load_sequences
from flowtrain.data.text import MAX_RENDER_CHARS, ByteEncoder, ChatTemplate, check_encoder
from flowtrain.errors import CheckpointError, ConfigError, DataError
from flowtrain.model.model_dir import read_config
from flowtrain.model.presets import preset
from flowtrain.train.config.checks import check_fields
from flowtrain.train.config.run_config import TrainConfig

DEEP = 100_000  # levels of nesting: beyond any recursion limit


def deep_list(levels: int) -> str:
    return "[" * levels + "]" * levels


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "FLOWTRAIN_DEBUG"}
    return subprocess.run([sys.executable, "-m", "flowtrain", *args], capture_output=True, text=True,
                          env=env, timeout=300)  # a hang guard only


def one_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return lines[0]


# ---------------------------------------------------------------------- --adam-workers


def test_adam_workers_is_bounded():
    bound = max(256, 4 * (os.cpu_count() or 1))
    check_fields(TrainConfig(adam_workers=bound))
    with pytest.raises(ConfigError, match=rf"^adam_workers must be at most {bound} \(the larger of 256 and 4 per "
                                          r"CPU\) \(got 100000\)$"):  # the field, as the Python API names it
        check_fields(TrainConfig(adam_workers=100_000))


def test_adam_workers_100000_is_one_line_on_the_command_line():
    line = one_line(run_cli("train", "--no-progress", "--adam-workers", "100000"))
    assert "--adam-workers must be at most" in line


# ---------------------------------------------------------------------- --data rows


@pytest.mark.parametrize("row", [
    '{"input_ids": %s}' % deep_list(DEEP),
    '{"text": %s}' % deep_list(DEEP),
    '{"messages": [{"role": "user", "content": %s}]}' % deep_list(DEEP),
])
def test_a_row_nested_beyond_the_parser_names_its_file_and_line(tmp_path, row):
    first = row.split(":")[0] + ": " + ('[1, 2, 3]}' if "input_ids" in row else '"hi"}')
    if "messages" in row:
        first = '{"messages": [{"role": "user", "content": "hi"}]}'
    path = tmp_path / "d.jsonl"
    path.write_text(first + "\n" + row + "\n")
    parsed = read_jsonl(path, 256, lambda: ByteEncoder(None), lambda: ChatTemplate("t", "{{ messages }}", {}))
    with pytest.raises(DataError) as info:
        list(parsed.pieces)
    message = str(info.value)
    assert message.startswith(f"{path} line 2 nests its JSON too deeply to read") and "\n" not in message
    assert len(message) < 400


def test_nested_lists_where_ids_belong_are_a_data_error_naming_the_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"input_ids": [1, 2]}\n{"input_ids": %s}\n' % deep_list(200))
    with pytest.raises(DataError, match=r"line 2: \"input_ids\" must be a flat list of integers such as \[1, 2, 3\], "
                                        r"not \[\[\[\["):
        load_sequences(path, seq_len=8, vocab_size=256)


def test_a_deep_row_on_the_command_line_is_one_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"input_ids": %s}\n' % deep_list(DEEP))
    line = one_line(run_cli("train", "--no-progress", "--data", str(path)))
    assert f"{path} line 1 nests its JSON too deeply" in line


# ---------------------------------------------------------------------- chat templates

CONVERSATION = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def render_rows(tmp_path, template: str):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    parsed = read_jsonl(path, 256, lambda: ByteEncoder(None), lambda: ChatTemplate("the template", template, {}))
    return path, parsed


@pytest.mark.parametrize("template, why", [
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "it recursed too deeply"),
    ("{{ 'x' * 10**9 }}", "it would build a string of 1,000,000,000 characters"),  # 1 GB if unchecked
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
     "it would build a string of 134,217,728 characters"),
    ("{% set ns = namespace(s=['x']) %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "it would build a list of 134,217,728 items"),
    ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", "more than the 67,108,864"),
    ("{% set s %}{% for i in range(100000) %}{{ 'z' * 1000 }}{% endfor %}{% endset %}{{ s | length }}",
     "more than the 67,108,864"),
    ("{{ 7 ** 10000000 }}", "it would compute a number of about 30,000,000 bits"),
    ("{% set ns = namespace(n=3) %}{% for i in range(100) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
     "more than the 1,048,576 a rendering may"),
])
def test_a_template_that_recurses_or_builds_huge_strings_fails_its_row_in_one_line(tmp_path, template, why):
    path, parsed = render_rows(tmp_path, template)
    with pytest.raises(DataError) as info:
        list(parsed.pieces)
    message = str(info.value)
    assert message.startswith(f"{path} line 1: the chat template (the template) failed on this conversation: ")
    assert why in message and "\n" not in message and len(message) < 400


def test_a_template_under_the_bound_renders_as_before():
    t = ChatTemplate("t", "{% for m in messages %}{{ m.role ~ ': ' ~ m.content * 2 + '!' }}\n{% endfor %}"
                          "{{ 'x' * 1000 }}", {})
    assert t.render(CONVERSATION) == "user: hihi!\nassistant: hellohello!\n" + "x" * 1000
    assert MAX_RENDER_CHARS == 64 << 20


# ---------------------------------------------------------------------- weights and model files


def saved_tiny(tmp_path, dtype_of=None):
    """The tiny preset saved as a Hugging Face folder; ``dtype_of`` maps tensor names to the
    torch dtype to store them in instead."""
    import torch
    from safetensors.torch import load_file, save_file

    from flowtrain.ckpt.hf import save_hf
    from flowtrain.model import model_flat_maps

    cfg = preset("tiny")
    folder = tmp_path / "model"
    layouts = model_flat_maps(cfg)
    save_hf(folder, cfg, layouts, [torch.zeros(lay.numel) for lay in layouts])
    if dtype_of:
        tensors = load_file(folder / "model.safetensors")
        for name, dtype in dtype_of.items():
            tensors[name] = tensors[name].to(dtype)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("dtype, code", [("int8", "I8"), ("bool", "BOOL"), ("int64", "I64"), ("uint8", "U8")])
def test_integer_and_bool_weights_are_refused_naming_the_tensor(tmp_path, dtype, code):
    import torch

    name = "model.layers.1.mlp.up_proj.weight"
    folder = saved_tiny(tmp_path, {name: getattr(torch, dtype)})
    with pytest.raises(CheckpointError) as info:
        read_config(folder)
    assert str(info.value).startswith(f"tensor '{name}' in {folder / 'model.safetensors'} is '{code}', "
                                      "not a floating-point weight; flowtrain loads F64, F32, BF16, F16 weights")


@pytest.mark.slow
def test_int8_weights_are_one_line_on_the_command_line(tmp_path):
    import torch

    folder = saved_tiny(tmp_path, {"model.embed_tokens.weight": torch.int8})
    line = one_line(run_cli("train", "--no-progress", "--model", str(folder), "--byte-tokenizer", "--steps", "1"))
    assert "tensor 'model.embed_tokens.weight'" in line and "'I8', not a floating-point weight" in line


def test_float_weights_of_every_width_still_load(tmp_path):
    import torch

    folder = saved_tiny(tmp_path, {"model.norm.weight": torch.bfloat16, "lm_head.weight": torch.float16,
                                   "model.embed_tokens.weight": torch.float64})
    assert read_config(folder) == preset("tiny")


def test_a_truncated_weight_file_is_refused_from_its_header(tmp_path):
    folder = saved_tiny(tmp_path)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=r"model.safetensors: corrupt or truncated \('lm_head.weight' lies at"):
        read_config(folder)


def test_a_config_json_nested_too_deeply_is_one_line(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"architectures": %s}' % deep_list(DEEP))
    with pytest.raises(CheckpointError, match=r"config.json: its JSON is nested too deeply$"):
        read_config(folder)


def test_a_garbage_manifest_in_a_model_folder_is_no_checkpoint(tmp_path):
    """A folder without tokenizer.json trains on bytes only if it is a flowtrain checkpoint (its
    manifest.json says so); a manifest nested too deeply is simply not one."""
    folder = saved_tiny(tmp_path)
    (folder / "manifest.json").write_text('{"format": %s}' % deep_list(DEEP))
    with pytest.raises(DataError, match="has no tokenizer.json, so its text would be trained as raw UTF-8 bytes"):
        check_encoder(folder, 256)
