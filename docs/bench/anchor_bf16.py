"""Runs the baseline trainer (``llama_train.py``, beside it in the working folder) with its
model built on the GPU in bf16, instead of in fp32 on the CPU and then cast and moved: the same
run from then on. A Qwen2.5-32B-shaped model built in fp32 needs 131 GB of host memory (more than
the H200 machine's 128 GiB) and minutes of single-threaded initialisation. Its LoRA mode casts
the adapters to fp32 after building, as it does anyway. Arguments and environment as
``llama_train.py``'s::

    cd .anchors && LORA=16 python3 ../docs/bench/anchor_bf16.py gpu qwen32b 4096 4 3 4

The model is laid out on the meta device and its memory then taken on the GPU in one pass
(``to_empty``), where every weight is drawn: matrices and embeddings from N(0,
``initializer_range``), as transformers initialises these families, norms at 1, biases at 0.
Nothing of the model's size is computed on the CPU, so the set-up takes about as long for a 32B
model as for an 8B one. The rotary embeddings' tables, which ``to_empty`` leaves unset, are
computed again on the GPU. Without a GPU the same runs on the CPU (``tiny`` and ``tinymoe`` sizes).

Each phase's time goes to standard error and, with ``OUT`` set, to
``$OUT/anchor_bf16-<size>-phases.txt``: the trainer's first line counts it all as ``setup_s``.
"""

import os
import runpy
import sys
import time

import torch

T0 = time.perf_counter()


def phase(what: str) -> None:
    line = f"anchor_bf16 {sys.argv[2] if len(sys.argv) > 2 else ''}: {what} at {time.perf_counter() - T0:.1f} s"
    print(line, file=sys.stderr, flush=True)
    if out := os.environ.get("OUT"):
        with open(os.path.join(out, f"anchor_bf16-{sys.argv[2]}-phases.txt"), "a") as f:
            f.write(line + "\n")


sys.argv = ["llama_train.py", *sys.argv[1:]]
trainer = runpy.run_path("llama_train.py", run_name="anchor")  # its definitions; main() not run yet
phase("trainer imported")
# run_path returns a copy of the module's globals: its functions look names up in the original
namespace = trainer["main"].__globals__
classes = namespace["model_class"]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def init_weights(model: torch.nn.Module, std: float) -> None:
    """Every parameter drawn where it lives: 2-D and larger from N(0, std), a norm's weight 1,
    a bias 0; then each rotary embedding's buffers as a fresh one on the same device computes
    them."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.fill_(1.0)
        for module in model.modules():
            if type(module).__name__.endswith("RotaryEmbedding"):
                with torch.device(DEVICE):
                    fresh = type(module)(module.config)
                for key, buf in fresh.named_buffers():
                    module.get_buffer(key).copy_(buf)


def model_class():
    cls = classes()

    def build(cfg):
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("meta"):
                model = cls(cfg)
            model = model.to_empty(device=DEVICE)
            init_weights(model, cfg.initializer_range)
        finally:
            torch.set_default_dtype(torch.float32)
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        phase("model built")
        return model

    return build


namespace["model_class"] = model_class
namespace["main"]()
phase("done")
