"""Each expert's pieces of a sparse layer's flat buffer, and the ranges a few experts take."""

from __future__ import annotations

import msgspec
import pytest
import torch

from flowtrain.model import bind, model_flat_maps
from flowtrain.model.presets import preset
from flowtrain.model.expert_slices import ExpertSlices, merge_ranges


@pytest.fixture(scope="module")
def layouts():
    """Mixtral's layer, CPU-sized (odd widths: pieces that end off the alignment)."""
    cfg = msgspec.structs.replace(preset("mixtral-4l"), hidden_size=32, intermediate_size=24, moe_intermediate_size=24,
                                  vocab_size=64, num_heads=4, num_kv_heads=2, head_dim=8)
    return model_flat_maps(cfg.validate())


def test_a_dense_unit_has_no_slices(layouts):
    assert ExpertSlices.of(layouts[0]) is None and ExpertSlices.of(layouts[-1]) is None


def test_the_slices_cut_the_buffer_into_shared_and_per_expert_parts(layouts):
    lay = layouts[1]
    sl = ExpertSlices.of(lay)
    n_experts = lay.entry("experts_gate").shape[0]
    assert sl.num_experts == n_experts and sl.numel == lay.numel
    owner = torch.full((lay.numel,), -2)
    for lo, hi in sl.shared:
        assert bool((owner[lo:hi] == -2).all())
        owner[lo:hi] = -1
    for e, pieces in enumerate(sl.experts):
        assert len(pieces) == 3 and sum(hi - lo for lo, hi in pieces) == sl.expert_numel
        for lo, hi in pieces:
            assert bool((owner[lo:hi] == -2).all())
            owner[lo:hi] = e
    assert bool((owner != -2).all())  # every element is someone's, once
    # expert e's pieces are what the layer math reads as expert e
    flat = torch.arange(lay.numel, dtype=torch.float64)
    w = bind(flat, lay)
    for e in (0, n_experts - 1):
        want = torch.cat([w[k][e].reshape(-1) for k in ("experts_gate", "experts_up", "experts_down")])
        got = torch.cat([flat[lo:hi] for lo, hi in sorted(sl.experts[e], key=lambda r: flat[r[0]])])
        assert torch.equal(torch.sort(got).values, torch.sort(want).values)


def test_ranges_copy_the_shared_part_and_the_used_experts(layouts):
    sl = ExpertSlices.of(layouts[1])
    everything = sl.ranges([True] * sl.num_experts)
    assert everything == [(0, sl.numel)]
    used = [e % 3 == 0 for e in range(sl.num_experts)]
    got = sl.ranges(used)
    covered = torch.zeros(sl.numel, dtype=torch.bool)
    for lo, hi in got:
        covered[lo:hi] = True
    assert all(bool(covered[lo:hi].all()) for lo, hi in sl.shared)
    for e, pieces in enumerate(sl.experts):
        assert all(bool(covered[lo:hi].all()) == used[e] and bool(covered[lo:hi].any()) == used[e] for lo, hi in pieces)
    with pytest.raises(ValueError):
        sl.ranges([True])


def test_merge_ranges():
    assert merge_ranges([(5, 7), (0, 2), (2, 3), (4, 4), (6, 9)]) == [(0, 3), (5, 9)]
