"""What a run tells its user while it trains: a progress bar or plain lines, and metrics.

One :class:`StepMetrics` per optimizer step goes to the progress display and, with
``--metrics FILE``, as one JSON object per line. Values that are not finite (a step whose loss
blew up) are written as ``null``: bare ``NaN`` is not JSON. A skipped step says so::

    {"step": 7, "loss": null, "skipped": true, "grad_norm": null, ...}

``step`` counts optimizer steps from 1, as the progress lines do and as ``checkpoint-N`` names
the state after step ``N`` (Hugging Face's ``trainer_state.json`` counts the same way): the
line of step 7 is the one a run's ``checkpoint-7`` was saved after. A resumed run's lines go
on from the checkpoint's number.

A held-out loss (``--eval-data``, ``--eval-every``) is a line of its own, written right after
its step's line: the mean cross-entropy over every target token of the eval set, with the
weights after that step, and how many tokens that is::

    {"step": 7, "eval_loss": 3.1416, "eval_tokens": 12345}

On the terminal it is a line ``step 7/100  eval_loss 3.1416  (12,345 tokens)``. Without a
terminal (or with ``--no-progress``) a step's line comes every twentieth of the run, and at
least every 30 seconds. Through the
Python API the same numbers are on the step's :class:`StepMetrics` (``eval_loss``,
``eval_tokens``), filled before ``on_step`` sees it.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import TextIO

import msgspec

from .reporters import Tracker, step_values

#: Without a terminal (plain lines), a step's line comes at least this often, however long a
#: twentieth of the run takes: a step prints where waiting for the next one (as long as this one)
#: would leave more than this since the last line.
LINE_EVERY_S = 30.0


class StepMetrics(msgspec.Struct):
    #: optimizer steps done, this one included (1 for a run's first step), as the progress
    #: lines and ``checkpoint-N`` count
    step: int
    loss: float
    tokens: int
    seconds: float
    tokens_per_s: float
    lr: float
    grad_norm: float
    #: the step's loss or a gradient was not finite, so no weight, Adam moment or step count
    #: changed (the step's batch is consumed all the same)
    skipped: bool = False
    #: the held-out loss with the weights after this step (mean cross-entropy over every target
    #: token of ``--eval-data``) and how many tokens it covers; None for a step not evaluated
    eval_loss: float | None = None
    eval_tokens: int | None = None
    #: with ``--skip-idle-experts``: the fraction of the sparse layers' expert weights that the
    #: step's fetches (forward, recompute, backward) left in host memory, the idle experts'
    #: before the recompute and backward; None (and not on the ``--metrics`` line) otherwise
    experts_unfetched: float | None = None
    #: DPO: the step's mean rewards by TRL's names (``rewards/chosen``, ``rewards/rejected``,
    #: ``rewards/margins``, ``rewards/accuracies``), each a key of its own on the ``--metrics``
    #: line; None (and not there) otherwise
    rewards: dict[str, float] | None = None
    #: a policy step (:class:`~flowtrain.train.policy_session.PolicyTrainer`): the mean k3 KL
    #: to the reference and the share of completion tokens the clip held, by TRL's names
    #: (``kl``, ``clip_ratio/region_mean``), each a key of its own on the ``--metrics`` line;
    #: None (and not there) otherwise
    policy: dict[str, float] | None = None


#: fields of :class:`StepMetrics` that ``--metrics`` writes on a line of their own (:meth:`Reporter.eval`)
_EVAL_FIELDS = ("eval_loss", "eval_tokens")


def metrics_json(m: StepMetrics) -> str:
    """One JSON line; non-finite numbers become ``null``. The held-out loss is not on it: it
    has a line of its own, written when the evaluation is done."""
    fields = msgspec.to_builtins(m)
    fields.update(fields.pop("rewards") or {})
    fields.update(fields.pop("policy") or {})
    data = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in fields.items()
            if k not in _EVAL_FIELDS and not (k == "experts_unfetched" and v is None)}
    return json.dumps(data, allow_nan=False)


def _rewards_text(m: StepMetrics) -> str:
    """DPO's margin and accuracy on a progress line (nothing for other runs)."""
    if not m.rewards:
        return ""
    return (f"  margin {_num(m.rewards['rewards/margins'], '.4f')}  "
            f"acc {_num(m.rewards['rewards/accuracies'], '.2f')}")


def _num(x: float, fmt: str) -> str:
    return format(x, fmt) if math.isfinite(x) else str(x)


class Reporter:
    """Progress on a terminal (tqdm), plain lines otherwise, and the ``--metrics`` JSON lines.

    ``first`` is the number of steps a resumed run had done, so the bar and the lines count
    from there. ``progress``: None for a bar on a terminal and plain lines otherwise, True for
    the bar, ``"lines"`` for plain lines (``--no-progress``), False for nothing printed at all.
    """

    def __init__(self, *, total: int, first: int = 0, metrics: TextIO | None = None,
                 progress: bool | str | None = None, quiet: bool = False,
                 clock: Callable[[], float] = time.monotonic, trackers: Sequence[Tracker] = ()) -> None:
        #: nothing printed (``progress=False``, or a data-parallel process other than rank 0);
        #: the ``--metrics`` lines are written all the same
        self.quiet = quiet or progress is False
        interactive = not self.quiet and (progress is True or (progress is None and sys.stderr.isatty()))
        self.bar = None
        if interactive:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=first, unit="step", dynamic_ncols=True)
        #: the ``--metrics`` file, opened, locked and (on a resume) cut back to the checkpoint's
        #: steps by :class:`~flowtrain.train.metrics_file.MetricsFile`, so one file holds the
        #: whole run's curve, each step once
        self.metrics = metrics
        self.every = max(1, (total - first) // 20)
        self.first = first
        self.total = total
        #: plain lines come every ``every`` steps, and at least once a ``LINE_EVERY_S`` seconds
        #: where steps are slow (a line every 5% of a long run of slow steps could be hours apart)
        self.clock = clock
        self.last_line = self.last_step = clock()
        #: ``--report-to``'s experiment trackers (:mod:`~flowtrain.train.reporters`), fed the
        #: numbers of every ``--metrics`` line (whoever opened them closes them)
        self.trackers = list(trackers)
        self.skipped_steps = 0

    def step(self, m: StepMetrics) -> None:
        if self.metrics:
            self.metrics.write(metrics_json(m) + "\n")
            self.metrics.flush()
        self.skipped_steps += m.skipped
        for t in self.trackers:
            t.log(m.step, step_values(m.loss, m.lr, m.grad_norm, m.tokens_per_s, m.skipped, self.skipped_steps))
        if self.bar is not None:
            extra = ({"margin": _num(m.rewards["rewards/margins"], ".4f"),
                      "acc": _num(m.rewards["rewards/accuracies"], ".2f")} if m.rewards else {})
            self.bar.set_postfix(loss=_num(m.loss, ".4f"), tok_s=f"{m.tokens_per_s:,.0f}", **extra,
                                 **({"skipped": "yes"} if m.skipped else {}))
            self.bar.update(1)
        now = self.clock()
        since, self.last_step = now - self.last_step, now  # this step's time: a guess of the next one's
        if self.bar is None and not self.quiet and (m.skipped or (m.step - 1 - self.first) % self.every == 0
                                                    or m.step == self.total or now - self.last_line + since > LINE_EVERY_S):
            self.last_line = now
            print(
                f"step {m.step}/{self.total}  loss {_num(m.loss, '.4f')}  grad_norm {_num(m.grad_norm, '.3f')}  "
                f"{m.tokens_per_s:,.0f} tok/s  lr {m.lr:.3g}" + _rewards_text(m)
                + ("  skipped: not finite, weights unchanged" if m.skipped else ""),
                flush=True,
            )

    def eval(self, m: StepMetrics) -> None:
        """The held-out loss after step ``m`` (its ``eval_loss`` filled): its own JSON line and
        its own progress line."""
        loss, tokens = m.eval_loss, m.eval_tokens
        assert loss is not None and tokens is not None, "eval() reports an evaluated step"
        if self.metrics:
            value = loss if math.isfinite(loss) else None
            self.metrics.write(json.dumps({"step": m.step, "eval_loss": value, "eval_tokens": tokens}, allow_nan=False) + "\n")
            self.metrics.flush()
        for t in self.trackers:
            t.log(m.step, {"eval/loss": loss})
        self.say(f"step {m.step}/{self.total}  eval_loss {_num(loss, '.4f')}  ({tokens:,} tokens)")

    def say(self, line: str) -> None:
        """A line of its own, between progress updates."""
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.metrics:
            self.metrics.close()

