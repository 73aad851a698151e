"""Runs the baseline trainer (``llama_train.py``, beside it in the working folder) with its
model built on the GPU in bf16, instead of in fp32 on the CPU and then cast and moved: the same
run from then on. A Qwen2.5-32B-shaped model built in fp32 needs 131 GB of host memory (more than
the H200 machine's 128 GiB) and minutes of single-threaded initialisation. Its LoRA mode casts
the adapters to fp32 after building, as it does anyway. Arguments and environment as
``llama_train.py``'s::

    cd .anchors && LORA=16 python3 ../docs/bench/anchor_bf16.py gpu qwen32b 4096 4 3 4
"""

import runpy
import sys

import torch

sys.argv = ["llama_train.py", *sys.argv[1:]]
trainer = runpy.run_path("llama_train.py", run_name="anchor")  # its definitions; main() not run yet
classes = trainer["model_class"]


def model_class():
    cls = classes()

    def build(cfg):
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("cuda"):
                return cls(cfg)
        finally:
            torch.set_default_dtype(torch.float32)

    return build


trainer["model_class"] = model_class
trainer["main"]()
