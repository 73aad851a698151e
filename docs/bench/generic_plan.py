"""The generic layer path's memory plan against the GPU allocator, one family at a time.

    python3 docs/bench/generic_plan.py OUT_JSONL [ARCH ...]

For each family (default: all below) writes a config.json of a small but GPU-sized model of
transformers' own config class (hidden size 1024, four layers, the family's distinctive layers
switched on), runs ``flowtrain bench`` on it at 2 x 4096 tokens, and appends one JSON line:
the plan's GPU bytes, PyTorch's ``max_memory_allocated``, and their ratio. The plan is within
10% when ``planned / allocated`` lies in [0.9, 1.1]. The weights are transformers' random
initialization, saved in bf16.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers

COMMON = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=4, head_dim=128, max_position_embeddings=8192, vocab_size=32000,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
LINEAR = dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=128, linear_value_head_dim=128,
              linear_conv_kernel_dim=4, full_attention_interval=2)
EXPERTS = dict(num_experts_per_tok=2, moe_intermediate_size=512)

#: architecture -> config keys beyond COMMON that give it its distinctive layers
FAMILIES = {
    "Qwen3_5ForCausalLM": LINEAR,
    "Qwen3NextForCausalLM": dict(LINEAR, num_experts=8, shared_expert_intermediate_size=512, **EXPERTS),
    "GptOssForCausalLM": dict(num_local_experts=8, sliding_window=1024, num_experts_per_tok=2),
    "Gemma2ForCausalLM": dict(sliding_window=1024),
    "Phi3ForCausalLM": {},
    "Glm4ForCausalLM": {},
    "Olmo2ForCausalLM": {},
    "DeepseekV3ForCausalLM": dict(n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=384,
                                  kv_lora_rank=256, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                                  num_key_value_heads=8, head_dim=64, n_group=2, topk_group=1, **EXPERTS),
    "Llama4ForCausalLM": dict(num_local_experts=8, num_experts_per_tok=1, intermediate_size_mlp=2816,
                              attention_chunk_size=1024, interleave_moe_layer_step=2),
    "FalconH1ForCausalLM": dict(mamba_d_ssm=1024, mamba_n_heads=16, mamba_d_head=64, mamba_d_state=64,
                                mamba_n_groups=1, mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=256),
}


def config_of(arch: str):
    config = getattr(transformers, arch).config_class(**{**COMMON, **FAMILIES[arch]})
    config.architectures = [arch]
    return config


def write_model(folder: Path, arch: str) -> None:
    torch.manual_seed(0)
    getattr(transformers, arch)(config_of(arch)).to(torch.bfloat16).save_pretrained(folder)


def measure(arch: str) -> dict:
    folder = Path("/tmp/generic-plan") / arch
    write_model(folder, arch)
    result = folder / "bench.json"
    cmd = [sys.executable, "-m", "flowtrain.cli", "bench", "--model", str(folder), "--seq-len", "4096",
           "--batch-size", "2", "--micro-batch-size", "1", "--steps", "2", "--warmup", "1", "--host-mem", "100",
           "--json", str(result)]
    if os.environ.get("PEAK_DIR"):  # what was alive at the GPU peak (such a run's speed is no measurement)
        cmd += ["--gpu-peak-report", f"{os.environ['PEAK_DIR']}/{arch}-peak.json"]
    t0 = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=int(os.environ.get("FAMILY_TIMEOUT", "150")))
    if run.returncode != 0:
        lines = (run.stderr or run.stdout).strip().splitlines() or ["no output"]
        return {"arch": arch, "failed": True, "error": lines[-1][:300]}
    d = json.loads(result.read_text())
    planned, allocated = d["planned_gpu_gib"], d["gpu_peak_gib"]
    return {"arch": arch, "planned_gpu_gib": planned, "gpu_peak_gib": allocated,
            "planned_over_allocated": round(planned / allocated, 3), "tokens_per_s": d.get("tokens_per_s"),
            "wall_s": round(time.perf_counter() - t0, 1)}


def main() -> None:
    out = Path(sys.argv[1])
    for arch in sys.argv[2:] or list(FAMILIES):
        row = measure(arch)
        print(json.dumps(row), flush=True)
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
