"""Sizes within every bound of config.json that no machine could hold are refused before sizing.

``vocab_size`` 2**24 and ``hidden_size`` 2**18 are each within ``SIZE_BOUNDS``, and their
product (4.4e12 parameters of embedding) within ``MAX_PARAMETERS``; with small layers the
embedding's gradient would pass the staging slots in over a million chunks, and ``flowtrain
plan`` died of a MemoryError building them (``flowtrain train`` would have, given weights).
Now a unit whose state alone (12 bytes per parameter) is more than the host could hold is
refused by integer arithmetic, naming the fields and the host's memory, before the weights are
looked at; and even where ``--host-mem`` claims the room, a unit needing more than
``MAX_GRAD_CHUNKS`` staging chunks is refused before a task is built. The command-line tests run
in a child whose address space is capped at 3 GiB (``test_config_bounds.run_cli``), so a refusal
that came after a large allocation would fail them.
"""

from __future__ import annotations

import msgspec
import pytest
from test_config_bounds import PLAN, model_dir, one_line, run_cli

from flowtrain.errors import ConfigError
from flowtrain.model.presets import preset
from flowtrain.plan.buffer_sizes import MAX_GRAD_CHUNKS, check_units_fit, host_memory_total

#: within every bound of config.json; small layers, so the embedding is 1.3 million layers
ABSURD = dict(vocab_size=2**24, hidden_size=2**18, intermediate_size=1, num_attention_heads=1, num_key_value_heads=1,
              head_dim=2)


@pytest.mark.parametrize("command", [["plan", *PLAN], ["train", "--no-progress", "--byte-tokenizer", *PLAN]])
def test_a_model_no_host_could_hold_is_refused_in_one_line(tmp_path, command):
    folder = model_dir(tmp_path, **ABSURD)  # config.json alone: train refuses before asking for weights
    line = one_line(run_cli(command[0], "--model", str(folder), *command[1:]))
    assert line.startswith("flowtrain: error: model config: vocab_size 16,777,216 x hidden_size 262,144: an output "
                           "head of 4,398,046,773,248 parameters, whose training state alone (12 bytes each: 49,152 GiB) "
                           "is more than the host could hold ("), line
    assert "GiB, all of this machine's memory); no plan can fit this model" in line, line


def test_room_claimed_with_host_mem_still_stops_before_the_chunks_are_built(tmp_path):
    folder = model_dir(tmp_path, **ABSURD)
    line = one_line(run_cli("plan", "--model", str(folder), *PLAN, "--host-mem", str(10**8)))
    assert "model config: vocab_size and hidden_size make the embedding (4,398,046,511,104 parameters) 1,290,556 " \
           "times the largest decoder layer (3,407,872)" in line, line
    assert f"more than the {MAX_GRAD_CHUNKS:,} a step may hold" in line


def test_real_models_pass_and_the_gpu_counts_where_it_holds_more():
    check_units_fit(preset("llama-8b"), host_mem=16)  # does not fit whole, but every unit does: the plan says so
    check_units_fit(preset("tiny"), host_mem=None)
    big = msgspec.structs.replace(preset("tiny"), vocab_size=2**20, hidden_size=2**12)  # 48 GiB of embedding state
    with pytest.raises(ConfigError, match=r"is more than the host could hold \(40.0 GiB planned for \(--host-mem, or"):
        check_units_fit(big, host_mem=40)
    check_units_fit(big, host_mem=40, gpu_bytes=64 * 2**30)  # resident on a GPU that large, it could fit
    assert host_memory_total() is not None and host_memory_total() > 0
