"""The predictions the pages quote are what their commands print today.

README.md and docs/*.md quote ``flowtrain simulate`` and ``flowtrain plan --machine`` outputs
with the command beside them. A change to the cost model or a machine file changes those
numbers; each test here runs the quoted command (in-process, as ``flowtrain`` would) and looks
for the number as the page prints it, so a page cannot go on quoting a simulator that no longer
exists. When one fails, run the command it names and put its output in the page.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flowtrain.cli import main

ROOT = Path(__file__).parents[2]
DOCS = ROOT / "docs"


def simulate(capsys, *args: str) -> str:
    """``flowtrain simulate ARGS``'s text output."""
    assert main(["simulate", *args]) == 0
    return capsys.readouterr().out


def predicted(text: str) -> tuple[str, str, str]:
    """(tokens/s, model TFLOP/s, step seconds) as the ``predicted:`` line prints them."""
    m = re.search(r"predicted: ([\d,]+) tokens/s, ([\d.]+) model TFLOP/s, ([\d.]+) s per step", text)
    assert m, text
    return m.group(1), m.group(2), m.group(3)


def quoted(page: str, fragment: str) -> None:
    text = (ROOT / page).read_text()
    flat = " ".join(text.split())  # a quote may wrap across lines
    assert fragment in text or " ".join(fragment.split()) in flat, f"{page} no longer quotes {fragment!r}"


CARD = ["--seq-len", "4096", "--batch-size", "16", "--host-mem", "120"]


@pytest.mark.parametrize("machine, model, micro, extra", [
    ("rtx3080-10gb", "llama-8b", 2, []),
    ("rtx3080-10gb", "llama-8b", 1, ["--gpu-mem", "8"]),
    ("rtx3080-10gb", "llama-3b", 2, []),
    ("rtx4090", "llama-8b", 2, []),
    ("rtx4090", "llama-3b", 4, []),
])
def test_readme_consumer_cards(capsys, machine, model, micro, extra):
    out = simulate(capsys, "--machine", machine, "--model", model, *CARD, "--micro-batch-size", str(micro), *extra)
    tok, tflops, _ = predicted(out)
    gpu = re.search(r"GPU ([\d.]+) GiB", out).group(1)
    quoted("README.md", f"| {micro} | {gpu} GiB | {tok} ({tflops}) |")


def test_training_order_example(capsys):
    args = ["--model", "llama-3b", "--seq-len", "4096", "--batch-size", "16", "--micro-batch-size", "4",
            "--host-mem", "110", "--machine", "h200", "--order"]
    layer, micro = (predicted(simulate(capsys, *args, o))[0] for o in ("layer", "micro"))
    quoted("docs/training.md", f"predicts {micro} tok/s in `micro` order against {layer} in `layer` order")


@pytest.mark.parametrize("machine, batch, micro", [("rtx4090", 16, 2), ("rtx3080-10gb", 8, 1)])
def test_lora_70b_table(capsys, machine, batch, micro):
    out = simulate(capsys, "--model", str(DOCS / "simulate" / "llama-70b"), "--seq-len", "4096", "--batch-size", str(batch),
                   "--micro-batch-size", str(micro), "--lora-rank", "16", "--host-mem", "192", "--machine", machine)
    tok, tflops, step = predicted(out)
    quoted("docs/lora.md", f"| {tok} tok/s, {tflops} model TFLOP/s, {round(float(step))} s per step, compute-bound")


def test_dpo_reference_pass_per_pair(capsys):
    out = simulate(capsys, "--model", "llama-8b", "--objective", "dpo", "--seq-len", "4096", "--batch-size", "16",
                   "--micro-batch-size", "2", "--gpu-mem", "10", "--host-mem", "118", "--machine", "h100-sxm")
    m = re.search(r"predicted ([\d.]+) s a pair, ([\d,]+) s per 1,000 pairs", out)
    assert m, out
    quoted("docs/preference.md", f"({m.group(1)} s a pair, {m.group(2)} s per 1,000 pairs)")


@pytest.mark.parametrize("batch, host", [(2, 32), (16, 64)])
def test_disk_tier_examples(capsys, tmp_path, batch, host):
    out = simulate(capsys, "--machine", "rtx3080-10gb", "--model", "llama-8b", "--seq-len", "4096", "--batch-size", str(batch),
                   "--micro-batch-size", "2", "--gpu-mem", "10", "--host-mem", str(host), "--state-dir", str(tmp_path))
    for line in out.splitlines():
        if line.startswith(("predicted:", "busy fraction:")):
            quoted("docs/disk-tier.md", line)


def test_disk_tier_long_context_example(capsys, tmp_path):
    common = ["--machine", "h200", "--model", "llama-8b-256k", "--seq-len", "262144", "--batch-size", "1",
              "--micro-batch-size", "1", "--host-mem", "118"]
    out = simulate(capsys, *common, "--activations", "attention", "--state-dir", str(tmp_path), "--disk-gbs", "1.3")
    for line in out.splitlines():
        if line.startswith(("predicted:", "busy fraction:", "  moments on disk", "  on disk")):
            quoted("docs/disk-tier.md", line)
    slow = predicted(simulate(capsys, *common, "--activations", "attention", "--state-dir", str(tmp_path)))
    quoted("docs/disk-tier.md", f"the disk sets the step at {float(slow[2]):.1f} s")
    tok, tflops, _ = predicted(simulate(capsys, *common))
    quoted("docs/disk-tier.md", f"without the folder predicts {tok} tokens/s ({tflops} TFLOP/s)")


def test_two_gpus_against_one(capsys):
    common = ["--model", "llama-8b", "--seq-len", "4096", "--micro-batch-size", "4", "--host-mem", "256",
              "--resident", "none", "--machine", "h200"]
    one = predicted(simulate(capsys, *common, "--batch-size", "16"))[0]
    two = predicted(simulate(capsys, *common, "--batch-size", "32", "--nproc-per-node", "2"))[0]
    ratio = float(two.replace(",", "")) / float(one.replace(",", ""))
    quoted("docs/distributed.md", f"# predicted: {two} tokens/s ({ratio:.2f}x one GPU's {one})")


@pytest.mark.parametrize("backend", ["auto", "flash"])
def test_simulate_page_long_context_by_kernel(capsys, backend):
    out = simulate(capsys, "--model", "llama-8b-256k", "--seq-len", "262144", "--batch-size", "1", "--micro-batch-size", "1",
                   "--host-mem", "118", "--machine", "h200", "--attention-backend", backend)
    quoted("docs/simulate.md", f"{predicted(out)[0]} {'tokens/s with `auto`' if backend == 'auto' else 'with `flash`'}")


@pytest.mark.parametrize("args", [
    "--model qwen3-30b-a3b --machine h200 --host-mem 512 --batch-size 16 --micro-batch-size 4",
    "--model qwen3-30b-a3b --machine h200 --host-mem 512 --batch-size 64 --micro-batch-size 4",
    "--model qwen3-30b-a3b --machine gh200 --batch-size 16 --micro-batch-size 4",
    "--model qwen3-30b-a3b --machine gh200 --batch-size 64 --micro-batch-size 4",
    "--model qwen3-30b-a3b --machine rtx4090 --host-mem 384 --batch-size 16 --micro-batch-size 4",
    "--model qwen3-235b-a22b --machine h200 --host-mem 3072 --batch-size 64 --micro-batch-size 4",
])
def test_simulate_page_mixture_of_experts_table(capsys, args):
    out = simulate(capsys, "--seq-len", "4096", *args.split())
    tok, tflops, step = predicted(out)
    gpu, host = (float(x) for x in re.search(r"GPU ([\d.]+) GiB, host ([\d.]+) GiB", out).groups())
    quoted("docs/simulate.md", f"| {tok} | {float(tflops):.0f} | {float(step):.2f} | {gpu:,.0f} / {host:,.0f} |")


def test_simulate_page_predictions_table():
    from flowtrain.cli.figures import predictions_table

    for line in predictions_table().splitlines():
        quoted("docs/simulate.md", line)


@pytest.mark.slow
def test_simulate_page_70b_advice(capsys):
    argv = ["plan", "--model", str(DOCS / "simulate" / "llama-70b"), "--seq-len", "4096", "--batch-size", "16",
            "--micro-batch-size", "2", "--host-mem", "1536", "--gpu-mem", "139.8", "--device", "cuda", "--machine", "h200"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for line in out.splitlines():
        if line.startswith(("fastest predicted", "+")):
            quoted("docs/simulate.md", line)


def test_validation_table_on_the_simulate_page(capsys):
    """docs/simulate.md's table of measured runs is what ``python -m flowtrain.sim.validate`` prints."""
    from flowtrain.sim import validate

    assert validate.main([]) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(table) > 2
    for line in table:
        quoted("docs/simulate.md", line)
