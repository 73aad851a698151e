"""Trace and graph analysis, exact on hand-made inputs (see viz_helpers.hand_trace's drawing)."""

from __future__ import annotations

import pytest
from viz_helpers import doc, engine_records, ev, hand_trace

from flowtrain.graph import Backward, CpuAdam, Fetch, Forward, StepSpec, compile_steps
from flowtrain.policy import resolve_policy
from flowtrain.viz import analysis as A
from flowtrain.viz.graphview import positions
from flowtrain.viz.load import trace_from_json


def us(n: float) -> float:
    """Microseconds as the loader stores them (n / 1e6, exactly)."""
    return n / 1e6


def approx(x):
    return pytest.approx(x, abs=1e-12)


def names(trace, indices):
    return [trace.tasks[i].name for i in indices]


def test_interval_arithmetic():
    assert A.union([(3, 4), (0, 1), (0.5, 2), (2, 2.5), (5, 5)]) == [(0, 2.5), (3, 4)]
    assert A.length([(0, 1), (0.5, 2)]) == 2
    assert A.intersect([(0, 2), (3, 6)], [(1, 4), (5, 7)]) == [(1, 2), (3, 4), (5, 6)]


def test_busy_overlap_and_steps():
    s = A.summarize(hand_trace(), min_gap=0)
    assert s.tasks == 11 and s.wall == us(80)
    assert s.tasks_per_lane == {"compute": 6, "h2d": 3, "d2h": 1, "cpu:0": 1}
    assert s.busy == {"compute": approx(us(47)), "h2d": approx(us(30)), "d2h": approx(us(5)), "cpu:0": approx(us(15))}
    assert s.busy_fraction["compute"] == approx(47 / 80)
    o = s.overlap
    # copies [0,20) [40,45) [60,70); compute [10,40) [45,47) [50,55) [70,80): only [10,20) overlaps
    assert (o.copy, o.compute_copy, o.copy_hidden) == (approx(us(35)), approx(us(10)), approx(10 / 35))
    # cpu [45,60) against compute: [45,47) and [50,55)
    assert (o.cpu, o.compute_cpu, o.cpu_hidden) == (approx(us(15)), approx(us(7)), approx(7 / 15))
    assert [(p.step, p.start, p.end, p.tasks) for p in s.steps] == [(1, 0.0, us(60), 9), (2, us(60), us(80), 2)]
    assert s.step_time == approx(us(20))
    assert s.bytes_per_lane == {"h2d": 300, "compute": 0, "d2h": 50, "cpu:0": 0}
    assert s.idle_compute == approx(us(33))  # 80 - 47


def test_slot_tenancies_and_occupancy():
    tr = hand_trace()
    uses = [(u.pool, u.slot, tr.tasks[u.holder].name, names(tr, u.readers), u.start, u.end) for u in A.slot_uses(tr)]
    assert uses == [
        ("weights", 0, "fA", ["uA"], 0.0, us(30)),
        ("weights", 1, "fB", ["uB"], us(10), us(40)),
        ("grads", 0, "zA", ["uB", "oA"], us(30), us(45)),
        ("grads", 0, "zB", [], us(45), us(47)),
        ("weights", 0, "fD", ["uD"], us(60), us(80)),
    ]
    occ = A.occupancy(tr)
    assert occ["weights"] == [(0.0, 1), (us(10), 2), (us(30), 1), (us(40), 0), (us(60), 1), (us(80), 0)]
    # zB takes the slot the instant oA frees it: released before taken, so never 2
    assert occ["grads"] == [(0.0, 0), (us(30), 1), (us(47), 0)]
    s = A.summarize(tr, min_gap=0)
    assert s.budgets == {"grads": 1, "weights": 2}
    assert s.peak_slots == {"grads": 1, "weights": 2}
    assert s.mean_slots == {"grads": approx(17 / 80), "weights": approx(80 / 80)}


def test_slot_readers_found_without_deps():
    """A producer that writes no deps: a reader belongs to the latest taker of its slot."""
    tr = trace_from_json(doc(
        ev("f0", "h2d", 0, 1, kind="fetch", takes="weights", slot=0),
        ev("u0", "compute", 1, 2, kind="forward", reads={"weights": [0]}),
        ev("f1", "h2d", 2, 3, kind="fetch", takes="weights", slot=0),
        ev("u1", "compute", 3, 5, kind="forward", reads={"weights": [0]}),
    ))
    assert [(tr.tasks[u.holder].name, names(tr, u.readers), u.end) for u in A.slot_uses(tr)] == [
        ("f0", ["u0"], us(2)), ("f1", ["u1"], us(5))]
    assert A.pool_budgets(tr) == {"weights": 1}


def test_what_each_task_waited_for():
    tr = hand_trace()
    got = {t.name: (w.cause, tr.tasks[w.task].name) if w else None for t, w in zip(tr.tasks, A.blockers(tr))}
    assert got == {
        "fA": None,
        "uA": ("dep", "fA"),
        "fB": ("lane", "fA"),
        "zA": ("lane", "uA"),
        "uB": ("dep", "zA"),  # zA ended at 32 as a dependency and as the lane's last task: the dep wins
        "oA": ("dep", "uB"),
        "zB": ("slot", "oA"),  # grads budget 1: zB waits for oA to finish reading zA's slot
        "adamA": ("dep", "oA"),
        "uC": ("lane", "zB"),
        "fD": ("dep", "adamA"),
        "uD": ("dep", "fD"),
    }


def test_compute_gaps_name_what_compute_waited_for():
    tr = hand_trace()
    gaps = [(g.start, g.end, g.reason, names(tr, g.chain)) for g in A.compute_gaps(tr, min_gap=0)]
    assert gaps == [
        (us(0), us(10), "fetch", ["fA"]),
        (us(40), us(45), "slot", ["oA"]),
        (us(47), us(50), "host", []),
        (us(55), us(70), "fetch", ["fD", "adamA"]),
    ]
    texts = [g.text for g in A.compute_gaps(tr, min_gap=0)]
    assert texts[1] == "zB waited for a grads slot, freed when oA finished"
    assert texts[3] == "uD waited for fD, which waited for adamA"
    assert "launch overhead" in texts[2]
    # min_gap hides the short ones; the summary adds the marked gaps up by reason
    assert [g.start for g in A.compute_gaps(tr, min_gap=us(4))] == [us(0), us(40), us(55)]
    s = A.summarize(tr, min_gap=0)
    assert s.idle_by_reason == {"fetch": approx(us(25)), "slot": approx(us(5)), "host": approx(us(3))}


def test_a_fetch_held_back_by_the_single_slot_is_followed_to_the_slot():
    """``sequential``: f1 may only fill the one weight slot once u0 has read it, so compute
    idles while f1 copies; the blame goes through f1 to the slot u0 freed::

        h2d      f0 0-1 (w0)      f1 3-4 (w0)
        compute        u0 1-3                u1 4-6
    """
    tr = trace_from_json(doc(
        ev("f0", "h2d", 0, 1, kind="fetch", takes="weights", slot=0),
        ev("u0", "compute", 1, 3, kind="forward", reads={"weights": [0]}, deps=("f0",)),
        ev("f1", "h2d", 3, 4, kind="fetch", takes="weights", slot=0),
        ev("u1", "compute", 4, 6, kind="forward", reads={"weights": [0]}, deps=("f1",)),
    ))
    (lead, gap) = A.compute_gaps(tr, min_gap=0)
    assert (gap.start, gap.end, gap.reason, names(tr, gap.chain)) == (us(3), us(4), "fetch", ["f1", "u0"])
    assert gap.text == "u1 waited for f1, which waited for a weights slot, freed when u0 finished"


def test_default_min_gap_is_a_twentieth_of_the_median_compute_task():
    # compute durations 20, 2, 8, 2, 5, 10 us: median 6.5 us, 5% of it is below the 1 us floor
    assert A.default_min_gap(hand_trace()) == 1e-6
    slow = trace_from_json(doc(ev("a", "compute", 0, 2000), ev("b", "compute", 3000, 9000), ev("c", "compute", 9000, 10000)))
    assert slow.by_lane["compute"][1].duration == approx(us(6000))
    assert A.default_min_gap(slow) == approx(0.05 * us(2000))


def test_critical_chain_follows_what_each_task_waited_for():
    tr = hand_trace()
    assert names(tr, A.critical_chain(tr)) == ["fA", "uA", "zA", "uB", "oA", "adamA", "fD", "uD"]


def test_critical_path_of_a_graph():
    """::

        a --> b --> d
         \\         ^
          `-> c --'
               `--> e

    By task count a-b-d and a-c-d tie (the first inserted wins); make c's kind slow and
    the path goes through it.
    """
    import networkx as nx

    a, b, c = Fetch(unit="layer", layer=0), Forward(layer=0, micro_batch=0), Backward(layer=0, micro_batch=0)
    d, e = Forward(layer=1, micro_batch=0), CpuAdam(unit="layer", layer=0)
    g = nx.DiGraph()
    g.add_edges_from([(a, b), (a, c), (b, d), (c, d), (c, e)])
    assert A.critical_path(g) == ([a, b, d], 3.0)
    assert A.critical_path(g, {"backward": 5.0}) == ([a, c, d], 7.0)
    assert A.critical_path(g, {"backward": 5.0, "cpu_adam": 2.0}) == ([a, c, e], 8.0)
    assert A.critical_path(nx.DiGraph()) == ([], 0.0)


def test_critical_path_of_a_compiled_step_runs_through_the_whole_model():
    g = compile_steps(StepSpec(layers=3, micro_batches=2), 1)
    path, length = A.critical_path(g)
    assert length == len(path)
    assert all(g.has_edge(u, v) for u, v in zip(path, path[1:]))
    assert {t.kind for t in path} >= {"fetch", "forward", "loss", "backward", "cpu_adam"}


@pytest.mark.parametrize("policy", ["sequential", "double_buffer", "lookahead"])
def test_planned_order_is_the_policys_proposal(policy):
    g = compile_steps(StepSpec(layers=3, micro_batches=2), 2)
    order, budgets = A.planned_order(g, policy)
    proposal = resolve_policy(policy).propose(g)
    assert order == list(proposal.order) and budgets == dict(proposal.budgets)


def test_layout_draws_every_edge_left_to_right_without_overlaps():
    g = compile_steps(StepSpec(layers=4, micro_batches=2, checkpoint_every=2), 2)
    pos = positions(g)
    assert all(pos[u][0] < pos[v][0] for u, v in g.edges)
    assert len(set(pos.values())) == g.number_of_nodes()


def test_engine_trace_accounts_for_every_compute_gap():
    """On a real trace every idle stretch of compute is found, and gaps never overlap tasks."""
    from flowtrain.runtime import chrome_trace

    _, records = engine_records(layers=3, micro_batches=2, steps=2, sleep=0.001)
    tr = trace_from_json(chrome_trace(records, {"policy": "double_buffer"}))
    gaps = A.compute_gaps(tr, min_gap=0)
    comp = A.lane_spans(tr, ["compute"])
    assert not A.intersect(comp, [(g.start, g.end) for g in gaps])
    last = tr.by_lane["compute"][-1].end
    assert sum(g.duration for g in gaps) == pytest.approx(last - A.length(comp), abs=1e-9)
    assert all(g.reason in {"host", "slot"} | {t.kind for t in tr.tasks} for g in gaps)
