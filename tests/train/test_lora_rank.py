"""A LoRA rank larger than a linear map it adapts can use is refused in one line.

The update ``B A`` of a map of (out, in) has rank at most ``min(out, in)``, as PEFT users know
it: ``--lora-rank 100000`` on a model of hidden size 64 was accepted, and would have allocated
adapters of 100,000 rows for maps of 64. ``train``, ``plan`` and ``simulate`` share the check
(``_check_lora``); it names the rank, the map with the smallest bound and its sides.
"""

from __future__ import annotations

import pytest

from flowtrain.cli import main

TINY = ["--model", "tiny", "--seq-len", "64", "--batch-size", "2", "--micro-batch-size", "1"]


@pytest.mark.parametrize("command", ["train", "plan", "simulate"])
def test_a_rank_above_the_smallest_side_of_a_map_is_refused(tmp_path, capsys, command):
    extra = ["--out", str(tmp_path / "out"), "--no-progress"] if command == "train" else []
    assert main([command, *TINY, "--lora-rank", "100000", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["flowtrain: error: --lora-rank 100000 is larger than the smaller side of a linear map it adapts: "
                   "k_proj of layer 0 is 32 x 64 (out x in), so its update has rank at most 32; give a rank of at "
                   "most 32, or leave k_proj out of the --lora-targets"], err
    assert not (tmp_path / "out").exists()


def test_the_bound_is_the_smallest_adapted_map(capsys):
    assert main(["plan", *TINY, "--lora-rank", "32"]) == 0  # k_proj's 32: at the bound
    capsys.readouterr()
    assert main(["plan", *TINY, "--lora-rank", "33"]) == 2
    assert "--lora-rank 33 is larger than" in capsys.readouterr().err
    assert main(["plan", *TINY, "--lora-rank", "64", "--lora-targets", "q_proj,o_proj"]) == 0  # 64 x 64 maps
    capsys.readouterr()
    assert main(["plan", *TINY, "--lora-rank", "65", "--lora-targets", "q_proj,o_proj"]) == 2
    assert "q_proj of layer 0 is 64 x 64 (out x in), so its update has rank at most 64" in capsys.readouterr().err


def test_a_router_is_held_to_its_input_side(capsys):
    """A router's output is one number per expert (8 in Mixtral): PEFT's all-linear, like the
    default targets, adapts it at the run's rank, so rank 16 passes; its input side still bounds."""
    moe = ["--model", "mixtral-4l", "--seq-len", "64", "--batch-size", "1", "--micro-batch-size", "1",
           "--host-mem", "1000"]
    assert main(["plan", *moe, "--lora-rank", "16", "--lora-targets", "router", "--json"]) == 0
    capsys.readouterr()
    assert main(["plan", *moe, "--lora-rank", "5000", "--lora-targets", "router"]) == 2
    assert "--lora-rank 5000 is larger than the input side of a linear map it adapts: router of layer 0 is 8 x 4096" \
        in capsys.readouterr().err
