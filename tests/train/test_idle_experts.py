"""``--skip-idle-experts``: an expert that no token of a step is routed to gets no gradient and no
update, exactly as ``torch.optim.AdamW`` skips a parameter whose gradient is None.

The reference is transformers' model trained by torch's AdamW over *one parameter per expert*:
transformers stacks each projection of all experts into one tensor, so for the reference each
expert's slice is a leaf of its own, whose gradient is set to None in a step where no token
reached it (a forward hook on the experts module records the routing). Many experts and few
tokens make idle experts common: some are idle in every step, some in one step and not the next
(so their own step counts fall behind the layer's)."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_moe_parity import COEF, step_backward, straight_and_resumed
from test_train_vs_hf import ROWS, STEPS, make_checkpoint, make_data, run_flowtrain

from flowtrain.cli import main

SPARSE = {
    # 32 experts, one per token, 48 tokens a step: about a fifth idle in each sparse layer
    "qwen3-moe": dict(model_type="qwen3_moe", head_dim=8, num_experts=32, num_experts_per_tok=1,
                      moe_intermediate_size=16, norm_topk_prob=True, mlp_only_layers=[1]),
    "mixtral-tied": dict(model_type="mixtral", num_local_experts=24, num_experts_per_tok=2, intermediate_size=16,
                         tied=True),
}
STACKS = ("gate_up_proj", "down_proj")


def _sparse_blocks(model):
    return [(i, layer.mlp.experts) for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]


def reference_skipping(model, rows, micro):
    """torch AdamW, each expert's slice of a stack a parameter of its own, skipped (grad None) in
    a step that routed no token to it. Returns the model and, per step, the idle experts of each
    sparse layer."""
    hits: dict[int, set[int]] = {}
    now: dict[str, torch.Tensor] = {}  # the micro-batch's attention mask: padding reaches an expert, and is no token

    def hit(i, args):
        hits[i].update(args[1][now["real"]].reshape(-1).tolist())

    for i, experts in _sparse_blocks(model):
        experts.register_forward_pre_hook(lambda mod, args, i=i: hit(i, args))
    stacked = {n: p for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] in STACKS}
    leaves = {n: [p[e].detach().clone().requires_grad_(True) for e in range(p.shape[0])] for n, p in stacked.items()}
    plain = [p for n, p in model.named_parameters() if n not in stacked]
    opt = torch.optim.AdamW(plain + [leaf for ls in leaves.values() for leaf in ls], lr=0.01, weight_decay=0.1,
                            betas=(0.9, 0.95), eps=1e-6)
    idle_per_step = []
    for s in range(STEPS):
        opt.zero_grad()
        model.zero_grad(set_to_none=True)
        hits.clear()
        hits.update({i: set() for i, _ in _sparse_blocks(model)})
        step_backward(model, rows, s, micro, before=lambda mask: now.update(real=mask.reshape(-1).bool()))
        for name, p in stacked.items():
            layer = int(name.split(".")[2])
            for e, leaf in enumerate(leaves[name]):
                leaf.grad = p.grad[e].clone() if e in hits[layer] else None
        opt.step()
        with torch.no_grad():
            for name, p in stacked.items():
                for e, leaf in enumerate(leaves[name]):
                    p[e].copy_(leaf)
        idle_per_step.append({i: set(range(len(leaves[next(iter(leaves))]))) - h for i, h in hits.items()})
    return model, idle_per_step


ROUTER_SCALE = 30.0  # routers far from uniform: no token's choice hangs on the last bits of its logits


def _setup(tmp_path, name):
    """A model whose routers decide clearly (a near tie between two experts' probabilities would
    let a rounding difference move a token, and with it which experts are idle), and the data."""
    spec = {**SPARSE[name], "output_router_logits": True, "router_aux_loss_coef": COEF}
    model = make_checkpoint(tmp_path / "made", layers=3, seed=11, **spec)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts"):
                layer.mlp.gate.weight.mul_(ROUTER_SCALE)
    model.save_pretrained(tmp_path / "model")
    rows = make_data(tmp_path / "data.jsonl", seed=12)
    return spec, rows


def _reference_model(tmp_path):
    return transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)


def _expert_slices(model):
    """{(parameter name, expert): its weights} of every stacked expert parameter."""
    return {(n, e): p[e].detach() for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] in STACKS
            for e in range(p.shape[0])}


@pytest.mark.parametrize("name", list(SPARSE))
def test_idle_experts_are_skipped_as_torch_adamw_skips_them(tmp_path, name):
    spec, rows = _setup(tmp_path, name)
    ref, idle = reference_skipping(_reference_model(tmp_path), rows, micro=2)
    run_flowtrain(tmp_path / "model", tmp_path / "data.jsonl", tmp_path / "out", "--skip-idle-experts",
                  "--metrics", str(tmp_path / "m.jsonl"))
    # the case is one that tests something: idle experts, and one idle in one step, used in another
    first, later = idle[0], idle[1:]
    assert any(first.values())
    assert any(e not in step[i] for i, es in first.items() for e in es for step in later)
    ours = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    theirs = dict(ref.named_parameters())
    for n, p in ours.named_parameters():
        r = theirs[n].detach()
        assert float((p.detach() - r).norm() / r.norm()) < 1e-4, n
    mine, want = _expert_slices(ours), _expert_slices(ref)
    for key, r in want.items():  # each expert on its own: one wrongly updated hides in a stack's norm
        assert float((mine[key] - r).norm() / r.norm()) < 1e-4, key
    fractions = [json.loads(line)["experts_unfetched"] for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert all(0 < f < 1 for f in fractions)


def test_experts_idle_all_run_stay_as_loaded_and_the_default_updates_them(tmp_path):
    """An expert no token reaches in any step is left bit for bit as loaded; without the flag it
    moves (weight decay, a zero gradient's Adam step), as transformers' stacked experts do."""
    spec, rows = _setup(tmp_path, "qwen3-moe")
    _, idle = reference_skipping(_reference_model(tmp_path), rows, micro=2)
    always = {(i, e) for i in idle[0] for e in set.intersection(*(step[i] for step in idle))}
    assert always
    start = _expert_slices(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model"))
    run_flowtrain(tmp_path / "model", tmp_path / "data.jsonl", tmp_path / "skip", "--skip-idle-experts")
    run_flowtrain(tmp_path / "model", tmp_path / "data.jsonl", tmp_path / "all")
    skip = _expert_slices(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "skip"))
    every = _expert_slices(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "all"))
    for (name, e), w in start.items():
        if (int(name.split(".")[2]), e) in always:
            assert torch.equal(skip[(name, e)], w), (name, e)
            assert not torch.equal(every[(name, e)], w), (name, e)
        else:
            assert not torch.equal(skip[(name, e)], w), (name, e)


def test_skipping_resumes_bit_identically_with_each_experts_step_count(tmp_path, capsys):
    from safetensors import safe_open

    _setup(tmp_path, "qwen3-moe")
    straight_and_resumed(tmp_path, skip_idle_experts=True)
    with safe_open(str(tmp_path / "a" / "checkpoint-4" / "optimizer-00002-of-00005.safetensors"), "pt") as f:
        steps, layer = f.get_tensor("expert_steps"), f.get_tensor("step")
    assert float(layer) == 4 and steps.shape == (32,) and float(steps.min()) < 4 and float(steps.max()) == 4
    # a run that updates every expert would continue them otherwise: refused, in one line
    capsys.readouterr()
    assert main(["train", "--resume", str(tmp_path / "a" / "checkpoint-2"), "--data", str(tmp_path / "data.jsonl"),
                 "--steps", "3", "--batch-size", str(ROWS), "--micro-batch-size", "2", "--seq-len", "12",
                 "--device", "cpu", "--precision", "fp32", "--no-progress"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "skip_idle_experts=True" in err[0] and "--skip-idle-experts" in err[0], err


@pytest.mark.parametrize("placement", [("--order", "micro"), ("--activations", "keep"),
                                       ("--activations", "offload", "--checkpoint-every", "3"),
                                       ("--layout", "full"), ("--layout", "stream-bf16"),
                                       ("--resident", "embed,head,layer.0,layer.1"),
                                       ("--resident", "layer.2", "--grad-clip", "1e6")])
def test_skipping_in_every_order_placement_and_layout(tmp_path, placement):
    """Micro-batch order (each micro-batch's backward fetch follows its own routing, the update
    every micro-batch's), kept forwards, a recompute segment over three layers (the rebuilt
    layers' fetches follow the routing too), the other host layouts, and sparse layers resident
    on the device (no fetch: their AdamW skips the idle experts where it runs, under the step's
    own found_inf, or after the clipping norm)."""
    spec, rows = _setup(tmp_path, "qwen3-moe")
    ref, _ = reference_skipping(_reference_model(tmp_path), rows, micro=2)
    run_flowtrain(tmp_path / "model", tmp_path / "data.jsonl", tmp_path / "out", "--skip-idle-experts", *placement)
    mine = _expert_slices(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out"))
    for key, r in _expert_slices(ref).items():
        assert float((mine[key] - r).norm() / r.norm()) < 1e-4, key


@pytest.mark.parametrize("resident", ["auto", "layer.2"])
def test_a_step_found_not_finite_leaves_each_experts_step_count(tmp_path, monkeypatch, resident):
    """Step 2's gradient of layer 0 is NaN, found after layer 2's Adam may have run: the step is
    undone, the experts' own step counts with it (as the checkpoints around it show); resident,
    layer 2's AdamW on the device skips it under the step's found_inf."""
    from safetensors import safe_open

    from flowtrain.train.run import TrainConfig, train

    _setup(tmp_path, "qwen3-moe")
    monkeypatch.setenv("FLOWTRAIN_INJECT_NAN", "step=1,where=layer.0")
    metrics = train(TrainConfig(model=str(tmp_path / "model"), data=str(tmp_path / "data.jsonl"), batch_size=ROWS,
                                micro_batch_size=2, seq_len=12, steps=3, device="cpu", precision="fp32",
                                progress=False, save_every=1, out=str(tmp_path / "out"), skip_idle_experts=True,
                                resident=resident))
    assert [m.skipped for m in metrics] == [False, True, False]

    def counts(step):
        with safe_open(str(tmp_path / "out" / f"checkpoint-{step}" / "optimizer-00004-of-00005.safetensors"),
                       "pt") as f:
            return float(f.get_tensor("step")), f.get_tensor("expert_steps")

    (l1, e1), (l3, e3) = counts(1), counts(3)  # a skipped step's checkpoint is written with the next
    assert (l1, l3) == (2 - 1, 3 - 1)
    # one update between the two for an expert the third step used, none for one it did not;
    # had the undone step counted, an expert used in steps two and three would be two ahead
    assert set((e3 - e1).tolist()) == {0.0, 1.0}


def test_refusals_end_in_one_line(tmp_path, capsys):
    """A dense model and LoRA are refused before anything trains."""
    _setup(tmp_path, "qwen3-moe")
    common = ["--data", str(tmp_path / "data.jsonl"), "--steps", "1", "--batch-size", "4", "--micro-batch-size", "2",
              "--seq-len", "12", "--device", "cpu", "--no-progress", "--skip-idle-experts"]
    cases = [(["--model", "tiny"], "no layer with experts"),
             (["--model", str(tmp_path / "model"), "--lora-rank", "4"], "LoRA leaves every expert frozen")]
    for extra, words in cases:
        capsys.readouterr()
        assert main(["train", *extra, *common]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err
    assert not (tmp_path / "out").exists()


def test_the_graph_command_draws_the_routing_edges(tmp_path):
    from flowtrain.graph.export import read_graph

    assert main(["graph", "--layers", "3", "--micro-batches", "2", "--skip-idle-experts", "0,2", "--out", str(tmp_path / "g.json")]) == 0
    g = read_graph(tmp_path / "g.json")
    routed = {(u.layer, u.micro_batch, v.phase) for u, v in g.edges if u.kind == "forward" and v.kind == "fetch"}
    assert routed == {(i, m, "backward") for i in (0, 2) for m in (0, 1)}


def test_the_trace_shows_what_routing_left_unfetched(tmp_path):
    """The run's trace as ``flowtrain viz`` reads it: a sparse layer's fetches before its backward
    depend on its forwards and copied only part of it (the page's tooltip says how much); the
    dense layer's and every forward fetch copied all of theirs."""
    from flowtrain.viz.analysis import partial_fetches
    from flowtrain.viz.load import load_input

    _setup(tmp_path, "qwen3-moe")
    run_flowtrain(tmp_path / "model", tmp_path / "data.jsonl", tmp_path / "out", "--skip-idle-experts",
                  "--trace", str(tmp_path / "trace.json"))
    trace = load_input(tmp_path / "trace.json")
    part = partial_fetches(trace)
    fetches = [t for t in trace.tasks if t.kind == "fetch" and t.unit == "layer"]
    assert {(t.layer, t.phase) for t in fetches if t.index in part} == {(0, "backward"), (2, "backward")}
    assert all(0 < part[t.index] < 1 for t in fetches if t.index in part)
    for t in fetches:
        forwards = {(trace.tasks[d].kind, trace.tasks[d].layer) for d in trace.dep_indices[t.index]}
        assert (("forward", t.layer) in forwards) == (t.layer != 1 and t.phase == "backward")
    assert main(["viz", str(tmp_path / "trace.json"), "--out", str(tmp_path / "page.html")]) == 0
    page = (tmp_path / "page.html").read_text()
    assert "stayed in host memory" in page and "trains every parameter; experts no token reached are not updated" in page


def test_bench_reports_the_unfetched_share_per_step(tmp_path):
    _setup(tmp_path, "qwen3-moe")
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "data.jsonl"), "--seq-len", "12",
                 "--batch-size", "4", "--micro-batch-size", "2", "--steps", "2", "--warmup", "1", "--device", "cpu",
                 "--skip-idle-experts", "--json", str(out)]) == 0
    shares = json.loads(out.read_text())["experts_unfetched"]
    assert len(shares) == 2 and all(0 < f < 1 for f in shares)
