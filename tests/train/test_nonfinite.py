"""A step whose loss or gradients are not finite changes nothing, exactly.

Each run drives the engine the way the trainer does (two steps in flight, the next step's tasks
linked to this step's by ``cross_step_edges``) on the CPU, with a tiny Llama. A NaN is written
into one place of step 2 (the loss, the head's gradient, a layer's, the embedding's) through
the program's test hook. The state after four steps must equal, bit for bit, that of a run
fed the same batches minus batch 2: master weights, Adam m and v, Adam step counts and the
streaming and compute copies. That holds only if nothing of step 2 reached the weights *and*
step 3 never read an update of step 2 that was later undone::

    steps 0 1 [2: NaN in layer.0 -> head, layer.2, layer.1 updated, then put back] 3
      ==  steps 0 1 3     (same batches, batch 2 left out)
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from flowtrain.errors import ConfigError, NonFiniteError
from flowtrain.graph import StepSpec, compile_step, cross_step_edges
from flowtrain.model import ModelConfig
from flowtrain.model.flat_map import model_flat_maps
from flowtrain.policy import resolve_policy
from flowtrain.runtime.engine import Engine
from flowtrain.train.host_state import HostState, grad_chunks, staging_numel
from flowtrain.train.nonfinite import INJECT_ENV, Injection, nonfinite
from flowtrain.train.optimizer import AdamWConfig, adamw_step
from flowtrain.train.program import StepProgram

LAYERS, SEQ, ROWS, MICRO, LR = 3, 8, 4, 2, 1e-2
POISONED = 2


def make_batches(n: int, vocab: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (ROWS, SEQ), generator=g)
        targets = torch.cat([ids[:, 1:], torch.full((ROWS, 1), -100)], dim=1)
        out.append(([ids[m:m + MICRO] for m in range(0, ROWS, MICRO)],
                    [targets[m:m + MICRO] for m in range(0, ROWS, MICRO)]))
    return out


class Run:
    """One model, program and engine on the CPU, trained like the trainer does."""

    def __init__(self, *, tied=False, vocab=64, layout="staged", resident=(), clip=None, policy="double_buffer",
                 order="layer", dtype=torch.float32, inject=None, undo_bytes=1 << 30, device="cpu",
                 cpu_workers=1, save_attention=()) -> None:
        cfg = ModelConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_layers=LAYERS, num_heads=4,
                          num_kv_heads=2, max_position_embeddings=64, tie_word_embeddings=tied)
        layouts = model_flat_maps(cfg)
        staged = layout != "full"
        chunks = grad_chunks(layouts, resident, staging_numel(layouts, resident)) if staged else {}
        self.spec = StepSpec(layers=LAYERS, micro_batches=ROWS // MICRO, order=order, tied=tied,
                             grad_clip=clip is not None, resident=tuple(resident), staged=staged, grad_chunks=chunks,
                             save_attention=tuple(save_attention))
        self.device = device
        self.state = HostState.create(cfg, pin=device != "cpu", layout=layout, resident=resident, device=device,
                                      dtype=dtype, chunks=chunks)
        self.state.init_random(0)
        self.policy = resolve_policy(policy)
        budgets = self.policy.propose(compile_step(self.spec)).budgets
        self.program = StepProgram(self.state, device=device, dtype=dtype, seq_len=SEQ, checkpoint_every=1,
                                   budgets=budgets, adamw=AdamWConfig(lr=LR, grad_clip=clip), inject_nonfinite=inject,
                                   undo_bytes=undo_bytes)
        self.vocab = vocab
        self.cpu_workers = cpu_workers

    def train(self, batches, in_flight=2, on_step=None) -> list[tuple[float, float, bool]]:
        return asyncio.run(self._train(batches, in_flight, on_step or (lambda s: None)))

    async def _train(self, batches, most, on_step):
        engine = Engine(self.program, self.policy, device=self.device, cpu_workers=self.cpu_workers)
        results, in_flight, prev = [], [], None
        async with engine:
            try:
                for s, (ids, targets) in enumerate(batches):
                    self.program.begin_step(s, ids, targets, LR)
                    graph = compile_step(self.spec, step=s)
                    # (a step already waited for is gone from the engine: nothing to link to)
                    engine.add(graph, cross_step_edges(prev, graph, self.spec) if in_flight else ())
                    prev = list(graph)
                    in_flight.append((s, graph))
                    if len(in_flight) == most:
                        results.append(await self._finish(engine, *in_flight.pop(0)))
                        on_step(results[-1])
                while in_flight:
                    results.append(await self._finish(engine, *in_flight.pop(0)))
                    on_step(results[-1])
            except BaseException:
                await engine.drain()
                raise
        return results

    async def _finish(self, engine, s, graph):
        await engine.wait(graph)
        return self.program.end_step(s)

    def snapshot(self) -> dict[str, torch.Tensor]:
        out = {}
        for u in self.state.units:
            k = u.flat_map.key
            out.update({f"{k}.master": u.master, f"{k}.exp_avg": u.exp_avg, f"{k}.exp_avg_sq": u.exp_avg_sq,
                        f"{k}.steps": torch.stack(u.steps)})
            for name in ("stream", "compute"):
                copy = getattr(u, name)
                if copy is not None and copy is not u.master:
                    out[f"{k}.{name}"] = copy
        return {k: v.detach().clone() for k, v in out.items()}


def assert_same_state(ours: dict, ref: dict) -> None:
    assert ours.keys() == ref.keys()
    for k in ref:
        assert torch.equal(ours[k], ref[k]), f"{k} differs"


WHERE = ["loss", "head", f"layer.{LAYERS - 1}", "layer.1", "layer.0", "embed"]
PLACEMENTS = {
    "staged": dict(layout="staged"),
    # two Adam tasks at once: verify_step may settle while one is updating (it waits for it)
    "staged-two-cpu-workers": dict(layout="staged", cpu_workers=2, policy="lookahead"),
    "full": dict(layout="full", policy="sequential"),
    "stream-bf16": dict(layout="stream-bf16", dtype=torch.bfloat16, policy="lookahead"),
    "resident": dict(resident=("embed", "head", "layer.0")),
    "resident-mid-micro": dict(layout="full", resident=("layer.1",), order="micro", policy="lookahead"),
    "clip": dict(layout="full", clip=1.0),
    "clip-resident": dict(layout="full", clip=1.0, resident=("embed", "head", "layer.0"), policy="sequential"),
    "tied-chunks": dict(tied=True, vocab=512),
    "saved-attention": dict(save_attention=(0, 1), order="micro"),  # embedding and head pass through staging in chunks
    "tied-full-resident-layer": dict(tied=True, layout="full", resident=("layer.1",)),
}
_REFERENCES: dict[str, dict] = {}


def reference(name: str) -> dict:
    """The state after the same batches with batch 2 left out."""
    if name not in _REFERENCES:
        run = Run(**PLACEMENTS[name])
        batches = make_batches(4, run.vocab)
        results = run.train(batches[:POISONED] + batches[POISONED + 1:])
        assert not any(skipped for _, _, skipped in results)
        _REFERENCES[name] = run.snapshot()
    return _REFERENCES[name]


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_a_poisoned_step_is_left_out_exactly(placement, where):
    run = Run(**PLACEMENTS[placement], inject=Injection(step=POISONED, where=where))
    results = run.train(make_batches(4, run.vocab))
    assert [skipped for _, _, skipped in results] == [s == POISONED for s in range(4)]
    loss = results[POISONED][0]
    assert math.isnan(loss) if where == "loss" else math.isfinite(loss), "the loss is reported as computed"
    assert_same_state(run.snapshot(), reference(placement))
    if PLACEMENTS[placement].get("clip"):
        assert run.program.undo.recorded == 0, "with --grad-clip the step is verified before any Adam"
    assert run.program.undo.used == 0, "every undo record is given back"


def test_a_nan_loss_is_known_before_any_adam():
    """Every loss precedes every Adam task, so a bad loss skips every update with no undo
    record; a bad layer 0 is found late, after the units above were updated (and recorded)."""
    run = Run(inject=Injection(step=0, where="loss"))
    before = run.snapshot()
    assert run.train(make_batches(1, run.vocab))[0][2]
    assert run.program.undo.recorded == 0
    assert_same_state(run.snapshot(), before)

    run = Run(inject=Injection(step=0, where="layer.0"))
    assert run.train(make_batches(1, run.vocab))[0][2]
    assert run.program.undo.recorded > 0
    assert_same_state(run.snapshot(), before)


def test_a_late_nan_past_the_undo_budget_stops_the_run():
    run = Run(inject=Injection(step=1, where="layer.0"), undo_bytes=0)
    with pytest.raises(NonFiniteError) as err:
        run.train(make_batches(3, run.vocab))
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("step 2: the gradient of layer.0 was not finite, but head c0, layer.2 c0, layer.1 c0")
    assert "could not be put back; resume from the last checkpoint" in msg


def test_no_undo_budget_still_trains_the_same_weights():
    run = Run(undo_bytes=0)
    batches = make_batches(4, run.vocab)
    run.train(batches[:POISONED] + batches[POISONED + 1:])
    assert run.program.undo.recorded == 0
    assert_same_state(run.snapshot(), reference("staged"))


def test_a_finite_gradient_whose_squared_norm_overflows_is_not_skipped():
    run = Run(inject=Injection(step=0, where="layer.1", value=3e19))  # its square overflows fp32
    before = run.snapshot()
    (loss, norm, skipped), = run.train(make_batches(1, run.vocab))
    assert not skipped and norm == math.inf and math.isfinite(loss)
    after = run.snapshot()
    assert all(torch.isfinite(v).all() for v in after.values())
    assert not torch.equal(after["layer.1.master"], before["layer.1.master"])


def test_nonfinite_decides_exactly_on_the_host_and_without_the_shortcut():
    big = torch.tensor([3e19, 1.0])
    cases = [(torch.tensor([1.0, 2.0]), False), (torch.tensor([1.0, math.nan]), True),
             (torch.tensor([math.inf, 1.0]), True), (torch.tensor([-math.inf, math.nan]), True), (big, False)]
    for piece, bad in cases:
        sq = piece.square().sum()
        assert bool(nonfinite(piece, sq)) is bad, piece
        assert bool(nonfinite(piece)) is bad, piece
    assert bool(big.square().sum().isinf())


@pytest.mark.parametrize("flag", [0.0, 1.0])
def test_fused_adamw_with_found_inf(flag):
    """torch's fused kernel leaves master, m and v alone where found_inf is 1; adamw_step takes
    the step count back too. With 0 it is the plain update."""
    g = torch.Generator().manual_seed(0)
    master, grad, m, v = (torch.randn(64, generator=g) for _ in range(4))
    v = v.abs()
    step = torch.tensor(3.0)
    plain = [t.clone() for t in (master, m, v, step)]
    adamw_step(*plain[:1], grad.clone(), *plain[1:3], plain[3], AdamWConfig(), LR)
    ours = [t.clone() for t in (master, m, v, step)]
    adamw_step(ours[0], grad.clone(), ours[1], ours[2], ours[3], AdamWConfig(), LR, found_inf=torch.tensor(flag))
    expected = [master, m, v, step] if flag else plain
    for a, b in zip(ours, expected):
        assert torch.equal(a, b)


def test_injection_spec(monkeypatch):
    inj = Injection.parse("step=2,where=layer.0", LAYERS)
    assert (inj.step, inj.where, math.isnan(inj.value)) == (2, "layer.0", True)
    assert Injection.parse("where=loss,step=0,value=inf", LAYERS).value == math.inf
    for bad in ["step=2", "step=x,where=loss", "step=1,where=layer.3", "step=1,where=loss,colour=red", "nonsense"]:
        with pytest.raises(ConfigError, match=INJECT_ENV) as err:
            Injection.parse(bad, LAYERS)
        assert "\n" not in str(err.value)
    monkeypatch.setenv(INJECT_ENV, "step=1,where=embed")
    assert (Run().program.inject.step, Run().program.inject.where) == (1, "embed")
    monkeypatch.setenv(INJECT_ENV, "step=1,where=nowhere")
    with pytest.raises(ConfigError, match=INJECT_ENV):
        Run()


GPU_PLACEMENTS = {name: PLACEMENTS[name] for name in ("staged", "stream-bf16", "resident", "clip-resident", "tied-chunks")}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.filterwarnings("ignore:Attempting to run cuBLAS")  # once per new thread: harmless
@pytest.mark.parametrize("where", ["loss", "head", "layer.1", "layer.0", "embed"])
@pytest.mark.parametrize("placement", list(GPU_PLACEMENTS))
def test_on_the_gpu_a_poisoned_step_changes_nothing(placement, where):
    """bf16 compute on CUDA (flags on the device, pinned host copies, found_inf in the fused
    CUDA kernel): the state after the poisoned step is bit for bit the state before it, and the
    steps around it train. One step at a time here, so the snapshots fall between steps."""
    opts = {**GPU_PLACEMENTS[placement], "dtype": torch.bfloat16}
    run = Run(**opts, device="cuda", inject=Injection(step=1, where=where))
    snaps = []
    results = run.train(make_batches(3, run.vocab), in_flight=1, on_step=lambda r: snaps.append(run.snapshot()))
    assert [skipped for _, _, skipped in results] == [False, True, False]
    assert_same_state(snaps[1], snaps[0])
    assert not torch.equal(snaps[2]["layer.0.master"], snaps[1]["layer.0.master"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.filterwarnings("ignore:Attempting to run cuBLAS")  # once per new thread: harmless
@pytest.mark.parametrize("placement", ["staged", "resident"])
def test_on_the_gpu_overlapped_steps_leave_the_poisoned_one_out(placement):
    """Two steps in flight on CUDA, layer 0 poisoned (found last): the same state as a run
    without batch 2 (fp32 compute, so that only the order of work could make a difference)."""
    opts = {**PLACEMENTS[placement], "device": "cuda"}
    run, ref = Run(**opts, inject=Injection(step=POISONED, where="layer.0")), Run(**opts)
    batches = make_batches(4, run.vocab)
    assert [skipped for _, _, skipped in run.train(batches)] == [s == POISONED for s in range(4)]
    ref.train(batches[:POISONED] + batches[POISONED + 1:])
    assert_same_state(run.snapshot(), ref.snapshot())
