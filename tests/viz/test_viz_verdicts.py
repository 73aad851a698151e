"""What bounds a stall: one verdict per gap and per pattern, on hand-made traces whose waits are
known (times in us), and chains said without repeated links."""

from __future__ import annotations

from viz_helpers import doc, ev, hand_trace

from flowtrain.viz.html import TraceView
from flowtrain.viz.load import trace_from_json
from flowtrain.viz.verdicts import pattern_verdicts


def verdicts(tr) -> list[tuple[str, str]]:
    v = TraceView(tr, min_gap=0, steps=":")
    return [(g.pattern, d.key) for g, d in zip(v.gaps, v.verdicts)]


def by_pattern(tr) -> dict[str, str]:
    v = TraceView(tr, min_gap=0, steps=":")
    return pattern_verdicts(v.gaps, v.verdicts, v.window.start, v.window.end)


def test_each_gap_of_the_hand_trace_gets_its_verdict():
    """fA runs from 0 with h2d busy through the gap (copy-bound); zB waits for the one grads
    slot (budget-bound); uC had everything (launch overhead); fD waits for adamA (CPU-bound)."""
    assert verdicts(hand_trace()) == [
        ("forward waited for fetch", "copy-bound h2d"),
        ("zero_grad waited for a grads slot", "budget-bound grads"),
        ("forward had all it needed (launch overhead)", "launch overhead"),
        ("forward waited for fetch, which waited for cpu_adam", "CPU-bound"),
    ]
    text = by_pattern(hand_trace())["zero_grad waited for a grads slot"]
    assert text.startswith("budget-bound: the grads pool was full (budget 1) while zero_grad waited for a grads slot")
    assert "the trace records no slot size for grads" in text  # zero_grad moves no bytes


def fetches(slot_wait: bool):
    """Two fetches into a weights pool; compute waits for the second. With ``slot_wait`` the
    pool has one slot and the second fetch waits for the first's reader (h2d idle 10-20);
    without, the fetches run back to back."""
    if slot_wait:
        return trace_from_json(doc(
            ev("f0", "h2d", 0, 10, kind="fetch", takes="weights", slot=0, nbytes=2**30),
            ev("u0", "compute", 10, 20, kind="forward", reads={"weights": [0]}, deps=("f0",)),
            ev("f1", "h2d", 20, 30, kind="fetch", takes="weights", slot=0, nbytes=2**30),
            ev("u1", "compute", 30, 40, kind="forward", reads={"weights": [0]}, deps=("f1",)),
            budgets={"weights": 1}, slot_bytes={"weights": 2**30}))
    return trace_from_json(doc(
        ev("f0", "h2d", 0, 10, kind="fetch", takes="weights", slot=0),
        ev("f1", "h2d", 10, 30, kind="fetch", takes="weights", slot=1),
        ev("u0", "compute", 10, 15, kind="forward", reads={"weights": [0]}, deps=("f0",)),
        ev("u1", "compute", 30, 40, kind="forward", reads={"weights": [1]}, deps=("f1",)),
        budgets={"weights": 2}))


def test_a_full_pool_is_budget_bound_and_names_one_more_slot():
    tr = fetches(slot_wait=True)
    assert verdicts(tr)[-1] == ("forward waited for fetch, which waited for a weights slot", "budget-bound weights")
    text = by_pattern(tr)["forward waited for fetch, which waited for a weights slot"]
    assert "the weights pool was full (budget 1) while h2d sat idle for a weights slot" in text
    assert "one more weights slot costs 1.00 GiB on the GPU (the plan's slot size)" in text
    assert text.endswith("(the plan's slot size)")  # h2d sat idle 10-20, before compute did


def test_back_to_back_copies_are_copy_bound():
    tr = fetches(slot_wait=False)
    assert verdicts(tr)[-1] == ("forward waited for fetch", "copy-bound h2d")
    text = by_pattern(tr)["forward waited for fetch"]
    assert text.startswith("copy-bound: h2d copied back to back") and text.endswith("(h2d busy 100% of these gaps)")


def test_a_wait_for_work_that_nothing_held_back_is_a_dependency():
    """o (d2h, 12-14) was not held back and d2h was idle half of the gap 10-14."""
    tr = trace_from_json(doc(ev("a", "compute", 0, 10, kind="forward"),
                             ev("o", "d2h", 12, 14, kind="offload_act"),
                             ev("b", "compute", 14, 20, kind="backward", deps=("o",))))
    assert verdicts(tr) == [("backward waited for offload_act", "dependency")]


def test_repeated_links_are_said_once_and_pools_take_their_article():
    """b waits for c3, which waited for its lane behind c2 and c1: one link, x2. An acts slot."""
    tr = trace_from_json(doc(ev("a", "compute", 0, 1, kind="forward"),
                             ev("c1", "cpu:0", 0, 10, kind="cpu_adam"), ev("c2", "cpu:0", 10, 20, kind="cpu_adam"),
                             ev("c3", "cpu:0", 20, 30, kind="cpu_adam"),
                             ev("b", "compute", 30, 40, kind="forward", deps=("c3",))))
    v = TraceView(tr, min_gap=0, steps=":")
    (g,) = v.gaps
    assert g.pattern == "forward waited for cpu_adam, which waited for its lane (cpu) \u00d72"
    assert g.text == "b waited for c3, which waited for its lane (cpu:0), busy with c2, then c1"
    assert v.verdicts[0].key == "CPU-bound"
    acts = trace_from_json(doc(
        ev("x0", "h2d", 0, 10, kind="fetch_act", takes="acts", slot=0),
        ev("k0", "compute", 10, 20, kind="backward", reads={"acts": [0]}, deps=("x0",)),
        ev("x1", "h2d", 20, 30, kind="fetch_act", takes="acts", slot=0),
        ev("k1", "compute", 30, 40, kind="backward", reads={"acts": [0]}, deps=("x1",)),
        budgets={"acts": 1}))
    assert verdicts(acts)[-1] == ("backward waited for fetch_act, which waited for an acts slot", "budget-bound acts")
