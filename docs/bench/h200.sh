#!/usr/bin/env bash
# Runs benchmark jobs on an H200 machine, one after another, and collects their results.
#   bash docs/bench/h200.sh JOB [JOB...]
# from the repository root, with the wheels in .whl/ and the baseline trainers in .anchors/ (see
# docs/benchmarks.md). Every job appends its JSON result as one line to $OUT/results.jsonl;
# its output goes to $OUT/log.txt. The anchors' own JSON lines go to $OUT/train_*.jsonl.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# the newest wheel of each package in .whl/ (one put beside an older one replaces it; pip refuses two)
newest_wheels() { ls .whl/*.whl | sort -V | awk -F- '{last[$1] = $0} END {for (n in last) print last[n]}'; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $(newest_wheels) \
  >/dev/null 2>&1 || echo "warning: wheel install failed"
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
FT="python3 -m flowtrain.cli"
RES=$OUT/results.jsonl
log() { echo "=== $* ($(date +%T))" | tee -a "$OUT/log.txt"; }
bench() {  # NAME ARGS...: one flowtrain bench, its JSON tagged with NAME (PEAK=1: with $OUT/NAME-peak.json,
           # what was alive at its GPU peak; such a run's speed is no measurement)
  local name=$1; shift
  log "$name: flowtrain bench $*"
  if timeout ${BT:-420} $FT bench "$@" ${PEAK:+--gpu-peak-report "$OUT/$name-peak.json"} --json /tmp/r.json >>"$OUT/log.txt" 2>&1; then
    python3 -c "import json,sys; d=json.load(open('/tmp/r.json')); d['job']='$name'; print(json.dumps(d))" >>"$RES"
    tail -c 600 /tmp/r.json; echo
  else
    python3 -c "import json, sys; lines = [l for l in open(sys.argv[1]).read().splitlines() if 'rror' in l]; print(json.dumps({'job': '$name', 'failed': True, 'error': (lines or ['timed out or killed'])[-1][:300]}))" "$OUT/log.txt" >>"$RES"
    tail -5 "$OUT/log.txt"
  fi
}
anchor() {  # MODE GA STEPS [SIZE MICRO]: the baseline trainer (default llama-3b, micro-batch 4)
  log "anchor $1 ${4:-3b} mb${5:-4} ga$2"
  (cd .anchors && OUT=$OUT timeout 400 python3 llama_train.py "$1" "${4:-3b}" 4096 "${5:-4}" "$3" "$2" 2>&1 | grep -v Warning | tail -3) | tee -a "$OUT/log.txt"
}
mtrun() {  # SHAPE SEQ "BATCHES" STEPS: MegaTrain (docs/bench/megatrain_run.py) at the first batch that fits
  local b
  for b in $3; do
    log "megatrain $1, sequence $2, batch $b"
    timeout ${MTT:-420} python3 docs/bench/megatrain_run.py "$1" "$2" "$b" "$4" 2>>"$OUT/log.txt" | tail -1 | tee -a "$RES"
    tail -1 "$RES" | grep -q '"failed"' || break
  done
}
baseline() {  # NAME COMMAND...: one baseline runner's JSON line to $RES, its stderr to the log; a run
              # killed by its timeout (${BLT:-300} s) or printing no JSON gets a failed line
  local name=$1; shift
  local line
  if [[ ! -d /tmp/site-base ]]; then  # the baselines' own wheels (docs/bench/baseline-wheels.sh), for them alone
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-base .whl-base/*.whl \
      >/dev/null 2>&1 || echo "warning: the baselines' wheel install failed (carry .whl-base)" | tee -a "$OUT/log.txt"
  fi
  line=$(PYTHONPATH=/tmp/site-base:$PYTHONPATH timeout ${BLT:-300} "$@" 2>>"$OUT/log.txt" | grep '^{' | tail -1)
  [[ -n $line ]] || line="{\"job\": \"$name\", \"failed\": true, \"error\": \"timed out or killed, no JSON line\"}"
  echo "$line" | tee -a "$RES"
  [[ $line != *'"failed": true'* ]]
}
titanrun() {  # "DTYPE:AC:MICRO ...": torchtitan's Qwen3 MoE (docs/bench/torchtitan_moe.py) at qwen3-moe-12l,
              # 16 x 4096, at the first setting that runs
  local s dtype ac mb
  for s in $1; do
    IFS=: read -r dtype ac mb <<<"$s"
    log "torchtitan qwen3-moe-12l, $dtype, activation checkpointing $ac, micro-batch $mb"
    TITAN_DTYPE=$dtype TITAN_AC=$ac baseline torchtitan-qwen3-moe-12l-4096 python3 docs/bench/torchtitan_moe.py 4096 16 "$mb" 3 && break
  done
}
nemorun() {  # "AC:MICRO ...": NeMo AutoModel's Qwen3 MoE (docs/bench/nemo_moe.py) at qwen3-moe-12l, 16 x 4096,
             # at the first setting that runs
  local s ac mb
  for s in $1; do
    IFS=: read -r ac mb <<<"$s"
    log "nemo automodel qwen3-moe-12l, activation checkpointing $ac, micro-batch $mb"
    NEMO_AC=$ac baseline nemo-qwen3-moe-12l-4096 python3 docs/bench/nemo_moe.py 4096 16 "$mb" 3 && break
  done
}
usrun() {  # SHAPE "MICROS": Unsloth's bf16 LoRA (docs/bench/unsloth_lora.py), 16 x 4096, at the first micro-batch that fits
  local mb
  for mb in $2; do
    log "unsloth $1 LoRA 16, micro-batch $mb"
    baseline "unsloth-$1-4096" python3 docs/bench/unsloth_lora.py "$1" 4096 16 "$mb" 3 && break
  done
}
# The GPU tests: files whose tests need one (or compare it with the CPU), and files of CPU tests
# with some marked `gpu` (tests/test_gpu_gate.py checks that every GPU test is in one of them).
GPU_FILES="tests/train/test_gpu.py tests/model/test_model_gpu.py tests/model/test_attention.py tests/train/test_saved_attention.py tests/model/test_lora_experts.py tests/test_gpu_peak.py"
GPU_MARKED="tests/ckpt/test_checkpoints.py tests/runtime/test_cancel.py tests/train/test_nonfinite.py tests/train/test_first_step.py"
W="--model llama-3b --seq-len 4096 --micro-batch-size 4 --host-mem 110"
GATE=0
if [[ "${1:-}" == gate ]]; then  # the GPU gate: docs/benchmarks.md, "The GPU gate"
  GATE=1; set -- info tests w1 w2 8b 8b10o long moe
fi
run_job() {  # JOB: one job of the list below
  local job=$1
  case $job in
    info) nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee -a "$OUT/log.txt"; free -g | tee -a "$OUT/log.txt" ;;
    tests) log tests  # every test that needs a GPU: whole files of them, then the GPU-marked ones among CPU tests
      : >"$OUT/tests-full.txt"; runs_failed=0  # the whole output kept: a failure's cause, not only its name
      timeout 360 python3 -m pytest -q -o addopts= -p no:cacheprovider $GPU_FILES --tb=short >>"$OUT/tests-full.txt" 2>&1 || runs_failed=$((runs_failed + 1))
      timeout 240 python3 -m pytest -q -o addopts= -p no:cacheprovider -m gpu $GPU_MARKED --tb=short >>"$OUT/tests-full.txt" 2>&1 || runs_failed=$((runs_failed + 1))
      tail -25 "$OUT/tests-full.txt" | tee -a "$OUT/log.txt"
      # a pytest killed by its timeout prints no summary: its non-zero exit counts as a failure
      python3 -c "import json, re, sys; t = open(sys.argv[1]).read(); n = lambda w: sum(int(x) for x in re.findall(r'(\d+) ' + w + r'\b', t)); print(json.dumps({'job': 'tests', 'passed': n('passed'), 'failures': max(n('failed') + n('errors?'), int(sys.argv[2]))}))" "$OUT/tests-full.txt" "$runs_failed" >>"$RES" ;;
    loratests) log loratests; timeout 200 python3 -m pytest -q -o addopts= -p no:cacheprovider tests/train/test_gpu.py tests/model/test_lora_experts.py -k lora --tb=short 2>&1 | tee "$OUT/loratests-full.txt" | tail -30 | tee -a "$OUT/log.txt" ;;
    attntests) log attntests; timeout 200 python3 -m pytest -q -x -o addopts= -p no:cacheprovider tests/train/test_saved_attention.py 2>&1 | tail -8 | tee -a "$OUT/log.txt" ;;
    w1) bench w1 $W --batch-size 4 --steps 7 --trace "$OUT/w1-trace.json" ;;
    w1tr) FT="python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m flowtrain" bench w1tr $W --batch-size 4 --steps 7 ;;  # W1 under torchrun, one process
    w1s) bench w1s $W --batch-size 4 --steps 7 --layout stream-bf16 ;;  # half the fetch bytes, a CPU refresh per update
    w1c) bench w1c $W --batch-size 4 --steps 7 --compile inductor ;;  # what auto chooses on a GPU, named
    w1none) bench w1none $W --batch-size 4 --steps 6 --resident none ;;
    w2) bench w2 $W --batch-size 16 --steps 5 --trace "$OUT/w2-trace.json" ;;
    w2m) bench w2m $W --batch-size 16 --steps 5 --order micro --policy lookahead --trace "$OUT/w2m-trace.json" ;;  # each micro-batch through the model
    w2c) bench w2c $W --batch-size 16 --steps 5 --compile inductor ;;  # what auto chooses on a GPU, named
    gpu1) anchor gpu 1 4 ;;
    liger1) LIGER=1 CKPT=0 anchor gpu 1 4 ;;   # the strongest all-on-GPU run at W1
    liger4) LIGER=1 CKPT=0 anchor gpu 4 3 ;;   # ... and at W2
    w1r) bench w1r $W --batch-size 4 --steps 7 --activations recompute ;;
    w1g80) bench w1g80 $W --batch-size 4 --steps 7 --gpu-mem 80 ;;
    w2r) bench w2r $W --batch-size 16 --steps 5 --activations recompute ;;
    gpu4) anchor gpu 4 4 ;;
    liger8) LIGER=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True anchor gpu 4 3 8b 1 ;;  # llama-8b's strongest all-on-GPU run: checkpointing, micro-batch 1
    ds1) anchor ds 1 4 ;;
    ds4) anchor ds 4 3 ;;
    8b) bench 8b --model llama-8b --seq-len 4096 --batch-size 16 --micro-batch-size 4 --steps 3 --warmup 1 --host-mem 118 --resident none ${EXTRA8:-} ;;
    8bm) bench 8bm --model llama-8b --seq-len 4096 --batch-size 16 --micro-batch-size 8 --order micro --resident embed,head --steps 3 --warmup 1 --host-mem 118 ;;  # flowtrain plan --machine h200's choice
    8bgen) bench 8bgen --model llama-8b --seq-len 4096 --batch-size 16 --micro-batch-size 4 --steps 3 --warmup 1 --host-mem 118 --resident none --layer-path generic ;;  # transformers' Llama layer over the same stream
    q35) bench q35 --model qwen3.5-9b-16l --seq-len 4096 --batch-size 16 --micro-batch-size ${MBQ:-4} --steps 3 --warmup 1 --host-mem 118 ;;  # the generic path, hybrid linear attention
    genplan) log genplan; timeout 300 python3 docs/bench/generic_plan.py "$OUT/generic-plan.jsonl" 2>&1 | grep '^{' | tee -a "$OUT/log.txt" ;;  # each generic family's plan against the allocator
    q35full) bench q35full --model qwen3.5-9b --seq-len 4096 --batch-size 16 --micro-batch-size ${MBQ:-4} --steps 3 --warmup 1 --host-mem 118 ;;  # the whole 9B model
    q35hf) log "hf_anchor qwen3.5-9b-16l"; (timeout 300 python3 docs/bench/hf_anchor.py qwen3.5-9b-16l 4096 ${MBQ:-4} 4 $((16 / ${MBQ:-4})) 2>&1 | grep -v Warning | tail -3) | tee -a "$OUT/log.txt" ;;  # transformers alone, all on the GPU
    8bauto) bench 8bauto --model llama-8b --seq-len 4096 --batch-size 16 --micro-batch-size 4 --steps 3 --warmup 1 --host-mem 118 ${EXTRA8:-} ;;
    8b10o) bench 8b10o --model llama-8b --seq-len 4096 --batch-size 16 --micro-batch-size ${MB10:-2} --steps 3 --warmup 1 --host-mem 118 --gpu-mem 10 --trace "$OUT/8b10o-trace.json" ;;
    8b256ke) BT=${BT:-520} PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True bench 8b256ke --model llama-8b-256k --seq-len 262144 --batch-size 1 --micro-batch-size 1 --steps 2 --warmup 1 --host-mem 118 --trace "$OUT/8b256k-trace.json" ;;
    3b512k) BT=575 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True bench 3b512k --model llama-3b-512k --seq-len 524288 --batch-size 1 --micro-batch-size 1 --steps 1 --warmup 0 --host-mem 118 ;;
    w1flash) bench w1flash $W --batch-size 4 --steps 7 --attention-backend flash ;;
    w2flash) bench w2flash $W --batch-size 16 --steps 5 --attention-backend flash ;;
    long) BT=300 bench long --model llama-3b-512k --seq-len 65536 --batch-size 1 --micro-batch-size 1 --steps 3 --warmup 1 --host-mem 118 ;;  # one long-context step: saved attention outputs
    8b256k) bench 8b256k --model llama-8b-256k --seq-len 262144 --batch-size 1 --micro-batch-size 1 --steps 2 --warmup 1 --host-mem 118 ;;
    simtime)  # flowtrain simulate of a 100-layer, 16-micro-batch step, the whole command
      mkdir -p /tmp/m100 && python3 -c "import json; json.dump({'architectures': ['LlamaForCausalLM'], 'model_type': 'llama', 'hidden_size': 4096, 'intermediate_size': 14336, 'num_hidden_layers': 100, 'num_attention_heads': 32, 'num_key_value_heads': 8, 'vocab_size': 128256, 'max_position_embeddings': 8192, 'rms_norm_eps': 1e-5, 'rope_theta': 500000.0}, open('/tmp/m100/config.json', 'w'))"
      log simtime; for i in 1 2 3; do /usr/bin/time -f "simulate wall %e s" $FT simulate --model /tmp/m100 --seq-len 4096 --batch-size 16 --micro-batch-size 1 --host-mem 2048 --machine h200 2>&1 | tail -2 | tee -a "$OUT/log.txt"; done ;;
    simprof)  # where simulate's time goes on this machine: the torch import and the profile
      log simprof; python3 -X importtime -c "import torch" 2>&1 | tail -1 | tee -a "$OUT/log.txt"
      python3 -c "import cProfile, pstats, sys; sys.argv = ['flowtrain', 'simulate', '--model', '/tmp/m100', '--seq-len', '4096', '--batch-size', '16', '--micro-batch-size', '1', '--host-mem', '2048', '--machine', 'h200']; from flowtrain.cli import main; cProfile.run('main()', '/tmp/prof')" >/dev/null 2>&1
      python3 -c "import pstats; pstats.Stats('/tmp/prof').sort_stats('cumulative').print_stats(22)" | tail -26 | cut -c1-160 | tee -a "$OUT/log.txt" ;;
    moe) bench moe --model qwen3-moe-12l --seq-len 4096 --batch-size 16 --micro-batch-size ${MBM:-4} --steps 3 --warmup 1 --host-mem 118 --trace "$OUT/moe-trace.json" ;;  # Qwen3-30B-A3B's layer, 12 layers
    moe10) bench moe10 --model qwen3-moe-12l --seq-len 4096 --batch-size 16 --micro-batch-size ${MB10:-2} --steps 3 --warmup 1 --host-mem 118 --gpu-mem 10 --trace "$OUT/moe10-trace.json" ;;
    moe10b64) bench moe10b64 --model qwen3-moe-12l --seq-len 4096 --batch-size 64 --micro-batch-size 2 --steps 3 --warmup 1 --host-mem 118 --gpu-mem 10 ;;  # the 10 GB card at 64 sequences: CPU AdamW spread over 4x the tokens
    moeidle)  # the share of expert bytes --skip-idle-experts leaves in host memory at 1, 4 and 16 sequences a step
      for b in ${MOEIDLE:-1 4 16}; do bench moeidle$b --model qwen3-moe-12l --seq-len 4096 --batch-size $b --micro-batch-size 1 --steps 2 --warmup 1 --host-mem 118 --gpu-mem 10 --skip-idle-experts; done ;;
    moeprof) log moeprof; timeout 200 python3 docs/bench/moe_layer.py ${MOEPROF:-} 2>&1 | tail -25 | tee -a "$OUT/log.txt" ;;  # one expert layer's forward and backward, its backward's kernels
    ligermoe) LIGER=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True anchor gpu 16 3 moe12l 1 ;;  # its all-on-GPU run: checkpointing, micro-batch 1
    ligermoe2) LIGER=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True anchor gpu 8 3 moe12l 2 ;;  # the same at micro-batch 2
    gpumoe) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True anchor gpu 16 3 moe12l 1 ;;
    lora32) BT=520 bench lora32 --model qwen2.5-32b --seq-len 4096 --batch-size 16 --micro-batch-size ${MB32:-2} --steps 3 --warmup 1 --host-mem 118 --gpu-mem 10 --lora-rank 16 ;;  # LoRA over a 32B base on a 10 GB card
    lora32h) BT=520 bench lora32h --model qwen2.5-32b --seq-len 4096 --batch-size 16 --micro-batch-size ${MB32:-1} --steps 3 --warmup 1 --host-mem 118 --gpu-mem 10 --lora-rank 16 --lora-state host ;;  # the same, the adapters in host memory
    lorag32) log "anchor gpu qwen32b LoRA 16 mb${MBA:-4} ga$((16 / ${MBA:-4})) (built on the GPU in bf16)"  # its all-on-GPU PEFT run
      (cd .anchors && LORA=16 OUT=$OUT PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 400 python3 ../docs/bench/anchor_bf16.py gpu qwen32b 4096 ${MBA:-4} 3 $((16 / ${MBA:-4})) 2>&1 | grep -v Warning | tail -3) | tee -a "$OUT/log.txt" ;;
    lora8) bench lora8 --model llama-8b --seq-len 4096 --batch-size 16 --micro-batch-size ${MB8L:-4} --steps 3 --warmup 1 --host-mem 118 --gpu-mem 10 --lora-rank 16 ;;
    lorag8) log "anchor gpu 8b LoRA 16 mb${MBA:-4} ga$((16 / ${MBA:-4})) (built on the GPU in bf16)"  # llama-8b's all-on-GPU PEFT run
      (cd .anchors && LORA=16 OUT=$OUT PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 400 python3 ../docs/bench/anchor_bf16.py gpu 8b 4096 ${MBA:-4} 3 $((16 / ${MBA:-4})) 2>&1 | grep -v Warning | tail -3) | tee -a "$OUT/log.txt" ;;
    loramoe) BT=520 bench loramoe --model qwen3-moe-12l --seq-len 4096 --batch-size 16 --micro-batch-size ${MBM:-1} --steps 3 --warmup 1 --host-mem 118 --gpu-mem 10 --lora-rank 16 --lora-targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj ;;  # LoRA over the experts on a 10 GB card, the anchor's targets (no router)
    loragmoe) log "anchor gpu moe12l LoRA 16 mb${MBA:-2} ga$((16 / ${MBA:-2})) (built on the GPU in bf16)"  # its all-on-GPU PEFT run
      (cd .anchors && LORA=16 OUT=$OUT PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 400 python3 ../docs/bench/anchor_bf16.py gpu moe12l 4096 ${MBA:-2} 3 $((16 / ${MBA:-2})) 2>&1 | grep -v Warning | tail -3) | tee -a "$OUT/log.txt" ;;
    8b10) bench 8b10 --model llama-8b --seq-len 4096 --batch-size 2 --micro-batch-size 1 --steps 3 --warmup 1 --host-mem 118 --gpu-mem 10 ;;
    14b) bench 14b --model qwen-14b --seq-len 4096 --batch-size 8 --micro-batch-size 4 --steps 3 --warmup 1 --host-mem 118 ${EXTRA8:-} ;;
    attn) log attn; timeout 200 python3 docs/bench/attention_kernels.py 2>&1 | grep -v Warn | tail -12 | tee -a "$OUT/log.txt" ;;
    layer) log layer; timeout 200 python3 docs/bench/layer_packing.py 2>&1 | tail -3 | tee -a "$OUT/log.txt" | tee -a "$RES" ;;
    packdata)  # chat-shaped id rows (and the same tokens as one stream) for the packing runs
      python3 docs/bench/chat_ids.py /tmp/chat-qwen --vocab 151936 --rows 4000 | tee -a "$OUT/log.txt"
      python3 docs/bench/chat_ids.py /tmp/chat-llama --vocab 128256 --rows 4000 | tee -a "$OUT/log.txt" ;;
    q8pack) bench q8pack --model qwen3-8b --seq-len 4096 --batch-size 16 --micro-batch-size 4 --steps 3 --warmup 1 --host-mem 118 --resident none --data /tmp/chat-qwen.jsonl ;;
    8bpack) bench 8bpack --model llama-8b --seq-len 4096 --batch-size 16 --micro-batch-size 4 --steps 3 --warmup 1 --host-mem 118 --resident none --data /tmp/chat-llama.jsonl ;;
    8bstream) bench 8bstream --model llama-8b --seq-len 4096 --batch-size 16 --micro-batch-size 4 --steps 3 --warmup 1 --host-mem 118 --resident none --data /tmp/chat-llama.npy ;;
    probe) log probe; timeout 240 $FT probe --out "$OUT/h200-probe.json" 2>&1 | tail -5 | tee -a "$OUT/log.txt" ;;
    mt7b)  # MegaTrain beside flowtrain on MegaTrain's own configuration: Qwen2.5-7B's shape, 158 x 1024
      mtrun qwen2.5-7b 1024 "${MTB:-158 79}" 3
      BT=300 bench ft7b --model qwen2.5-7b --seq-len 1024 --batch-size 158 --micro-batch-size 79 --steps 3 --warmup 1 --host-mem 118 ;;
    ft7b) BT=300 bench ft7b --model qwen2.5-7b --seq-len 1024 --batch-size 158 --micro-batch-size 79 --steps 3 --warmup 1 --host-mem 118 --trace "$OUT/ft7b-trace.json" ;;  # flowtrain's side of mt7b alone, traced
    pinsrc) log "pinsrc: torch's pinned host memory by task, and the autotuner's host copies (qwen2.5-7b, 158 x 1024)"
      timeout ${BT:-300} python3 docs/bench/pinned_by_task.py --model qwen2.5-7b --seq-len 1024 --batch-size 158 \
        --micro-batch-size 79 --steps 2 --warmup 1 --host-mem 118 --json "$OUT/pinsrc.json" 2>&1 | grep -v '^{' | grep -v Warning | tail -40 | tee -a "$OUT/log.txt" ;;
    stalls8b10o) log "stalls8b10o: long task calls and the GPU allocator's retries in them (llama-8b on a 10 GB card)"
      timeout ${BT:-300} python3 docs/bench/stalls_by_task.py --model llama-8b --seq-len 4096 --batch-size 16 --micro-batch-size 2 \
        --steps 3 --warmup 1 --host-mem 118 --gpu-mem 10 --json "$OUT/stalls8b10o.json" >"$OUT/stalls8b10o-full.txt" 2>&1
      # the 30 longest calls, then the counts by kind (every call of over 50 ms: stalls8b10o-full.txt)
      grep '^long ' "$OUT/stalls8b10o-full.txt" | sort -t: -k2 -rn | head -30 | tee -a "$OUT/log.txt"
      grep '^kind ' "$OUT/stalls8b10o-full.txt" | tee -a "$OUT/log.txt" ;;
    # w1 and 8b10o with the memory-map walk at every step's end, on the event loop (as the bench
    # did until 2026-12-08): run beside w1 and 8b10o, what the walk costs and whether it stalls
    w1walk) bench w1walk $W --batch-size 4 --steps 7 --walk-memory-map-each-step --trace "$OUT/w1walk-trace.json" ;;
    8b10owalk) bench 8b10owalk --model llama-8b --seq-len 4096 --batch-size 16 --micro-batch-size ${MB10:-2} --steps 3 --warmup 1 --host-mem 118 --gpu-mem 10 --walk-memory-map-each-step --trace "$OUT/8b10owalk-trace.json" ;;
    w1gc) bench w1gc $W --batch-size 4 --steps 30 ;;  # W1 over 30 steps: the full collections its steps meet (gc_full_by_step)
    ft7bpeak) PEAK=1 BT=300 bench ft7bpeak --model qwen2.5-7b --seq-len 1024 --batch-size 158 --micro-batch-size 79 --steps 2 --warmup 1 --host-mem 118 ;;  # what is alive at its GPU peak: 80,896 tokens a micro-batch allocate 4.5% over the plan
    mt8b1k)  # MegaTrain's Llama-3.1-8B configuration: 148 x 1024, then flowtrain on it
      mtrun llama-3.1-8b 1024 "${MTB:-148 74}" 3
      BT=300 bench ft8b1k --model llama-8b --seq-len 1024 --batch-size 148 --micro-batch-size ${MBF:-74} --steps 3 --warmup 1 --host-mem 118 ;;
    mt8b)  # the same on this project's llama-8b configuration, 16 x 4096
      mtrun llama-3.1-8b 4096 "${MTB:-16 8}" 3
      BT=300 bench ft8b --model llama-8b --seq-len 4096 --batch-size 16 --micro-batch-size 4 --steps 3 --warmup 1 --host-mem 118 --resident none ;;
    w2r12) bench w2r12 $W --batch-size 16 --steps 5 --resident embed,head,$(seq -s, -f 'layer.%g' 0 9) ;;  # W2 with 10 layers resident
    w2r26) bench w2r26 $W --batch-size 16 --steps 5 --resident embed,head,$(seq -s, -f 'layer.%g' 0 25) ;;  # W2 with 26 layers resident, as the H200 planned it before the simulator's rates of 2026-12-06
    moer10) bench moer10 --model qwen3-moe-12l --seq-len 4096 --batch-size 16 --micro-batch-size ${MBM:-4} --steps 3 --warmup 1 --host-mem 118 --resident embed,head,$(seq -s, -f 'layer.%g' 0 9) ;;  # the MoE with 10 layers resident, the same
    moer8) bench moer8 --model qwen3-moe-12l --seq-len 4096 --batch-size 16 --micro-batch-size ${MBM:-4} --steps 3 --warmup 1 --host-mem 118 --resident embed,head,$(seq -s, -f 'layer.%g' 0 7) ;;  # the MoE with 8 layers resident
    diskspeed)  # the state folder's disk: 4 GiB written and read back with direct I/O
      log diskspeed; df -h /tmp | tail -1 | tee -a "$OUT/log.txt"
      dd if=/dev/zero of=/tmp/ddtest bs=16M count=256 oflag=direct 2>&1 | tail -1 | tee -a "$OUT/log.txt"
      dd if=/tmp/ddtest of=/dev/null bs=16M iflag=direct 2>&1 | tail -1 | tee -a "$OUT/log.txt"; rm -f /tmp/ddtest ;;
    8b256kd)  # one sequence of 262,144 tokens, every layer saving its attention output: the checkpoints
              # the outputs displace wait in host memory, and the Adam moments those displace on disk (--state-dir)
      rm -rf /tmp/ftstate; mkdir -p /tmp/ftstate; df -h /tmp | tail -1 | tee -a "$OUT/log.txt"
      BT=${BT:-560} PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True bench 8b256kd --model llama-8b-256k --seq-len 262144 --batch-size 1 --micro-batch-size 1 --steps ${DSTEPS:-2} --warmup 1 --host-mem 118 --activations attention --state-dir /tmp/ftstate --trace "$OUT/8b256kd-trace.json"
      rm -rf /tmp/ftstate ;;
    8b10disk)  # llama-8b on a 10 GB card past host memory: what --host-mem cannot hold of the Adam state on disk
      rm -rf /tmp/ftstate; mkdir -p /tmp/ftstate; df -h /tmp | tail -1 | tee -a "$OUT/log.txt"
      (m=0; while sleep 2; do s=$(du -sb /tmp/ftstate 2>/dev/null | cut -f1); if [[ ${s:-0} -gt $m ]]; then m=$s; echo "$m" >"$OUT/8b10disk-bytes.txt"; fi; done) &
      local_du=$!
      BT=${BT:-480} bench 8b10disk --model llama-8b --seq-len 4096 --batch-size 16 --micro-batch-size ${MB10:-2} --steps ${DSTEPS:-3} --warmup 1 --host-mem ${HM:-80} --gpu-mem 10 --state-dir /tmp/ftstate --trace "$OUT/8b10disk-trace.json"
      kill $local_du; echo "state folder peak bytes: $(cat "$OUT/8b10disk-bytes.txt" 2>/dev/null)" | tee -a "$OUT/log.txt"; ls /tmp/ftstate | head -3 | tee -a "$OUT/log.txt" ;;
    dpo8b10)  # DPO on llama-8b on a 10 GB card: 8 pairs a step, 2,048 prompt + 2,040 completion tokens each (random ids)
      python3 -c "import json, random; r = random.Random(0); ids = lambda n: [r.randrange(128256) for _ in range(n)]; print('\n'.join(json.dumps({'prompt_input_ids': ids(2048), 'chosen_input_ids': ids(2040), 'rejected_input_ids': ids(2040)}) for _ in range(32)))" >/tmp/prefs.jsonl
      log "dpo8b10: flowtrain train --model llama-8b --objective dpo, 16 x 4096, --gpu-mem 10"
      timeout ${BT:-420} $FT train --model llama-8b --objective dpo --data /tmp/prefs.jsonl --seq-len 4096 --batch-size 16 \
        --micro-batch-size 2 --steps 3 --host-mem 118 --gpu-mem 10 --no-progress --metrics "$OUT/dpo8b10-metrics.jsonl" 2>&1 | tail -9 | tee -a "$OUT/log.txt" ;;
    ckpt)  # checkpoint cost and exact resume: llama-1b (a 3b/8b checkpoint outgrows the 64 GiB disk)
      C="--model llama-1b --seq-len 4096 --batch-size 4 --micro-batch-size 4 --steps 10 --compile none --no-progress"
      log "ckpt: no saves"; $FT train $C --metrics "$OUT/ckpt-plain.jsonl" 2>&1 | tail -2 | tee -a "$OUT/log.txt"
      log "ckpt: --save-every 5"; $FT train $C --out /tmp/ck --save-every 5 --save-total-limit 2 \
        --metrics "$OUT/ckpt-saved.jsonl" 2>&1 | tail -2 | tee -a "$OUT/log.txt"
      du -sh /tmp/ck/checkpoint-* | tee -a "$OUT/log.txt"
      log "ckpt: resume from checkpoint-5"
      $FT train $C --resume /tmp/ck/checkpoint-5 --out /tmp/ck2 --metrics "$OUT/ckpt-resumed.jsonl" 2>&1 | tail -2 | tee -a "$OUT/log.txt"
      log "ckpt: done" ;;
    titanmoe)  # torchtitan's trainer on the MoE, then flowtrain's moe job (docs/benchmarks.md, "Beside torchtitan, NeMo AutoModel and Unsloth")
      titanrun "${TITANS:-float32:selective:2 float32:selective:1 float32:full:1 bfloat16:selective:2 bfloat16:full:1}"
      run_job moe ;;
    nemomoe)  # NeMo AutoModel's Qwen3 MoE model on the MoE, then flowtrain's moe job
      nemorun "${NEMOS:-selective:2 selective:1 full:2 full:1}"
      run_job moe ;;
    unsloth8b)  # Unsloth's bf16 LoRA on llama-8b, then flowtrain's lora8 job
      usrun llama-8b "${USB:-4 2 1}"
      run_job lora8 ;;
    unsloth32)  # the same on qwen2.5-32b, then flowtrain's lora32 job
      BLT=${BLT:-360} usrun qwen2.5-32b "${USB:-2 1}"
      run_job lora32 ;;
    *) echo "unknown job $job" ;;
  esac
}
for job in "$@"; do run_job "$job"; done
log done
traces=("$OUT"/*-trace.json)  # what the schedules do not explain: late starts, long tasks (docs/viz.md)
if [[ -e ${traces[0]} ]]; then
  $FT viz "${traces[@]}" --out /tmp/traces.html 2>&1 | tee -a "$OUT/log.txt"
fi
if [[ $GATE == 1 ]]; then
  python3 docs/bench/gate.py "$RES" docs/bench/gate-baseline.json ${GATE_RECORD:+--record "$GATE_RECORD"} 2>&1 | tee -a "$OUT/log.txt"
  exit "${PIPESTATUS[0]}"
fi
python3 - "$RES" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    d = json.loads(line)
    keys = ("job", "tokens_per_s", "model_tflops", "gpu_peak_gib", "planned_gpu_gib", "gpu_process_peak_gib", "host_peak_gib",
            "planned_host_gib", "measured_host_bytes_per_param", "busy_fraction", "resident", "failed")
    print({k: d[k] for k in keys if k in d})
PY
