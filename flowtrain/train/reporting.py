"""What a run tells its user while it trains: a progress bar or plain lines, and metrics.

One :class:`StepMetrics` per optimizer step goes to the progress display and, with
``--metrics FILE``, as one JSON object per line. Values that are not finite (a step whose loss
blew up) are written as ``null``: bare ``NaN`` is not JSON. A skipped step says so::

    {"step": 7, "loss": null, "skipped": true, "grad_norm": null, ...}

A held-out loss (``--eval-data``, ``--eval-every``) is a line of its own, written right after
its step's line: the mean cross-entropy over every target token of the eval set, with the
weights after that step (``step`` is 0-based, as on the step lines), and how many tokens that
is::

    {"step": 7, "eval_loss": 3.1416, "eval_tokens": 12345}

On the terminal it is a line ``step 8/100  eval_loss 3.1416  (12,345 tokens)``.
"""

from __future__ import annotations

import json
import math
import sys

import msgspec


class StepMetrics(msgspec.Struct):
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


def metrics_json(m: StepMetrics) -> str:
    """One JSON line; non-finite numbers become ``null``."""
    data = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in msgspec.to_builtins(m).items()}
    return json.dumps(data, allow_nan=False)


def _num(x: float, fmt: str) -> str:
    return format(x, fmt) if math.isfinite(x) else str(x)


class Reporter:
    """Progress on a terminal (tqdm), plain lines otherwise, and the ``--metrics`` JSON lines.

    ``first`` is the step a resumed run starts at, so the bar and the lines count from there.
    """

    def __init__(self, *, total: int, first: int = 0, metrics: str | None = None,
                 progress: bool | None = None, quiet: bool = False) -> None:
        #: nothing printed (a data-parallel process other than rank 0; its metrics go nowhere)
        self.quiet = quiet
        interactive = not quiet and (progress if progress is not None else sys.stderr.isatty())
        self.bar = None
        if interactive:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=first, unit="step", dynamic_ncols=True)
        # Appended to on a resume, so one file holds the whole run's curve.
        self.metrics = open(metrics, "a" if first else "w") if metrics else None
        self.every = max(1, (total - first) // 20)
        self.first = first
        self.total = total

    def step(self, m: StepMetrics) -> None:
        if self.metrics:
            self.metrics.write(metrics_json(m) + "\n")
            self.metrics.flush()
        if self.bar is not None:
            self.bar.set_postfix(loss=_num(m.loss, ".4f"), tok_s=f"{m.tokens_per_s:,.0f}",
                                 **({"skipped": "yes"} if m.skipped else {}))
            self.bar.update(1)
        elif not self.quiet and (m.skipped or (m.step - self.first) % self.every == 0 or m.step == self.total - 1):
            print(
                f"step {m.step + 1}/{self.total}  loss {_num(m.loss, '.4f')}  grad_norm {_num(m.grad_norm, '.3f')}  "
                f"{m.tokens_per_s:,.0f} tok/s  lr {m.lr:.3g}" + ("  skipped: not finite, weights unchanged" if m.skipped else ""),
                flush=True,
            )

    def eval(self, step: int, loss: float, tokens: int) -> None:
        """The held-out loss after ``step``: its own JSON line and its own progress line."""
        if self.metrics:
            value = loss if math.isfinite(loss) else None
            self.metrics.write(json.dumps({"step": step, "eval_loss": value, "eval_tokens": tokens}, allow_nan=False) + "\n")
            self.metrics.flush()
        self.say(f"step {step + 1}/{self.total}  eval_loss {_num(loss, '.4f')}  ({tokens:,} tokens)")

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
