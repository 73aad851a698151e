"""Plain progress lines (no terminal, or ``--no-progress``): every twentieth of the run, and at
least every 30 seconds where a twentieth of the run takes longer."""

from __future__ import annotations

from flowtrain.train.reporting import LINE_EVERY_S, Reporter, StepMetrics


def _metrics(step: int) -> StepMetrics:
    return StepMetrics(step=step, loss=2.0, tokens=4096, seconds=42.0, tokens_per_s=97.5, lr=1e-5, grad_norm=1.0)


def _lines(capsys, total: int, seconds_a_step: float, steps: int) -> list[str]:
    now = [0.0]
    reporter = Reporter(total=total, progress="lines", clock=lambda: now[0])
    for s in range(1, steps + 1):
        now[0] += seconds_a_step
        reporter.step(_metrics(s))
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]


def test_a_long_run_of_fast_steps_prints_a_line_at_least_every_30_seconds(capsys):
    """100,000 steps of 0.4 s: every twentieth would be a line every 5,000 steps (33 minutes)."""
    assert LINE_EVERY_S <= 30.0
    lines = _lines(capsys, total=100_000, seconds_a_step=0.4, steps=3000)
    steps = [int(line.split()[1].split("/")[0]) for line in lines]
    assert steps[0] == 1
    gaps = [(b - a) * 0.4 for a, b in zip(steps, steps[1:])]
    assert len(gaps) >= 3000 * 0.4 / 30.0 - 1 and max(gaps) <= 30.0 + 1e-9


def test_slow_steps_print_a_line_at_least_once_a_minute(capsys):
    """2,000 steps of 42 s: every twentieth would be a line every 100 steps (70 minutes)."""
    lines = _lines(capsys, total=2000, seconds_a_step=42.0, steps=200)
    assert len(lines) >= 200 * 42.0 / (LINE_EVERY_S + 42.0)
    assert lines[0].startswith("step 1/2000")


def test_fast_steps_print_every_twentieth_of_the_run(capsys):
    lines = _lines(capsys, total=2000, seconds_a_step=0.01, steps=2000)
    assert [int(line.split()[1].split("/")[0]) for line in lines] == [*range(1, 2000, 100), 2000]
