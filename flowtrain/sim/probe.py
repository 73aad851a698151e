"""``flowtrain probe``: measure the machine it runs on and write a machine file for ``simulate``.

What it measures, each the way flowtrain's tasks do the work (median of a few repetitions
after a warm-up; GPU times from CUDA events):

- CPU: fused AdamW over fp32 (torch's fused kernel, the one ``cpu_adam`` calls) in G
  parameters/s, the fp32 -> bf16 cast of the stream-bf16 refresh, the disk's sequential write
  and read rates in ``--state-dir`` (``--disk-dir``: a file of a few hundred MiB written, fsynced
  and read back in 8 MiB pieces, four in flight, with ``O_DIRECT`` where the filesystem takes it,
  as the disk tier's reads and writes go), cores and host memory.
- GPU (when there is one): pinned host -> device, device -> host, and both at once (two
  streams), a bf16 GEMM at several square sizes (the largest rate is ``matmul_tflops``; how the
  small ones fall off gives ``matmul_half_dim``), causal SDPA attention forward and backward, the
  same forward+backward by sequence length for each fused kernel (``attention_tflops``), a
  device copy (memory bandwidth), fused AdamW on the device, and the host cost of a launch.

On a machine without a GPU it measures the CPU parts, says so, and takes the GPU fields from
``--extends`` (a shipped machine) or the defaults::

    flowtrain probe --out h200-probe.json                       # on the H200
    flowtrain probe --quick --extends h200 --out cpu-box.json   # here: CPU parts only
    flowtrain probe --state-dir /nvme/state --out desk.json    # the disk of the state folder too
    flowtrain simulate ... --machine h200-probe.json
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

MiB = 2**20


def add_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--out", default=None, metavar="FILE", help="machine file to write (default: machine-HOSTNAME.json)")
    a("--name", default=None, help="the machine's name in the file (default: the host name)")
    a("--extends", default=None, metavar="MACHINE",
      help="a shipped machine whose fields stand in for what is not measured here (e.g. the GPU's, without one)")
    a("--device", choices=["auto", "cpu", "cuda"], default="auto")
    a("--state-dir", "--disk-dir", dest="disk_dir", default=None, metavar="DIR",
      help="the folder whose disk to time (the --state-dir of the runs to come; default: the system's temporary "
           "folder)")
    a("--quick", action="store_true", help="small sizes and few repetitions (seconds, less exact)")


def run(args: argparse.Namespace) -> int:
    import torch

    from .machine import load_machine

    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.device == "cuda" and not torch.cuda.is_available():
        from ..errors import ConfigError

        raise ConfigError("--device cuda: no CUDA device here; run `flowtrain probe` without it to measure the CPU")
    name = args.name or socket.gethostname()
    fields: dict = {}
    notes: dict[str, str] = {}
    q = args.quick
    print(f"probing {name} ({'CPU and GPU' if use_cuda else 'CPU only: no GPU here'}) ...", flush=True)
    fields.update(_probe_cpu(notes, q, args.disk_dir))
    if use_cuda:
        fields.update(_probe_gpu(notes, q))
    else:
        print("no GPU here: measured the CPU parts only; GPU fields come from "
              + (f"--extends {args.extends}" if args.extends else "the defaults (give --extends NAME for better ones)"))
    now = datetime.datetime.now().strftime("%Y-%m-%d")
    what = "CPU and GPU" if use_cuda else "CPU only (no GPU)"
    data = {"name": name, "description": f"probed {what} on {name}", "extends": args.extends,
            "source": f"probe: flowtrain probe{' --quick' if q else ''} on {name}, {now}, torch {torch.__version__}; "
                      f"measured {what}" + (f"; unmeasured fields from {args.extends}" if args.extends else ""),
            **fields, "notes": notes}
    if args.extends is None:
        data.pop("extends")
    out = Path(args.out or f"machine-{name}.json")
    out.write_text(json.dumps(data, indent=1) + "\n")
    load_machine(out)  # what simulate will read back: validated now, not at the first simulate
    width = max(len(k) for k in fields)
    for k, v in fields.items():
        print(f"  {k:<{width}} {v}")
    print(f"wrote {out}; use it with: flowtrain simulate ... --machine {out}")
    return 0


# ---- timing -------------------------------------------------------------------------------------
def _median_seconds(fn: Callable[[], object], reps: int, sync: Callable[[], object] = lambda: None) -> float:
    fn()  # warm-up
    sync()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _cuda_seconds(fn: Callable[[], object], reps: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


# ---- the CPU ------------------------------------------------------------------------------------
def _fused_adamw(p, g, m, v, steps):  # tensors
    import torch

    torch._fused_adamw_([p], [g], [m], [v], [], [steps], lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.01,
                        eps=1e-8, amsgrad=False, maximize=False)


def _probe_cpu(notes: dict[str, str], quick: bool, disk_dir: str | None) -> dict:
    import torch

    out: dict = {"cpu_cores": os.cpu_count() or 1}
    n = (8 if quick else 64) * MiB // 4 * 4  # parameters
    p, g = torch.randn(n), torch.randn(n)
    m, v = torch.zeros(n), torch.zeros(n)
    steps = torch.ones(())
    t = _median_seconds(lambda: _fused_adamw(p, g, m, v, steps), 2 if quick else 5)
    out["cpu_adam_gparams"] = round(n / t / 1e9, 3)
    notes["cpu_adam_gparams"] = (f"probe: torch._fused_adamw_ over {n / 1e6:.0f}M fp32 parameters, {t * 1e3:.1f} ms, "
                                 f"{torch.get_num_threads()} threads")
    b = torch.empty(n, dtype=torch.bfloat16)
    t = _median_seconds(lambda: b.copy_(p), 2 if quick else 5)
    out["cpu_cast_gparams"] = round(n / t / 1e9, 3)
    notes["cpu_cast_gparams"] = f"probe: fp32 -> bf16 copy of {n / 1e6:.0f}M elements, {t * 1e3:.1f} ms"
    out.update(_probe_disk(notes, (64 if quick else 384) * MiB, 1 if quick else 2, disk_dir))
    try:
        with open("/proc/meminfo") as f:
            total = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
        out["host_mem_gib"] = round(total * 1024 / 2**30, 1)
    except (OSError, StopIteration):
        pass
    return out


#: bytes of one disk request, and requests in flight: as the disk tier's transfers go
_PIECE = 8 * MiB
_QUEUE_DEPTH = 4


def _probe_disk(notes: dict[str, str], size: int, reps: int, folder: str | None) -> dict:
    """The sequential write and read rates (GB/s) of the disk under ``folder``: a file of
    ``size`` bytes written and fsynced, then read, in :data:`_PIECE` pieces with
    :data:`_QUEUE_DEPTH` in flight, through ``O_DIRECT`` where the filesystem allows it (else
    through the page cache, dropped before each read). The best of ``reps``; the file is removed."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    where = folder or tempfile.gettempdir()
    buf = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT asks
    buf.write(os.urandom(MiB) * (size // MiB))
    mem = memoryview(buf)
    with tempfile.TemporaryDirectory(dir=folder, prefix="flowtrain-probe-") as tmp, \
            ThreadPoolExecutor(_QUEUE_DEPTH) as pool:
        path = Path(tmp) / "probe.bin"
        direct = hasattr(os, "O_DIRECT")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0), 0o600)
        except OSError:  # the filesystem takes no direct I/O
            direct = False
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            def pieces(write: bool) -> None:
                def one(lo: int) -> None:
                    part = mem[lo: lo + _PIECE]
                    done = 0
                    while done < len(part):
                        k = (os.pwritev if write else os.preadv)(fd, [part[done:]], lo + done)
                        if k <= 0:
                            raise OSError(f"{'wrote' if write else 'read'} nothing at {lo + done} of {path}")
                        done += k
                for f in [pool.submit(one, lo) for lo in range(0, size, _PIECE)]:
                    f.result()

            def write() -> None:
                pieces(True)
                os.fsync(fd)

            def read() -> None:
                if not direct:
                    os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)
                pieces(False)

            write()  # the file's blocks in place: the timed writes overwrite them, as the tier's do
            t_write = min(_timed(write) for _ in range(reps))
            t_read = min(_timed(read) for _ in range(reps))
        finally:
            os.close(fd)
    mem.release()
    buf.close()
    how = (f"{size // MiB} MiB in {_PIECE // MiB} MiB pieces, {_QUEUE_DEPTH} in flight, "
           f"{'O_DIRECT' if direct else 'through the page cache (no O_DIRECT here)'}, in {where}")
    notes["disk_write_gbps"] = f"probe: written and fsynced, {how}"
    notes["disk_read_gbps"] = f"probe: read, {how}"
    notes["disk_queue_depth"] = "probe: the requests in flight the rates were measured at (as the disk tier keeps them)"
    return {"disk_write_gbps": round(size / t_write / 1e9, 3), "disk_read_gbps": round(size / t_read / 1e9, 3),
            "disk_queue_depth": _QUEUE_DEPTH}


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# ---- the GPU ------------------------------------------------------------------------------------
def _probe_gpu(notes: dict[str, str], quick: bool) -> dict:
    import torch

    from ..model.attention import attend, attention_backends

    dev = torch.device("cuda")
    reps = 3 if quick else 10
    props = torch.cuda.get_device_properties(dev)
    out: dict = {"gpu": props.name, "gpu_mem_gib": round(props.total_memory / 2**30, 1)}
    from ..model.moe import grouped_supported

    out["grouped_mm"] = grouped_supported(dev, torch.bfloat16)

    # copies: pinned host <-> device, one direction, then both at once on two streams
    nbytes = (64 if quick else 512) * MiB
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    host2 = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    d1, d2 = torch.empty(nbytes, dtype=torch.uint8, device=dev), torch.empty(nbytes, dtype=torch.uint8, device=dev)
    t_h2d = _cuda_seconds(lambda: d1.copy_(host, non_blocking=True), reps)
    t_d2h = _cuda_seconds(lambda: host2.copy_(d2, non_blocking=True), reps)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def both() -> None:
        cur = torch.cuda.current_stream()
        s1.wait_stream(cur)
        s2.wait_stream(cur)
        with torch.cuda.stream(s1):
            d1.copy_(host, non_blocking=True)
        with torch.cuda.stream(s2):
            host2.copy_(d2, non_blocking=True)
        cur.wait_stream(s1)
        cur.wait_stream(s2)

    t_both = _cuda_seconds(both, reps)
    out["h2d_gbps"] = round(nbytes / t_h2d / 1e9, 1)
    out["d2h_gbps"] = round(nbytes / t_d2h / 1e9, 1)
    out["duplex_gbps"] = round(max(2 * nbytes / t_both / 1e9, out["h2d_gbps"], out["d2h_gbps"]), 1)
    notes["h2d_gbps"] = f"probe: pinned copies of {nbytes // MiB} MiB (a fetch also casts fp32 to bf16 on the device)"
    notes["duplex_gbps"] = "probe: one copy each way at once, on two streams"

    # bf16 GEMMs: the peak, and how small square ones fall off (rate = peak * (d / (d + half))^3)
    rates = {}
    for d in ((256, 1024, 4096) if quick else (256, 512, 1024, 2048, 4096, 8192)):
        a, b = torch.randn(d, d, device=dev, dtype=torch.bfloat16), torch.randn(d, d, device=dev, dtype=torch.bfloat16)
        rates[d] = 2 * d**3 / _cuda_seconds(functools.partial(torch.matmul, a, b), reps) / 1e12
    peak = max(rates.values())
    halves = [d * ((peak / r) ** (1 / 3) - 1) for d, r in rates.items() if r < 0.95 * peak]
    out["matmul_tflops"] = round(peak, 1)
    out["matmul_half_dim"] = round(statistics.median(halves), 1) if halves else 16.0
    notes["matmul_tflops"] = "probe: bf16 square GEMMs, TFLOP/s by size: " + ", ".join(f"{d}: {r:.0f}" for d, r in rates.items())

    # causal attention (SDPA with the kernels training prefers), forward and forward+backward
    heads, seq, hd = 32, (1024 if quick else 4096), 128
    aq, ak, av = (torch.randn(1, heads, seq, hd, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    flops = 2 * seq * seq * heads * hd  # causal: half of 4 S^2 H D
    grad = torch.randn(1, heads, seq, hd, device=dev, dtype=torch.bfloat16)
    with attention_backends("auto", "cuda"):  # the order applies to training's own call, attend
        t_f = _cuda_seconds(lambda: attend(aq, ak, av, None, None), reps)
        t_fb = _cuda_seconds(lambda: attend(aq, ak, av, None, None).backward(grad), reps)
    out["attention_fwd_tflops"] = round(flops / t_f / 1e12, 1)
    out["attention_bwd_tflops"] = round(2.5 * flops / max(t_fb - t_f, 1e-9) / 1e12, 1)
    notes["attention_fwd_tflops"] = f"probe: causal SDPA, {heads} heads x {seq} tokens x {hd}, backward counted as 2.5x the forward's FLOPs"

    out["attention_tflops"] = _attention_by_length(notes, quick)

    # memory bandwidth (a device copy reads and writes), fused AdamW on the device
    n = (64 if quick else 256) * MiB
    x, y = torch.empty(n, dtype=torch.uint8, device=dev), torch.empty(n, dtype=torch.uint8, device=dev)
    out["hbm_gbps"] = round(2 * n / _cuda_seconds(lambda: y.copy_(x), reps) / 1e9, 1)
    k = (16 if quick else 64) * MiB // 4
    p, g, m, v = (torch.randn(k, device=dev) for _ in range(4))
    steps = torch.ones((), device=dev)
    out["gpu_adam_gparams"] = round(k / _cuda_seconds(lambda: _fused_adamw(p, g, m, v, steps), reps) / 1e9, 1)

    # the host's cost of launching a small kernel
    z = torch.zeros(1, device=dev)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(1000):
        z.add_(1)
    out["launch_us"] = round((time.perf_counter() - t) * 1e3, 1)  # per launch: total ms over 1000 = µs each
    torch.cuda.synchronize()
    return out


#: the kernel each ``attention_tflops`` entry names -> the ``--attention-backend`` that runs it
_KERNEL_BACKEND = {"cudnn": "auto", "flash": "flash"}


def _attention_by_length(notes: dict[str, str], quick: bool) -> dict[str, list[list[float]]]:
    """Causal attention forward+backward TFLOP/s by sequence length, per fused kernel, through
    training's own call (:func:`attend` under ``--attention-backend``), with llama-8b's heads
    (32 query heads sharing 8 KV heads, head_dim 128) and at least 16,384 tokens per call (short
    sequences batched). What ``simulate`` reads as ``attention_tflops``: attention's rate grows
    with length until the kernel's tiles are full, and the kernels differ by a factor."""
    import torch

    heads, kv_heads, hd = 32, 8, 128
    lengths = (2048, 8192) if quick else (4096, 32768, 131072, 262144)
    table: dict[str, list[list[float]]] = {}
    for kernel, backend in _KERNEL_BACKEND.items():
        points = []
        for seq in lengths:
            batch = max(1, 16384 // seq)
            t = _attention_seconds(batch, heads, kv_heads, seq, hd, backend, 2 if seq >= 131072 else 5)
            flops = 3.5 * 2 * batch * seq * seq * heads * hd  # causal forward: half of 4 S^2 H D; backward 2.5x
            points.append([seq, round(flops / t / 1e12, 1)])
            torch.cuda.empty_cache()  # the next length's tensors in one piece
        table[kernel] = points
    notes["attention_tflops"] = ("probe: causal attention forward+backward through training's call, by kernel "
                                 "(cudnn: --attention-backend auto, flash: --attention-backend flash) and length; "
                                 f"{heads} heads sharing {kv_heads} KV heads, head_dim {hd}, >= 16,384 tokens a call; "
                                 "FLOPs counted causal, backward 2.5x the forward")
    return table


def _attention_seconds(batch: int, heads: int, kv_heads: int, seq: int, hd: int, backend: str, reps: int) -> float:
    """Seconds of one causal attention forward+backward through :func:`attend` under ``backend``."""
    import torch

    from ..model.attention import attend, attention_backends

    dev = torch.device("cuda")
    q = torch.randn(batch, heads, seq, hd, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(batch, kv_heads, seq, hd, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    grad = torch.randn_like(q)
    with attention_backends(backend, "cuda"):
        return _cuda_seconds(lambda: torch.autograd.grad(attend(q, k, v, None, None), (q, k, v), grad), reps)
