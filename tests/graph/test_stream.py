"""The step stream that the training loop and the simulator's clock share: how many steps are
open, which is finished when, and which edges link a step to the one before."""

from __future__ import annotations

import pytest

from flowtrain.graph.compiler import StepSpec, compile_step, cross_step_edges
from flowtrain.graph.stream import StepStream

SPEC = StepSpec(layers=3, micro_batches=2)


def run(stream: StepStream, steps: int, drain_after: set[int] = frozenset()) -> list[tuple]:
    """The events of feeding ``steps`` steps through ``stream``: ("add", s, number of edges)
    and ("finish", s), in order."""
    events: list[tuple] = []
    for s in range(steps):
        g = compile_step(SPEC, step=s)
        events.append(("add", s, len(stream.push(s, g))))
        if s in drain_after:
            events += [("finish", d.step) for d in stream.drain()]
        events += [("finish", d.step) for d in stream.due()]
    events += [("finish", d.step) for d in stream.drain()]
    return events


@pytest.mark.parametrize("in_flight", [1, 2, 3])
def test_at_most_in_flight_steps_are_open_and_they_finish_in_order(in_flight):
    events = run(StepStream(SPEC, in_flight), steps=6)
    open_now, finished = set(), []
    for kind, s, *_ in events:
        if kind == "add":
            open_now.add(s)
            assert len(open_now) <= in_flight
        else:
            open_now.remove(s)
            finished.append(s)
    assert finished == list(range(6)) and not open_now
    # a step is finished only once `in_flight` steps are open
    first_finish = next(i for i, e in enumerate(events) if e[0] == "finish")
    assert [e[0] for e in events[:first_finish]] == ["add"] * in_flight


def test_a_step_is_linked_to_the_one_before_by_its_adam_and_the_callers_edges():
    seen = []

    def link(prev, graph):
        seen.append(prev.step)
        return [("extra", prev.data)]

    stream = StepStream(SPEC, 2, link=link)
    g0, g1 = compile_step(SPEC, step=0), compile_step(SPEC, step=1)
    assert stream.push(0, g0, data="zero") == []  # the first step follows nothing
    edges = stream.push(1, g1, data="one")
    assert edges[:-1] == cross_step_edges(g0, g1, SPEC) and edges[-1] == ("extra", "zero")
    assert seen == [0] and edges[:-1]  # fetches of step 1 wait for step 0's Adam


def test_after_a_drain_the_next_step_follows_none():
    events = run(StepStream(SPEC, 2), steps=4, drain_after={1})
    adds = {s: n for kind, s, *rest in events if kind == "add" for n in rest}
    assert adds[0] == 0 and adds[1] > 0 and adds[2] == 0 and adds[3] > 0
    assert [s for kind, s, *_ in events if kind == "finish"] == [0, 1, 2, 3]


def test_in_flight_must_be_positive():
    with pytest.raises(ValueError, match="in_flight must be at least 1"):
        StepStream(SPEC, 0)
