"""Machine descriptions: the handful of rates a training step's time depends on.

A machine is a small JSON file. The ones shipped with flowtrain live in
``flowtrain/sim/machines/`` and are found by name; any other path works too, and ``flowtrain
probe`` writes one for the machine it runs on::

    m = load_machine("h200")                 # or load_machine("my-box.json")
    m.h2d_gbps, m.matmul_tflops, m.cpu_adam_gparams

Every number is a rate *achieved* by the kind of work flowtrain does (a pinned copy of a whole
layer, a large bf16 GEMM, fused CPU AdamW over fp32), not a datasheet peak, and every file says
where its numbers come from (``source``): a measurement (``probe``, a benchmark run) or a
datasheet scaled by the H200's measured-to-datasheet ratios. A file may leave out any field
with a default below; ``extends`` names a machine whose fields it starts from.

Fields, by the task kinds that use them (:mod:`flowtrain.sim.costs`):

- copies (``fetch``, ``offload_grad``): ``h2d_gbps``, ``d2h_gbps`` (GB/s, one direction at a
  time), ``duplex_gbps`` (both directions at once, the sum; while both copy, each direction's
  rate is scaled by ``duplex_gbps / (h2d_gbps + d2h_gbps)``), ``copy_latency_us`` per copy.
- compute (``forward``, ``recompute``, ``backward``, ``loss``, ``embed``): ``matmul_tflops``
  (bf16 GEMM, large shapes), ``matmul_half_dim`` (a GEMM dimension at which efficiency has
  fallen to half: small GEMMs are slower per FLOP), ``attention_fwd_tflops`` and
  ``attention_bwd_tflops`` (causal flash attention), ``hbm_gbps`` (elementwise work, memsets).
- attention by kernel and length (optional): ``attention_tflops`` maps a fused attention kernel
  (``cudnn``, ``flash``) to ``[[seq_len, TFLOP/s], ...]``, its causal forward+backward rate at
  each sequence length (FLOPs counted as the cost model counts them: forward ``2 x tokens x seq
  x heads x head_dim``, backward 2.5x that). Between two lengths the rate is interpolated in
  ``log(seq_len)``; outside them it is the nearest one's (:meth:`Machine.attention_rate`). The
  cost model takes the run's kernel from it (``--attention-backend``; :mod:`flowtrain.sim.costs`)
  and splits the rate into forward and backward as ``attention_fwd_tflops`` and
  ``attention_bwd_tflops`` split theirs. A machine without it, or without the run's kernel in
  it, uses those two rates at every length.
- optimizer: ``gpu_adam_gparams`` (fused AdamW on the device, G parameters/s),
  ``cpu_adam_gparams`` (fused AdamW on the host's fp32 state with all cores, G parameters/s),
  ``cpu_cast_gparams`` (the fp32 -> bf16 refresh of the stream-bf16 layout).
- ``disk_write_gbps`` (``save``, and ``write_state`` of the state on disk), ``disk_read_gbps``
  (``read_state``), both at ``disk_queue_depth`` requests in flight (what a run keeps: each
  transfer is cut into 8 MiB pieces); ``launch_us`` (host time to issue one device task),
  ``sync_us`` (a completion travelling back to the event loop).
- memory: ``gpu_mem_gib``, ``host_mem_gib`` (used when ``--gpu-mem``/``--host-mem`` are not given);
  ``grouped_mm`` (the GPU runs a mixture of experts' grouped GEMMs, which the plan counts
  apart from the loop that runs everywhere else).
- data parallel (``reduce_grad``): ``gpu_link_gbps`` (all-reduce bus bandwidth between the GPUs
  of a node; 0 means their PCIe path) and ``network_gbps`` (between nodes).
"""

from __future__ import annotations

import bisect
import json
import math
from pathlib import Path

import msgspec

from ..errors import ConfigError

MACHINES_DIR = Path(__file__).parent / "machines"
#: the fused attention kernels an ``attention_tflops`` table may name: cuDNN's (what
#: ``--attention-backend auto`` runs on CUDA) and flash (``--attention-backend flash``)
ATTENTION_KERNELS = ("cudnn", "flash")


class Machine(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One machine's rates (see the module docstring for what each field is used for)."""

    name: str
    description: str = ""
    #: where the numbers come from: "measured ...", "datasheet ...", "probe ..."
    source: str = ""
    extends: str | None = None
    gpu: str = ""
    gpu_mem_gib: float = 80.0
    host_mem_gib: float = 256.0
    #: the GPU runs ``torch._grouped_mm`` in bf16 (compute capability 9.0 or newer): a mixture of
    #: experts takes the grouped experts there, and its plan counts what they hold
    grouped_mm: bool = False
    cpu_cores: int = 16
    # copies
    h2d_gbps: float = 25.0
    d2h_gbps: float = 25.0
    duplex_gbps: float = 40.0
    copy_latency_us: float = 10.0
    # compute
    matmul_tflops: float = 300.0
    matmul_half_dim: float = 64.0
    attention_fwd_tflops: float = 150.0
    attention_bwd_tflops: float = 110.0
    hbm_gbps: float = 2000.0
    #: causal attention forward+backward TFLOP/s by kernel and sequence length (see the module
    #: docstring); empty: ``attention_fwd_tflops`` and ``attention_bwd_tflops`` at every length
    attention_tflops: dict[str, list[tuple[int, float]]] = msgspec.field(default_factory=dict)
    # optimizer and the rest
    gpu_adam_gparams: float = 30.0
    cpu_adam_gparams: float = 2.0
    cpu_cast_gparams: float = 4.0
    disk_write_gbps: float = 0.4
    disk_read_gbps: float = 1.0
    disk_queue_depth: int = 4
    launch_us: float = 20.0
    sync_us: float = 50.0
    #: data parallel: all-reduce bus bandwidth between the GPUs of one node (GB/s; 0: their PCIe
    #: path, the smaller of ``h2d_gbps`` and ``d2h_gbps``) and between nodes
    gpu_link_gbps: float = 0.0
    network_gbps: float = 12.5
    #: free-form notes on each number (field -> note); kept when a file is rewritten
    notes: dict[str, str] = msgspec.field(default_factory=dict)

    def validate(self) -> "Machine":
        for field in self.__struct_fields__:
            value = getattr(self, field)
            if isinstance(value, float) and not value > 0 and field not in ("copy_latency_us", "launch_us", "sync_us", "gpu_link_gbps"):
                raise ConfigError(f"machine {self.name!r}: {field} must be > 0 (got {value})")
        for kernel, points in self.attention_tflops.items():
            where = f"machine {self.name!r}: attention_tflops[{kernel!r}]"
            if kernel not in ATTENTION_KERNELS:
                raise ConfigError(f"machine {self.name!r}: attention_tflops names kernel {kernel!r}; "
                                  f"the kernels are {', '.join(ATTENTION_KERNELS)}")
            if not points:
                raise ConfigError(f"{where} is empty: give [[seq_len, TFLOP/s], ...]")
            lengths = [seq for seq, _ in points]
            if any(seq <= 0 for seq in lengths) or lengths != sorted(set(lengths)):
                raise ConfigError(f"{where}: sequence lengths must be > 0 and increasing (got {lengths})")
            if any(not rate > 0 for _, rate in points):
                raise ConfigError(f"{where}: every rate must be > 0 (got {[rate for _, rate in points]})")
        if self.duplex_gbps < max(self.h2d_gbps, self.d2h_gbps):
            raise ConfigError(f"machine {self.name!r}: duplex_gbps ({self.duplex_gbps}) is both directions together, "
                              f"so at least the larger of h2d_gbps and d2h_gbps")
        return self

    def attention_rate(self, kernel: str, seq_len: int) -> float | None:
        """The causal forward+backward TFLOP/s of ``kernel`` at ``seq_len`` from
        ``attention_tflops``: a point's rate at its length, linear in ``log(seq_len)`` between
        two points, the first or last point's outside them; None where the table does not name
        the kernel."""
        points = self.attention_tflops.get(kernel)
        if not points:
            return None
        lengths = [seq for seq, _ in points]
        if seq_len <= lengths[0]:
            return float(points[0][1])
        if seq_len >= lengths[-1]:
            return float(points[-1][1])
        i = bisect.bisect_right(lengths, seq_len)
        (s0, r0), (s1, r1) = points[i - 1], points[i]
        w = (math.log(seq_len) - math.log(s0)) / (math.log(s1) - math.log(s0))
        return float(r0 + w * (r1 - r0))

    def to_json(self) -> str:
        return json.dumps(msgspec.to_builtins(self), indent=1) + "\n"


def machine_names() -> list[str]:
    """Names of the machines shipped with flowtrain."""
    return sorted(p.stem for p in MACHINES_DIR.glob("*.json"))


def load_machine(name_or_path: str | Path, _seen: tuple[str, ...] = ()) -> Machine:
    """A shipped machine by name (``h200``) or a machine file by path."""
    path = Path(name_or_path)
    if not path.suffix and not path.exists():
        path = MACHINES_DIR / f"{name_or_path}.json"
    if not path.is_file():
        raise ConfigError(f"--machine {name_or_path!r} is neither a file nor a shipped machine "
                          f"(shipped: {', '.join(machine_names())}; `flowtrain probe` writes one for this machine)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"machine file {path}: not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"machine file {path}: expected a JSON object")
    base = raw.get("extends")
    if base:
        if base in _seen:
            raise ConfigError(f"machine file {path}: 'extends' loops through {base!r}")
        parent = msgspec.to_builtins(load_machine(base, (*_seen, base)))
        parent.update({k: v for k, v in raw.items() if k != "notes"})
        parent["notes"] = {**parent.get("notes", {}), **raw.get("notes", {})}
        raw = parent
    try:
        return msgspec.convert(raw, Machine).validate()
    except msgspec.ValidationError as exc:
        raise ConfigError(f"machine file {path}: {exc}") from None


def machine_for_gpu(gpu_name: str) -> Machine | None:
    """The shipped machine whose GPU is ``gpu_name`` (``torch.cuda.get_device_name()``, e.g.
    "NVIDIA H200"), or None: what the planner predicts with when a run leaves a choice to it."""
    for name in machine_names():
        machine = load_machine(name)
        if machine.gpu and machine.gpu == gpu_name:
            return machine
    return None


def with_disk_rate(machine: Machine, gbps: float) -> Machine:
    """``machine`` with a disk that reads and writes at ``gbps`` GB/s (``--disk-gbs``): the
    state folder's, which ``read_state``, ``write_state`` and ``save`` are costed at."""
    notes = {**machine.notes, "disk_read_gbps": f"--disk-gbs {gbps:g}", "disk_write_gbps": f"--disk-gbs {gbps:g}"}
    return msgspec.structs.replace(machine, disk_read_gbps=gbps, disk_write_gbps=gbps, notes=notes)
