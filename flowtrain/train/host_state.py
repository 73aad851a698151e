"""Model state: what every unit of the model keeps between steps, and where.

A *unit* is the embedding, one decoder layer, or the head. Each is either **streamed** (its
state lives in host memory and its weights cross PCIe to the GPU for every pass) or
**resident** (its state lives in device memory and its Adam runs there). Per unit, flat:

- ``master``: fp32 weights. Streamed: in host memory, pinned on a CUDA machine, since it is
  what ``fetch`` copies to the GPU (cast there to the compute dtype) unless a streaming copy
  exists. Resident: in device memory.
- ``exp_avg``, ``exp_avg_sq``: Adam's fp32 moments, beside the master.
- ``grad``: a whole fp32 gradient: pinned host memory in the ``full`` layout (what
  ``offload_grad`` writes and ``cpu_adam`` reads), device memory for a resident unit (the
  accumulator its backward adds into), absent in the ``staged`` layouts, where gradients pass
  through a small ring of pinned staging slots owned by the step program instead.
- ``stream``: only in the ``stream-bf16`` layout, a pinned compute-dtype copy of the master that
  ``fetch`` copies (half the PCIe bytes of fp32) and ``cpu_adam`` refreshes after each update.
- ``compute``: a resident unit's compute-dtype copy (the master itself when computing in fp32).
- ``steps``: Adam's step count, one per gradient chunk (chunks are updated independently).
- ``disk_fields``: with a state folder (``--state-dir``), which of ``master``, ``exp_avg`` and
  ``exp_avg_sq`` live in the unit's files there instead (:mod:`flowtrain.train.disk_state`);
  those tensors are then empty here, and a unit whose master is on disk keeps a ``stream``
  copy in the compute dtype (fp32 too, in an fp32 run) for its fetches.
- ``expert_steps``: only in a sparse layer that skips idle experts (``StepSpec.skip_idle_experts``), each
  expert's own Adam step count, (experts,) fp32 (on the device where the layer is resident): an
  expert that no token reached in a step is not updated, so its count falls behind the layer's
  (``steps``, which counts the rest).

With LoRA (:mod:`flowtrain.model.lora`) the model's units are **frozen**: ``master`` holds the
weights in the compute dtype (what ``fetch`` copies as it is: 2 bytes per parameter in bf16),
with no moments, gradient or step count. The trained units are each decoder layer's adapters
(``adapters``, unit key ``adapter.i``): resident, fp32, with their Adam state on the device; or,
where the GPU cannot hold them (``host_adapters``), streamed like a unit of full training in the
``full`` layout (each layer's fetch brings its adapters along, CPU Adam updates them).

Host bytes per streamed parameter by layout:

=============== ============================================== =====
layout          host state                                     bytes
=============== ============================================== =====
``staged``      master, m, v (+ the shared staging ring)       12
``full``        master, m, v, gradient                         16
``stream-bf16`` master, m, v, bf16 copy (+ the staging ring)   14
LoRA's base     the weights in the compute dtype                2 (bf16)
=============== ============================================== =====

A state is built unit by unit, either from a seeded random initialisation or from a Hugging
Face checkpoint, so the model never exists twice in memory::

    state = HostState.create(cfg, pin=False)                    # everything streamed, full layout
    state.init_random(seed=0)                                   # or state.load_checkpoint(model_dir)
    state.refresh_copies()                                      # compute / stream copies from masters
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable

import torch

from ..ckpt.checkpoints import all_finite
from ..ckpt.hf import handed_out, load_into, save_hf, saved_tensors, unit_tensors
from ..errors import CheckpointError, ConfigError
from ..model import FlatMap, ModelConfig, init_unit, model_flat_maps
from ..model.adapters import LoraSpec, adapter_flat_maps
from ..model.lora import init_adapter, merge_adapter
from ..ckpt.adapter_files import save_adapter
from ..plan.buffer_sizes import LAYOUTS, chunk_range, grad_chunks, slot_numel, staging_numel  # noqa: F401 - re-exported
from .disk_state import ALIGN as DISK_ALIGN, StateStore, aligned_empty, field_numel
from .distributed import World
from .pinning import pin as pin_in_place
from .shared_state import SharedArena, aligned


def pinned_zeros(n: int, pin: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A zeroed host tensor of ``n`` elements, page-locked when ``pin``: its own pages,
    registered in place (:mod:`flowtrain.train.pinning`), or where that fails, a block of
    torch's pinned allocator."""
    t = torch.zeros(n, dtype=dtype)
    if pin and n > 0 and not pin_in_place(t):
        t = torch.zeros(n, dtype=dtype, pin_memory=True)
    return t


def return_freed_memory() -> None:
    """Make glibc give large freed blocks back to the OS at once.

    By default glibc raises its mmap threshold each time a large block is freed, so later blocks
    of that size come from per-thread heaps that keep the memory after ``free``; with tensors
    allocated and freed on several lane threads the process's resident memory then drifts far
    above what is live (0.7 GiB for a 57M-parameter model on the CPU). A fixed 1 MiB threshold
    keeps host memory what the plan says it is. A no-op where glibc is not the allocator."""
    global _RETURN_SET
    if _RETURN_SET:
        return
    _RETURN_SET = True
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


_RETURN_SET = False


def shared_sizes(layouts: list[FlatMap], layout: str, resident: set[str], dtype: torch.dtype,
                 chunks: dict[str, int], experts: dict[str, int] | None = None) -> dict[str, int]:
    """Bytes of the two shared files :class:`UnitState` takes its streamed tensors from: the
    ``pinned`` one (what ``fetch`` copies: the fp32 master, or the ``stream-bf16`` copy) and
    the ``plain`` one (Adam's moments and step counts, a streamed copy's master, and the
    per-expert step counts of the layers ``experts`` names, by unit key)."""
    streams_copy = layout == "stream-bf16" and dtype != torch.float32
    item = dtype.itemsize
    sizes = {"pinned": 0, "plain": 0}
    for lay in layouts:
        if lay.key in resident:
            continue
        n = lay.numel
        sizes["pinned"] += aligned(n * (item if streams_copy else 4))
        sizes["plain"] += 2 * aligned(4 * n) + (aligned(4 * n) if streams_copy else 0)
        sizes["plain"] += chunks.get(lay.key, 1) * aligned(4)
        sizes["plain"] += aligned(4 * (experts or {}).get(lay.key, 0))
    return sizes


class UnitState:
    """The flat tensors of one unit; see the module docstring for each field."""

    __slots__ = ("flat_map", "master", "exp_avg", "exp_avg_sq", "grad", "stream", "compute", "steps", "resident",
                 "frozen", "expert_steps", "disk_fields")

    def __init__(self, layout: FlatMap, *, pin: bool, layout_name: str, resident: bool,
                 device: torch.device, dtype: torch.dtype, chunks: int, arena: SharedArena | None = None,
                 frozen: bool = False, experts: int = 0, disk_fields: tuple[str, ...] = ()) -> None:
        n = layout.numel
        self.flat_map = layout  # where each weight sits in the unit's flat buffers
        self.disk_fields = disk_fields
        self.expert_steps = None
        if experts:  # on the device where resident; in the node's shared file where the state is
            self.expert_steps = (arena.take("plain", experts, torch.float32) if arena is not None and not resident
                                 else torch.zeros(experts, dtype=torch.float32, device=device if resident else "cpu"))
        self.resident = resident
        #: a LoRA base unit: its weights in the compute dtype, nothing else (see the module docstring)
        self.frozen = frozen
        self.stream: torch.Tensor | None = None
        self.compute: torch.Tensor | None = None
        self.grad: torch.Tensor | None  # the full layout's gradient; staged gradients pass through a ring
        if frozen:
            self.master = torch.zeros(n, dtype=dtype, device=device) if resident else pinned_zeros(n, pin, dtype)
            self.compute = self.master if resident else None
            self.exp_avg = self.exp_avg_sq = torch.empty(0)
            self.grad, self.steps = None, []
            return
        if resident:
            z = lambda dt=torch.float32: torch.zeros(n, dtype=dt, device=device)  # noqa: E731
            self.master, self.exp_avg, self.exp_avg_sq, self.grad = z(), z(), z(), z()
            self.compute = self.master if dtype == torch.float32 else z(dtype)
            self.steps = [torch.zeros((), dtype=torch.float32, device=device)]
            return
        streams_copy = layout_name == "stream-bf16" and dtype != torch.float32
        if disk_fields:  # in the state folder's files; a master there leaves a compute copy here
            empty = torch.empty(0, dtype=torch.float32)
            on_disk = "master" in disk_fields
            self.master = empty if on_disk else pinned_zeros(n, pin and not streams_copy)
            self.stream = pinned_zeros(n, pin, dtype) if (streams_copy or on_disk) else None
            self.exp_avg = self.exp_avg_sq = empty
            self.steps = [torch.zeros((), dtype=torch.float32) for _ in range(chunks)]
        elif arena is None:
            self.master = pinned_zeros(n, pin and not streams_copy)
            self.stream = pinned_zeros(n, pin, dtype) if streams_copy else None
            self.exp_avg = torch.zeros(n, dtype=torch.float32)
            self.exp_avg_sq = torch.zeros(n, dtype=torch.float32)
            self.steps = [torch.zeros((), dtype=torch.float32) for _ in range(chunks)]
        else:  # the node's one copy (fetch copies the pinned file's tensors)
            self.master = arena.take("plain" if streams_copy else "pinned", n, torch.float32)
            self.stream = arena.take("pinned", n, dtype) if streams_copy else None
            self.exp_avg = arena.take("plain", n, torch.float32)
            self.exp_avg_sq = arena.take("plain", n, torch.float32)
            self.steps = [arena.take("plain", 1, torch.float32).view(()) for _ in range(chunks)]
        self.grad = pinned_zeros(n, pin) if layout_name == "full" else None

    @property
    def master_on_disk(self) -> bool:
        return "master" in self.disk_fields

    def own_grad(self) -> torch.Tensor:
        """The unit's own fp32 gradient: a resident unit's on the device, the full layout's on
        the host. A staged unit has none (its gradient passes through the pinned ring)."""
        if self.grad is None:
            raise RuntimeError(f"{self.flat_map.key} has no gradient buffer of its own (staged layout, streamed)")
        return self.grad

    def refresh_copies(self, lo: int = 0, hi: int | None = None) -> None:
        """Bring the compute / streaming copy of ``master[lo:hi]`` up to date."""
        self.refresh_from(self.master[lo:hi], lo)

    def refresh_from(self, master: torch.Tensor, lo: int = 0) -> None:
        """Bring ``[lo, lo + len(master))`` of the compute / streaming copy up to date from
        ``master`` (the unit's master there, or where it is on disk, the slot it was read into)."""
        hi = lo + master.numel()
        for copy in (self.compute, self.stream):
            if copy is not None and copy is not self.master:
                copy[lo:hi].copy_(master)


class HostState:
    """All units' state, indexed like :func:`model_flat_maps` (embed, layers, head)."""

    def __init__(self, cfg: ModelConfig, units: list[UnitState], layout: str = "full",
                 arena: SharedArena | None = None, lora: LoraSpec | None = None,
                 adapters: list[UnitState] | None = None) -> None:
        self.cfg = cfg
        self.units = units
        self.layout = layout
        #: the node's shared state files, where the processes of a node share the state
        self.arena = arena
        #: LoRA: what the adapters are, and each decoder layer's (fp32; resident, or streamed)
        self.lora = lora
        self.adapters = adapters or []
        #: the state folder's files, where some units keep their state on disk (``--state-dir``;
        #: :meth:`attach_store`)
        self.store: StateStore | None = None
        #: elements of one staging chunk (the units' files are one per chunk of this size)
        self.stage_n = 0
        self.chunks: dict[str, int] = {}

    @classmethod
    def create(cls, cfg: ModelConfig, *, pin: bool, layout: str = "full", resident: Iterable[str] = (),
               device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
               chunks: dict[str, int] | None = None, world: World | None = None,
               lora: LoraSpec | None = None, skip_idle: Iterable[int] = (),
               host_adapters: bool = False, disk: dict[str, tuple[str, ...]] | None = None) -> "HostState":
        """Allocate every unit's state (zeros): ``resident`` unit keys on ``device``, the rest in
        host memory in ``layout``; ``chunks`` gives the staging chunks of large units. With a
        ``world`` of several processes on this node, the streamed units' state is the node's
        one shared copy (:mod:`flowtrain.train.shared_state`); every process of the node calls
        this at the same point. With ``lora`` the model's units are frozen, in ``dtype``, and
        each layer has its adapters on ``device`` (with ``host_adapters``, in host memory). The
        decoder layers in ``skip_idle`` (streamed, sparse) count each expert's Adam steps apart
        (``expert_steps``). ``disk`` names, by unit key, the fields that live in the state folder
        (:meth:`attach_store` makes the files)."""
        if layout not in LAYOUTS:
            raise ConfigError(f"{{layout}} must be one of {', '.join(LAYOUTS)} (got {layout!r})", named=True)
        res = set(resident)
        chunks = chunks or {}
        layouts = model_flat_maps(cfg)
        arena = None
        skipping = {f"layer.{i}" for i in skip_idle}
        if world is not None and world.local_size > 1 and lora is None:
            sizes = shared_sizes(layouts, layout, res, dtype, chunks, {k: cfg.num_experts for k in skipping})
            arena = SharedArena.open(world, sizes, pin=pin)
        dev = torch.device(device)
        if skipping and lora is not None:
            raise ConfigError("layers that skip idle experts are in a run that trains the whole model")
        disk = disk or {}
        if disk and (arena is not None or lora is not None):
            raise ConfigError("a state folder (--state-dir) is for a whole model's training in one process per node")
        units = [UnitState(lay, pin=pin, layout_name=layout, resident=lay.key in res, device=dev,
                           dtype=dtype, chunks=chunks.get(lay.key, 1), arena=arena, frozen=lora is not None,
                           experts=cfg.num_experts if lay.key in skipping else 0,
                           disk_fields=disk.get(lay.key, ()) if lay.key not in res else ())
                 for lay in layouts]
        # the adapters on the device, or with ``host_adapters`` streamed: in (pinned) host
        # memory with a whole gradient of their own (the full layout: a few MB a layer)
        adapters = [UnitState(lay, pin=pin and host_adapters, layout_name="full", resident=not host_adapters,
                              device=dev, dtype=torch.float32, chunks=1)
                    for lay in adapter_flat_maps(cfg, lora)] if lora is not None else []
        state = cls(cfg, units, layout, arena, lora, adapters)
        state.chunks = dict(chunks)
        state.stage_n = staging_numel(layouts, res)
        return state

    # ---- the state folder --------------------------------------------------------------------
    @property
    def disk_units(self) -> list[UnitState]:
        return [u for u in self.units if u.disk_fields]

    def disk_files(self) -> list[tuple[str, int | None, int, tuple[str, ...]]]:
        """``(key, chunk, numel, fields)`` of every file the state folder holds: one per unit,
        or per staging chunk where the unit's Adam runs in chunks (the staged layout)."""
        out: list[tuple[str, int | None, int, tuple[str, ...]]] = []
        for u in self.disk_units:
            for c in self.unit_chunks(u):
                lo, hi = chunk_range(u.flat_map.numel, self.stage_n, c)
                out.append((u.flat_map.key, c, hi - lo, u.disk_fields))
        return out

    def unit_chunks(self, u: UnitState) -> list[int | None]:
        """The chunks a unit's ``cpu_adam`` runs over: ``[None]`` for the whole unit (the full
        layout), else ``[0, 1, ...]``."""
        if self.layout == "full":
            return [None]
        return list(range(self.chunks.get(u.flat_map.key, 1)))

    def attach_store(self, store: StateStore) -> None:
        """Take the state folder's files (made for :meth:`disk_files`); the units' disk fields
        are filled by the initialisation or load that follows."""
        self.store = store

    def put_on_disk(self, u: UnitState, fields: dict[str, torch.Tensor], scratch: torch.Tensor | None = None) -> None:
        """Write a whole unit's disk fields from memory (``fields`` by name, each ``numel``
        elements; a missing one is zeros), chunk by chunk, and refresh its compute copy from a
        master given."""
        assert self.store is not None, "attach_store first"
        key, n = u.flat_map.key, u.flat_map.numel
        if scratch is None:
            scratch = aligned_empty(self.store.slot_numel)
        for c in self.unit_chunks(u):
            lo, hi = chunk_range(n, self.stage_n, c)
            self.store.fill(key, c, {k: v[lo:hi] for k, v in fields.items() if k in u.disk_fields}, scratch)
        if "master" in fields:
            u.refresh_from(fields["master"])

    def from_disk(self, u: UnitState, fields: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """A whole unit's disk fields (those of ``fields`` only, where given) as fresh tensors: a
        checkpoint's state, or the final model's master. Each field is read alone, chunk by chunk,
        straight into its tensor where the chunk starts on a 4 KiB boundary of it (always for a
        unit in one file), else through a buffer of one chunk: memory holds the fields asked
        for, and only for a unit in unaligned chunks one chunk's field more."""
        assert self.store is not None
        key, n = u.flat_map.key, u.flat_map.numel
        names = [k for k in u.disk_fields if fields is None or k in fields]
        out = {k: aligned_empty(field_numel(n)) for k in names}
        scratch: torch.Tensor | None = None
        for c in self.unit_chunks(u):  # in order: a chunk read in place pads into the next one's start
            lo, hi = chunk_range(n, self.stage_n, c)
            for k in names:
                if lo % (DISK_ALIGN // 4) == 0:
                    self.store.read_field(key, c, k, out[k][lo:])
                    continue
                if scratch is None:
                    scratch = aligned_empty(field_numel(self.stage_n))
                out[k][lo:hi].copy_(self.store.read_field(key, c, k, scratch))
        return {k: v[:n] for k, v in out.items()}

    def field_of(self, u: UnitState, name: str) -> torch.Tensor:
        """The unit's ``master``, ``exp_avg`` or ``exp_avg_sq``: its own tensor, or where that
        field is on disk a fresh tensor read back (held only as long as the caller holds it)."""
        if name in u.disk_fields:
            return self.from_disk(u, (name,))[name]
        tensor: torch.Tensor = getattr(u, name)
        return tensor

    def to_disk(self, u: UnitState, field: str, buf: torch.Tensor) -> None:
        """Write one of a whole unit's disk fields (``field``) from ``buf`` (an
        :func:`aligned_empty` of :func:`field_numel` of the unit's elements, its first ``numel``
        the field), chunk by chunk, and nothing else of its files: :meth:`from_disk`'s
        counterpart. Each chunk goes straight from ``buf`` where it starts on a 4 KiB boundary of
        it and its padding is ``buf``'s zeroed tail (always for a unit in one file), else through
        a zero-padded buffer of one chunk; the files' padding stays zeros."""
        assert self.store is not None
        key, n = u.flat_map.key, u.flat_map.numel
        per = DISK_ALIGN // 4
        buf[n: field_numel(n)].zero_()
        scratch: torch.Tensor | None = None
        for c in self.unit_chunks(u):
            lo, hi = chunk_range(n, self.stage_n, c)
            if lo % per == 0 and (hi == n or (hi - lo) % per == 0):
                self.store.write_field(key, c, field, buf[lo:])
                continue
            if scratch is None:
                scratch = aligned_empty(field_numel(self.stage_n))
            scratch[hi - lo:].zero_()
            scratch[: hi - lo].copy_(buf[lo:hi])
            self.store.write_field(key, c, field, scratch)

    @contextlib.contextmanager
    def filling(self, u: UnitState, field: str) -> Iterator[torch.Tensor]:
        """The unit's moment ``field`` (``exp_avg`` or ``exp_avg_sq``) as a checkpoint fills it in
        place, every element: its own tensor, or where it is on disk a buffer of that field
        alone, written to the files once filled (:meth:`to_disk`; one field in memory)."""
        if field not in u.disk_fields:
            yield getattr(u, field)
            return
        buf = aligned_empty(field_numel(u.flat_map.numel))
        yield buf[: u.flat_map.numel]
        self.to_disk(u, field, buf)

    def saved_unit(self, u: UnitState) -> "UnitState | DiskUnitView":
        """What a checkpoint writes of ``u``: the unit itself, or where its state is on disk a
        view that reads each field back as the checkpoint asks for it (one field in memory)."""
        return DiskUnitView(self, u) if u.disk_fields else u

    @property
    def flat_maps(self) -> list[FlatMap]:
        return [u.flat_map for u in self.units]

    @property
    def embed(self) -> UnitState:
        return self.units[0]

    @property
    def head(self) -> UnitState:
        return self.units[-1]

    @property
    def resident(self) -> tuple[str, ...]:
        return tuple(u.flat_map.key for u in self.units if u.resident)

    @property
    def trained(self) -> list[UnitState]:
        """The units the optimizer updates: the model's, or with LoRA the adapters."""
        return self.adapters if self.lora is not None else self.units

    def unit(self, unit: str, layer: int | None) -> UnitState:
        """The state of ``("embed", None)``, ``("layer", i)``, ``("head", None)`` or, with
        LoRA, ``("adapter", i)``."""
        if unit == "adapter":
            return self.adapters[layer]  # type: ignore[index]
        if unit == "embed":
            return self.units[0]
        if unit == "head":
            return self.units[-1]
        return self.units[1 + layer]  # type: ignore[operator]

    def init_random(self, seed: int) -> None:
        """Fresh weights, unit by unit, each unit from its own seeded generator: so the units are
        drawn on every core at once (a 32B model's 33 billion draws take minutes on one) and
        the weights are the same whatever the order. A unit whose master is on disk is drawn
        into a passing buffer and written there (one at a time: the model never is in memory)."""
        in_memory = [u for u in self.units if not u.master_on_disk]
        workers = max(1, min(len(in_memory), os.cpu_count() or 1))
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda u: init_unit(u.master, u.flat_map, self.cfg, seed), in_memory))
        self._place_disk_units(lambda u, m: init_unit(m, u.flat_map, self.cfg, seed))
        self.init_adapters(seed)
        self.refresh_copies()

    def hf_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The model's tensors as they are now, by the Hub's names (fp32, on the CPU): views of
        the masters, or under LoRA each layer's base with its adapters merged, a copy per layer
        (the base stays as it is). A tied model's ``lm_head.weight`` is left out, as saved. A
        master on disk is read back when its unit comes, and no longer referenced here once the
        unit's last tensor is handed out (one such unit in memory, for a consumer that copies)."""
        for i, u in enumerate(self.units):
            flat = self.field_of(u, "master")
            if self.lora is not None and 0 < i <= len(self.adapters):
                a = self.adapters[i - 1]
                flat = flat.clone()
                merge_adapter(flat, u.flat_map, a.master.cpu(), a.flat_map, self.lora.scale)
            tensors = saved_tensors(self.cfg, flat, u.flat_map)
            del flat
            yield from handed_out(tensors)  # empties the list as it goes

    def merge_adapters(self) -> None:
        """Add each layer's adapters into its base weights, in place (the base is then no
        longer the one the adapters were trained over: for the end of a run)."""
        assert self.lora is not None
        for i, a in enumerate(self.adapters):
            base = self.units[1 + i]
            merge_adapter(base.master, base.flat_map, a.master.cpu(), a.flat_map, self.lora.scale)
            base.refresh_copies()

    def load_adapters(self, flats: list[torch.Tensor]) -> None:
        """Each layer's adapters from ``flats`` (one buffer per layer, as :func:`read_adapter` gives)."""
        for a, flat in zip(self.adapters, flats, strict=True):
            a.master.copy_(flat)

    def init_adapters(self, seed: int) -> None:
        """Fresh adapters as PEFT makes them (``B`` zero: the adapted model is the base)."""
        for a in self.adapters:
            init_adapter(a.master, a.flat_map, seed)

    def load_checkpoint(self, model_dir: str | Path, units: list[UnitState] | None = None) -> None:
        """Fill the masters of ``units`` (by default the model's) from a Hugging Face model
        directory, or from a checkpoint of this run (:attr:`trained`, the adapters with LoRA);
        weights that hold NaN or inf are refused (training from them would only spread it)."""
        units = self.units if units is None else units
        in_memory = [u for u in units if not u.master_on_disk]
        load_into(model_dir, self.cfg, [u.flat_map for u in in_memory], [u.master for u in in_memory])
        for u in in_memory:
            self._check_finite(model_dir, u, u.master)

        def load_one(u: UnitState, master: torch.Tensor) -> None:  # a master on disk, through memory
            load_into(model_dir, self.cfg, [u.flat_map], [master])
            self._check_finite(model_dir, u, master)

        self._place_disk_units(load_one, [u for u in units if u.disk_fields])
        self.refresh_copies()

    @staticmethod
    def _check_finite(model_dir: str | Path, u: UnitState, master: torch.Tensor) -> None:
        for name, view in unit_tensors(master, u.flat_map):
            if not all_finite(view):
                raise CheckpointError(f"{model_dir}: the weight {name} ({u.flat_map.key}) holds NaN or inf")

    def _place_disk_units(self, fill_master, units: list[UnitState] | None = None) -> None:
        """Give each unit with state on disk its first contents: the master, filled by
        ``fill_master(unit, buffer)`` into a passing buffer where it is on disk, and zero
        moments."""
        units = self.disk_units if units is None else units
        if not units:
            return
        assert self.store is not None, "attach_store before the state is filled"
        scratch = aligned_empty(self.store.slot_numel)
        for u in units:
            fields: dict[str, torch.Tensor] = {}
            if u.master_on_disk:
                fields["master"] = torch.empty(u.flat_map.numel, dtype=torch.float32)
                fill_master(u, fields["master"])
            self.put_on_disk(u, fields, scratch)

    def refresh_copies(self) -> None:
        for u in self.units:
            if not u.master_on_disk:  # its copy is refreshed where the master passes through memory
                u.refresh_copies()

    def save(self, out_dir: str | Path, dtype: torch.dtype = torch.float32, *, max_shard_bytes: int | None = None,
             source_config: dict | None = None, merge: bool = False, base_model: str | None = None) -> None:
        """The masters as a Hugging Face checkpoint in ``dtype`` (see :func:`save_hf`). With LoRA,
        the adapters as a PEFT adapter folder (fp32; ``base_model`` named in its config), or with
        ``merge`` the base with the adapters merged into it (:meth:`merge_adapters`) as a model."""
        if self.lora is not None and not merge:
            save_adapter(out_dir, self.lora, [a.flat_map for a in self.adapters], [a.master.cpu() for a in self.adapters],
                         base_model=base_model)
            return
        if self.lora is not None:
            self.merge_adapters()
        # a master on disk is read back as its unit's tensors are written: one unit in memory
        masters = [functools.partial(self.field_of, u, "master") if u.master_on_disk else u.master for u in self.units]
        save_hf(out_dir, self.cfg, self.flat_maps, masters, dtype,
                max_shard_bytes=max_shard_bytes, source_config=source_config)


class DiskUnitView:
    """A unit whose state is on disk as a checkpoint writes it: its own layout, step counts and
    compute copy; each field that is on disk read back afresh from its files each time it is
    asked for (a checkpoint asks once per field, as its turn to be written comes, and lets it go
    before the next: :class:`~flowtrain.ckpt.saved_state.SavedUnit`)."""

    def __init__(self, state: HostState, unit: UnitState) -> None:
        self.state = state
        self.unit = unit
        self.flat_map = unit.flat_map
        self.steps = unit.steps
        self.expert_steps = unit.expert_steps

    @property
    def master(self) -> torch.Tensor:
        return self.state.field_of(self.unit, "master")

    @property
    def exp_avg(self) -> torch.Tensor:
        return self.state.field_of(self.unit, "exp_avg")

    @property
    def exp_avg_sq(self) -> torch.Tensor:
        return self.state.field_of(self.unit, "exp_avg_sq")
