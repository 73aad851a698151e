"""Where compute's time goes: by task kind, by layer, and the model FLOP/s it achieved.

A compute lane that is 99.98% busy says nothing about what kept it busy. Here its tasks are
summed per kind (forward, recompute, backward, loss, ...) and, for kinds that run per layer,
per layer, so that a loss taking a fifth of the step or one layer slower than the others
stands out. Numbers are kept per step, as :mod:`flowtrain.viz.steps` keeps its own, so a
window's table is a sum of its steps' rows (the page sums them for the brushed window)::

    per_step = kind_steps(trace)                     # {step: {kind: KindTime}}
    table = compute_table(trace, per_step, window)  # the window's rows, shares and FLOP/s
    for r in table.kinds:
        print(r.kind, r.tasks, r.seconds, r.share, r.slow_layer)

A compute task counts in the step its ``step`` field names, the step whose band holds it
(each step starts at its first compute task). **Model FLOP/s** needs what the model costs:
``flowtrain train --trace`` records ``model_flops_per_token`` (model FLOPs as MFU counts them)
and ``tokens_per_step`` in the trace's metadata; a file without them gets no figure.
"""

from __future__ import annotations

import statistics
from typing import Mapping

import msgspec

from .load import Trace
from .steps import Window

#: A layer whose mean task time is this much above the median layer's is called out.
SLOW_LAYER = 1.10


class KindTime(msgspec.Struct):
    """Tasks and seconds of one kind in one step, in total and per layer (``{layer: [tasks,
    seconds]}``; tasks without a layer are in the total only)."""

    tasks: int = 0
    seconds: float = 0.0
    layers: dict[int, list] = msgspec.field(default_factory=dict)


class KindRow(msgspec.Struct, frozen=True):
    """A kind's row of the table: its tasks and seconds over the window, its ``share`` of the
    compute lane's busy time, and per layer the mean seconds of one task."""

    kind: str
    tasks: int
    seconds: float
    share: float
    layer_mean: dict[int, float]

    @property
    def slow_layer(self) -> tuple[int, float] | None:
        """``(layer, times the median layer)`` of the slowest layer where it stands out
        (:data:`SLOW_LAYER`), among three or more layers."""
        if len(self.layer_mean) < 3:
            return None
        med = statistics.median(self.layer_mean.values())
        layer = max(self.layer_mean, key=lambda k: (self.layer_mean[k], -k))
        ratio = self.layer_mean[layer] / med if med > 0 else 0.0
        return (layer, ratio) if ratio >= SLOW_LAYER else None


class ComputeTable(msgspec.Struct, frozen=True):
    """The window's compute time by kind, most time first; ``flops_per_step`` and
    ``model_flops`` (FLOP/s over the window's time) where the trace records the model's FLOPs."""

    kinds: list[KindRow]
    busy: float  # the kinds' seconds together
    flops_per_step: float | None = None
    model_flops: float | None = None


def kind_steps(trace: Trace, lane: str = "compute") -> dict[int, dict[str, KindTime]]:
    """Per step, the compute lane's tasks and seconds by kind (and by layer)."""
    out: dict[int, dict[str, KindTime]] = {}
    for t in trace.by_lane.get(lane, []):
        k = out.setdefault(t.step, {}).setdefault(t.kind, KindTime())
        k.tasks += 1
        k.seconds += t.duration
        if t.layer is not None:
            n_s = k.layers.setdefault(t.layer, [0, 0.0])
            n_s[0] += 1
            n_s[1] += t.duration
    return out


def flops_per_step(trace: Trace) -> float | None:
    """The model FLOPs of one step of this trace (``model_flops_per_token`` times
    ``tokens_per_step`` in its metadata), or None where it does not record them."""
    per_token, tokens = trace.meta.get("model_flops_per_token"), trace.meta.get("tokens_per_step")
    ok = all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in (per_token, tokens))
    return float(per_token) * float(tokens) if ok else None  # type: ignore[arg-type]


def compute_table(trace: Trace, per_step: Mapping[int, Mapping[str, KindTime]], window: Window) -> ComputeTable:
    """The window's table: the steps' rows summed (see the module's example)."""
    total: dict[str, KindTime] = {}
    for step in range(window.first, window.last + 1):
        for kind, k in per_step.get(step, {}).items():
            t = total.setdefault(kind, KindTime())
            t.tasks += k.tasks
            t.seconds += k.seconds
            for layer, (n, s) in k.layers.items():
                n_s = t.layers.setdefault(layer, [0, 0.0])
                n_s[0] += n
                n_s[1] += s
    busy = sum(k.seconds for k in total.values())
    rows = [KindRow(kind, k.tasks, k.seconds, k.seconds / busy if busy > 0 else 0.0,
                    {layer: s / n for layer, (n, s) in sorted(k.layers.items()) if n})
            for kind, k in sorted(total.items(), key=lambda kv: (-kv[1].seconds, kv[0]))]
    fps = flops_per_step(trace)
    d = window.end - window.start
    return ComputeTable(rows, busy, fps, fps * window.steps / d if fps is not None and d > 0 else None)


def step_payload(k: Mapping[str, KindTime]) -> dict[str, list]:
    """One step's kinds for the page (microseconds): ``{kind: [tasks, us, {layer: [tasks, us]}]}``."""
    return {kind: [v.tasks, round(v.seconds * 1e6, 3),
                   {str(layer): [n, round(s * 1e6, 3)] for layer, (n, s) in sorted(v.layers.items())}]
            for kind, v in sorted(k.items())}
