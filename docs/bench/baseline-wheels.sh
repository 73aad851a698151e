#!/usr/bin/env bash
# Puts in .whl-base/ (ignored by git) the Python 3.12 wheels that the baseline trainers need on the
# benchmark GPU machine beyond its image (torch 2.11, transformers 5.17, peft, accelerate, triton,
# tokenizers, pyarrow, pandas, xxhash, ... are there):
#   torchtitan's Qwen3 MoE (docs/bench/torchtitan_moe.py): torchtitan 0.2.2, the release made against
#     the PyTorch nightly that became 2.11, and what it imports: torchdata (its data loader), tyro and
#     its needs (its config), datasets with dill and multiprocess (its qwen3 package imports its text
#     data sets).
#   NeMo AutoModel's Qwen3 MoE model (docs/bench/nemo_moe.py): nemo_automodel 0.7.0 alone (its model,
#     activation checkpointing and loss import nothing more the machine lacks; it asks for transformers
#     5.18 and runs on the machine's 5.17).
#   Unsloth's LoRA (docs/bench/unsloth_lora.py): unsloth and unsloth_zoo 2026.10.9 (the newest that
#     allow transformers 5.17), trl (imported unconditionally), datasets, and bitsandbytes, which a
#     bf16 LoRA never calls but Unsloth's post-load patching imports for a type check.
#   MegaTrain's loss (docs/bench/megatrain_run.py): flash-attn 2.8.3.post2's source archive, not a
#     wheel (flash-attn publishes none for this machine, and its CUDA extension builds for hours); the
#     runner takes only its Triton cross-entropy out of it (8.5 MB), which MegaTrain uses where
#     flash-attn is installed.
# Two wheels are slimmed to keep what is copied to the benchmark machine small: unsloth's without its studio/
# web application and unsloth_cli/ (27 of its 29 MB; neither is imported by `import unsloth`), and
# bitsandbytes's with only the CUDA 13.0 and CPU libraries (torch 2.11+cu130 loads the first; 43 MB
# to about 2). Not carried: xformers (Unsloth then uses PyTorch's SDPA), torchao, cut-cross-entropy,
# hf-transfer, diffusers (none is imported on the bf16 LoRA path).
# Run from the checkout; running it again downloads only what is missing:
#   bash docs/bench/baseline-wheels.sh
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
mkdir -p .whl-base
grep -qx '/.whl-base/' "$(git rev-parse --git-path info/exclude)" 2>/dev/null || echo '/.whl-base/' >> "$(git rev-parse --git-path info/exclude)"
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
  --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
dl() {  # NAME==VERSION...: each wheel not yet in .whl-base/
  local want=()
  for spec in "$@"; do
    local name=${spec%%==*} version=${spec##*==}
    compgen -G ".whl-base/${name//-/_}-${version}-*.whl" >/dev/null || want+=("$spec")
  done
  [[ ${#want[@]} == 0 ]] || python3 -m pip download -q --no-deps $PLAT -d .whl-base "${want[@]}" 2>&1 | grep -v '^WARNING' || true
}
slim() {  # NAME==VERSION PREFIX...: the wheel without the files under each PREFIX, named as before
  local spec=$1; shift
  local name=${spec%%==*} version=${spec##*==}
  compgen -G ".whl-base/${name//-/_}-${version}-*.whl" >/dev/null && return 0
  local tmp; tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps $PLAT -d "$tmp" "$spec" 2>&1 | grep -v '^WARNING' || true
  python3 - "$tmp"/*.whl .whl-base "$@" <<'PY'
import os, sys, zipfile
src, dest, drop = sys.argv[1], sys.argv[2], tuple(sys.argv[3:])
out = os.path.join(dest, os.path.basename(src))
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out + ".part", "w", zipfile.ZIP_DEFLATED) as zout:
    for item in zin.infolist():
        if item.filename.startswith(drop):
            continue
        data = zin.read(item.filename)
        if item.filename.endswith(".dist-info/RECORD"):  # the list of files, less those left out
            data = b"".join(l for l in data.splitlines(keepends=True) if not l.decode().startswith(drop))
        zout.writestr(item, data)
os.replace(out + ".part", out)
print(f"{os.path.basename(out)}: {os.path.getsize(src) / 2**20:.1f} MiB -> {os.path.getsize(out) / 2**20:.1f} MiB")
PY
  rm -rf "$tmp"
}
# shared: datasets and what it needs beyond the machine's image
dl datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19
# torchtitan
dl torchtitan==0.2.2 torchdata==0.11.0 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1
# NeMo AutoModel
dl nemo-automodel==0.7.0
# Unsloth
dl unsloth-zoo==2026.10.9 trl==1.15.0
slim unsloth==2026.10.9 studio/ unsloth_cli/
B=bitsandbytes/libbitsandbytes_
slim bitsandbytes==0.50.2 ${B}cuda118 ${B}cuda121 ${B}cuda124 ${B}cuda126 ${B}cuda128 ${B}cuda132 ${B}rocm ${B}xpu
# MegaTrain: flash-attn's source archive, by the name and digest the package index gives
[[ -f .whl-base/flash_attn-2.8.3.post2.tar.gz ]] || python3 - <<'PY'
import hashlib, json, os, urllib.request
name = "flash_attn-2.8.3.post2.tar.gz"
req = urllib.request.Request("https://pypi.org/simple/flash-attn/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
entry = next(f for f in json.load(urllib.request.urlopen(req))["files"] if f["filename"] == name)
data = urllib.request.urlopen(entry["url"]).read()
if hashlib.sha256(data).hexdigest() != entry["hashes"]["sha256"]:
    raise SystemExit(f"{name}: its sha256 is not the index's")
with open(f".whl-base/{name}.part", "wb") as f:
    f.write(data)
os.replace(f".whl-base/{name}.part", f".whl-base/{name}")
PY
ls -l .whl-base | awk 'NR > 1 {printf "%8.1f MiB  %s\n", $5 / 2^20, $9}'
du -sh .whl-base
