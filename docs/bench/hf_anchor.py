"""The all-on-GPU baseline for a model on the generic layer path: transformers trains it alone.

    python3 docs/bench/hf_anchor.py MODEL SEQ MICRO_BATCH STEPS [ACCUMULATE]

MODEL is a flowtrain preset of the generic path (``qwen3.5-9b``) or a model folder's
config.json folder. The model is transformers' own class from that config (random weights),
fp32 weights on the GPU, bf16 autocast, fused torch AdamW, with the linear-attention kernels
transformers finds (flash-linear-attention where installed). Env: ``LAYERS=N`` keeps the first N
layers (a model whose weights and Adam state outgrow the GPU), ``CKPT=0`` turns gradient
checkpointing off. Model FLOPs are flowtrain's count for the same config
(:func:`flowtrain.model.counts.model_flops_per_token`), so the two runs' TFLOP/s compare.
Prints one JSON line per step and a summary line, as the project's other anchors do.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch

from flowtrain.model.counts import model_flops_per_token
from flowtrain.model.hf_config import from_hf
from flowtrain.model.presets import HF_PRESETS

MODEL, SEQ, MBS, STEPS = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
GA = int(sys.argv[5]) if len(sys.argv) > 5 else 1
CKPT = os.environ.get("CKPT", "1") != "0"


def config_dict() -> dict:
    d = dict(HF_PRESETS[MODEL]) if MODEL in HF_PRESETS else json.loads((Path(MODEL) / "config.json").read_text())
    if os.environ.get("LAYERS"):
        d["num_hidden_layers"] = int(os.environ["LAYERS"])
        if isinstance(d.get("layer_types"), list):
            d["layer_types"] = d["layer_types"][: d["num_hidden_layers"]]
    return d


def main() -> None:
    import transformers

    d = config_dict()
    cls = getattr(transformers, d["architectures"][0])
    config = transformers.CONFIG_MAPPING[d["model_type"]].from_dict(d)
    config.use_cache = False
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = cls(config).cuda()
    if CKPT:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    flops = model_flops_per_token(from_hf(d, "generic"), SEQ)
    ids = torch.randint(0, config.vocab_size, (MBS, SEQ), generator=torch.Generator().manual_seed(1)).cuda()
    print(json.dumps({"model": MODEL, "layers": config.num_hidden_layers, "setup_s": time.perf_counter() - t0,
                      "params": sum(p.numel() for p in model.parameters()), "ckpt": CKPT}), flush=True)
    times = []
    for step in range(STEPS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(GA):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss / GA
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        tokens = MBS * SEQ * GA
        print(json.dumps({"step": step, "loss": float(loss) * GA, "s": times[-1], "tok_per_s": tokens / times[-1],
                          "gpu_peak_GiB": torch.cuda.max_memory_allocated() / 2**30}), flush=True)
    measured = sorted(times[2:] if len(times) > 3 else times)
    median = measured[len(measured) // 2]
    tok_s = MBS * SEQ * GA / median
    print(json.dumps({"summary": "hf_anchor", "model": MODEL, "layers": config.num_hidden_layers, "ckpt": CKPT,
                      "tok_per_s": round(tok_s, 1), "TFLOPs": round(tok_s * flops / 1e12, 1),
                      "gpu_peak_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2)}), flush=True)


if __name__ == "__main__":
    main()
