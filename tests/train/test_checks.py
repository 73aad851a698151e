"""The checks a run passes before anything is loaded: numbers, the compile backend, output
paths; and the values of a model's config.json. Each refusal is one ConfigError line naming the
flag (or the config.json key) and the value."""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys

import pytest

from flowtrain.errors import ConfigError
from flowtrain.model import preset
from flowtrain.cli.train import flag_of
from flowtrain.train.config.checks import check_compile_backend, check_fields, check_output_paths
from flowtrain.train.run import TrainConfig
from flowtrain.model.hf_config import from_hf, to_hf

NAN, INF = math.nan, math.inf


def cfg(**changes):
    """TrainConfig's defaults with ``changes``."""
    return TrainConfig(**changes)


@contextlib.contextmanager
def refused(match: str):
    """A ConfigError whose line on the command line (the fields it names spelled as train's
    flags) starts with ``match``."""
    with pytest.raises(ConfigError) as info:
        yield info
    assert info.value.spelled(flag_of).startswith(match), info.value.spelled(flag_of)


# ---------------------------------------------------------------------- numbers


def test_the_defaults_pass():
    check_fields(TrainConfig())


@pytest.mark.parametrize("changes, message", [
    ({"lr": NAN}, "--lr must be a finite number >= 0 (got nan)"),
    ({"lr": INF}, "--lr must be a finite number >= 0 (got inf)"),
    ({"lr": -1e-3}, "--lr must be a finite number >= 0 (got -0.001)"),
    ({"eps": NAN}, "--eps must be a finite number >= 0 (got nan)"),
    ({"eps": -1e-8}, "--eps must be a finite number >= 0"),
    ({"weight_decay": INF}, "--weight-decay must be a finite number >= 0 (got inf)"),
    ({"min_lr": NAN}, "--min-lr must be a finite number >= 0 (got nan)"),
    ({"grad_clip": 0.0}, "--grad-clip must be a finite number > 0 (got 0.0)"),
    ({"grad_clip": NAN}, "--grad-clip must be a finite number > 0 (got nan)"),
    ({"gpu_mem": 0.0}, "--gpu-mem must be a finite number > 0 (got 0.0)"),
    ({"host_mem": INF}, "--host-mem must be a finite number > 0 (got inf)"),
    ({"host_mem": -2.0}, "--host-mem must be a finite number > 0 (got -2.0)"),
    ({"lr": "0.1"}, "--lr must be a finite number >= 0 (got '0.1')"),
    ({"betas": (NAN, 0.999)}, "--betas must be two numbers in [0, 1) like 0.9,0.999 (got nan,0.999)"),
    ({"betas": (0.9, 1.0)}, "--betas must be two numbers in [0, 1)"),
    ({"betas": (-0.1, 0.9)}, "--betas must be two numbers in [0, 1)"),
    ({"betas": (0.9,)}, "--betas must be two numbers in [0, 1)"),
    ({"steps": 0}, "--steps must be at least 1 (got 0)"),
    ({"steps": 2.5}, "--steps must be an integer >= 1 (got 2.5)"),
    ({"steps": True}, "--steps must be an integer >= 1 (got True)"),
    ({"seq_len": 1}, "--seq-len must be at least 2 (got 1)"),
    ({"warmup_steps": -1}, "--warmup-steps must be at least 0 (got -1)"),
    ({"chunk_tokens": 0}, "--chunk-tokens must be at least 1 (got 0)"),
    ({"checkpoint_every": 0}, "--activation-checkpoint-every must be at least 1 (got 0)"),
    ({"adam_workers": 0}, "--adam-workers must be at least 1 (got 0)"),
    ({"micro_batch_size": 3, "batch_size": 8}, "--micro-batch-size 3 does not divide --batch-size 8"),
    ({"seed": 2**64}, "--seed must be an integer from -2**63 to 2**64-1"),
    # fields the trainer grows: checked when present
    ({"save_every": 0}, "--save-every must be at least 1 (got 0)"),
    ({"save_total_limit": 0}, "--save-total-limit must be at least 1 (got 0)"),
    ({"max_skipped": -1}, "--max-skipped must be at least 0 (got -1)"),
    ({"undo_mem": NAN}, "--undo-mem must be a finite number >= 0 (got nan)"),
    ({"task_timeout": 0.0}, "--task-timeout must be a finite number > 0 (got 0.0)"),
])
def test_a_bad_number_is_refused_naming_its_flag(changes, message):
    """The command line names the flag; the Python API (the exception's text) the field."""
    with pytest.raises(ConfigError) as info:
        check_fields(cfg(**changes))
    assert info.value.spelled(flag_of).startswith(message)
    field = next(iter(changes))
    assert str(info.value).startswith(field + " "), str(info.value)


@pytest.mark.parametrize("batch, micro", [(4, 4), (12, 6), (7, 7), (16, 8), (24, 8), (1, 1), (10, 5)])
def test_the_default_micro_batch_shrinks_to_divide_the_batch(batch, micro):
    """A batch the default micro-batch (8) does not divide takes the largest divisor below 8; a
    micro-batch the user gives is kept as given, and refused where it does not divide."""
    made = TrainConfig(batch_size=batch)
    assert made.micro_batch_size == micro and made.batch_size % made.micro_batch_size == 0
    check_fields(made)
    assert TrainConfig(batch_size=batch, micro_batch_size=8).micro_batch_size == 8


@pytest.mark.parametrize("changes", [
    {"eps": 0.0}, {"lr": 0.0}, {"weight_decay": 0}, {"grad_clip": None}, {"grad_clip": 1},
    {"betas": (0.0, 0.0)}, {"seed": -1}, {"seed": 2**64 - 1}, {"chunk_tokens": None},
    {"gpu_mem": 0.5, "host_mem": 64}, {"save_every": None, "save_total_limit": None, "max_skipped": 0},
    {"task_timeout": None, "undo_mem": 0.0},
])
def test_edge_values_that_torch_accepts_pass(changes):
    check_fields(cfg(**changes))


# ---------------------------------------------------------------------- compile backend


@pytest.mark.parametrize("name", ["inductor", "aot_eager", "eager", "none", "auto", None])
def test_known_backends_pass(name):
    check_compile_backend(name)


def test_an_unknown_backend_is_refused_with_the_known_ones():
    with pytest.raises(ConfigError) as info:
        check_compile_backend("nosuch")
    message = info.value.spelled(flag_of)
    assert message.startswith("--compile 'nosuch' is not a torch.compile backend")
    assert all(name in message for name in ("auto", "none", "eager", "inductor"))


def test_trivial_names_do_not_import_dynamo():
    code = ("import sys; from flowtrain.train.config.checks import check_compile_backend\n"
            "for n in ('auto', 'none', 'eager', None): check_compile_backend(n)\n"
            "print('torch._dynamo' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "False", proc.stderr


# ---------------------------------------------------------------------- output paths


def listing(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_paths_that_can_be_written_pass_and_nothing_is_created(tmp_path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "old.json").write_text("{}")  # an existing file is replaced, as before
    before = listing(tmp_path)
    check_output_paths(None, False, None, None)
    check_output_paths(tmp_path / "a" / "b" / "out", False, tmp_path / "old.json", tmp_path / "runs" / "m.jsonl")
    empty = tmp_path / "runs"
    check_output_paths(empty, False, None, None)
    assert listing(tmp_path) == before  # no folders made, no probe file left behind


def test_out_must_not_be_a_file_or_under_one(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    with refused(f"--out {f} is a file; give a folder"):
        check_output_paths(f, True, None, None)
    with refused(f"--out {f / 'deep' / 'out'}: {f} is a file, so no folder can be made under it"):
        check_output_paths(f / "deep" / "out", False, None, None)
    assert f.read_text() == "x"


def test_a_non_empty_out_needs_overwrite_or_a_resume_inside_it(tmp_path):
    out = tmp_path / "out"
    (out / "checkpoint-4").mkdir(parents=True)
    with refused(f"--out {out} exists and is not empty; choose another directory or add --overwrite"):
        check_output_paths(out, False, None, None)
    check_output_paths(out, True, None, None)
    check_output_paths(out, False, None, None, resume=out)
    check_output_paths(out, False, None, None, resume=out / "checkpoint-4")
    elsewhere = tmp_path / "other" / "checkpoint-4"
    elsewhere.mkdir(parents=True)
    with refused(f"--out {out} exists and is not empty"):
        check_output_paths(out, False, None, None, resume=elsewhere)


@pytest.mark.parametrize("flag", ["--trace", "--metrics"])
def test_trace_and_metrics_must_be_writable_files(tmp_path, flag):
    f = tmp_path / "f"
    f.write_text("x")

    def check(path):
        check_output_paths(tmp_path / "out", False, *((path, None) if flag == "--trace" else (None, path)))

    with refused(f"{flag} {tmp_path} is a folder; give a file name"):
        check(tmp_path)
    with refused(f"{flag} {f / 'x.json'}: {f} is a file, so nothing can be written under it"):
        check(f / "x.json")
    with refused(f"{flag} {f / 'a' / 'x.json'}: {f} is a file, so no folder can be made under it"):
        check(f / "a" / "x.json")
    missing = tmp_path / "no" / "such" / "x.json"
    with refused(f"{flag} {missing}: its folder {missing.parent} does not exist; create it first"):
        check(missing)


def test_two_outputs_cannot_share_a_path(tmp_path):
    t = tmp_path / "t.json"
    with refused(f"--trace and --metrics both name {t}"):
        check_output_paths(None, False, t, t)
    with refused("--out and --trace both name"):
        check_output_paths(t, False, t, None)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc, a file system nobody can write")
def test_a_file_system_that_refuses_files_is_found_even_as_root():
    # os.access says yes to root everywhere; the probe file is what finds this.
    with refused("--out /proc/flowtrain-nosuch/out cannot be written (in /proc)"):
        check_output_paths("/proc/flowtrain-nosuch/out", False, None, None)
    with refused("--trace /proc/flowtrain-t.json cannot be written (in /proc)"):
        check_output_paths(None, False, "/proc/flowtrain-t.json", None)


def test_a_folder_os_access_denies_is_refused(tmp_path, monkeypatch):
    # What a read-only folder looks like to anyone but root, who the tests may run as.
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with refused(f"--out {tmp_path / 'out'} cannot be written (in {tmp_path}): permission denied"):
        check_output_paths(tmp_path / "out", False, None, None)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a read-only folder")
def test_a_read_only_folder_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with refused(f"--out {ro / 'out'} cannot be written (in {ro})"):
            check_output_paths(ro / "out", False, None, None)
        with refused(f"--metrics {ro / 'm.jsonl'} cannot be written (in {ro})"):
            check_output_paths(None, False, None, ro / "m.jsonl")
    finally:
        ro.chmod(0o755)


# ---------------------------------------------------------------------- config.json values


def hf(**changes):
    d = to_hf(preset("tiny"))
    d.update(changes)
    return d


@pytest.mark.parametrize("d, message", [
    (hf(vocab_size="lots"), "config.json: vocab_size must be a positive integer (got 'lots')"),
    (hf(vocab_size=-5), "config.json: vocab_size must be a positive integer (got -5)"),
    (hf(vocab_size=0), "config.json: vocab_size must be a positive integer (got 0)"),
    (hf(vocab_size=256.5), "config.json: vocab_size must be a positive integer (got 256.5)"),
    (hf(vocab_size=256.0), "config.json: vocab_size must be a positive integer (got 256.0)"),
    (hf(vocab_size=True), "config.json: vocab_size must be a positive integer (got True)"),
    (hf(vocab_size=None), "config.json for LlamaForCausalLM lacks required key(s) vocab_size"),
    (hf(num_hidden_layers="2"), "config.json: num_hidden_layers must be a positive integer (got '2')"),
    (hf(num_key_value_heads=[2]), "config.json: num_key_value_heads must be a positive integer (got [2])"),
    (hf(head_dim=-16), "config.json: head_dim must be a positive integer (got -16)"),
    (hf(max_position_embeddings="big"), "config.json: max_position_embeddings must be a positive integer"),
    (hf(rms_norm_eps="tiny"), "config.json: rms_norm_eps must be a finite number (got 'tiny')"),
    (hf(rms_norm_eps=INF), "config.json: rms_norm_eps must be a finite number (got inf)"),
    (hf(rms_norm_eps=-1e-6), "model config: rms_norm_eps must be > 0"),
    (hf(initializer_range=NAN), "config.json: initializer_range must be a finite number (got nan)"),
    (hf(rope_theta=NAN, rope_parameters=None), "config.json: rope_theta must be a finite number (got nan)"),
    (hf(rope_parameters={"rope_type": "default", "rope_theta": "1e4"}),
     "config.json: rope_parameters.rope_theta must be a finite number (got '1e4')"),
    (hf(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": "x", "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
     "config.json: rope_parameters.factor must be a finite number (got 'x')"),
    (hf(rope_parameters=None, rope_scaling="llama3"), "config.json: rope_scaling must be an object or null"),
    (hf(tie_word_embeddings="false"), "config.json: tie_word_embeddings must be true or false (got 'false')"),
    (hf(eos_token_id=["</s>"]), "config.json: eos_token_id must be an integer (got '</s>')"),
    (hf(pad_token_id=1.5), "config.json: pad_token_id must be an integer (got 1.5)"),
    (hf(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window="big"),
     "config.json: sliding_window must be a positive integer (got 'big')"),
])
def test_config_json_values_of_the_wrong_kind_are_refused(d, message):
    with refused(message) as info:
        from_hf(d)
    assert "\n" not in str(info.value)


def test_config_json_nulls_take_the_defaults():
    d = hf(head_dim=None, num_key_value_heads=None, rms_norm_eps=None, tie_word_embeddings=None)
    got = from_hf(d)
    assert got.num_kv_heads == got.num_heads and got.head_dim == 16 and got.rms_norm_eps == 1e-6


def test_an_unknown_attention_backend_is_refused_before_anything_runs():
    with pytest.raises(ConfigError) as info:
        check_fields(TrainConfig(attention_backend="cudnn-only"))
    assert info.value.spelled(flag_of) == "--attention-backend must be auto or flash (got 'cudnn-only')"


def test_long_context_asks_for_expandable_segments_unless_the_user_chose():
    from flowtrain.train.prepare import prefer_expandable_segments

    env: dict[str, str] = {}
    assert not prefer_expandable_segments(TrainConfig(seq_len=4096, micro_batch_size=8), env) and env == {}
    assert prefer_expandable_segments(TrainConfig(seq_len=262144, micro_batch_size=1, batch_size=1), env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    mine = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    assert not prefer_expandable_segments(TrainConfig(seq_len=65536, micro_batch_size=1, batch_size=1), mine)
    assert mine == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
