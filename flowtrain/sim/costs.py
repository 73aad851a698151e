"""The cost model: how long one task takes on one machine.

Each task kind costs what its work is divided by the rate of the part of the machine that does
it (:class:`~flowtrain.sim.machine.Machine`)::

    costs = CostModel(machine, shape)
    costs.seconds(Forward(layer=3, micro_batch=0))   # FLOPs over the matmul and attention rates
    costs.copy_bytes(Fetch(unit="layer", layer=3))   # bytes; the simulator picks the link rate

- ``forward`` / ``recompute``: the layer's GEMMs (2 x tokens x parameters, each GEMM at a rate
  that falls for small dimensions: ``dim / (dim + matmul_half_dim)`` per dimension), causal
  attention (``2 x tokens x seq x heads x head_dim``) at the attention forward rate, and the
  elementwise passes (norms, rotary, SwiGLU, residuals) at the memory bandwidth.
- ``backward``: the layer's forward once more (flowtrain rebuilds the layer under autograd from
  its saved input), twice its GEMM FLOPs, the attention backward (2.5x the forward's FLOPs,
  as flash attention counts it) at the attention backward rate, twice the elementwise passes
  and the fp32 accumulation of the weight gradient. A layer whose forward kept its activations
  (activations ``keep``, ``--activations``) runs no forward again in its backward; one that kept
  its attention output (activations ``attn``) runs no attention forward again.
- LoRA (``Shape.adapter_params``): the frozen base's backward has input gradients only (one
  GEMM pass, no accumulation), and every layer adds its adapters' work: thin GEMMs (2 FLOPs per
  adapter parameter and token, one of the sizes the rank) and ``SOFTWARE["ew_adapter"]`` passes
  over each product, which is as wide as its map's output; the backward runs twice that.
- the attention rates: the run's kernel (:func:`attention_kernel`: ``Shape.attention_backend``
  ``auto`` runs cuDNN's fused attention on CUDA, ``flash`` flash attention) at the run's
  sequence length, from the machine's ``attention_tflops`` table (forward+backward TFLOP/s by
  kernel and length, interpolated in ``log(seq)``: :meth:`Machine.attention_rate`). That rate
  ``R`` is split as the machine's ``attention_fwd_tflops`` (``f``) and ``attention_bwd_tflops``
  (``b``) split theirs: the forward rate ``R (1 + 2.5 f / b) / 3.5``, the backward ``b / f``
  times it, so that the forward and backward of a layer take ``3.5 x forward FLOPs / R``
  together. A machine without the table, or without the run's kernel in it, uses ``f`` and
  ``b`` themselves at every length.
- ``loss``: head forward and backward (three GEMMs of ``tokens x hidden x vocab`` in loss
  chunks) plus passes over the fp32 logits.
- ``fetch`` / ``offload_grad``, and ``offload_act`` / ``fetch_act`` (one micro-batch's layer
  input, ``tokens x hidden`` in the compute dtype): bytes over the link; the rate depends on
  whether the other direction is busy at the time, so the simulator asks
  :meth:`CostModel.copy_seconds`.
- ``cpu_adam``: parameters over the CPU's fused AdamW rate; with ``adam_workers`` jobs at once
  each gets that share of the cores. ``gpu_adam``: parameters over the device's AdamW rate.
- ``save``: 12 bytes per parameter over the disk's write rate. ``read_state``/``write_state``
  (the optimizer state kept in ``--state-dir``): 8 bytes per parameter of the unit or chunk, 12
  where its master is on disk too, over the disk's read or write rate
  (:meth:`CostModel.disk_seconds`). ``reduce_grad`` (data parallel):
  a ring all-reduce of the unit's fp32 gradient, 2 (n - 1) / n of its bytes over the GPUs' link
  (``gpu_link_gbps``) or, across nodes, the network. Every device task adds the host's launch
  cost.

:data:`SOFTWARE` holds the few numbers that describe flowtrain's kernels rather than the machine
(how many elementwise passes a layer makes, ...), the same for every machine: most counted from
the kernels, the rest fitted to task times of the H200 and H100 traces in docs/bench/, each
entry saying which.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from ..graph.registry import KindTable
from ..graph.tasks import STATE_PIECE, STATE_QUEUE_DEPTH, Task
from .machine import Machine

#: flowtrain's kernels, not the machine's: counted or fitted, as each says (see module docstring).
SOFTWARE = {
    # bytes moved by a layer's elementwise work per token, in units of hidden / intermediate
    # elements of the compute dtype (compiled RMSNorm, rotary, SwiGLU and residual adds)
    "ew_hidden": 12.0,
    "ew_intermediate": 4.0,
    # passes over a loss chunk's fp32 logits (cast, logsumexp, softmax, gradient, bf16 copy), and
    # each chunk's own cost beside them (its dozen kernels, the weight gradient's add), seconds:
    # fitted to the loss tasks of the H100 gate's traces at chunks of 512, 1,536 and 2,048 tokens
    # (docs/bench/2026-12-06/gate6-h100-*-trace.json, ft7b-h100-trace.json: llama-8b 72.5 ms,
    # llama-3b 106.5, qwen3-moe-12l 99.0, Qwen2.5-7B's shape 678; within 8% each)
    "loss_logit_passes": 14.0,
    "loss_chunk_seconds": 680e-6,
    # attention backward FLOPs per forward FLOP (flash attention's convention)
    "attention_bwd_ratio": 2.5,
    # a mixture of experts' routed rows: hidden elements moved per (token, expert) pair in the
    # forward (gathered by expert, weighted, added back to their token), not fitted
    "ew_routed": 6.0,
    # LoRA: output-sized elements moved per adapted map and token in the forward (the adapter's
    # product written, read back with the map's own output, their sum written), counted, not fitted
    "ew_adapter": 4.0,
    # ... and in the backward: the output gradient scaled (read, written) and the input
    # gradient added to the base map's (two read, one written), counted, not fitted
    "ew_adapter_backward_out": 2.0,
    "ew_adapter_backward_in": 3.0,
    # an MLP in pieces (flowtrain.model.mlp), eager: intermediate-sized passes per token in its
    # forward (the activation reads gate and writes; the product reads two and writes) and in its
    # backward (the rebuild's 5; the product's backward 6, the activation's 3), counted, not fitted
    "ew_pieces_forward": 5.0,
    "ew_pieces_backward": 14.0,
    # GEMMs and fused attention inside a training step run at this share of the rates a probe of
    # each kernel alone measures (the machine's matmul_tflops and attention_tflops): the clock
    # under sustained load, HBM shared with the copies beside them. The layer forward and backward
    # tasks of the H100 gate's traces (docs/bench/2026-12-06/gate6-h100-*-trace.json) ran 2-7%
    # over the probed rates' times, the H200's (docs/bench/2026-12-04/*-trace.json) 4-6%
    "in_step": 0.97,
    # a layer's and the head's backward GEMMs (input and weight gradients) per FLOP against the
    # forward's rate; 1: the same rate
    "gemm_backward": 1.0,
}


class Shape(msgspec.Struct, frozen=True, kw_only=True):
    """What the cost model needs of a model and a run: sizes and per-unit parameter counts.

    ``numel`` maps unit keys (``embed``, ``layer.3``, ``head``) to parameters; a layer missing
    from it has ``layer_numel``. ``fetch_bytes`` is bytes per parameter crossing the link on a
    fetch (4: fp32 masters cast on the device; 2: the stream-bf16 layout's bf16 copy).
    """

    hidden: int
    #: a dense MLP's width; for a mixture of experts, the k experts' together (k x expert width)
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    seq_len: int
    micro_batch_size: int
    layer_numel: int
    numel: dict[str, int] = {}
    chunk_tokens: int = 4096
    compute_bytes: int = 2
    fetch_bytes: int = 4
    refresh: bool = False  # cpu_adam also refreshes a bf16 streaming copy (stream-bf16)
    grad_chunks: dict[str, int] = {}
    adam_workers: int = 1
    #: data-parallel processes in all, and the nodes they run on (``reduce_grad``)
    world: int = 1
    nodes: int = 1
    #: the streamed units whose Adam this process runs, where the node's processes share one
    #: host copy of the state (``StepSpec.owned_by``); None: every unit
    owned: frozenset[str] | None = None
    #: the run's ``--attention-backend`` (``auto``: cuDNN's fused attention on CUDA; ``flash``):
    #: which of the machine's ``attention_tflops`` rates attention runs at (:func:`attention_kernel`)
    attention_backend: str = "auto"
    #: a mixture of experts' sparse layers (0: dense): experts per layer, experts per token
    #: (``intermediate`` is then ``experts_per_token`` x each expert's width)
    experts: int = 0
    experts_per_token: int = 0
    #: LoRA: the adapter parameters a token multiplies by (0: the whole model trains). The base's units then take
    #: no weight gradient: a layer's backward runs its input gradients only, the loss no head
    #: gradient, and each ``gpu_adam`` updates one layer's adapters (``numel["adapter.i"]``).
    adapter_params: float = 0
    #: LoRA: the adapters' rank, and the adapted maps' output features a token passes through in
    #: a layer (:func:`~flowtrain.plan.adapters.adapter_active_outputs`)
    lora_rank: int = 0
    adapter_outputs: float = 0
    #: LoRA: the adapted maps' input features in a layer, added up (the widest layer's)
    adapter_inputs: int = 0
    #: model FLOPs per trained token, the one count every report uses
    #: (:func:`flowtrain.model.counts.model_flops_per_token`; 0 in a shape built by hand)
    flops_per_token: float = 0.0
    #: units whose fp32 master is on disk beside their moments (``--disk-state``)
    disk_master: frozenset[str] = frozenset()
    #: the pieces a dense layer's MLP runs in (0: the plain, compiled path): a micro-batch longer
    #: than :data:`flowtrain.model.config.MLP_CHUNK_TOKENS` runs it that many tokens at a time,
    #: outside the compiled layer, and its backward rebuilds each piece's gate and up
    mlp_pieces: int = 0

    @property
    def per_node(self) -> int:
        """Data-parallel processes on one node: they share its CPU cores, so each one's Adam
        runs at a ``1 / per_node`` share of them (each on the units it owns)."""
        return max(1, self.world // self.nodes)

    @property
    def tokens(self) -> int:
        """Tokens per micro-batch."""
        return self.micro_batch_size * self.seq_len

    @staticmethod
    def unit_key(task: Task) -> str:
        return f"{task.unit}.{task.layer}" if task.layer is not None else (task.unit or "layer")

    def unit_numel(self, task: Task) -> int:
        key = self.unit_key(task)
        n = self.numel.get(key, self.layer_numel if task.unit == "layer" else 0)
        chunks = self.grad_chunks.get(key, 1) if task.chunk is not None else 1
        return -(-n // chunks)



def _eff(dim: float, half: float) -> float:
    return dim / (dim + half)


def attention_kernel(backend: str, device_type: str = "cuda") -> str:
    """The fused attention kernel a run with ``--attention-backend backend`` runs on a
    ``device_type`` device, as :func:`flowtrain.model.attention.attention_backends` orders
    them: ``auto`` is cuDNN's on CUDA, ``flash`` is flash attention (the simulator's machines
    are GPUs, so ``device_type`` is CUDA unless said otherwise)."""
    if backend not in ("auto", "flash"):
        raise ValueError(f"attention backend must be auto or flash (got {backend!r})")
    return "cudnn" if backend == "auto" and device_type == "cuda" else "flash"


def attention_rates(machine: Machine, kernel: str, seq_len: int, bwd_ratio: float = SOFTWARE["attention_bwd_ratio"]
                    ) -> tuple[float, float]:
    """``(forward, backward)`` TFLOP/s of causal attention with ``kernel`` at ``seq_len`` on
    ``machine``: its ``attention_tflops`` rate for that kernel and length, split in the ratio of
    its ``attention_fwd_tflops`` and ``attention_bwd_tflops`` (``bwd_ratio`` backward FLOPs per
    forward FLOP); those two themselves where the table does not name the kernel."""
    f, b = machine.attention_fwd_tflops, machine.attention_bwd_tflops
    rate = machine.attention_rate(kernel, seq_len)
    if rate is None:
        return f, b
    fwd = rate * (1.0 + bwd_ratio * f / b) / (1.0 + bwd_ratio)
    return fwd, fwd * b / f


class CostModel:
    """Seconds per task of one :class:`Shape` on one :class:`Machine` (see module docstring)."""

    def __init__(self, machine: Machine, shape: Shape, software: dict | None = None) -> None:
        self.m = machine
        self.s = shape
        self.sw = {**SOFTWARE, **(software or {})}
        #: the attention kernel the run uses, and its forward and backward TFLOP/s at the run's length
        self.attention_kernel = attention_kernel(shape.attention_backend)
        self.attention_tflops = attention_rates(machine, self.attention_kernel, shape.seq_len,
                                                self.sw["attention_bwd_ratio"])
        self._layer = self._layer_costs()

    # ---- building blocks ------------------------------------------------------------------
    def gemm_seconds(self, m: int, n: int, k: int, count: float = 1.0) -> float:
        """``count`` GEMMs of (m x k) @ (k x n) in bf16: 2 m n k FLOPs each."""
        h = self.m.matmul_half_dim
        rate = self.m.matmul_tflops * 1e12 * _eff(m, h) * _eff(n, h) * _eff(k, h)
        return count * 2.0 * m * n * k / rate

    def hbm_seconds(self, nbytes: float) -> float:
        return nbytes / (self.m.hbm_gbps * 1e9)

    def _layer_costs(self) -> dict[str, float]:
        s, sw = self.s, self.sw
        T, h, i = s.tokens, s.hidden, s.intermediate
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        gemms = (self.gemm_seconds(T, q, h) + 2 * self.gemm_seconds(T, kv, h) + self.gemm_seconds(T, h, q)
                 + self._mlp_gemm_seconds()) / sw["in_step"]
        bwd_gemms = gemms / sw["gemm_backward"]  # one pass of the backward's GEMMs (input or weight gradients)
        attn_flops = 2.0 * T * s.seq_len * q
        fwd_tflops, bwd_tflops = self.attention_tflops
        attn_fwd = attn_flops / (fwd_tflops * 1e12 * sw["in_step"])
        attn_bwd = sw["attention_bwd_ratio"] * attn_flops / (bwd_tflops * 1e12 * sw["in_step"])
        routed = sw["ew_routed"] * s.experts_per_token * h if s.experts else 0.0
        ew = self.hbm_seconds(T * s.compute_bytes * (sw["ew_hidden"] * h + sw["ew_intermediate"] * i + routed))
        forward = gemms + attn_fwd + ew
        if s.mlp_pieces and not s.adapter_params:
            forward += self._pieces_forward_extra()
        if s.adapter_params:  # a frozen base: input gradients only, and the adapters' own work
            adapter_gemms, adapter_ew = self._adapter_seconds()
            forward += adapter_gemms + adapter_ew
            backward = forward + bwd_gemms + attn_bwd + 2 * ew + 2 * adapter_gemms + self._adapter_backward_ew()
        else:
            accumulate = self.hbm_seconds(s.layer_numel * (s.compute_bytes + 8))
            backward = forward + 2 * bwd_gemms + attn_bwd + 2 * ew + accumulate
            if s.mlp_pieces:  # each piece's gate and up once more, under autograd in the backward
                backward += 2 * self.gemm_seconds(T, i, h) / sw["in_step"] + self._pieces_backward_extra()
        return {"forward": forward, "backward": backward, "gemms": gemms, "attention": attn_fwd + attn_bwd,
                "attention_forward": attn_fwd}

    def _pieces_forward_extra(self) -> float:
        """An MLP in pieces' forward beyond the compiled path's elementwise passes: its eager
        passes over the intermediate (``ew_pieces_forward`` against ``ew_intermediate``) and each
        piece's output copied into the layer's."""
        s, sw = self.s, self.sw
        T, cb = s.tokens, s.compute_bytes
        return self.hbm_seconds(T * cb * ((sw["ew_pieces_forward"] - sw["ew_intermediate"]) * s.intermediate
                                          + 2 * s.hidden))

    def _pieces_backward_extra(self) -> float:
        """An MLP in pieces' backward beyond the compiled path's: its eager passes over the
        intermediate (``ew_pieces_backward`` against twice ``ew_intermediate``), each piece's input
        gradient copied into the layer's, and the three weight gradients added in fp32 once a
        piece (read, the piece's own read, written), then cast to the compute dtype."""
        s, sw = self.s, self.sw
        T, cb, h, i = s.tokens, s.compute_bytes, s.hidden, s.intermediate
        weights = 3 * h * i
        return self.hbm_seconds(T * cb * ((sw["ew_pieces_backward"] - 2 * sw["ew_intermediate"]) * i + 2 * h)
                                + s.mlp_pieces * weights * (4 + cb + 4) + weights * (4 + cb))

    def _adapter_seconds(self) -> tuple[float, float]:
        """A LoRA layer's adapters in its forward: (their thin GEMMs, ``x A^T`` then ``B``: 2
        FLOPs per adapter parameter and token, at the rate of a GEMM one of whose sizes is the
        rank; the elementwise passes over each product as wide as its map's output). Their
        backward runs twice the GEMMs: input and adapter gradients (two GEMMs each per map)."""
        s = self.s
        per_layer = s.adapter_params / s.layers
        rank = max(s.lora_rank, 1)
        gemm = self.gemm_seconds(s.tokens, rank, max(round(per_layer / rank), 1))
        return gemm, self.hbm_seconds(s.tokens * s.compute_bytes * self.sw["ew_adapter"] * s.adapter_outputs)

    def _adapter_backward_ew(self) -> float:
        """A LoRA layer's adapters' elementwise passes in its backward: the output gradient
        scaled for each adapter (``ew_adapter_backward_out`` passes of its outputs) and each
        adapter's input gradient added to its map's (``ew_adapter_backward_in`` of its inputs)."""
        s, sw = self.s, self.sw
        return self.hbm_seconds(s.tokens * s.compute_bytes * (sw["ew_adapter_backward_out"] * s.adapter_outputs
                                                              + sw["ew_adapter_backward_in"] * s.adapter_inputs))

    def _mlp_gemm_seconds(self) -> float:
        """The MLP's GEMMs in a layer's forward. Dense: gate and up (T x h by h x i), down. A
        mixture of experts: the router, then each projection as one grouped GEMM over the
        experts, expert e's rows a GEMM of its own; with T k rows spread evenly, E GEMMs of T k / E
        rows each, at the rate a GEMM of that size runs (small ones run far below a dense MLP's)."""
        s = self.s
        T, h, i = s.tokens, s.hidden, s.intermediate
        if not s.experts:
            return 2 * self.gemm_seconds(T, i, h) + self.gemm_seconds(T, h, i)
        rows = max(1, T * s.experts_per_token // s.experts)
        width = i // s.experts_per_token
        return (self.gemm_seconds(T, s.experts, h) + 2 * self.gemm_seconds(rows, width, h, count=s.experts)
                + self.gemm_seconds(rows, h, width, count=s.experts))

    def _loss_seconds(self, backward: bool) -> float:
        s = self.s
        T, chunk = s.tokens, min(s.chunk_tokens, s.tokens)
        bwd_products = 0 if not backward else 1 if s.adapter_params else 2  # a frozen head: no weight gradient
        gemms = (1 + bwd_products / self.sw["gemm_backward"]) * self.gemm_seconds(
            chunk, s.vocab, s.hidden, count=T / chunk) / self.sw["in_step"]
        if not backward:  # the logits' log-softmax at the targets, no gradient
            return gemms + self.hbm_seconds(3.0 * T * s.vocab * 4)
        return (gemms + self.hbm_seconds(self.sw["loss_logit_passes"] * T * s.vocab * 4)
                + self.sw["loss_chunk_seconds"] * T / chunk)

    # ---- per task -------------------------------------------------------------------------
    def copy_bytes(self, task: Task) -> int:
        """Bytes a copy task moves (0 for other kinds)."""
        match task.kind:
            case "fetch":
                return self.s.unit_numel(task) * self.s.fetch_bytes
            case "offload_grad":
                return self.s.unit_numel(task) * 4
            case "offload_act" | "fetch_act":
                return self.s.tokens * self.s.hidden * self.s.compute_bytes
        return 0

    def disk_seconds(self, task: Task, gbps: float) -> float:
        """Seconds of one ``read_state`` or ``write_state``: the unit's (or chunk's) moments, 8
        bytes per parameter, and its master where that is on disk too (``disk_master``: 12), at
        ``gbps``, the drive's rate with ``disk_queue_depth`` requests in flight. The run keeps
        up to :data:`~flowtrain.graph.tasks.STATE_QUEUE_DEPTH` pieces of ``STATE_PIECE`` bytes
        in flight (fewer for a small transfer); with fewer than the machine's depth the rate
        falls in proportion."""
        nbytes = self.s.unit_numel(task) * (12 if self.s.unit_key(task) in self.s.disk_master else 8)
        in_flight = min(STATE_QUEUE_DEPTH, -(-nbytes // STATE_PIECE))
        rate = gbps * min(1.0, in_flight / max(1, self.m.disk_queue_depth))
        return nbytes / (rate * 1e9) + self.m.copy_latency_us * 1e-6

    def copy_seconds(self, task: Task, other_direction_busy: bool) -> float:
        """A copy's time: its bytes over its direction's rate, or, while the other direction is
        copying too, its share of the duplex rate (the two directions' rates scaled alike until
        they sum to ``duplex_gbps``: each keeps the same fraction of its lone rate, as the traces
        show, ``python -m flowtrain.sim.link_rates``)."""
        m = self.m
        rate = m.h2d_gbps if task.lane == "h2d" else m.d2h_gbps
        if other_direction_busy:
            rate *= min(1.0, m.duplex_gbps / (m.h2d_gbps + m.d2h_gbps))
        t = self.copy_bytes(task) / (rate * 1e9) + m.copy_latency_us * 1e-6
        if task.kind == "fetch" and self.s.fetch_bytes == 4 and self.s.compute_bytes != 4:
            t += self.hbm_seconds(self.s.unit_numel(task) * (4 + self.s.compute_bytes))  # cast on the device
        return t + m.launch_us * 1e-6

    def seconds(self, task: Task) -> float:
        """Seconds of a task that is not a copy (copies: :meth:`copy_seconds`): the cost its kind
        is entered with in :data:`COSTS`."""
        return COSTS[task.kind](self, task)

    @property
    def launch(self) -> float:
        """Seconds to launch one task on its lane."""
        return self.m.launch_us * 1e-6

    def _skipped(self, activations: str | None) -> float:
        """What a layer's backward does not run again: the whole forward where its activations
        were kept, the attention forward where its attention output was."""
        if activations == "keep":
            return self._layer["forward"]
        return self._layer["attention_forward"] if activations == "attn" else 0.0

    def reduce_seconds(self, nbytes: float) -> float:
        """A ring all-reduce of ``nbytes`` over the processes: each sends and receives
        2 (n - 1) / n of it, over the GPUs' link within a node or the network between nodes."""
        n, m = self.s.world, self.m
        if n < 2:
            return 0.0
        link = m.network_gbps if self.s.nodes > 1 else (m.gpu_link_gbps or min(m.h2d_gbps, m.d2h_gbps))
        return 2.0 * (n - 1) / n * nbytes / (link * 1e9) + m.copy_latency_us * 1e-6

    def layer_breakdown(self) -> dict[str, float]:
        """Seconds of one layer's forward and backward, and of their GEMMs and attention."""
        return dict(self._layer)


# ---- the cost of each task kind ----------------------------------------------------------------
#: Seconds of one task of each kind, ``cost(model, task)``: what the simulator charges for it
#: (one table beside the program's handlers and the visualizer's colours:
#: :mod:`flowtrain.graph.registry`).
COSTS: KindTable[Callable[[CostModel, Task], float]] = KindTable("the simulator's costs")


@COSTS.register("forward", "recompute")
def _forward(c: CostModel, task: Task) -> float:
    return c._layer["forward"] + c.launch


@COSTS.register("backward")
def _backward(c: CostModel, task: Task) -> float:
    return c._layer["backward"] - c._skipped(task.activations) + c.launch


@COSTS.register("loss")
def _loss(c: CostModel, task: Task) -> float:
    return c._loss_seconds(backward=True) + c.launch


@COSTS.register("eval_loss")
def _eval_loss(c: CostModel, task: Task) -> float:
    return c._loss_seconds(backward=False) + c.launch


@COSTS.register("embed")
def _embed(c: CostModel, task: Task) -> float:
    s = c.s
    return c.hbm_seconds(2 * s.tokens * s.hidden * s.compute_bytes) + c.launch


@COSTS.register("embed_backward")
def _embed_backward(c: CostModel, task: Task) -> float:
    return c.hbm_seconds(3 * c.s.tokens * c.s.hidden * 4) + c.launch


@COSTS.register("zero_grad", "grad_sq_norm")
def _pass_over_gradient(c: CostModel, task: Task) -> float:
    return c.hbm_seconds(c.s.unit_numel(task) * 4) + c.launch


@COSTS.register("found_inf")
def _found_inf(c: CostModel, task: Task) -> float:
    return c.hbm_seconds(4 * sum(c.s.numel.values())) / 8 + c.launch  # a fraction is resident


@COSTS.register("gpu_adam")
def _gpu_adam(c: CostModel, task: Task) -> float:
    return c.s.unit_numel(task) / (c.m.gpu_adam_gparams * 1e9) + c.launch


@COSTS.register("cpu_adam")
def _cpu_adam(c: CostModel, task: Task) -> float:
    m, s = c.m, c.s
    if s.owned is not None and s.unit_key(task) not in s.owned:
        return c.launch  # another process of the node updates the shared copy
    n = s.unit_numel(task)
    t = n / (m.cpu_adam_gparams * 1e9)
    if s.refresh:
        t += n / (m.cpu_cast_gparams * 1e9)
    return t * s.adam_workers * s.per_node


@COSTS.register("reduce_grad")
def _reduce_grad(c: CostModel, task: Task) -> float:
    return c.reduce_seconds(c.s.unit_numel(task) * 4) + c.launch


@COSTS.register("save")
def _save(c: CostModel, task: Task) -> float:
    return c.s.unit_numel(task) * 12 / (c.m.disk_write_gbps * 1e9)


@COSTS.register("read_state")
def _read_state(c: CostModel, task: Task) -> float:
    return c.disk_seconds(task, c.m.disk_read_gbps)


@COSTS.register("write_state")
def _write_state(c: CostModel, task: Task) -> float:
    return c.disk_seconds(task, c.m.disk_write_gbps)


@COSTS.register("sync_step")
def _sync_step(c: CostModel, task: Task) -> float:  # a barrier of the node's processes over local sockets
    return c.m.sync_us * 1e-6 + c.m.copy_latency_us * 1e-6


@COSTS.register("grad_norm", "verify_step")
def _host_bookkeeping(c: CostModel, task: Task) -> float:
    return c.m.sync_us * 1e-6


@COSTS.register("fetch", "offload_grad", "offload_act", "fetch_act")
def _copy(c: CostModel, task: Task) -> float:
    return c.copy_seconds(task, other_direction_busy=False)
