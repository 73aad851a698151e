"""Runs torchtitan's own trainer on its Qwen3 mixture-of-experts model at flowtrain's
``qwen3-moe-12l`` shape (Qwen3-30B-A3B's layer, 12 layers) on one GPU, with random weights and
random tokens, and prints one JSON line of its speed, counted as flowtrain counts.

torchtitan is not part of this repository. Its release 0.2.2 (PyPI, BSD-3-Clause; released
2026-02-20 against the PyTorch nightly that became 2.11, the benchmark machine's) goes in
``.whl-base/`` with what it imports that the machine lacks (``bash docs/bench/baseline-wheels.sh``);
``docs/bench/h200.sh`` installs those wheels for the baseline runners. Then::

    python3 docs/bench/torchtitan_moe.py 4096 16 2 3       # SEQ BATCH MICRO STEPS

``BATCH`` sequences make one optimizer step, in micro-batches of ``MICRO`` (gradient
accumulation). Set ``TITAN_DTYPE=bfloat16`` for torchtitan's all-bf16 training (parameters,
gradients and AdamW state in bf16, no fp32 copy), ``TITAN_AC=full`` or ``none`` for another
activation checkpointing mode, ``TITAN_COMPILE=1`` for torch.compile of the model and the loss.

What runs is torchtitan's ``Trainer`` (``torchtitan/train.py``), driven by a TOML file written
from its own ``qwen3_moe_debug.toml`` (the one Qwen3 MoE training config it ships): AdamW (fused,
lr 3e-4, eps 1e-8, weight decay 0.1), gradient clipping to 1.0, selective activation
checkpointing by op, no torch.compile, a warm-up of the learning rate. On one GPU torchtitan
applies no FSDP: the parameters and AdamW state are fp32 and the forward runs under
``torch.autocast`` in bf16 (its "single-device training" branch); the experts run through its
grouped-GEMM path (``torch._grouped_mm`` over tokens padded per expert by its Triton kernel),
routing is its token-choice top-8 softmax router with normalised weights and its auxiliary-loss-free
load balancing. Why the trainer and not a loop of our own: every one of those choices is the
trainer's, and its step (micro-batches, clipping, optimizer, scheduler) is what a torchtitan user
runs. Two things are supplied from here through torchtitan's own extension point, a registered
``TrainSpec``: the model flavour (torchtitan's ``30B-A3B`` arguments with 12 layers instead of 48)
and the data loader (torchtitan's ``ParallelAwareDataloader`` over random token ids, since the
machine has no data set and no tokenizer; the SDPA attention needs none).

fp32 master weights and AdamW state take 16 bytes a parameter: 121 GiB for this 8.1 B-parameter
model before activations, so the default run fits an H200 only, if at all; ``TITAN_DTYPE=bfloat16``
halves that (and is not the same precision as flowtrain's fp32 master weights: the JSON says
which ran).

The speed is the mean over the steps after the first, each step timed around torchtitan's
``train_step`` (which synchronises: it reads the loss and the gradient norm); torchtitan's own
logged tokens/s and TFLOP/s for those steps are in the JSON too (``titan_tps``,
``titan_tflops``: its own FLOP count, not this page's). Model FLOPs per token are flowtrain's
(``flowtrain.model.counts.model_flops_per_token``: 6 x the weights a token multiplies by, the top-8
experts' only, no input embedding, + 6 x layers x heads x head_dim x sequence).

``TITAN_TINY=1`` runs torchtitan's ``debugmodel_moe`` flavour (width 256, 64 experts) with 2
layers at sequence 128 for a check: on a machine without a GPU it builds that model with torchtitan's
arguments, initialises it, runs one forward, backward and AdamW step on the CPU (through the
experts' for-loop path, as the grouped GEMM needs a GPU) and parses the trainer's config, then
prints a failed line saying that the trainer needs a GPU. Out of GPU memory prints a line with
``"failed": true`` and exits 3 (``h200.sh`` then tries the next setting).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
import tempfile
import time

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch

import json_line  # docs/bench/json_line.py, beside this script

T0 = time.perf_counter()
TINY = os.environ.get("TITAN_TINY") == "1"
DTYPE = os.environ.get("TITAN_DTYPE", "float32")
AC = os.environ.get("TITAN_AC", "selective")
COMPILE = os.environ.get("TITAN_COMPILE") == "1"
SHAPE = "qwen3-moe-12l"
SPEC = "qwen3_flowtrain_bench"
FLAVOR = "tiny" if TINY else "12L"


def say(what: str) -> None:
    """A timestamped phase line on stderr."""
    print(f"[{time.perf_counter() - T0:7.1f} s] {what}", file=sys.stderr, flush=True)


def job_name(seq: int) -> str:
    return f"torchtitan-{'tiny' if TINY else SHAPE}-{seq}"


def model_args(seq: int):
    """torchtitan's own Qwen3-30B-A3B arguments with 12 layers (or its debug MoE flavour), checked
    against flowtrain's preset so both run one shape."""
    from torchtitan.models.qwen3 import qwen3_args

    if TINY:
        return dataclasses.replace(qwen3_args["debugmodel_moe"], n_layers=2, max_seq_len=seq)
    args = dataclasses.replace(qwen3_args["30B-A3B"], n_layers=12, max_seq_len=seq)
    cfg = flowtrain_config(args)
    from flowtrain.model.presets import preset

    ref = preset(SHAPE)
    keys = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "num_experts",
            "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "tie_word_embeddings")
    diff = {k: (getattr(cfg, k), getattr(ref, k)) for k in keys if getattr(cfg, k) != getattr(ref, k)}
    if diff:
        raise SystemExit(f"torchtitan's arguments differ from {SHAPE}'s: {diff}")
    return args


def flowtrain_config(args):
    """flowtrain's ModelConfig of torchtitan's model arguments: the FLOP count's input."""
    from flowtrain.model.config import ModelConfig

    moe = args.moe_args
    return ModelConfig(vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.hidden_dim,
                       num_layers=args.n_layers, num_heads=args.n_heads, num_kv_heads=args.n_kv_heads,
                       head_dim=args.head_dim, rms_norm_eps=args.norm_eps, rope_theta=float(args.rope_theta),
                       max_position_embeddings=args.max_seq_len, tie_word_embeddings=args.enable_weight_tying,
                       architecture="Qwen3MoeForCausalLM", num_experts=moe.num_experts,
                       num_experts_per_tok=moe.top_k, moe_intermediate_size=args.moe_inter_dim,
                       norm_topk_prob=moe.route_norm)


def flops_per_token(args, seq: int) -> float:
    from flowtrain.model.counts import model_flops_per_token

    return model_flops_per_token(flowtrain_config(args), seq)


def random_loader(seq: int, vocab: int):
    """The data loader builder of the train spec: torchtitan's ParallelAwareDataloader over an
    endless stream of random sequences, each ``({"input": ids[:-1]}, ids[1:])`` as its text data
    sets yield them."""
    from torch.utils.data import IterableDataset
    from torchtitan.components.dataloader import ParallelAwareDataloader

    class RandomTokens(IterableDataset):
        def __iter__(self):
            gen = torch.Generator().manual_seed(1)
            while True:
                ids = torch.randint(0, vocab, (seq + 1,), generator=gen)
                yield {"input": ids[:-1]}, ids[1:]

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    def build(dp_world_size: int, dp_rank: int, tokenizer, job_config, **kwargs):
        return ParallelAwareDataloader(RandomTokens(), dp_rank=dp_rank, dp_world_size=dp_world_size,
                                       batch_size=job_config.training.local_batch_size)

    return build


def register(seq: int):
    """torchtitan's qwen3 train spec with one more flavour and the random data loader."""
    from torchtitan.models import qwen3
    from torchtitan.protocols.train_spec import register_train_spec

    args = model_args(seq)
    base = qwen3.get_train_spec()
    spec = dataclasses.replace(base, model_args={FLAVOR: args}, build_dataloader_fn=random_loader(seq, args.vocab_size),
                               build_tokenizer_fn=None, build_validator_fn=None)
    register_train_spec(SPEC, spec)
    return args


def toml_text(seq: int, batch: int, micro: int, steps: int, out: str) -> str:
    """torchtitan's qwen3_moe_debug.toml with this run's model, batch and steps."""
    return f"""[job]
dump_folder = "{out}"
description = "Qwen3 MoE {FLAVOR} beside flowtrain"

[metrics]
log_freq = 1
enable_tensorboard = false

[model]
name = "{SPEC}"
flavor = "{FLAVOR}"
hf_assets_path = "{out}"

[optimizer]
name = "AdamW"
lr = 3e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = {min(2, steps)}

[training]
local_batch_size = {micro}
global_batch_size = {batch}
seq_len = {seq}
max_norm = 1.0
steps = {steps}
dtype = "{DTYPE}"
mixed_precision_param = "bfloat16"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 1
expert_parallel_degree = 1
expert_tensor_parallel_degree = 1

[checkpoint]
enable = false

[activation_checkpoint]
mode = "{AC}"
selective_ac_option = "op"

[compile]
enable = {"true" if COMPILE else "false"}
components = ["model", "loss"]
"""


def job_config(seq: int, batch: int, micro: int, steps: int):
    from torchtitan.config import ConfigManager

    out = tempfile.mkdtemp(prefix="titan-")
    path = os.path.join(out, "run.toml")
    with open(path, "w") as f:
        f.write(toml_text(seq, batch, micro, steps, out))
    return ConfigManager().parse_args(["--job.config_file", path])


def cpu_check(args, seq: int) -> dict:
    """What runs without a GPU: the model built with torchtitan's arguments and initialised as the
    trainer does it, one forward, backward and AdamW step (the experts' for-loop path)."""
    from torchtitan.components.loss import cross_entropy_loss

    args = dataclasses.replace(args, moe_args=dataclasses.replace(args.moe_args, use_grouped_mm=False))
    from torchtitan.models.qwen3 import Qwen3Model

    with torch.device("meta"):
        model = Qwen3Model(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    n = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, args.vocab_size, (2, seq + 1))
    histc = torch.histc  # the router counts tokens per expert with histc, which the CPU has for floats only
    torch.histc = lambda x, *a, **k: histc(x.float(), *a, **k).to(x.dtype)
    try:
        loss = cross_entropy_loss(model(ids[:, :-1]), ids[:, 1:]) / ids[:, 1:].numel()
        loss.backward()
    finally:
        torch.histc = histc
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, eps=1e-8, weight_decay=0.1)
    opt.step()
    return {"cpu_params": n, "cpu_loss": round(float(loss.detach()), 4)}


def run(seq: int, batch: int, micro: int, steps: int) -> dict:
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    import torchtitan
    from torchtitan.train import Trainer

    say(f"torchtitan {torchtitan.__version__} imported; registering {FLAVOR}")
    args = register(seq)
    config = job_config(seq, batch, micro, steps)
    head = {"job": job_name(seq), "system": "torchtitan", "version": torchtitan.__version__, "shape": FLAVOR if TINY else SHAPE,
            "seq_len": seq, "batch_size": batch, "micro_batch_size": micro, "steps": steps, "training_dtype": DTYPE,
            "activation_checkpoint": AC, "compile": COMPILE}
    if not torch.cuda.is_available():
        check = cpu_check(args, seq)
        say(f"CPU check: {check}")
        return {**head, **check, "failed": True,
                "error": "no GPU: torchtitan's Trainer needs one (its config parsed, its model built and stepped on the CPU)"}
    state = flowtrain_config(args).num_parameters() * (16 if DTYPE == "float32" else 8)
    card = torch.cuda.get_device_properties(0).total_memory
    if state > card:  # parameters, gradients and AdamW's two moments: no micro-batch makes it fit
        raise torch.OutOfMemoryError(f"{state / 2**30:.1f} GiB of {DTYPE} parameters, gradients and AdamW state "
                                     f"exceed the card's {card / 2**30:.1f} GiB")
    say("building torchtitan's Trainer")
    trainer = Trainer(config)
    setup_s = time.perf_counter() - T0
    logged: dict[int, dict] = {}
    inner_log = trainer.metrics_processor.logger.log
    trainer.metrics_processor.logger.log = lambda metrics, step: (logged.__setitem__(step, dict(metrics)),
                                                                  inner_log(metrics, step))[1]
    times: list[float] = []
    inner_step = trainer.train_step

    def timed_step(data_iterator):
        torch.cuda.synchronize()
        t = time.perf_counter()
        inner_step(data_iterator)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        say(f"step {len(times)}: {times[-1]:.2f} s")

    trainer.train_step = timed_step
    say(f"trainer ready; {trainer.gradient_accumulation_steps} micro-batches a step")
    try:
        trainer.train()
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    tok_s = json_line.steady_tokens_per_s(times, batch * seq)
    later = [logged[s] for s in sorted(logged) if s > 1] or list(logged.values())
    mean = lambda key: round(sum(m.get(key, 0.0) for m in later) / max(len(later), 1), 1)  # noqa: E731
    return {**head, "step_s": [round(t, 3) for t in times],
            "losses": [round(logged[s].get("loss_metrics/global_avg_loss", float("nan")), 4) for s in sorted(logged)],
            "tokens_per_s": round(tok_s, 1), "model_tflops": round(tok_s * flops_per_token(args, seq) / 1e12, 1),
            "titan_tps": mean("throughput(tps)"), "titan_tflops": mean("tflops"), "setup_s": round(setup_s, 1),
            **json_line.gpu_fields()}


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    default = ["128", "4", "2", "2"] if TINY else ["4096", "16", "2", "3"]
    seq, batch, micro, steps = (int(a) for a in (sys.argv[1:] + default[len(sys.argv) - 1:])[:4])
    fail = {"job": job_name(seq), "system": "torchtitan", "seq_len": seq, "batch_size": batch,
            "micro_batch_size": micro, "training_dtype": DTYPE, "activation_checkpoint": AC, "failed": True}
    return json_line.report(fail, lambda: run(seq, batch, micro, steps), "torchtitan")


if __name__ == "__main__":
    sys.exit(main())
