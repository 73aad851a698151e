#!/usr/bin/env bash
# Writes `flowtrain plan --json` of thirteen reference runs into DIR, one file each, so that a
# change meant to keep every plan can be checked byte for byte:
#   bash docs/bench/reference_plans.sh /tmp/before   # on the old code
#   bash docs/bench/reference_plans.sh /tmp/after    # on the new
#   diff -r /tmp/before /tmp/after                   # prints nothing when every plan is the same
# The runs are the GPU gate's (planned for the H200 from any computer with --machine h200),
# LoRA, the mixtures of experts, the CPU default and the small cards.
set -euo pipefail
out=${1:?usage: reference_plans.sh DIR}
mkdir -p "$out"
H200="--device cuda --machine h200"
W="--model llama-3b --seq-len 4096 --micro-batch-size 4 --host-mem 110 $H200"
runs=(
  "w1|$W --batch-size 4"
  "w2|$W --batch-size 16"
  "8b|--model llama-8b --seq-len 4096 --batch-size 16 --micro-batch-size 4 --host-mem 118 --resident none $H200"
  "8b10o|--model llama-8b --seq-len 4096 --batch-size 16 --micro-batch-size 2 --host-mem 118 --gpu-mem 10 $H200"
  "long|--model llama-3b-512k --seq-len 65536 --batch-size 1 --micro-batch-size 1 --host-mem 118 $H200"
  "moe|--model qwen3-moe-12l --seq-len 4096 --batch-size 16 --micro-batch-size 4 --host-mem 118 $H200"
  "moe10|--model qwen3-moe-12l --seq-len 4096 --batch-size 16 --micro-batch-size 2 --host-mem 118 --gpu-mem 10 $H200"
  "lora32|--model qwen2.5-32b --seq-len 4096 --batch-size 16 --micro-batch-size 2 --host-mem 118 --gpu-mem 10 --lora-rank 16 $H200"
  "lora8|--model llama-8b --seq-len 4096 --batch-size 16 --micro-batch-size 4 --host-mem 118 --gpu-mem 10 --lora-rank 16 $H200"
  "8b256k|--model llama-8b-256k --seq-len 262144 --batch-size 1 --micro-batch-size 1 --host-mem 118 $H200"
  "rtx3080|--model llama-8b --seq-len 4096 --batch-size 16 --micro-batch-size 2 --host-mem 120 --device cuda --machine rtx3080-10gb"
  "tied|--model gemma3-1b --seq-len 2048 --batch-size 8 --micro-batch-size 2 --gpu-mem 8 --host-mem 64 --grad-clip 1.0 $H200"
  "cpu|--model tiny --seq-len 128 --batch-size 8 --micro-batch-size 4 --device cpu --host-mem 16"
)
for run in "${runs[@]}"; do
  name=${run%%|*}
  # shellcheck disable=SC2086
  python3 -m flowtrain.cli plan ${run#*|} --json >"$out/$name.json"
done
echo "wrote ${#runs[@]} plans to $out"
