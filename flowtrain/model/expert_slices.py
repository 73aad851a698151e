"""Where each expert's weights sit in a sparse layer's flat buffer, and what to copy for a few.

A mixture-of-experts layer keeps each projection of all its experts as one stacked entry
(:mod:`flowtrain.model.flat_map`), so expert ``e``'s weights are three pieces of the flat buffer,
one in each stack. A step that routes no token to ``e`` need not copy those pieces, nor take
their gradient, nor update them. :class:`ExpertSlices` names the pieces::

    sl = ExpertSlices.of(layout)           # None for a unit without experts
    sl.shared                              # [(lo, hi), ...]: attention, router, norms, padding
    sl.experts[3]                          # expert 3's three pieces
    sl.ranges([True, False, True, True])   # what to copy: shared + experts 0, 2, 3, merged

Pure index arithmetic over a layout: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flowtrain.model.flat_map import FlatMap

__all__ = ["ExpertSlices", "merge_ranges"]

Range = tuple[int, int]


def merge_ranges(ranges: Sequence[Range]) -> list[Range]:
    """``[lo, hi)`` ranges sorted, empty ones dropped and touching ones joined."""
    out: list[Range] = []
    for lo, hi in sorted(r for r in ranges if r[1] > r[0]):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(hi, out[-1][1]))
        else:
            out.append((lo, hi))
    return out


@dataclass(frozen=True)
class ExpertSlices:
    """A sparse layer's flat buffer cut into what every token uses and what each expert owns."""

    numel: int
    #: the ranges outside every expert stack, merged
    shared: tuple[Range, ...]
    #: per expert, its piece of each stack, in buffer order
    experts: tuple[tuple[Range, ...], ...]

    @classmethod
    def of(cls, layout: FlatMap) -> ExpertSlices | None:
        """The slices of ``layout``; None where it stacks no experts (a dense unit)."""
        stacks = [e for e in layout.entries if e.stacked]
        if not stacks:
            return None
        n_experts = stacks[0].shape[0]
        if any(e.shape[0] != n_experts for e in stacks):
            raise ValueError(f"{layout.key}: its stacked entries hold different numbers of experts")
        experts = tuple(
            tuple((e.offset + j * (e.numel // n_experts), e.offset + (j + 1) * (e.numel // n_experts))
                  for e in sorted(stacks, key=lambda e: e.offset))
            for j in range(n_experts))
        shared, at = [], 0
        for e in sorted(stacks, key=lambda e: e.offset):
            shared.append((at, e.offset))
            at = e.offset + e.numel
        shared.append((at, layout.numel))
        return cls(layout.numel, tuple(merge_ranges(shared)), experts)

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    @property
    def expert_numel(self) -> int:
        """Elements of one expert's weights (all its stacks' pieces)."""
        return sum(hi - lo for lo, hi in self.experts[0])

    def ranges(self, used: Sequence[bool]) -> list[Range]:
        """What a step whose routing reached the experts ``used`` (one flag per expert) reads of
        the buffer: the shared ranges and those experts' pieces, merged."""
        if len(used) != self.num_experts:
            raise ValueError(f"{len(used)} expert flags for {self.num_experts} experts")
        return merge_ranges([*self.shared, *(r for e, on in zip(self.experts, used) if on for r in e)])
