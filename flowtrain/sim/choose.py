"""Choosing a configuration by predicted time: the planner's second step.

The memory plan (:mod:`flowtrain.plan.planner`) answers "does it fit, and where does every byte
live". Among the configurations that fit, this module picks the one the simulator predicts to
be fastest on a machine, and says why::

    choice = choose_fastest(cfg, req, machine, policy="double_buffer")
    choice.best.flags, choice.best.tokens_per_s, choice.explain()

What it varies, one setting at a time from the request as given (coordinate descent, two
rounds, so a setting that only pays off after another changed is still found): the policy
(the built-ins and the one asked for), the micro-batch size (divisors of the batch), the
micro-batch order (``layer``, ``micro``), the placement (``--resident auto``, ``embed,head``, ``none``), the host layout (``staged``,
``stream-bf16``; ``full`` with ``--grad-clip``) and the activations (``auto``,
``recompute``, ``offload``, and ``keep`` with a checkpoint at every layer). Every candidate is planned by ``plan_run`` (so
its slot budgets are the planner's) and simulated for a few steps; one that does not fit is
skipped. The request's own configuration is always a candidate, so the choice is never slower
than what was asked for, by the model's own account.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .machine import Machine

_POLICIES = ("double_buffer", "lookahead", "sequential")


class Candidate(msgspec.Struct, kw_only=True):
    settings: dict[str, Any]
    fits: bool
    tokens_per_s: float = 0.0
    step_seconds: float = 0.0
    critical_by_lane: dict[str, float] = {}

    @property
    def flags(self) -> str:
        s = self.settings
        return (f"--micro-batch-size {s['micro_batch_size']} --order {s['order']} --policy {s['policy']} "
                f"--resident {s['resident']} --layout {s['layout']} --activations {s['activations']}")


class Choice(msgspec.Struct, kw_only=True):
    machine: str
    asked: Candidate
    best: Candidate
    tried: list[Candidate]

    def explain(self) -> str:
        """Two or three lines: what was chosen, by how much it beats the request, and why."""
        a, b = self.asked, self.best
        if not b.fits:  # nothing tried fits: there is no fastest to name
            return (f"no configuration tried fits on {self.machine} ({len(self.tried)} tried); "
                    "the plan above says what would make it fit")
        lines = [f"fastest predicted on {self.machine} (of {sum(c.fits for c in self.tried)} configurations that fit): "
                 f"{b.flags}: {b.tokens_per_s:,.0f} tokens/s, {b.step_seconds:.3f} s per step"]
        if not a.fits:
            lines.append("the request as given does not fit, so it was not simulated")
        elif b is a or b.settings == a.settings:
            lines.append(f"that is the request as given; {_bound(a)}")
        else:
            changed = ", ".join(f"{k} {a.settings[k]} -> {b.settings[k]}" for k in b.settings if b.settings[k] != a.settings[k])
            if b.tokens_per_s < 1.02 * a.tokens_per_s:
                lines.append(f"the request ({a.tokens_per_s:,.0f} tokens/s) is within 2% of it, closer than the model "
                             f"can tell apart: keep it; its step {_bound(a)}")
                return "\n".join(lines)
            lines.append(f"{b.tokens_per_s / a.tokens_per_s - 1:+.0%} over the request ({a.tokens_per_s:,.0f} tokens/s) "
                         f"by changing {changed}: the request's step {_bound(a)}; the choice's {_bound(b)}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        def one(c: Candidate) -> dict:
            return {"flags": c.flags, "settings": c.settings, "fits": c.fits, "tokens_per_s": round(c.tokens_per_s, 1),
                    "step_seconds": round(c.step_seconds, 4)}

        return {"machine": self.machine, "asked": one(self.asked), "best": one(self.best),
                "tried": [one(c) for c in self.tried]}


def _bound(c: Candidate) -> str:
    """Which lanes its critical chain runs through: the largest, and the next if it matters."""
    total = sum(c.critical_by_lane.values()) or 1.0
    lanes = sorted(((k, v) for k, v in c.critical_by_lane.items() if k != "wait"), key=lambda kv: -kv[1])
    if not lanes:
        return "has no critical chain"
    text = f"is bound by {lanes[0][0]} ({lanes[0][1] / total:.0%} of its critical chain"
    if len(lanes) > 1 and lanes[1][1] / total >= 0.03:
        text += f", then {lanes[1][0]} {lanes[1][1] / total:.0%}"
    return text + ")"


def choose_fastest(cfg: Any, req: Any, machine: Machine, policy: str = "double_buffer", *,
                   device: Any = None, dtype: Any = None, adam_workers: int = 1, steps: int = 3,
                   local_gpu: bool = True) -> Choice:
    """The fastest configuration that fits, among single-setting changes of ``req`` (two rounds).
    Each is planned as ``plan_run`` plans it (``local_gpu``: also capped by the free memory of
    this machine's GPU, as the memory plan printed beside the choice is)."""
    from ..plan.memory import Precision, Target
    from ..plan.planner import plan_run
    from .choose_plan import plan_and_choose
    from .predict import predict

    device = device or Target("cuda")
    dtype = dtype or Precision(2)  # bf16
    if req.order == "auto":  # as the planner decides it for this machine: the request as it would run
        req = msgspec.structs.replace(req, order=plan_and_choose(cfg, req, device=device, dtype=dtype, policy=policy,
                                                                 local_gpu=local_gpu, machine=machine).spec.order)
    seen: dict[tuple, Candidate] = {}

    def evaluate(settings: dict[str, Any]) -> Candidate:
        key = tuple(sorted(settings.items()))
        if key in seen:
            return seen[key]
        r = msgspec.structs.replace(req, micro_batch_size=settings["micro_batch_size"], order=settings["order"],
                                    resident=settings["resident"], layout=settings["layout"],
                                    activations=settings["activations"])
        plan = plan_run(cfg, r, device=device, dtype=dtype, policy=settings["policy"], local_gpu=local_gpu)
        cand = Candidate(settings=settings, fits=plan.fits)
        if plan.fits:
            s = predict(cfg, plan, r, machine, settings["policy"], adam_workers=adam_workers, steps=steps).summary
            cand.tokens_per_s, cand.step_seconds, cand.critical_by_lane = s.tokens_per_s, s.step_seconds, s.critical_by_lane
        seen[key] = cand
        return cand

    layouts = ("full",) if req.grad_clip else ("staged", "stream-bf16")
    options = {
        "policy": list(dict.fromkeys((policy, *_POLICIES))),
        "order": list(dict.fromkeys((req.order, "layer", "micro"))),
        "micro_batch_size": [b for b in range(req.batch_size, 0, -1) if req.batch_size % b == 0][:4],
        "resident": list(dict.fromkeys((req.resident, "auto", "embed,head", "none"))),
        "layout": list(dict.fromkeys((req.layout, *layouts))),
        "activations": list(dict.fromkeys((req.activations, "auto", "recompute", "offload",
                                           *(("keep", "attention") if req.checkpoint_every == 1 else ())))),
    }
    start = {"policy": policy, "micro_batch_size": req.micro_batch_size, "order": req.order, "resident": req.resident,
             "layout": req.layout, "activations": req.activations}
    asked = evaluate(start)
    best = asked if asked.fits else None
    current = dict(start)
    for _ in range(2):
        for name, values in options.items():
            for v in values:
                cand = evaluate({**current, name: v})
                if cand.fits and (best is None or cand.tokens_per_s > best.tokens_per_s * 1.005):
                    best = cand
            if best is not None:
                current = dict(best.settings)
    fitting = [c for c in seen.values() if c.fits]
    best = max(fitting, key=lambda c: c.tokens_per_s) if fitting else asked
    return Choice(machine=machine.name, asked=asked, best=best, tried=list(seen.values()))
