"""Fault injection: the spec grammar, matching, the three modes, the environment variable, and
(hypothesis) a fault at any task of any compiled step fails the run naming that task, with
nothing downstream of it run and every fence set."""

from __future__ import annotations

import threading

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from runtime_helpers import FenceLog, Recorder, lane_threads, run_async, specs

from flowtrain.errors import ConfigError, StepFailed
from flowtrain.graph import Backward, CpuAdam, Fetch, Forward, Task, compile_steps
from flowtrain.runtime import Fault, FaultInjector, FaultSpec, InjectedFault
from flowtrain.runtime import faults as faults_module
from flowtrain.runtime.faults import ENV, from_env

POLICIES = ["sequential", "double_buffer", "lookahead"]


class Archive(Task, tag="archive"):
    """A kind no graph has (yet): faults match kinds by their string."""


def noop(task, ctx):
    return 7


# ---- the grammar -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, faults, seed",
    [
        ("cpu_adam:raise", [Fault("cpu_adam", (), "raise", 0.0, 1, "cpu_adam:raise")], 0),
        ("backward@step=2,layer=1:hang",
         [Fault("backward", (("step", 2), ("layer", 1)), "hang", 0.0, 1, "backward@step=2,layer=1:hang")], 0),
        ("*:delay=0.002;seed=7", [Fault("*", (), "delay", 0.002, None, "*:delay=0.002")], 7),
        (" fetch@unit=head, phase=backward : raise,count=2 ; ",
         [Fault("fetch", (("unit", "head"), ("phase", "backward")), "raise", 0.0, 2,
                "fetch@unit=head, phase=backward : raise,count=2")], 0),
        ("save:raise,always;offload_grad@chunk=3:delay=1,count=1",
         [Fault("save", (), "raise", 0.0, None, "save:raise,always"),
          Fault("offload_grad", (("chunk", 3),), "delay", 1.0, 1, "offload_grad@chunk=3:delay=1,count=1")], 0),
        ("", [], 0),
    ],
)
def test_valid_specs_parse(spec, faults, seed):
    assert FaultSpec.parse(spec) == FaultSpec(tuple(faults), seed)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("cpu_adam", "fault 'cpu_adam': expected KIND[@key=value,...]:MODE"),
        ("cpu_adam:", "expected KIND[@key=value,...]:MODE"),
        ("@layer=1:raise", "'' is not a task kind or '*'"),
        ("cpu-adam:raise", "'cpu-adam' is not a task kind"),
        ("backward@lyr=1:raise", "unknown key 'lyr' (keys: step, layer, micro_batch, chunk, unit, phase, activations)"),
        ("backward@layer=one:raise", "layer=one is not an integer"),
        ("backward@layer:raise", "key layer needs a value, as in layer=1"),
        ("backward@layer=1,layer=2:raise", "key layer is given twice"),
        ("backward:explode", "unknown mode 'explode' (modes: raise, hang, delay=SECONDS)"),
        ("backward:raise=2", "unknown mode 'raise=2'"),
        ("backward:delay", "delay needs a number of seconds, as in delay=0.01"),
        ("backward:delay=-1", "delay=-1 is not a number of seconds >= 0"),
        ("backward:delay=nan", "delay=nan is not a number of seconds >= 0"),
        ("backward:raise,count=0", "count must be at least 1 (got 0)"),
        ("backward:raise,forever", "unknown option 'forever' (options: count=N, always)"),
        ("seed=x", "seed=x is not an integer"),
        ("seed=1;seed=2", "seed is given twice"),
    ],
)
def test_invalid_specs_say_what_is_wrong_in_one_line(spec, message):
    with pytest.raises(ConfigError) as err:
        FaultSpec.parse(spec)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_matching_is_by_kind_string_and_fields():
    [f] = FaultSpec.parse("backward@step=1,layer=2:raise").faults
    assert f.matches(Backward(unit="layer", layer=2, micro_batch=0, step=1))
    assert not f.matches(Backward(unit="layer", layer=2, micro_batch=0, step=0))
    assert not f.matches(Forward(unit="layer", layer=2, micro_batch=0, step=1))
    [head] = FaultSpec.parse("fetch@unit=head,phase=backward:raise").faults
    assert head.matches(Fetch(unit="head", phase="backward"))
    assert not head.matches(Fetch(unit="head", phase="forward"))
    [unset] = FaultSpec.parse("cpu_adam@chunk=0:raise").faults
    assert not unset.matches(CpuAdam(unit="layer", layer=0))  # an unset field never matches
    assert unset.matches(CpuAdam(unit="layer", layer=0, chunk=0))
    [archive] = FaultSpec.parse("archive@layer=3:raise").faults
    assert archive.matches(Archive(unit="layer", layer=3))
    [anything] = FaultSpec.parse("*@layer=3:raise").faults
    assert anything.matches(Archive(unit="layer", layer=3)) and anything.matches(Forward(layer=3, micro_batch=0))
    assert not anything.matches(Forward(layer=4, micro_batch=0))


# ---- the modes ---------------------------------------------------------------------------------


def test_raise_fires_once_by_default_before_the_program_runs():
    ran: list = []
    inj = FaultInjector(lambda task, ctx: ran.append(task), "forward:raise")
    f0, f1 = Forward(layer=0, micro_batch=0), Forward(layer=1, micro_batch=0)
    inj(Fetch(unit="layer", layer=0), None)
    with pytest.raises(InjectedFault, match=r"injected fault in forward L0 m0 \(forward:raise\)") as err:
        inj(f0, None)
    assert isinstance(err.value, RuntimeError)
    inj(f1, None)
    inj(f0, None)
    assert ran == [Fetch(unit="layer", layer=0), f1, f0]
    assert inj.fired == [(f0, inj.spec.faults[0])]


@pytest.mark.parametrize("option, raises", [("count=2", 2), ("always", 5)])
def test_count_and_always(option, raises):
    inj = FaultInjector(noop, f"forward:raise,{option}")
    outcomes = []
    for i in range(5):
        try:
            outcomes.append(inj(Forward(layer=i, micro_batch=0), None))
        except InjectedFault:
            outcomes.append("raised")
    assert outcomes == ["raised"] * raises + [7] * (5 - raises)


def test_delay_sleeps_a_seeded_random_time_up_to_the_bound(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(faults_module.time, "sleep", slept.append)

    def pauses(spec):
        slept.clear()
        inj = FaultInjector(noop, spec)
        assert [inj(Forward(layer=i, micro_batch=0), None) for i in range(20)] == [7] * 20
        return list(slept)

    a, b, c = pauses("*:delay=0.5;seed=3"), pauses("*:delay=0.5;seed=3"), pauses("*:delay=0.5")
    assert a == b != c and len(a) == 20 and all(0 <= p <= 0.5 for p in a + c)
    assert pauses("backward:delay=0.5") == []


def test_hang_blocks_until_released_and_only_the_first_match():
    inj = FaultInjector(noop, "forward@layer=1:hang")
    result: list = []
    t = threading.Thread(target=lambda: result.append(inj(Forward(layer=1, micro_batch=0), None)))
    t.start()
    t.join(0.05)
    assert t.is_alive() and not result  # blocked (it would be for ever)
    assert inj(Forward(layer=1, micro_batch=0), None) == 7  # fired once: the next match runs
    inj.release()
    t.join(60)  # a hang guard: the thread ends at once
    assert result == [7]


def test_from_env(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert from_env(noop) is noop
    monkeypatch.setenv(ENV, "  ")
    assert from_env(noop) is noop
    monkeypatch.setenv(ENV, "cpu_adam@layer=1:raise")
    inj = from_env(noop)
    assert isinstance(inj, FaultInjector) and inj.program is noop
    with pytest.raises(InjectedFault):
        inj(CpuAdam(unit="layer", layer=1), None)
    monkeypatch.setenv(ENV, "cpu_adam@layer=x:raise")
    with pytest.raises(ConfigError, match=r"^FLOWTRAIN_FAULT: fault 'cpu_adam@layer=x:raise': layer=x is not"):
        from_env(noop)
    assert from_env(noop, {ENV: "save:hang"}).spec.faults[0].kind == "save"


# ---- a fault anywhere --------------------------------------------------------------------------


def fault_at(task) -> str:
    """A spec that matches ``task`` by every field it has set."""
    fields = ["step", "unit", "layer", "micro_batch", "phase", "activations", "chunk"]
    where = ",".join(f"{k}={getattr(task, k)}" for k in fields if getattr(task, k) is not None)
    return f"{task.kind}@{where}:raise"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs, steps=st.integers(1, 2), policy=st.sampled_from(POLICIES), jitter=st.booleans(), data=st.data())
def test_a_fault_at_any_task_fails_the_run_naming_it_and_nothing_downstream_runs(spec, steps, policy, jitter, data):
    graph = compile_steps(spec, steps)
    target = data.draw(st.sampled_from(sorted(graph, key=str)), label="target")
    text = fault_at(target)
    parsed = FaultSpec.parse(("*:delay=0.001;" if jitter else "") + text)
    assert [t for t in graph if parsed.faults[-1].matches(t)] == [target], "a spec can name any one task"
    rec = Recorder()
    inj = FaultInjector(rec, parsed)
    with pytest.MonkeyPatch.context() as mp:
        log = FenceLog(mp)
        with pytest.raises(StepFailed) as err:
            run_async(graph, inj, policy)
    assert err.value.task == target and isinstance(err.value.__cause__, InjectedFault)
    assert str(err.value) == f"task {target} failed: InjectedFault: injected fault in {target} ({text})"
    assert inj.fired == [(target, parsed.faults[-1])]
    assert target not in rec.ran and not rec.ran & nx.descendants(graph, target)
    assert not log.unset and rec.active == 0 and not lane_threads()
