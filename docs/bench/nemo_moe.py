"""Runs NeMo AutoModel's Qwen3 mixture-of-experts model at flowtrain's ``qwen3-moe-12l`` shape
(Qwen3-30B-A3B's layer, 12 layers) on one GPU, with random weights and random tokens, and prints
one JSON line of its speed, counted as flowtrain counts.

NeMo AutoModel is not part of this repository. Its release 0.7.0 (PyPI, Apache-2.0) goes in
``.whl-base/`` with what its model code imports that the benchmark machine lacks (``bash
docs/bench/baseline-wheels.sh``); ``docs/bench/h200.sh`` installs those wheels for the baseline
runners. Then::

    python3 docs/bench/nemo_moe.py 4096 16 2 3       # SEQ BATCH MICRO STEPS

``BATCH`` sequences make one optimizer step, in micro-batches of ``MICRO`` (gradient
accumulation). ``NEMO_AC=selective`` or ``none`` picks another activation checkpointing mode
than its Qwen3-30B-A3B configs' (whole decoder blocks, the router's choice saved);
``NEMO_COMPILE=1`` compiles each decoder block with torch.compile.

What is NeMo AutoModel's: the model (``nemo_automodel.components.models.qwen3_moe``: its attention,
its MoE layer with the top-8 softmax router and normalised weights, the experts' grouped GEMM
``torch._grouped_mm``, its ``experts: torch_mm`` backend), its activation checkpointing
(``moe.parallelizer.apply_ac``), its weight initialisation (``initialize_weights``) and its loss
(``loss.masked_ce.MaskedCrossEntropy``, summed and divided by the step's token count, as its
fine-tuning recipe does). The settings are those of its Qwen3-30B-A3B fine-tuning config
(``qwen3_moe_30b_hellaswag.yaml``): parameters in bf16 (its ``torch_dtype: bfloat16``; AdamW's
moments then bf16 too), torch's AdamW (lr 1e-3, betas 0.9 and 0.95, eps 1e-8, weight decay 0.01;
fused), gradient clipping to 1.0 (its recipe's default), ``rms_norm: torch_fp32``, expert GEMMs
``torch_mm``. Two of that config's choices cannot run here and are replaced: ``attn: te``
(Transformer Engine's attention) by ``sdpa``, and ``dispatcher: deepep`` (DeepEP, expert
parallelism across GPUs) by ``torch`` (one GPU has no peer to dispatch to). Transformer Engine's
CUDA 13 core is a 276 MB wheel and its PyTorch extension is published as source only, built
against the installed torch; DeepEP is not on PyPI. What is this script's: the loop that runs the
micro-batches, clipping and the optimizer (NeMo's recipe adds data loading, logging and
checkpoints around the same calls), random token ids, and the model config, taken from
flowtrain's preset so that both run one shape.

fp32 parameters would take 16 bytes a parameter with their gradients and moments (121 GiB for
this 8.1 B-parameter model); NeMo's bf16 takes 8 (60 GiB), which fits an 80 GB card with room for
activations, and is not the same precision as flowtrain's fp32 master weights and moments.

The speed is the mean over the steps after the first, each timed between two synchronisations.
Model FLOPs per token are flowtrain's (``flowtrain.model.counts.model_flops_per_token``: 6 x the
weights a token multiplies by, the top-8 experts' only, no input embedding, + 6 x layers x heads
x head_dim x sequence).

``NEMO_TINY=1`` runs a 2-layer model of width 128 with 8 experts at sequence 128 for a check; on a
machine without a GPU it builds NeMo's model on the CPU (its constructor asks for a CUDA device
index, answered 0 there), runs the step and prints a failed line saying that the speed needs a
GPU. Out of GPU memory prints a line with ``"failed": true`` and exits 3 (``h200.sh`` then tries
the next setting).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch

import json_line  # docs/bench/json_line.py, beside this script

T0 = time.perf_counter()
TINY = os.environ.get("NEMO_TINY") == "1"
AC = os.environ.get("NEMO_AC", "full")
COMPILE = os.environ.get("NEMO_COMPILE") == "1"
SHAPE = "qwen3-moe-12l"
#: NeMo AutoModel's Qwen3-30B-A3B fine-tuning config: optimizer and clipping
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
MAX_NORM = 1.0


def say(what: str) -> None:
    """A timestamped phase line on stderr."""
    print(f"[{time.perf_counter() - T0:7.1f} s] {what}", file=sys.stderr, flush=True)


def job_name(seq: int) -> str:
    return f"nemo-{'tiny' if TINY else SHAPE}-{seq}"


def flowtrain_config():
    """flowtrain's ModelConfig of the shape (tiny: 2 layers, width 128, 8 experts of 64)."""
    import msgspec

    from flowtrain.model.presets import preset

    cfg = preset(SHAPE)
    if TINY:
        cfg = msgspec.structs.replace(cfg, vocab_size=1000, hidden_size=128, intermediate_size=256, num_layers=2,
                                  num_heads=4, num_kv_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                                  moe_intermediate_size=64)
    return cfg


def hf_config(cfg, seq: int):
    """transformers' Qwen3MoeConfig of flowtrain's config, the one NeMo's model class takes."""
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig

    from flowtrain.model.hf_config import to_hf

    d = to_hf(cfg)
    d.pop("architectures", None)
    d.pop("model_type", None)
    d.update(max_position_embeddings=max(seq, d.get("max_position_embeddings", 0)), use_cache=False)
    return Qwen3MoeConfig(**d)


def build(cfg, seq: int, device: torch.device):
    """NeMo's model with its 30B config's backends (attention: SDPA for Transformer Engine),
    built on the meta device, placed on ``device`` and initialised in bf16 by NeMo's own code,
    then wrapped by NeMo's activation checkpointing."""
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.qwen3_moe.model import Qwen3MoeForCausalLM
    from nemo_automodel.components.moe.parallelizer import apply_ac

    backend = BackendConfig(attn="sdpa", linear="torch", rms_norm="torch_fp32", experts="torch_mm",
                            dispatcher="torch", rope_fusion=False, fake_balanced_gate=False,
                            enable_hf_state_dict_adapter=False)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(hf_config(cfg, seq), backend=backend)
    model.to_empty(device=device)
    model.initialize_weights(buffer_device=device, dtype=torch.bfloat16)
    if AC != "none":
        apply_ac(model, selective=AC == "selective")
    if COMPILE:
        for block in model.model.layers.values():
            block.compile()
    return model


def train_step(model, opt, loss_fn, batches: list[torch.Tensor]) -> tuple[float, float]:
    """One optimizer step over the micro-batches: the loss summed over every token and divided by
    the step's token count (its recipe's normalisation), clipping, AdamW. (loss, grad norm)."""
    tokens = sum(b[:, 1:].numel() for b in batches)
    total = 0.0
    for ids in batches:
        out = model(ids[:, :-1].contiguous())
        logits = out.logits if hasattr(out, "logits") else out
        loss = loss_fn(logits, ids[:, 1:].contiguous(), num_label_tokens=tokens)
        loss.backward()
        total += float(loss.detach())
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total, float(norm)


def run(seq: int, batch: int, micro: int, steps: int) -> dict:
    import nemo_automodel
    from nemo_automodel.components.loss.masked_ce import MaskedCrossEntropy

    from flowtrain.model.counts import model_flops_per_token

    cuda = torch.cuda.is_available()
    if not cuda:  # NeMo's model asks for the current CUDA device when it is built
        torch.cuda.current_device = lambda: 0
    device = torch.device("cuda" if cuda else "cpu")
    cfg = flowtrain_config()
    version = getattr(nemo_automodel, "__version__", "?")
    head = {"job": job_name(seq), "system": "nemo-automodel", "version": version, "shape": "tiny" if TINY else SHAPE,
            "seq_len": seq, "batch_size": batch, "micro_batch_size": micro, "steps": steps, "training_dtype": "bfloat16",
            "activation_checkpoint": AC, "compile": COMPILE, "experts": "torch_mm", "attention": "sdpa"}
    if cuda:
        need = cfg.num_parameters() * 8  # bf16 parameters, gradients and AdamW's two moments
        card = torch.cuda.get_device_properties(0).total_memory
        if need > card:
            raise torch.OutOfMemoryError(f"{need / 2**30:.1f} GiB of bf16 parameters, gradients and AdamW state "
                                         f"exceed the card's {card / 2**30:.1f} GiB")
    say(f"nemo_automodel {version} imported; building {head['shape']} in bf16 on {device}")
    model = build(cfg, seq, device)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW, fused=cuda)
    loss_fn = MaskedCrossEntropy()
    gen = torch.Generator().manual_seed(1)
    setup_s = time.perf_counter() - T0
    say(f"model ready ({sum(p.numel() for p in model.parameters()):,} parameters); {batch // micro} micro-batches a step")
    times, losses, norms = [], [], []
    for _ in range(steps):
        batches = [torch.randint(0, cfg.vocab_size, (micro, seq + 1), generator=gen).to(device)
                   for _ in range(batch // micro)]
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        loss, norm = train_step(model, opt, loss_fn, batches)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        losses.append(round(loss, 4))
        norms.append(round(norm, 4))
        say(f"step {len(times)}: {times[-1]:.2f} s, loss {loss:.4f}, grad norm {norm:.3f}")
    if not cuda:
        return {**head, "cpu_losses": losses, "failed": True,
                "error": "no GPU: the speed needs one (NeMo's model built and stepped on the CPU)"}
    tok_s = json_line.steady_tokens_per_s(times, batch * seq)
    return {**head, "step_s": [round(t, 3) for t in times], "losses": losses, "grad_norms": norms,
            "tokens_per_s": round(tok_s, 1), "model_tflops": round(tok_s * model_flops_per_token(cfg, seq) / 1e12, 1),
            "setup_s": round(setup_s, 1), **json_line.gpu_fields()}


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    default = ["128", "4", "2", "2"] if TINY else ["4096", "16", "2", "3"]
    seq, batch, micro, steps = (int(a) for a in (sys.argv[1:] + default[len(sys.argv) - 1:])[:4])
    fail = {"job": job_name(seq), "system": "nemo-automodel", "seq_len": seq, "batch_size": batch,
            "micro_batch_size": micro, "activation_checkpoint": AC, "failed": True}
    if batch % micro:
        print(json.dumps({**fail, "error": f"batch {batch} is not a multiple of micro-batch {micro}"}), flush=True)
        return 1
    return json_line.report(fail, lambda: run(seq, batch, micro, steps), "NeMo AutoModel")


if __name__ == "__main__":
    sys.exit(main())
