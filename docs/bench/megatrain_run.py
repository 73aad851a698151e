"""Runs MegaTrain, the streamed single-GPU trainer flowtrain follows, on one shape with random
weights and random tokens, and prints one JSON line of its speed, counted as flowtrain counts.

MegaTrain is not part of this repository. Put its public code (github.com/DLYuanGod/MegaTrain,
Apache-2.0) in ``.megatrain/`` beside the checkout (``git clone ... .megatrain`` and
``echo '/.megatrain/' >> .git/info/exclude``); DeepSpeed's wheel in ``.whl/`` gives it DeepSpeed's
CPU Adam, which its own training script uses (``prepare-wheels.sh --deepspeed``). Then::

    python3 docs/bench/megatrain_run.py qwen2.5-7b 1024 158 3     # SHAPE SEQ BATCH STEPS

What it runs is MegaTrain's own training step, as its ``examples/sft/train.py`` does it:
``CPUMasterModel(model, config)``, ``forward_and_backward`` over the whole batch, gradient clipping
to 1.0, ``DeepSpeedCPUAdam.step`` (AdamW mode) over ``get_parameters()``, then
``_sync_params_to_gpu`` and ``zero_grad``. The model is transformers' model of the shape's config
in bf16 (MegaTrain loads it so: its trained weights are bf16, the Adam moments fp32), random weights
from one pool (:func:`random_model`: transformers' own initialisation takes minutes on the CPU), with
PyTorch's scaled-dot-product attention, causal (its configs ask for flash-attn 2, which the
benchmark machine lacks; its step hands each layer the batch's 2-D padding mask, which flash-attn 2
takes and transformers' SDPA path refuses, so :func:`register_causal_sdpa` drops that mask, all
ones here, and lets SDPA pick its flash kernel). Model FLOPs per token follow docs/benchmarks.md ("Model FLOPs"): 6 x the weights a
token multiplies by (no input embedding) + 6 x layers x heads x head_dim x sequence. MegaTrain's
own log counts 6 x every parameter, the embedding included, and no attention.

MegaTrain's loss takes flash-attn's cross-entropy where flash-attn is installed (its configs' case:
they ask for flash-attn 2), a Triton kernel whose backward writes the logits' gradient over the
logits, and PyTorch's otherwise, which holds a second chunk of logits (158 sequences x 128 positions
x 152,064 bf16 logits is 5.7 GiB). flash-attn publishes only its source (its CUDA extension builds
for hours), but that cross-entropy is pure Python and Triton: where ``.whl-base/`` holds flash-attn's
source archive (``docs/bench/baseline-wheels.sh`` fetches it), :func:`flash_cross_entropy` unpacks
just its loss and kernel into a temporary folder and puts that first on the path, so MegaTrain
imports it as it would from flash-attn (``MT_FLASH_CE=0`` keeps PyTorch's); the result line's
``cross_entropy`` says which ran.

A batch that runs out of GPU memory prints a JSON line with ``"failed": true`` and exits 3 (the
benchmark script then tries a smaller one). The first step is a warm-up; the speed is over the
steps after it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
sys.path.insert(0, os.path.join(os.getcwd(), ".megatrain"))

import torch

#: (family, hidden, layers, heads, kv heads, ffn, vocab, tied) of each shape, from its config.json
SHAPES = {
    "qwen2.5-7b": ("qwen2", 3584, 28, 28, 4, 18944, 152064, False),
    "llama-3.1-8b": ("llama", 4096, 32, 32, 8, 14336, 128256, False),
}


def say(what: str, since: float) -> None:
    """A timestamped phase line on stderr: where the set-up's minutes go."""
    print(f"[{time.perf_counter() - since:7.1f} s] {what}", file=sys.stderr, flush=True)


def hf_config(shape: str):
    from transformers import LlamaConfig, Qwen2Config

    family, h, layers, heads, kv, ffn, vocab, tied = SHAPES[shape]
    cls = Qwen2Config if family == "qwen2" else LlamaConfig
    extra = {"rope_theta": 1e6, "rms_norm_eps": 1e-6} if family == "qwen2" else {"rope_theta": 5e5}
    return cls(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
               intermediate_size=ffn, vocab_size=vocab, tie_word_embeddings=tied, max_position_embeddings=32768,
               **extra)


def flops_per_token(shape: str, seq: int) -> float:
    family, h, layers, heads, kv, ffn, vocab, tied = SHAPES[shape]
    head_dim = h // heads
    per_layer = h * heads * head_dim + 2 * h * kv * head_dim + heads * head_dim * h + 3 * h * ffn
    return 6 * (layers * per_layer + h * vocab) + 6 * layers * heads * head_dim * seq


CAUSAL_SDPA = "sdpa_causal_unpadded"


def register_causal_sdpa() -> None:
    """transformers' SDPA attention under a new name that ignores the attention mask: MegaTrain passes
    every layer the 2-D padding mask as flash-attn 2 wants it; with rows of only real tokens the
    causal kernel computes the same thing."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def causal_sdpa(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)

    AttentionInterface.register(CAUSAL_SDPA, causal_sdpa)


#: the files of flash-attn's source archive that its cross-entropy loss needs (the package's own
#: ``__init__`` imports its CUDA extension, so an empty one stands in for it)
FLASH_CE_FILES = ("flash_attn/losses/__init__.py", "flash_attn/losses/cross_entropy.py", "flash_attn/ops/__init__.py",
                  "flash_attn/ops/triton/__init__.py", "flash_attn/ops/triton/cross_entropy.py", "LICENSE")


def flash_cross_entropy(archives: str = ".whl-base", into: str = "/tmp/megatrain-flash-ce") -> str | None:
    """Put flash-attn's cross-entropy (from its source archive in ``archives``) on the path as
    ``flash_attn.losses.cross_entropy``; its version, or None where there is no archive or
    ``MT_FLASH_CE=0``."""
    import glob
    import tarfile

    found = sorted(glob.glob(os.path.join(archives, "flash_attn-*.tar.gz")))
    if os.environ.get("MT_FLASH_CE", "1") == "0" or not found:
        return None
    top = os.path.basename(found[-1])[: -len(".tar.gz")]
    with tarfile.open(found[-1]) as tar:
        for name in FLASH_CE_FILES:
            member = tar.getmember(f"{top}/{name}")
            target = os.path.join(into, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with tar.extractfile(member) as src, open(target, "wb") as dst:  # type: ignore[union-attr]
                dst.write(src.read())
    open(os.path.join(into, "flash_attn", "__init__.py"), "w").close()
    sys.path.insert(0, into)
    return top.split("-", 1)[1]


def random_model(auto, config):
    """The model with random bf16 weights in seconds: built on the meta device, then each matrix a slice
    of one random pool (transformers' own initialisation of 7B bf16 weights on the CPU takes minutes)."""
    with torch.device("meta"):
        model = auto.from_config(config, dtype=torch.bfloat16, attn_implementation=CAUSAL_SDPA)
    model = model.to_empty(device="cpu")
    pool = torch.randn(1 << 24, generator=torch.Generator().manual_seed(0)).mul_(0.02).to(torch.bfloat16)
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms' scales
                p.fill_(1.0)
                continue
            flat = p.view(-1)
            for start in range(0, flat.numel(), pool.numel()):
                n = min(pool.numel(), flat.numel() - start)
                first = min(n, pool.numel() - offset)
                flat[start:start + first].copy_(pool[offset:offset + first])
                flat[start + first:start + n].copy_(pool[:n - first])
                offset = (offset + n) % pool.numel()
    rotary = model.model.rotary_emb  # its inverse frequencies, a buffer to_empty left unset
    model.model.rotary_emb = type(rotary)(config=config)
    return model


def cross_entropy_name(flash_ce: str | None) -> str:
    """Which cross-entropy MegaTrain's loss takes, as it decided at its import: flash-attn's
    (``flash_ce``, its version) or PyTorch's."""
    from infinity.model import cpu_master

    return f"flash-attn {flash_ce}" if cpu_master.FLASH_CE_AVAILABLE else "pytorch"


def run(shape: str, seq: int, batch: int, steps: int, flash_ce: str | None) -> dict:
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from infinity import CPUMasterConfig, CPUMasterModel
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    torch.manual_seed(0)
    say(f"building {shape} in bf16 on the CPU", t0)
    register_causal_sdpa()
    model = random_model(AutoModelForCausalLM, hf_config(shape))
    say("built; handing it to CPUMasterModel", t0)
    config = CPUMasterConfig(model_name=shape, dataset_path="random tokens", max_seq_len=seq, batch_size=batch, num_steps=steps,
                             learning_rate=1e-5, weight_decay=0.01, attn_implementation="sdpa",
                             checkpoint_interval=4, num_grad_slabs=12, dtype=torch.bfloat16)
    mt = CPUMasterModel(model, config)
    del model
    say("CPUMasterModel ready; building DeepSpeed's CPU Adam", t0)
    opt = DeepSpeedCPUAdam(mt.get_parameters(), lr=1e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                           adamw_mode=True)
    setup_s = time.perf_counter() - t0
    vocab = SHAPES[shape][6]
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    times, losses = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        loss, _, _ = mt.forward_and_backward(ids, mask, ids.clone())
        torch.nn.utils.clip_grad_norm_(mt.get_parameters(), 1.0)
        opt.step()
        mt._sync_params_to_gpu()
        mt.zero_grad()
        opt.zero_grad()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        losses.append(float(loss))
        say(f"step {len(times)}: {times[-1]:.2f} s, loss {losses[-1]:.4f}", t0)
    timed = times[1:] or times
    tok_s = batch * seq / (sum(timed) / len(timed))
    return {"job": f"megatrain-{shape}-{seq}", "system": "MegaTrain", "shape": shape, "seq_len": seq,
            "batch_size": batch, "cross_entropy": cross_entropy_name(flash_ce), "steps": steps, "step_s": times, "losses": losses,
            "tokens_per_s": round(tok_s, 1),
            "model_tflops": round(tok_s * flops_per_token(shape, seq) / 1e12, 1), "setup_s": round(setup_s, 1),
            "gpu_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "gpu": torch.cuda.get_device_name()}


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    shape, seq, batch, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    flash_ce = flash_cross_entropy()  # before MegaTrain's import, which looks for it
    try:
        print(json.dumps(run(shape, seq, batch, steps, flash_ce)), flush=True)
    except torch.OutOfMemoryError as e:
        print(json.dumps({"job": f"megatrain-{shape}-{seq}", "batch_size": batch,
                          "cross_entropy": cross_entropy_name(flash_ce), "failed": True,
                          "error": "out of GPU memory: " + str(e).splitlines()[0][:200]}), flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
