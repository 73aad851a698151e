"""Mixtures of experts train like transformers + torch.optim.AdamW, fp32 on the CPU, with the
load-balancing loss (``output_router_logits``) included.

Three steps of ``flowtrain train`` on tiny Qwen3-MoE (one layer without experts through
``mlp_only_layers``, renormalised and raw top-k weights) and Mixtral models, tied and untied,
against the same model in transformers trained on the same rows. transformers computes the
load-balancing loss per forward call over all its layers' router logits at once, padding
excluded by ``attention_mask``; with two micro-batches per step the reference adds each
micro-batch's ``aux_loss`` divided by two (flowtrain's definition for gradient accumulation:
:mod:`flowtrain.train.load_balance`), and with one micro-batch per step flowtrain's loss is
transformers' ``outputs.loss`` itself.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from test_train_vs_hf import ROWS, SEQ, STEPS, assert_same_weights, make_checkpoint, make_data, run_flowtrain

MOE = {
    "qwen3-moe-dense-layer": dict(model_type="qwen3_moe", head_dim=8, num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=16, norm_topk_prob=True, mlp_only_layers=[1]),
    "qwen3-moe-raw-topk-tied": dict(model_type="qwen3_moe", head_dim=8, num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=16, norm_topk_prob=False, tied=True),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "mixtral-tied": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, tied=True),
}
COEF = 0.5  # large, so that the load-balancing gradient moves the routers measurably


def _batch(rows, s):
    ids = torch.zeros(ROWS, SEQ, dtype=torch.long)
    labels = torch.full((ROWS, SEQ), -100, dtype=torch.long)
    mask = torch.zeros(ROWS, SEQ, dtype=torch.long)
    for i, r in enumerate(rows[s * ROWS:(s + 1) * ROWS]):
        r = r[:SEQ]
        ids[i, :len(r)] = torch.tensor(r)
        labels[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    return ids, labels, mask


def step_backward(model, rows, s, micro, before=None):
    """Step ``s``'s gradients: per micro-batch, CE (summed, over the step's target count) plus
    coef * aux_loss / micro-batch count, each backward on its own; ``before(mask)`` is told each
    micro-batch's attention mask first. Returns the step's loss."""
    ids, labels, mask = _batch(rows, s)
    targets = torch.cat([labels[:, 1:], torch.full((ROWS, 1), -100)], dim=1)
    n = int((targets != -100).sum())
    total = 0.0
    for m in range(0, ROWS, micro):
        if before is not None:
            before(mask[m:m + micro])
        out = model(input_ids=ids[m:m + micro], attention_mask=mask[m:m + micro], labels=labels[m:m + micro])
        ce = F.cross_entropy(out.logits.flatten(0, 1), targets[m:m + micro].flatten(), reduction="sum",
                             ignore_index=-100) / n
        loss = ce + model.config.router_aux_loss_coef * out.aux_loss * micro / ROWS
        if micro == ROWS:  # one forward per step: transformers' own loss is the step's
            torch.testing.assert_close(loss, out.loss, rtol=1e-6, atol=0)
        loss.backward()
        total += float(loss.detach())
    return total


def reference_train(model, rows, micro):
    """AdamW on CE (mean over the step's targets) plus coef * aux_loss per micro-batch / count."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-6)
    losses = []
    for s in range(STEPS):
        opt.zero_grad()
        losses.append(step_backward(model, rows, s, micro))
        opt.step()
    return model, losses


def _train_both(tmp_path, name, micro, *extra):
    spec = {**MOE[name], "output_router_logits": True, "router_aux_loss_coef": COEF}
    make_checkpoint(tmp_path / "model", layers=3, seed=11, **spec)
    rows = make_data(tmp_path / "data.jsonl", seed=12)
    ref, losses = reference_train(make_checkpoint(tmp_path / "ref", layers=3, seed=11, **spec), rows, micro)
    run_flowtrain(tmp_path / "model", tmp_path / "data.jsonl", tmp_path / "out", "--micro-batch-size", str(micro),
                  "--metrics", str(tmp_path / "m.jsonl"), *extra)
    ours = [json.loads(line)["loss"] for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    return ref, losses, ours


@pytest.mark.parametrize("name", list(MOE))
def test_moe_matches_hf_adamw_with_load_balancing(tmp_path, name):
    ref, losses, ours = _train_both(tmp_path, name, micro=2)
    assert_same_weights(tmp_path / "out", ref)
    assert ours == pytest.approx(losses, rel=1e-5)


@pytest.mark.parametrize("activations", [("--activations", "keep"), ("--activations", "attention"),
                                       ("--activations", "offload", "--checkpoint-every", "2", "--order", "micro"),
                                       ("--compile", "aot_eager", "--activations", "keep")])
def test_moe_kept_saved_and_offloaded_activations_match_hf(tmp_path, activations):
    """Kept forwards (the load-balancing term from the kept graph), saved attention outputs,
    offloaded checkpoints with recompute (whose forward re-runs must not count twice), and the
    layer through torch.compile (the router tap and the expert loop run outside the graph)."""
    ref, losses, ours = _train_both(tmp_path, "qwen3-moe-dense-layer", 2, *activations)
    assert_same_weights(tmp_path / "out", ref)
    assert ours == pytest.approx(losses, rel=1e-5)


def test_one_micro_batch_loss_is_transformers_outputs_loss(tmp_path):
    """With the whole step in one forward the reference asserts its loss is ``outputs.loss``."""
    ref, losses, ours = _train_both(tmp_path, "qwen3-moe-dense-layer", micro=ROWS)
    assert_same_weights(tmp_path / "out", ref)
    assert ours == pytest.approx(losses, rel=1e-5)


def test_the_load_balancing_loss_matters(tmp_path):
    """Guards the parity above: the reference trained without the load-balancing loss ends
    measurably elsewhere, in the routers above all."""
    spec = {**MOE["mixtral"], "output_router_logits": True, "router_aux_loss_coef": COEF}
    rows = make_data(tmp_path / "data.jsonl", seed=12)
    with_aux, _ = reference_train(make_checkpoint(tmp_path / "a", layers=3, seed=11, **spec), rows, 2)
    without, _ = reference_train(make_checkpoint(tmp_path / "b", layers=3, seed=11,
                                                 **{**spec, "router_aux_loss_coef": 0.0}), rows, 2)
    a, b = with_aux.model.layers[0].mlp.gate.weight.detach(), without.model.layers[0].mlp.gate.weight.detach()
    assert float((a - b).norm() / b.norm()) > 1e-3


def test_moe_resume_is_bit_identical(tmp_path):
    """Four steps straight, and two steps, a checkpoint, then two more from it: the same files
    (the checkpoint's per-expert tensors and Adam state read back exactly)."""
    from safetensors.torch import load_file

    spec = {**MOE["qwen3-moe-dense-layer"], "output_router_logits": True, "router_aux_loss_coef": COEF}
    make_checkpoint(tmp_path / "model", layers=3, seed=11, **spec)
    make_data(tmp_path / "data.jsonl", seed=12)
    straight_and_resumed(tmp_path)
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in load_file(tmp_path / "a" / "model.safetensors")


def straight_and_resumed(tmp_path, **settings):
    """Four steps of tmp_path/model on tmp_path/data.jsonl into tmp_path/a; two, a checkpoint,
    and two more from it into tmp_path/b; every file of the two the same, bit for bit."""
    from safetensors.torch import load_file

    from flowtrain.train.run import TrainConfig, train

    base = dict(model=str(tmp_path / "model"), data=str(tmp_path / "data.jsonl"), batch_size=ROWS, micro_batch_size=2,
                seq_len=SEQ, steps=4, device="cpu", precision="fp32", progress=False, save_every=2, **settings)

    class Stop(Exception):
        pass

    def stop_after_two(m):
        if m.step == 2:
            raise Stop

    train(TrainConfig(**base, out=str(tmp_path / "a")))
    with pytest.raises(Stop):
        train(TrainConfig(**base, out=str(tmp_path / "b")), on_step=stop_after_two)
    train(TrainConfig(**base, out=str(tmp_path / "b"), resume=str(tmp_path / "b")))
    for sub in ("checkpoint-4", "."):
        files = sorted((tmp_path / "a" / sub).glob("*.safetensors"))
        assert files
        for f in files:
            a, b = load_file(f), load_file(tmp_path / "b" / sub / f.name)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f.name


# ---- the generic layer path: transformers' own modules, its load-balancing loss ---------------


@pytest.mark.parametrize("name, extra", [("mixtral", ()), ("qwen3-moe-raw-topk-tied", ()), ("qwen3-moe-dense-layer", ()),
                                         ("qwen3-moe-dense-layer", ("--activations", "keep"))])
def test_generic_path_matches_hf_adamw_with_load_balancing(tmp_path, name, extra):
    """Families with native layer math forced onto the generic path: the routers' logits come
    from transformers' router modules, the load-balancing loss is the native path's. Mixtral's
    checkpoint names its experts' block ``block_sparse_moe``, which transformers renames ``mlp``
    on loading: read under the stored names."""
    ref, losses, ours = _train_both(tmp_path, name, 2, "--layer-path", "generic", *extra)
    assert_same_weights(tmp_path / "out", ref)
    assert ours == pytest.approx(losses, rel=1e-5)


@pytest.mark.parametrize("arch", ["Qwen3NextForCausalLM", "GptOssForCausalLM"])
def test_generic_families_train_with_their_load_balancing_loss(tmp_path, arch):
    """Families without native layer math whose config asks for the loss: trained as
    transformers + AdamW with coef * aux_loss per micro-batch (over their number)."""
    from generic_models import make_family

    spec = dict(output_router_logits=True, router_aux_loss_coef=COEF)
    make_family(tmp_path / "model", arch, seed=3, **spec)
    rows = make_data(tmp_path / "data.jsonl", vocab=64, seed=12)
    ref, losses = reference_train(make_family(None, arch, seed=3, **spec), rows, 2)
    run_flowtrain(tmp_path / "model", tmp_path / "data.jsonl", tmp_path / "out", "--metrics", str(tmp_path / "m.jsonl"))
    assert_same_weights(tmp_path / "out", ref)
    ours = [json.loads(line)["loss"] for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert ours == pytest.approx(losses, rel=1e-5)
