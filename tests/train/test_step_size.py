"""A step of more micro-batches than its graph may hold, or a batch larger than the host could
hold, is refused before the graph is built.

``flowtrain train --batch-size 1000000`` (the tiny model, micro-batches of 8) once ran for over
ten minutes in the step compiler, to 11 GB, printing nothing: 125,000 micro-batches through 2
layers. Now the planner, which ``train``, ``plan`` and ``simulate`` share, counts the step's layer
passes (layers x micro-batches) by integer arithmetic first and refuses more than
``MAX_LAYER_PASSES`` in one line naming ``--batch-size`` and ``--micro-batch-size``. The
command-line tests run in a child whose address space is capped at 3 GiB
(``test_config_bounds.run_cli``): a refusal that came after the graph was built would die of a
MemoryError instead. A batch's token ids (16 bytes a token) are counted against the host the
same way first: ``--batch-size 10**12`` in one micro-batch planned candidate after candidate,
each compiling a graph. Nothing is timed.
"""

from __future__ import annotations

import pytest
from test_config_bounds import one_line, run_cli

from flowtrain.errors import ConfigError
from flowtrain.graph.spec import MAX_LAYER_PASSES
from flowtrain.model.presets import preset
from flowtrain.plan.planner import _micro_batch_sizes, check_step_size, most_micro_batches
from flowtrain.plan.request import RunRequest

REFUSED = ("--batch-size 1,000,000 in micro-batches of --micro-batch-size 8 is 125,000 micro-batches a step; "
           "through the model's 2 layers its graph would hold 250,000 layer passes, more than the 131,072 a step "
           "may hold (at most 65,536 micro-batches)")


@pytest.fixture
def corpus(tmp_path):
    """A small text corpus: a few hundred sequences of 128 bytes."""
    path = tmp_path / "small.txt"
    path.write_text("A small corpus for a step far larger than it. " * 1000)
    return path


def test_train_refuses_a_million_sequences_a_step_in_one_line(tmp_path, corpus):
    line = one_line(run_cli("train", "--no-progress", "--data", str(corpus), "--batch-size", "1000000",
                            "--steps", "1", "--out", str(tmp_path / "out")))
    assert line.startswith(f"flowtrain: error: {REFUSED}"), line
    assert "give a --micro-batch-size of at least 16 or a smaller --batch-size" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_plan_and_simulate_refuse_it_as_train_does(command):
    line = one_line(run_cli(command, "--model", "tiny", "--batch-size", "1000000"))
    assert line.startswith(f"flowtrain: error: {REFUSED}"), line


def test_the_bound_is_on_layer_passes():
    tiny = preset("tiny")  # 2 layers
    most = most_micro_batches(tiny)
    assert most == MAX_LAYER_PASSES // 2
    check_step_size(tiny, RunRequest(seq_len=16, batch_size=most * 8, micro_batch_size=8))  # at the bound: planned
    with pytest.raises(ConfigError, match=r"is 65,537 micro-batches a step"):
        check_step_size(tiny, RunRequest(seq_len=16, batch_size=(most + 1) * 8, micro_batch_size=8))
    with pytest.raises(ConfigError, match=r"\(this process's share of 4\)"):
        check_step_size(tiny, RunRequest(seq_len=16, batch_size=(most + 1), micro_batch_size=1, processes=4))


def test_the_largest_micro_batch_search_stays_within_the_bound():
    """``plan`` reports the largest micro-batch that fits by trying the batch's divisors: only
    those whose step the graph may hold, found from the micro-batch counts (a batch of 10**12
    sequences once meant a loop over 10**12 numbers)."""
    for batch in (1, 12, 97, 360, 1024):
        assert list(_micro_batch_sizes(batch, batch)) == [b for b in range(batch, 0, -1) if batch % b == 0]
    assert list(_micro_batch_sizes(360, 10)) == [360, 180, 120, 90, 72, 60, 45, 40, 36]
    assert list(_micro_batch_sizes(10**12, 4)) == [10**12, 10**12 // 2, 10**12 // 4]


def test_a_batch_the_host_could_not_hold_is_refused_in_one_line():
    line = one_line(run_cli("plan", "--model", "tiny", "--batch-size", str(10**12), "--micro-batch-size", str(10**12)))
    assert line.startswith("flowtrain: error: --batch-size 1,000,000,000,000 sequences of --seq-len 128 tokens: the "
                           "step's token ids alone (16 bytes a token: 1,907,348.6 GiB) are more than the host could "
                           "hold ("), line
    assert line.endswith("GiB, all of this machine's memory); give a smaller --batch-size"), line


def test_the_host_is_the_one_planned_for():
    tiny = preset("tiny")
    req = RunRequest(seq_len=1024, batch_size=65536, micro_batch_size=65536, host_mem=1.0)  # 1 GiB of ids
    check_step_size(tiny, req)
    with pytest.raises(ConfigError, match=r"\(1.0 GiB, host_mem\); give a smaller batch_size"):
        check_step_size(tiny, RunRequest(seq_len=1024, batch_size=65537, micro_batch_size=65537, host_mem=1.0))
