"""The planner: the plan of a training run, decided before anything is allocated.

``flowtrain train`` follows the plan and refuses a run that does not fit; ``flowtrain plan``
prints it::

    req = RunRequest(seq_len=4096, batch_size=16, micro_batch_size=4, gpu_mem=10)
    plan = plan_run(preset("llama-8b"), req, device=torch.device("cuda"), dtype=torch.bfloat16)
    plan.fits, plan.host, plan.gpu, plan.spec.resident, plan.max_micro_batch

The planner itself needs no torch: ``device`` and ``dtype`` are only read for their type and
element size, and CUDA is asked for its free memory only when planning for this machine's GPU
(``local_gpu=False`` plans for another machine: ``flowtrain simulate --machine``). What each
candidate costs is counted by :mod:`.memory`; what would make a run that does not fit fit, by
:mod:`.suggest`.

What the plan decides:

- **Layout** of the streamed units' host state (see ``host_state``): ``staged`` (12 bytes per
  parameter: fp32 master and Adam m, v; gradients pass through a few pinned staging slots) by
  default, ``full`` (16: a whole host gradient) where ``--grad-clip`` needs every gradient before
  any update, ``stream-bf16`` (14: a pinned bf16 copy, half the PCIe bytes per fetch) on request.
- **Placement**: on a GPU, which units are *resident* (state in GPU memory, Adam there). For
  speed, the embedding and head (whose Adam and fetch sit at the step boundary) and the bottom
  third of the layers (the first the next step's forward needs, while CPU Adam of the layers
  above is still running), as far as GPU memory allows;
  for capacity, further layers while the host cannot hold the streamed state.
- **Loss chunk** size: the largest (up to the default) whose logits fit the GPU budget.

Then **activations**: which layers keep theirs for the backward on the GPU
(:func:`plan_activations`), which checkpoints go to host memory, and at long sequences which
layers save their attention output (:mod:`.attention`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Callable

import msgspec

from ..errors import ConfigError
from ..graph.compiler import MAX_LAYER_PASSES, StepSpec, compile_step
from ..graph.tasks import ACTS, GRADS, HOST_GRADS, WEIGHTS
from ..model.config import ModelConfig, default_chunk_tokens
from .adapters import host_adapters
from .attention import attention_pays, forward_flops_saved, plan_saved_attention
from .experts import runs_grouped
from .buffer_sizes import LAYOUTS, grad_chunks, host_memory_total, staging_numel
from .disk import place_on_disk
from .memory import (
    ACTIVATIONS,
    Plan,
    RunRequest,
    budget_limits,
    compile_backend,
    count_bytes,
    gpu_peak,
    kept_bytes_per_token_by_layer,
    layer_work_bytes,
    live_micro_batches,
    offload_act_slots,
    offload_in_flight,
    unit_flat_maps,
)
from .suggest import suggest

if TYPE_CHECKING:
    import torch

__all__ = ["BATCH_BYTES_PER_TOKEN", "Chooser", "check_step_size", "most_micro_batches", "never_resident", "plan_activations", "plan_once",
           "plan_run"]


def _layout(req: RunRequest) -> str:
    if req.layout == "auto":
        return "full" if req.grad_clip else "staged"
    if req.layout not in LAYOUTS:
        raise ConfigError(f"--layout must be auto or one of {', '.join(LAYOUTS)} (got {req.layout!r})")
    return req.layout


def _explicit_resident(req: RunRequest) -> tuple[str, ...] | None:
    if req.resident == "auto":
        return None
    if req.resident in ("none", ""):
        return ()
    return tuple(k.strip() for k in req.resident.split(",") if k.strip())  # StepSpec checks the keys


def _make(cfg, req, device, dtype, policy, layout, resident, chunk_tokens, shrink: dict[str, int],
          grow: dict[str, int] | None = None) -> Plan:
    """One candidate plan; ``grow`` raises and ``shrink`` caps the policy's slot budgets."""
    spec = _spec(cfg, req, layout, resident)
    budgets, floor = _policy_budgets(spec, policy)
    for pool, want in (grow or {}).items():
        if pool in budgets:
            budgets[pool] = max(budgets[pool], want)
    for pool, cap in shrink.items():
        if pool in budgets:
            budgets[pool] = max(floor.get(pool, 1), min(budgets[pool], cap))
    if spec.lora:  # no gradient of the base leaves the device or waits in a slot (host adapters' do)
        budgets.update({pool: 0 for pool in ((HOST_GRADS,) if spec.host_adapters else (GRADS, HOST_GRADS))
                        if pool in budgets})
    host, gpu = count_bytes(cfg, req, device, dtype, layout, resident, budgets, chunk_tokens)
    params = sum(lay.numel for lay in unit_flat_maps(cfg))
    return Plan(device=device.type, params=params, layout=layout, spec=spec, budgets=budgets, node_processes=req.share,
                chunk_tokens=chunk_tokens, host=host, gpu=gpu, host_limit=None, gpu_limit=None)


class _BudgetCache:
    """The slot budgets a policy proposes for one step shape, and their floor, asked once each.

    Planning tries many candidates (resident units, smaller loss chunks and slot caps, every
    micro-batch size, the simulator's alternatives), and each needs its policy's budgets. A
    policy proposes from the compiled step graph, which takes ~30 ms to build for 100 layers
    and 16 micro-batches, while the answer depends only on the policy and the ``StepSpec``: so
    each pair is compiled and asked once. A policy object is keyed by identity and kept alive by
    its entries (its id cannot be reused while they exist); a name also by what it is
    registered as now.
    """

    def __init__(self, size: int = 512) -> None:
        self.size = size
        self._entries: dict[tuple, tuple[Any, dict[str, int], dict[str, int]]] = {}

    def __call__(self, spec: StepSpec, policy: Any) -> tuple[dict[str, int], dict[str, int]]:
        """(budgets, floor): the policy's proposal over the built-ins' defaults, and the least
        each pool may be shrunk to."""
        from ..policy import POLICIES

        who = (policy, POLICIES.get(policy)) if isinstance(policy, str) else id(policy)
        key = (who, msgspec.json.encode(spec))
        if key not in self._entries:
            if len(self._entries) >= self.size:
                self._entries.pop(next(iter(self._entries)))  # the oldest
            self._entries[key] = (policy, *self._ask(spec, policy))
        _, budgets, floor = self._entries[key]
        return dict(budgets), dict(floor)

    @staticmethod
    def _ask(spec: StepSpec, policy: Any) -> tuple[dict[str, int], dict[str, int]]:
        from ..policy import resolve_policy
        from ..policy.base import budgets as default_budgets
        from ..policy.base import min_grad_slots

        graph = compile_step(spec)
        # A pool the graph takes from but the policy did not budget (a user's policy written
        # for another layout, say) gets the built-ins' default.
        budgets = {**default_budgets(graph, weights=2, grads=1), **resolve_policy(policy).propose(graph).budgets}
        return budgets, {WEIGHTS: 1, GRADS: min_grad_slots(graph)}


_policy_budgets = _BudgetCache()


def _spec(cfg: ModelConfig, req: RunRequest, layout: str, resident: tuple[str, ...]) -> StepSpec:
    layouts = unit_flat_maps(cfg)
    staged = layout != "full"
    chunks = grad_chunks(layouts, resident, staging_numel(layouts, resident)) if staged else {}
    return StepSpec(layers=cfg.num_layers, micro_batches=req.batch_size // req.micro_batch_size,
                    checkpoint_every=req.checkpoint_every, order=req.order, tied=cfg.tie_word_embeddings,
                    grad_clip=req.grad_clip, resident=resident, staged=staged, grad_chunks=chunks,
                    # LoRA's processes each keep their own base and adapters: nothing to share
                    reduce=req.processes > 1, share=1 if req.lora_rank > 0 else req.share, lora=req.lora_rank > 0,
                    host_adapters=host_adapters(req),
                    skip_idle_experts=_skipping_idle_experts(cfg, req)).validate()


def _skipping_idle_experts(cfg: ModelConfig, req: RunRequest) -> tuple[int, ...]:
    """The layers whose idle experts are skipped: every sparse layer, with ``--skip-idle-experts``."""
    return tuple(cfg.sparse_layers()) if req.skip_idle_experts else ()


def _backlog(cfg: ModelConfig, resident: tuple[str, ...], weights: bool = True) -> dict[str, int]:
    """Extra slots for speed where every layer's gradient is finished by one backward pass (one
    micro-batch per step, or micro-batch order). Backward then outruns CPU Adam, so finished
    gradients queue, and the CPU runs Adam in the order the next step needs the units
    (:func:`~flowtrain.policy.base.optimizer_urgency`), which leaves the top layers' gradients
    waiting longest. They wait in pinned host staging slots (half the streamed layers can), not
    on the GPU, so backward never waits for Adam. And the next step's forward through the
    streamed layers is shorter than their fetches: with weight slots for a third of them
    (``weights``), their fetches start during the backward of the resident layers below, once
    each layer's Adam is done. Both measured on W1 in ``flowtrain simulate``: more gained
    nothing. The plan takes them only where memory holds them, and before kept activations
    (:func:`_keep` fills what is left), which save less per GPU byte where fetches bound the
    forward."""
    streamed_layers = sum(1 for i in range(cfg.num_layers) if f"layer.{i}" not in resident)
    out = {HOST_GRADS: 3 + math.ceil(streamed_layers / 2)}
    if weights:
        out[WEIGHTS] = max(2, math.ceil(streamed_layers / 3))
    return out


def plan_once(cfg, req, device, dtype, policy, host_limit, gpu_limit) -> Plan:
    """The plan for one micro-batch size (:func:`_plan_placed`), with what the state folder
    takes of it (:func:`~flowtrain.plan.disk.place_on_disk`, where ``--state-dir`` is given)."""
    return place_on_disk(_plan_lora(cfg, req, device, dtype, policy, host_limit, gpu_limit), cfg, req,
                         dtype.itemsize)


def _plan_lora(cfg, req, device, dtype, policy, host_limit, gpu_limit) -> Plan:
    """With LoRA and ``lora_state``
    auto, the adapters stay on the GPU where that plan fits, else go to host memory where that
    one fits (or, fitting neither, where the GPU's budget holds: host memory is then short)."""
    if req.lora_rank <= 0 or req.lora_state != "auto":
        return _plan_placed(cfg, req, device, dtype, policy, host_limit, gpu_limit)
    on_gpu = _plan_placed(cfg, msgspec.structs.replace(req, lora_state="gpu"), device, dtype, policy, host_limit,
                          gpu_limit)
    explicit = _explicit_resident(req) or ()
    if on_gpu.fits or device.type != "cuda" or any(u.startswith("layer.") for u in explicit):
        return on_gpu  # (a resident layer has no fetch to bring its adapters from host memory)
    on_host = _plan_placed(cfg, msgspec.structs.replace(req, lora_state="host"), device, dtype, policy, host_limit,
                           gpu_limit)
    return on_host if on_host.fits or (on_host.gpu_fits and not on_gpu.gpu_fits) else on_gpu


def _plan_placed(cfg, req, device, dtype, policy, host_limit, gpu_limit) -> Plan:
    """The plan for one micro-batch size: state placement first, then activations.

    The state is placed with every checkpoint on the GPU, as recompute keeps them. Where
    offloading is allowed (``offload``, or ``auto`` on a GPU) and that plan does not fit or had
    to give up weight or gradient slots to fit, the state is placed again with every checkpoint
    on the host, and :func:`_bring_back` returns to the GPU as many as then fit. A checkpoint
    saves more copying per GPU byte than a resident layer, so residency only gets what the
    checkpoints leave, as long as they fit. A plan that offloads checkpoints keeps no layers.
    At long sequences ``auto`` then compares that plan with one that saves attention outputs
    (:mod:`.attention`)."""
    if req.activations == "offload":
        return _bring_back(_plan_state(cfg, req, device, dtype, policy, host_limit, gpu_limit), cfg, req)
    if req.activations == "attention":
        _check_activations(req)
        if cfg.generic:
            raise ConfigError("{activations} attention saves the native layer's attention outputs; the generic layer "
                              "path runs transformers' attention: use keep, offload or recompute", named=True)
        every = _with_saved_attention(cfg, req, device, dtype, policy, host_limit, gpu_limit, every=True)
        assert every is not None  # with every layer saving, plan_saved_attention always answers
        return every
    plan = _plan_state(cfg, req, device, dtype, policy, host_limit, gpu_limit)
    if req.activations == "auto" and device.type == "cuda" and (not plan.fits or _squeezed(plan, policy)):
        offloading = msgspec.structs.replace(req, activations="offload")
        away = _bring_back(_plan_state(cfg, offloading, device, dtype, policy, host_limit, gpu_limit), cfg, req)
        # taken only where it fits and fits better: it costs host memory, which may be what is
        # short (then residency, not offloading, is the way to fit)
        if away.fits and (not plan.fits or not _squeezed(away, policy, than=plan)):
            plan = away
        elif not plan.fits and away.gpu_fits and not plan.gpu_fits:
            # neither fits, but offloading keeps the GPU in budget: host memory is what is
            # short, and that plan's refusal says so
            plan = away
    if not plan.spec.offload:
        plan = plan_activations(plan, cfg, req, dtype)
    if (req.activations == "auto" and device.type == "cuda" and req.checkpoint_every == 1 and not cfg.generic
            and attention_pays(cfg, req.seq_len)):
        saving = _with_saved_attention(cfg, req, device, dtype, policy, host_limit, gpu_limit, every=False)
        # judged as the state folder will leave it (plan_once places the state on disk last)
        if saving is not None and place_on_disk(saving, cfg, req, dtype.itemsize).fits and (
                forward_flops_saved(saving, cfg, req.seq_len) > forward_flops_saved(plan, cfg, req.seq_len)):
            return saving
    return plan


def _with_saved_attention(cfg, req, device, dtype, policy, host_limit, gpu_limit, every: bool) -> Plan | None:
    """The plan that saves attention outputs (:mod:`.attention`): the state placed (where
    attention pays, with residency only for capacity: a step is then long enough that fetches
    and CPU Adam hide), checkpoints offloaded as far as needed, the GPU spent on the outputs."""
    speed = not attention_pays(cfg, req.seq_len)
    eager_work = layer_work_bytes(cfg, req.micro_batch_size * req.seq_len, dtype.itemsize, compiled=False,
                                  grouped=runs_grouped(cfg, req, device.type, dtype))
    return plan_saved_attention(
        cfg, req, dtype.itemsize, req.micro_batch_size * req.seq_len * live_micro_batches(req), eager_work,
        lambda r: _plan_state(cfg, r, device, dtype, policy, host_limit, gpu_limit, speed=speed),
        offload_in_flight(req, req.micro_batch_size * req.seq_len * cfg.hidden_size * dtype.itemsize),
        offload_act_slots(req), every, _disk_room(cfg, req, dtype.itemsize, every))


def _disk_room(cfg: ModelConfig, req: RunRequest, compute_bytes: int, every: bool) -> Callable[[Plan], int]:
    """The host bytes the state folder frees for offloaded checkpoints, beside a plan's: what
    ``--disk-state moments`` or ``all`` moves there anyway; with ``auto``, only where every layer
    was asked to save its attention output (``every``), what moving every streamed unit's state
    would free, of which :func:`place_on_disk` then moves only what the plan needs. ``auto``
    without ``every`` plans as without a folder: it brings no disk traffic of its own accord."""
    mode = req.disk_state
    if mode == "none" or (mode == "auto" and not every):
        return lambda plan: 0
    widest = msgspec.structs.replace(req, disk_state="all" if mode == "auto" else mode)

    def room(plan: Plan) -> int:
        return max(0, plan.host_node_total - place_on_disk(plan, cfg, widest, compute_bytes).host_node_total)

    return room


def _squeezed(plan: Plan, policy: Any, than: Plan | None = None) -> bool:
    """Whether ``plan`` has fewer weight or gradient slots than the policy proposes for its step
    (or, with ``than``, than that plan has): it gave up prefetch or overlap to fit."""
    want = than.budgets if than is not None else _policy_budgets(plan.spec, policy)[0]
    return any(plan.budgets[p] < want[p] for p in (WEIGHTS, GRADS) if p in want)


def plan_activations(plan: Plan, cfg: ModelConfig, req: RunRequest, dtype: torch.dtype) -> Plan:
    """Where each layer's activations wait for its backward (``StepSpec.keep`` and ``.offload``),
    and their bytes: ``keep`` keeps every layer's on the GPU, ``recompute`` keeps a checkpoint
    every ``--activation-checkpoint-every`` layers on the GPU and recomputes the rest, ``offload``
    sends every checkpoint to pinned host memory and brings it back before its backward.

    This picks the kept layers; the offloaded checkpoints are picked before, with the state's
    placement (:func:`_plan_once`), and a plan that offloads some keeps none. ``auto`` (on a GPU;
    recompute on the CPU) spends the GPU budget in order of what it saves per byte: first
    checkpoints on the GPU instead of the host, then, once every checkpoint is on the GPU, kept
    layers from the top (their backward comes first, so their memory is freed first). Kept
    layers need a checkpoint at every layer, so ``--activation-checkpoint-every`` above 1 means
    recompute or offload."""
    mode = req.activations
    _check_activations(req)
    compiled = compile_backend(req.compile, plan.device) == "inductor"
    grouped = runs_grouped(cfg, req, plan.device, dtype)
    tokens = req.micro_batch_size * req.seq_len * live_micro_batches(req)
    per_layer = [b * tokens for b in kept_bytes_per_token_by_layer(cfg, dtype, compiled, grouped)]
    L = cfg.num_layers
    if mode == "keep":
        n = L
    elif mode == "recompute" or plan.device != "cuda" or req.checkpoint_every != 1:
        n = 0
    elif plan.gpu_limit is None:
        n = L
    else:  # the most top layers whose kept bytes fit
        free, n = plan.gpu_limit - plan.gpu_total, 0
        while n < L and per_layer[L - n - 1] <= free:
            free -= per_layer[L - n - 1]
            n += 1
    if n == 0:
        return plan
    # A kept layer's input is no checkpoint any more: its graph holds what backward needs.
    checkpoints = plan.gpu.get("checkpoints", 0) * (L - n) // L
    plan.spec = msgspec.structs.replace(plan.spec, keep=tuple(range(L - n, L)))
    plan.gpu = {**plan.gpu, "checkpoints": checkpoints, "kept_activations": sum(per_layer[L - n:])}
    return plan


def _check_activations(req: RunRequest) -> None:
    mode = req.activations
    if mode not in ACTIVATIONS:
        raise ConfigError(f"--activations must be one of {', '.join(ACTIVATIONS)} (got {mode!r})")
    if mode in ("keep", "attention") and req.checkpoint_every != 1:
        raise ConfigError(f"--activations {mode} needs --activation-checkpoint-every 1: a segment of "
                          "several layers recomputes them all")


def _bring_back(plan: Plan, cfg: ModelConfig, req: RunRequest) -> Plan:
    """From a plan with every checkpoint offloaded (:func:`_bytes`): ``offload`` keeps it so;
    ``auto`` brings checkpoints back to the GPU from the top while the budget holds them, and
    offloads the rest, the bottom ones (``StepSpec.offload``): they are away longest, so their
    copies have the most time to hide behind compute. With none left offloaded, the plan is a
    plain recompute plan."""
    starts = list(range(0, cfg.num_layers, req.checkpoint_every))
    per_ck = plan.host["offloaded_activations"] // len(starts)
    slots = plan.gpu["checkpoints"]
    offloading = plan.gpu
    recomputing = {k: v for k, v in offloading.items() if k != "offload_in_flight"}
    recomputing["checkpoints"] = len(starts) * per_ck

    def with_back(n_off: int) -> dict[str, int]:  # the GPU items with all but n_off checkpoints back
        if n_off == 0:
            return recomputing
        return {**offloading, "checkpoints": slots + (len(starts) - n_off) * per_ck}

    if req.activations == "offload":
        n_off = len(starts)
    elif plan.gpu_limit is None:
        n_off = 0
    else:  # the fewest offloaded (from the bottom) that fit, else all of them
        limit = plan.gpu_limit
        n_off = next((n for n in range(len(starts) + 1) if gpu_peak(with_back(n)) <= limit), len(starts))
    plan.gpu = with_back(n_off)
    host = {k: v for k, v in plan.host.items() if k != "offloaded_activations"}
    if n_off == 0:
        plan.host = host
        return plan
    plan.host = {**host, "offloaded_activations": n_off * per_ck}
    plan.spec = msgspec.structs.replace(plan.spec, offload=tuple(starts[:n_off]))
    plan.budgets = {**plan.budgets, ACTS: offload_act_slots(req)}
    return plan


def _plan_state(cfg, req, device, dtype, policy, host_limit, gpu_limit, speed: bool = True) -> Plan:
    """Layout, resident units, loss chunk and slot budgets for one micro-batch size. Without
    ``speed``, ``--resident auto`` makes units resident only as host memory needs, and no slots
    are added for a backlog (:func:`_backlog`)."""
    layout = _layout(req)
    explicit = _explicit_resident(req)
    default_chunk = req.chunk_tokens or default_chunk_tokens(cfg.vocab_size)

    def build(resident: tuple[str, ...]) -> Plan:
        """The plan for one placement, shrunk to the GPU budget: smaller loss chunks first, then
        one gradient accumulator instead of two, then one weight slot (no prefetch)."""
        chunk, shrink = default_chunk, dict[str, int]()
        if speed and device.type == "cuda" and (req.batch_size == req.micro_batch_size or req.order == "micro"):
            for weights in (True, False):
                p = _make(cfg, req, device, dtype, policy, layout, resident, chunk, shrink,
                          _backlog(cfg, resident, weights))
                p.host_limit, p.gpu_limit = host_limit, gpu_limit
                if p.host_fits and p.gpu_fits:
                    return p
        p = _make(cfg, req, device, dtype, policy, layout, resident, chunk, shrink)
        while device.type == "cuda" and gpu_limit is not None and p.gpu_total > gpu_limit:
            if req.chunk_tokens is None and chunk > 256:
                chunk = max(256, chunk // 2)
            elif GRADS not in shrink and p.budgets[GRADS] > 1:
                shrink = {**shrink, GRADS: 1}
            elif p.budgets[WEIGHTS] > 1 and WEIGHTS not in shrink:
                shrink = {**shrink, WEIGHTS: 1}
            else:
                break
            p = _make(cfg, req, device, dtype, policy, layout, resident, chunk, shrink)
        p.host_limit, p.gpu_limit = host_limit, gpu_limit
        return p

    if explicit is not None or device.type != "cuda":
        return build(explicit or ())
    return _choose_resident(cfg, build, policy, speed, never=never_resident(cfg, req))


def never_resident(cfg: ModelConfig, req: RunRequest) -> frozenset[str]:
    """The layers no ``--resident auto`` choice may keep on the GPU: with adapters in host
    memory, every layer (a layer's fetch is what brings its adapters)."""
    return frozenset(f"layer.{i}" for i in range(cfg.num_layers)) if host_adapters(req) else frozenset()


def _choose_resident(cfg: ModelConfig, build, policy: Any, speed: bool = True,  # build(resident) -> Plan
                     never: frozenset[str] = frozenset()) -> Plan:
    """The resident units: embedding and head if they fit, then layers bottom-up, as many as
    the GPU holds up to the speed set (a third of the layers: past it, one more resident layer
    saves less than it costs in slots) without shrinking the weight and gradient slots (a
    resident layer saves less than a prefetch slot costs), and past that only as many as host
    memory needs. Without ``speed``, only the layers host memory needs (where the step is long
    enough that fetches and CPU Adam hide behind compute, residency buys nothing).

    GPU bytes grow and host bytes shrink with every resident layer, so the count is found by
    bisection: about 2 log2(layers) plans instead of one per layer (a 100-layer plan compiles
    a step graph per candidate, ~30 ms each). The layers in ``never`` stay streamed."""
    plan = build(())
    head = ("embed", "head")
    base: tuple[str, ...] = ()
    if speed:
        trial = build(head)
        base = head if trial.gpu_fits and not _squeezed(trial, policy) else ()
        if base:
            plan = trial
    layers = [f"layer.{i}" for i in range(cfg.num_layers) if f"layer.{i}" not in never]
    L = len(layers)
    tried: dict[int, Plan] = {0: plan}

    def at(k: int) -> Plan:
        if k not in tried:
            tried[k] = build(base + tuple(layers[:k]))
        return tried[k]

    def first(lo: int, hi: int, pred) -> int:
        """The least k in [lo, hi] with pred(k), or hi + 1; pred is false then true."""
        while lo <= hi:
            mid = (lo + hi) // 2
            if pred(mid):
                hi = mid - 1
            else:
                lo = mid + 1
        return lo

    def fits(k: int) -> bool:  # on the GPU without giving up slots the policy proposes
        return at(k).gpu_fits and not _squeezed(at(k), policy)

    n_speed = min(L, math.ceil(L / 3)) if speed else 0
    k0 = n_speed if fits(n_speed) else first(1, n_speed, lambda k: not fits(k)) - 1  # the most that fit
    if at(k0).host_fits:
        return at(k0)
    # Then add layers until host memory fits or the GPU is full (slots may shrink here: this
    # residency is for capacity, without which the run does not fit at all).
    k = first(k0, L, lambda k: at(k).host_fits or not at(k).gpu_fits)
    if k > L or not at(k).gpu_fits:
        k -= 1
    # never below k0: where even k0 overflows the GPU, more residency cannot help it, and the
    # plan says so against the GPU budget rather than moving the whole model onto it
    return at(max(k, k0))




#: ``choose(req, plan_one) -> (req, plan, why_order, why_memory)``: the choices a plan leaves
#: to a prediction (``--order auto``, the alternatives to the rules' activations, layout and
#: resident units), made from above by
#: :func:`flowtrain.sim.choose_plan.plan_and_choose`; ``plan_one`` plans one request
Chooser = Callable[[RunRequest, Callable[[RunRequest], Plan]], tuple[RunRequest, Plan, str | None, str | None]]


def plan_run(cfg: ModelConfig, req: RunRequest, *, device: torch.device, dtype: torch.dtype,
             policy: Any = "double_buffer", local_gpu: bool = True, choose: Chooser | None = None) -> Plan:
    """The plan for ``req`` on ``device``, with the largest micro-batch that fits and, if the run
    does not fit, what would. ``local_gpu=False`` plans for a GPU elsewhere (the simulator's
    machine): its memory is ``req.gpu_mem`` alone, not capped by what is free on this one.
    ``choose`` makes the choices that need a prediction; without it ``--order auto`` is
    ``layer`` and the rules' plan stands (what ``plan_and_choose`` also answers on the
    CPU, or where no machine model describes the GPU)."""
    if req.batch_size < 1 or req.micro_batch_size < 1 or req.batch_size % req.micro_batch_size:
        raise ConfigError(f"{{micro_batch_size}} {req.micro_batch_size} does not divide {{batch_size}} {req.batch_size}",
                          named=True)
    check_step_size(cfg, req)
    host_limit, gpu_limit = budget_limits(req, device, local_gpu)

    def plan_one(r: RunRequest) -> Plan:
        return plan_once(cfg, r, device, dtype, policy, host_limit, gpu_limit)

    if choose is None:
        req = msgspec.structs.replace(req, order="layer") if req.order == "auto" else req
        plan, order_choice, memory_choice = plan_one(req), None, None
    else:
        req, plan, order_choice, memory_choice = choose(req, plan_one)
    plan.order_choice, plan.memory_choice = order_choice, memory_choice
    for b in _micro_batch_sizes(req.batch_size, most_micro_batches(cfg)):
        trial = plan if b == req.micro_batch_size else plan_once(
            cfg, msgspec.structs.replace(req, micro_batch_size=b), device, dtype, policy, host_limit, gpu_limit)
        if trial.fits:
            plan.max_micro_batch = b
            break
    if not plan.fits:
        plan.suggestions = suggest(plan, req, policy,
                                   lambda r, pol: plan_once(cfg, r, device, dtype, pol, host_limit, gpu_limit))
    return plan


def most_micro_batches(cfg: ModelConfig) -> int:
    """The most micro-batches a step of ``cfg`` may have: its step graph holds at most
    :data:`~flowtrain.graph.spec.MAX_LAYER_PASSES` layer passes (layers x micro-batches)."""
    return max(1, MAX_LAYER_PASSES // cfg.num_layers)


#: Host bytes per token of a step's batch that no run goes below: its input and target ids, int64
#: (``flowtrain.data.source.Batch``), copied out of the data for every step.
BATCH_BYTES_PER_TOKEN = 16


def check_step_size(cfg: ModelConfig, req: RunRequest) -> None:
    """Refuse, in one line naming the settings, a step whose batch the host could not hold (its
    token ids alone, :data:`BATCH_BYTES_PER_TOKEN` a token, against ``--host-mem`` or all of this
    machine's memory) or of more micro-batches than its graph may hold
    (:func:`most_micro_batches`), by integer arithmetic before any candidate plan compiles a
    graph: ``--batch-size`` 1,000,000 in micro-batches of 8 was 125,000 micro-batches, whose
    graph took 11 GB and ten minutes to build, printing nothing."""
    host = int(req.host_mem * 2**30) if req.host_mem is not None else host_memory_total()
    ids = req.batch_size * req.seq_len * BATCH_BYTES_PER_TOKEN
    if host is not None and ids > host:
        source = "{host_mem}" if req.host_mem is not None else "all of this machine's memory"
        raise ConfigError(
            f"{{batch_size}} {req.batch_size:,} sequences of {{seq_len}} {req.seq_len:,} tokens: the step's token ids "
            f"alone ({BATCH_BYTES_PER_TOKEN} bytes a token: {ids / 2**30:,.1f} GiB) are more than the host could hold "
            f"({host / 2**30:,.1f} GiB, {source}); give a smaller {{batch_size}}", named=True)
    n = req.batch_size // req.micro_batch_size
    most = most_micro_batches(cfg)
    if n <= most:
        return
    share = f" (this process's share of {req.processes})" if req.processes > 1 else ""
    raise ConfigError(
        f"{{batch_size}} {req.batch_size:,}{share} in micro-batches of {{micro_batch_size}} {req.micro_batch_size:,} is "
        f"{n:,} micro-batches a step; through the model's {cfg.num_layers:,} layers its graph would hold "
        f"{n * cfg.num_layers:,} layer passes, more than the {MAX_LAYER_PASSES:,} a step may hold (at most "
        f"{most:,} micro-batches): give a {{micro_batch_size}} of at least {-(-req.batch_size // most):,} or a smaller "
        f"{{batch_size}}", named=True)


def _micro_batch_sizes(batch_size: int, most: int) -> Iterator[int]:
    """The divisors of ``batch_size`` that make at most ``most`` micro-batches, largest first:
    found from the micro-batch counts, so a batch of 10**12 sequences costs ``most`` divisions,
    not 10**12."""
    for n in range(1, min(most, batch_size) + 1):
        if batch_size % n == 0:
            yield batch_size // n
