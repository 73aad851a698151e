"""Steps, windows and memory: exact numbers on the hand-made trace, and sums that agree with the
whole-trace summary on real ones."""

from __future__ import annotations

import pytest
from pytest import approx
from viz_helpers import doc, engine_records, ev, hand_trace

from flowtrain.errors import ConfigError
from flowtrain.runtime import chrome_trace
from flowtrain.viz import analysis as A
from flowtrain.viz.load import trace_from_json
from flowtrain.viz.memory import memory
from flowtrain.viz.steps import (
    choose_window,
    fmt_bytes,
    fmt_time,
    parse_steps,
    split,
    step_stats,
    step_table,
    window_summary,
)


def us(x: float) -> float:
    return x / 1e6  # as the loader computes: 60 us is exactly 60 / 1e6


def rows_of(tr):
    uses = A.slot_uses(tr)
    return step_stats(tr, A.compute_gaps(tr, min_gap=0, waits=A.blockers(tr, uses)), uses)


def test_split_cuts_spans_at_step_ends():
    assert split([(0, 4), (6, 9)], [0, 2, 7, 10]) == [2, 3, 2]
    assert split([(1, 3)], [0, 2, 4], weights=[5]) == [5, 5]


def test_each_step_starts_at_its_first_compute_task():
    """hand_trace: step 2's first compute task, uD, starts at 70 us; its prefetch fD (60-70)
    ran while step 1 was still on the clock, so it is counted in step 1. (The file's ``step``
    counts from 0, viz from 1, as training does.)"""
    r0, r1 = rows_of(hand_trace())
    assert (r0.step, r0.start, r0.end, r0.warmup) == (1, 0.0, us(70), True)
    assert (r1.step, r1.start, r1.end, r1.warmup) == (2, us(70), us(80), False)
    assert r0.tasks == {"h2d": 3, "compute": 5, "d2h": 1, "cpu:0": 1} and r1.tasks == {"compute": 1}
    assert r0.busy["compute"] == approx(us(37)) and r1.busy["compute"] == approx(us(10))
    assert r0.idle_by_reason == {"fetch": approx(us(25)), "slot": approx(us(5)), "host": approx(us(3))}
    assert r0.idle_compute == approx(us(33)) and r0.tail == 0.0 and r1.idle_compute == 0.0
    assert r0.peak_slots == {"grads": 1, "weights": 2} and r1.peak_slots == {"grads": 0, "weights": 1}
    assert r1.slot_seconds["weights"] == approx(us(10))  # fD holds weights #0 60-80


def test_the_default_window_leaves_out_the_first_step():
    rows = rows_of(hand_trace())
    w = choose_window(rows)
    assert (w.first, w.last, w.steps, w.total) == (2, 2, 1, 2) and w.label == "step 2 (1 of 2 steps, 10 µs)"
    s = window_summary(rows, w, {"weights": 2, "grads": 1})
    assert s.step_time == approx(us(10)) and s.busy_fraction["compute"] == approx(1.0)
    assert s.overlap.copy_hidden == 0.0 and s.idle_compute == 0.0
    assert s.mean_slots == {"grads": 0.0, "weights": approx(1.0)}


def test_a_window_of_every_step_is_the_whole_trace_summary():
    """Steps tile the trace: summing their rows gives the numbers computed on the whole trace."""
    _, records = engine_records(layers=3, micro_batches=2, steps=3)
    tr = trace_from_json(chrome_trace(records))
    rows = rows_of(tr)
    s = window_summary(rows, choose_window(rows, ":"), A.pool_budgets(tr))
    whole = A.summarize(tr, min_gap=0)
    assert s.duration == approx(whole.wall) and s.tasks == whole.tasks_per_lane
    assert s.busy == approx(whole.busy) and s.bytes == whole.bytes_per_lane
    assert s.overlap.copy_hidden == approx(whole.overlap.copy_hidden)
    assert s.idle_compute == approx(whole.idle_compute) and s.idle_by_reason == approx(whole.idle_by_reason)
    assert s.peak_slots == whole.peak_slots and s.mean_slots == approx(whole.mean_slots)


def test_a_slow_step_is_flagged_as_warm_up_and_left_out_at_the_start():
    """Steps of 10 us, except step 2 (100 us): steps 1 and 2 are warm-up, the window is 3..5."""
    events, t = [], 0
    for step, d in enumerate((10, 100, 10, 10, 10)):
        events.append(ev(f"f{step}", "compute", t, t + d, kind="forward", step=step))
        t += d
    rows = rows_of(trace_from_json(doc(*events)))
    assert [r.warmup for r in rows] == [True, True, False, False, False]
    w = choose_window(rows)
    assert (w.first, w.last) == (3, 5) and "warm-up steps 1, 2" in w.why
    assert step_table(rows)["step time"] == (approx(us(10)), approx(us(10)), approx(us(100)))


@pytest.mark.parametrize("text, want", [("1:", (1, None)), (":3", (None, 3)), ("2:5", (2, 5)), ("3", (3, 3)),
                                        ("4:4", (4, 4))])
def test_steps_are_a_range_of_training_steps_both_ends_included(text, want):
    assert parse_steps(text) == want


def test_steps_choose_the_window():
    rows = rows_of(hand_trace())
    assert (choose_window(rows, "1:1").first, choose_window(rows, "1:1").last) == (1, 1)
    assert (choose_window(rows, "1:2").first, choose_window(rows, "1:2").last) == (1, 2)  # 1..2, both
    assert (choose_window(rows, "2").first, choose_window(rows, "2").steps) == (2, 1)
    assert choose_window(rows, ":").steps == 2 and choose_window(rows, "0:").steps == 2
    with pytest.raises(ConfigError, match="no such steps in the trace"):
        choose_window(rows, "5:")
    with pytest.raises(ConfigError, match="B must be at least A"):
        parse_steps("3:2")
    with pytest.raises(ConfigError, match="expected A:B"):
        parse_steps("a:b")


def test_one_step_is_its_own_window():
    rows = rows_of(trace_from_json(doc(ev("a", "compute", 0, 5))))
    assert choose_window(rows).steps == 1 and "whole trace" in choose_window(rows).why


def test_bytes_held_per_place_from_the_takers_bytes():
    tr = hand_trace()
    m = memory(tr, A.slot_uses(tr))
    # fA and fB take weights slots with 100 bytes each; zero_grad moves nothing: size unknown
    assert m.slot_bytes == {"weights": 100} and m.unknown == ("grads",)
    assert m.held == {"gpu": [(0.0, 100), (us(10), 200), (us(30), 100), (us(40), 0), (us(60), 100), (us(80), 0)]}
    assert m.peak("gpu") == 200 and m.peak("pinned") == 0


def test_the_trace_can_say_slot_sizes_places_and_capacities():
    tr = hand_trace()
    tr.meta.update(slot_bytes={"grads": 400}, pool_memory={"grads": "pinned"}, capacities={"gpu": 1000})
    m = memory(tr, A.slot_uses(tr))
    assert m.slot_bytes == {"grads": 400, "weights": 100} and m.unknown == ()
    assert m.place == {"grads": "pinned", "weights": "gpu"} and m.capacities == {"gpu": 1000}
    assert m.held["pinned"] == [(0.0, 0), (us(30), 400), (us(47), 0)]  # zA 30-45, then zB 45-47


def test_gaps_are_grouped_by_pattern_most_idle_first():
    tr = hand_trace()
    groups = A.gap_patterns(A.compute_gaps(tr, min_gap=0))
    assert [(p, r, len(gs)) for p, r, gs in groups] == [
        ("forward waited for fetch, which waited for cpu_adam", "fetch", 1),
        ("forward waited for fetch", "fetch", 1),
        ("zero_grad waited for a grads slot", "slot", 1),
        ("forward had all it needed (launch overhead)", "host", 1),
    ]


def test_human_units():
    assert [fmt_time(x) for x in (2.5, 0.0123, 45e-6, 850e-9)] == ["2.5 s", "12.3 ms", "45 µs", "850 ns"]
    assert [fmt_bytes(x) for x in (512, 1536, 3 << 30)] == ["512 B", "1.5 KiB", "3.0 GiB"]
