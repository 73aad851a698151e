"""Runs Unsloth's bf16 LoRA training on one shape of flowtrain's presets (llama-8b, qwen2.5-32b) with
random weights and random tokens on one GPU, and prints one JSON line of its speed, counted as
flowtrain counts a LoRA run.

Unsloth is not part of this repository. Its wheels (``unsloth`` and ``unsloth_zoo``, PyPI,
Apache-2.0; the ``unsloth`` wheel without its ``studio/`` web application) and what they import
that the benchmark machine lacks go in ``.whl-base/`` (``bash docs/bench/baseline-wheels.sh``);
``docs/bench/h200.sh`` installs those wheels for the baseline runners. Then::

    python3 docs/bench/unsloth_lora.py llama-8b 4096 16 4 3       # SHAPE SEQ BATCH MICRO STEPS

What runs is Unsloth's own model path: ``FastLanguageModel.from_pretrained`` (``load_in_4bit=False``,
``load_in_16bit=True``, dtype bf16) patches transformers' Llama or Qwen2 classes with its kernels
(RoPE, RMSNorm, SwiGLU, the LoRA MLP/QKV/O kernels, its chunked cross-entropy) and
``FastLanguageModel.get_peft_model`` puts LoRA rank 16 (alpha 16, no dropout, no bias) on q, k, v,
o, gate, up and down with ``use_gradient_checkpointing="unsloth"`` (its checkpointing that keeps
each layer's input in host memory). Attention is PyTorch's SDPA: the machine has neither
flash-attn nor xformers, and Unsloth falls back to SDPA without them.

Two things are supplied from here. The weights: the machine has no checkpoint and cannot fetch
one, and a Qwen2.5-32B-shaped checkpoint (65 GB in bf16) would not fit its 64 GiB disk, so the
directory handed to ``from_pretrained`` holds only ``config.json`` (flowtrain's preset, as
``flowtrain.model.hf_config.to_hf`` writes it) and a small word-level tokenizer, and
transformers' ``AutoModelForCausalLM.from_pretrained`` is replaced for this process by a
function that builds the model from that config directly on the GPU, where transformers' own
initialisation draws its weights (seconds, where the same on the CPU takes minutes for 8B and the
host memory of a 32B model in fp32). Everything Unsloth does
before and after that call runs as it does for a downloaded model. And the training loop: a plain
loop over the patched model (micro-batches of ``MICRO`` with the loss divided by their number, the
gradients clipped to 1.0, PyTorch's fused AdamW over the adapters, lr 2e-4, weight decay 0.01),
not TRL's ``SFTTrainer``: the work Unsloth speeds up is all inside the model's forward and
backward, which the loop calls as the trainer would, and the trainer's data collation and
logging would only add time to no model's credit.

The speed is the mean over the steps after the first (a warm-up), each timed with the GPU
synchronised. Model FLOPs per token are flowtrain's for LoRA
(``flowtrain.model.counts.model_flops_per_token`` with the adapters'
``flowtrain.plan.adapters.adapter_active_numel``): 4 x every frozen weight a token multiplies by
(no input embedding) + 6 x every adapter weight + 6 x layers x heads x head_dim x sequence. The
PEFT model's own count of trainable parameters is printed beside it (``adapter_params``).

``UNSLOTH_TINY=1`` shrinks the shape (2 layers of width 256) for a check; without a GPU the
runner sets ``UNSLOTH_ALLOW_CPU=1`` (Unsloth's own switch for driverless hosts, which keeps its
CUDA code paths), builds and patches the model and its adapters on the CPU, and prints a failed
line saying the training step needs a GPU. Out of GPU memory prints a line with ``"failed": true``
and exits 3 (``h200.sh`` then tries a smaller micro-batch).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
os.environ.setdefault("UNSLOTH_COMPILE_LOCATION", "/tmp/unsloth_compiled_cache")  # not in the checkout

import torch

import json_line  # docs/bench/json_line.py, beside this script

T0 = time.perf_counter()
TINY = os.environ.get("UNSLOTH_TINY") == "1"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK = 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("UNSLOTH_ALLOW_CPU", "1")


def say(what: str) -> None:
    """A timestamped phase line on stderr."""
    print(f"[{time.perf_counter() - T0:7.1f} s] {what}", file=sys.stderr, flush=True)


def model_config(shape: str):
    """flowtrain's preset of the shape (2 layers of width 256 with ``UNSLOTH_TINY=1``)."""
    import msgspec
    from flowtrain.model.presets import preset

    cfg = preset(shape)
    if TINY:
        cfg = msgspec.structs.replace(cfg, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                                      num_kv_heads=2, head_dim=64, vocab_size=1024, bos_token_id=1,
                                      eos_token_id=2)
    return cfg


def flops_per_token(cfg, seq: int, batch: int, micro: int) -> tuple[float, float]:
    from flowtrain.model.counts import model_flops_per_token
    from flowtrain.plan.adapters import adapter_active_numel
    from flowtrain.plan.request import RunRequest

    req = RunRequest(seq_len=seq, batch_size=batch, micro_batch_size=micro, lora_rank=RANK, lora_targets=TARGETS)
    adapters = adapter_active_numel(cfg, req)
    return model_flops_per_token(cfg, seq, adapters), adapters


def write_model_dir(cfg, path: str) -> None:
    """``config.json`` of the shape and a word-level tokenizer of 256 words and four special tokens:
    all that ``from_pretrained`` reads here besides the weights."""
    from flowtrain.model.hf_config import to_hf
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    d = to_hf(cfg)
    d.update(torch_dtype="bfloat16", dtype="bfloat16")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(d, f, indent=1)
    special = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {w: i for i, w in enumerate(special + [f"w{i}" for i in range(256)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", model_max_length=cfg.max_position_embeddings)
    fast.save_pretrained(path)


def random_weights_loader():
    """A stand-in for ``AutoModelForCausalLM.from_pretrained``: the model of the directory's config
    (or of the ``config`` passed) with random weights on the GPU, in the dtype asked for."""
    from transformers import AutoConfig, AutoModelForCausalLM

    def from_pretrained(cls, name, *args, config=None, **kwargs):
        config = config if config is not None else AutoConfig.from_pretrained(name)
        if kwargs.get("max_position_embeddings") is not None:
            config.max_position_embeddings = kwargs["max_position_embeddings"]
        if kwargs.get("rope_scaling") is not None:
            config.rope_scaling = kwargs["rope_scaling"]
        dtype = kwargs.get("dtype") or kwargs.get("torch_dtype") or torch.bfloat16
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        say(f"from_pretrained({os.path.basename(name)}): building it with random {dtype} weights on the {DEVICE}")
        with torch.device(DEVICE):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                     attn_implementation=kwargs.get("attn_implementation", "sdpa"))
        model.config._name_or_path = name
        model.name_or_path = name
        model.eval()  # as from_pretrained returns a model
        return model

    AutoModelForCausalLM.from_pretrained = classmethod(from_pretrained)


def cpu_stand_ins() -> None:
    """For the check without a GPU only: the few ``torch.cuda`` queries Unsloth's loader makes
    (the device's name, memory and capability) answered for a pretend 24 GiB card."""

    class Props:
        name, total_memory, major, minor, multi_processor_count = "no GPU (CPU check)", 24 << 30, 9, 0, 2

    torch.cuda.get_device_properties = lambda *a, **k: Props()
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_name = lambda *a, **k: Props.name
    torch.cuda.mem_get_info = lambda *a, **k: (20 << 30, 24 << 30)
    torch.cuda.max_memory_reserved = lambda *a, **k: 0
    torch.cuda.memory_reserved = lambda *a, **k: 0
    torch.cuda.current_device = lambda: 0
    import unsloth.models.llama as llama  # its rotary embedding allocates on "the current device"

    llama.get_current_device = lambda *a, **k: "cpu"


def build(shape: str, seq: int):
    """Unsloth's model and adapters: ``FastLanguageModel.from_pretrained`` then ``get_peft_model``."""
    if DEVICE == "cpu":
        cpu_stand_ins()
    from unsloth import FastLanguageModel  # first: Unsloth patches transformers as it is imported

    import unsloth

    say(f"unsloth {getattr(unsloth, '__version__', '?')} imported")
    cfg = model_config(shape)
    path = f"/tmp/unsloth-{shape}{'-tiny' if TINY else ''}"
    write_model_dir(cfg, path)
    random_weights_loader()
    model, tokenizer = FastLanguageModel.from_pretrained(model_name=path, max_seq_length=seq, dtype=torch.bfloat16,
                                                         load_in_4bit=False, load_in_16bit=True,
                                                         full_finetuning=False, local_files_only=True)
    say("FastLanguageModel.from_pretrained done; adding LoRA adapters")
    model = FastLanguageModel.get_peft_model(model, r=RANK, target_modules=list(TARGETS), lora_alpha=RANK,
                                             lora_dropout=0.0, bias="none", use_gradient_checkpointing="unsloth",
                                             random_state=3407)
    return cfg, model, getattr(unsloth, "__version__", "?")


def run(shape: str, seq: int, batch: int, micro: int, steps: int) -> dict:
    torch.manual_seed(0)
    cfg, model, version = build(shape, seq)
    trainable = [p for p in model.parameters() if p.requires_grad]
    n_adapters = sum(p.numel() for p in trainable)
    fpt, flowtrain_adapters = flops_per_token(cfg, seq, batch, micro)
    head = {"job": f"unsloth-{shape}{'-tiny' if TINY else ''}-{seq}", "system": "Unsloth", "version": version,
            "shape": shape, "seq_len": seq, "batch_size": batch, "micro_batch_size": micro, "steps": steps,
            "lora_rank": RANK, "adapter_params": n_adapters, "flowtrain_adapter_params": int(flowtrain_adapters)}
    say(f"{n_adapters:,} adapter parameters ({int(flowtrain_adapters):,} by flowtrain's count)")
    if DEVICE == "cpu":
        return {**head, "failed": True,
                "error": "no GPU: Unsloth's model and adapters were built and patched on the CPU; its kernels need one to train"}
    setup_s = time.perf_counter() - T0
    opt = torch.optim.AdamW(trainable, lr=2e-4, weight_decay=0.01, fused=True)
    model.train()
    gen = torch.Generator().manual_seed(1)
    accum = batch // micro
    times, losses = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        total = 0.0
        for _ in range(accum):
            ids = torch.randint(0, cfg.vocab_size, (micro, seq), generator=gen).to(DEVICE, non_blocking=True)
            loss = model(input_ids=ids, labels=ids).loss / accum
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        losses.append(round(total, 4))
        say(f"step {len(times)}: {times[-1]:.2f} s, loss {losses[-1]:.4f}")
    tok_s = json_line.steady_tokens_per_s(times, batch * seq)
    return {**head, "step_s": [round(t, 3) for t in times], "losses": losses, "tokens_per_s": round(tok_s, 1),
            "model_tflops": round(tok_s * fpt / 1e12, 1), "setup_s": round(setup_s, 1), **json_line.gpu_fields()}


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    default = ["llama-8b", "128", "4", "2", "2"] if TINY else ["llama-8b", "4096", "16", "4", "3"]
    argv = sys.argv[1:] + default[len(sys.argv) - 1:]
    shape, (seq, batch, micro, steps) = argv[0], (int(a) for a in argv[1:5])
    fail = {"job": f"unsloth-{shape}{'-tiny' if TINY else ''}-{seq}", "system": "Unsloth", "shape": shape,
            "seq_len": seq, "batch_size": batch, "micro_batch_size": micro, "failed": True}
    if batch % micro:
        print(json.dumps({**fail, "error": f"batch {batch} is not a multiple of micro-batch {micro}"}), flush=True)
        return 2
    return json_line.report(fail, lambda: run(shape, seq, batch, micro, steps), "Unsloth")


if __name__ == "__main__":
    sys.exit(main())
