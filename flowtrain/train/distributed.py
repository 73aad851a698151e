"""Data parallel training over ``torch.distributed``: one process per GPU (or CPU worker).

Started by ``torchrun``, which sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and the rendezvous
address in each process's environment::

    torchrun --nproc-per-node 2 -m flowtrain train --model llama-1b --batch-size 16 ...

Every process reads the same data in the same order and takes its share of each step's
micro-batches (``--batch-size`` is the global batch: process ``r`` of ``n`` runs micro-batches
``r * k .. r * k + k - 1`` of the step's ``n * k``). The loss is normalised by the target
tokens of the whole global batch, so after every process's micro-batches have added to a unit's
gradient slot, one ``reduce_grad`` task (an all-reduce on the ``net`` lane) makes each slot the
global batch's gradient; it then leaves for the host and its Adam as on one process, and every
process's copy of the weights stays the same. Rank 0 alone writes checkpoints, the final
model, metrics and progress.

Backend: NCCL on CUDA, gloo on the CPU. The processes of a node share one host copy of the
state (:mod:`flowtrain.train.shared_state`): each streamed unit's Adam runs in one of them, its
owner (``StepSpec.owner``), and a ``sync_step`` barrier of the node's processes (a gloo group
of their own, :func:`node_barrier`) ends every step, before any of them reads the updated
weights.

A process that dies (``kill -9``, a crash) or stops answering (``SIGSTOP``, a hang) must not
leave the others waiting: every collective gives up after ``--dist-timeout`` seconds
(:data:`DEFAULT_TIMEOUT_S`, 30 minutes: longer than any one process's share of loading the
model or writing a checkpoint, while the others wait), and a peer's death is seen at once (its
connections close). Either ends the run with :class:`PeerLost`, one line::

    flowtrain: error: data parallel: another process is gone (killed or crashed; its own output
    says why) while this one waited in a gradient all-reduce (Connection closed by peer ...)
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
from typing import Any, Iterator

import msgspec

from ..errors import ConfigError, FlowtrainError

#: Seconds a collective waits for the other processes before the run ends (``--dist-timeout``).
DEFAULT_TIMEOUT_S = 30 * 60.0


class PeerLost(ConnectionError, FlowtrainError):
    """Another data-parallel process is gone, or gave no answer within the timeout; ``what``
    says which collective this process was in. A :class:`~flowtrain.errors.FlowtrainError`, so
    the command line prints its message as it is, and an ``OSError``, so the exit status is 1
    (the system failed, not the input)."""

    def __init__(self, what: str, cause: BaseException, timeout_s: float) -> None:
        detail = _gist(cause)
        if "timed out" in detail.lower():
            text = (f"data parallel: no answer from another process for {timeout_s:g} s (--dist-timeout) while this one "
                    f"waited in {what}: it is stopped, hung or far behind ({detail})")
        else:
            text = (f"data parallel: another process is gone (killed or crashed; its own output says why) while this "
                    f"one waited in {what} ({detail})")
        super().__init__(text)


#: whether this process joined a process group (:func:`join`), even if it has left it since
_JOINED = False


def exit_after_peer_lost(status: int) -> None:
    """End this process at once with ``status`` (its output flushed) if it joined a process
    group, which a lost peer has left broken. Left to the interpreter's exit, the backend's
    threads are torn down by destructors that sometimes abort the process instead ("terminate
    called without an active exception", status 134), after the one line that said why.
    Everything the run keeps is written by then: the error has passed every ``finally`` on its
    way up. A process that never joined one returns."""
    if not _JOINED:
        return
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _gist(exc: BaseException) -> str:
    """The first line of a backend's error without its source location and advice:
    ``[.../pair.cc:537] Read error [127.0.0.1]:16263: Connection reset by peer. This is ...``
    becomes ``Read error [127.0.0.1]:16263: Connection reset by peer``."""
    lines = str(exc).strip().splitlines()
    text = re.sub(r"^\[[^\]]*\]\s*", "", lines[0]) if lines else type(exc).__name__
    return text.split(". This is typically")[0].rstrip(". ")


@contextlib.contextmanager
def _collective(what: str, kinds: type[BaseException] | tuple[type[BaseException], ...] = RuntimeError) -> Iterator[None]:
    """Turn a backend's failure inside the block into :class:`PeerLost`: any ``RuntimeError``
    of a collective (gloo raises plain ones; torch's ``DistError`` is one too), or only
    ``kinds`` where other errors can come from the block (joining: a backend this torch lacks
    is no lost peer)."""
    try:
        yield
    except kinds as e:
        raise PeerLost(what, e, _TIMEOUT_S) from e


class World(msgspec.Struct, frozen=True):
    """This process's place among the data-parallel processes."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    #: processes on this node (torchrun's LOCAL_WORLD_SIZE)
    local_size: int = 1

    @property
    def parallel(self) -> bool:
        return self.size > 1

    @property
    def leader(self) -> bool:
        """Rank 0: the process that writes files and reports."""
        return self.rank == 0

    def share(self, micro_batches: list[Any]) -> list[Any]:
        """This process's consecutive share of a step's micro-batches."""
        k, extra = divmod(len(micro_batches), self.size)
        if extra:
            raise ConfigError(f"{len(micro_batches)} micro-batches per step do not split over {self.size} processes: "
                              f"make {{batch_size}} / {{micro_batch_size}} a multiple of {self.size}", named=True)
        return micro_batches[self.rank * k : (self.rank + 1) * k]


def local_share(cfg: Any, size: int) -> Any:
    """The run one of ``size`` processes plans for (a ``TrainConfig``): its share of the batch.
    ``--host-mem`` stays the node's: the plan counts the shared state once and each process's
    own buffers once per process (``Plan.host_node_total``)."""
    if size == 1:
        return cfg
    per = cfg.micro_batch_size * size
    if cfg.batch_size % per:
        raise ConfigError(f"{{batch_size}} {cfg.batch_size} does not split into {size} processes' shares of "
                          f"{{micro_batch_size}} {cfg.micro_batch_size}: use a multiple of {per}", named=True)
    return msgspec.structs.replace(cfg, batch_size=cfg.batch_size // size)


def world_from_env(environ: dict[str, str] | None = None) -> World:
    """The world ``torchrun`` describes in the environment (one process without it)."""
    env = os.environ if environ is None else environ
    try:
        size = int(env.get("WORLD_SIZE", "1"))
        rank = int(env.get("RANK", "0"))
        local = int(env.get("LOCAL_RANK", str(rank)))
        local_size = int(env.get("LOCAL_WORLD_SIZE", str(size)))
    except ValueError as e:
        raise ConfigError(f"WORLD_SIZE, RANK and LOCAL_RANK must be integers ({e})") from None
    if size < 1 or not 0 <= rank < size:
        raise ConfigError(f"RANK {rank} is not a process of WORLD_SIZE {size}")
    if local_size < 1 or size % local_size:
        raise ConfigError(f"WORLD_SIZE {size} is not a whole number of nodes of LOCAL_WORLD_SIZE {local_size} "
                          f"processes: give every node the same --nproc-per-node")
    return World(rank=rank, size=size, local_rank=local, local_size=max(1, local_size))


#: A second group of the same processes, for the few collectives the training loop's own
#: thread makes (the step's loss): the ``net`` lane's thread issues gradient all-reduces on the
#: default group at the same time, and collectives on one group must come in the same order on
#: every process.
_METRICS_GROUP: Any = None
#: The processes of this node (gloo, on the CPU): the ``sync_step`` barrier and the handing
#: round of the shared state's file name.
_NODE_GROUP: Any = None
#: The groups' timeout (``--dist-timeout``), for :class:`PeerLost`'s line.
_TIMEOUT_S = DEFAULT_TIMEOUT_S


def join(world: World, device_type: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the process group (NCCL on CUDA, gloo on the CPU); a no-op for one process. Every
    collective of every group gives up after ``timeout_s`` seconds (:class:`PeerLost`), and so
    does waiting here for the other processes to join."""
    global _METRICS_GROUP, _NODE_GROUP, _TIMEOUT_S, _JOINED
    _JOINED = True
    if not world.parallel:
        return
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        _TIMEOUT_S = timeout_s
        with _collective("joining the other processes", getattr(dist, "DistError", RuntimeError)):
            dist.init_process_group(backend, rank=world.rank, world_size=world.size, timeout=timeout)
            _METRICS_GROUP = dist.new_group(backend=backend, timeout=timeout)
            # every process creates every node's group, in the same order (new_group's rule)
            for node in range(world.size // world.local_size):
                ranks = list(range(node * world.local_size, (node + 1) * world.local_size))
                group = dist.new_group(ranks, backend="gloo", timeout=timeout)
                if world.rank in ranks:
                    _NODE_GROUP = group


def leave(world: World) -> None:
    """Leave the process group, if this process joined one."""
    if not world.parallel:
        return
    import torch.distributed as dist

    global _METRICS_GROUP, _NODE_GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _METRICS_GROUP = _NODE_GROUP = None


def all_reduce_sum(t: Any, *, metrics: bool = False, what: str | None = None) -> None:
    """Sum ``t`` over every process, in place (on the current CUDA stream on a GPU); with
    ``metrics``, on the group kept for the training loop's own collectives. ``what`` names it
    in :class:`PeerLost`'s line."""
    import torch.distributed as dist

    with _collective(what or ("summing the step's loss" if metrics else "a gradient all-reduce")):
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=_METRICS_GROUP if metrics else None)


def node_barrier() -> None:
    """Wait until every process of this node has come here (a one-element all-reduce on the
    node's gloo group, so it orders host work only: nothing waits on a GPU stream)."""
    import torch
    import torch.distributed as dist

    with _collective("a barrier of the node's processes"):
        dist.all_reduce(torch.zeros(1), group=_NODE_GROUP)


def node_broadcast(obj: Any, world: World) -> Any:
    """``obj`` of the node's first process, in every process of the node."""
    import torch.distributed as dist

    box = [obj]
    with _collective("handing round the shared state's files"):
        dist.broadcast_object_list(box, src=world.rank - world.local_rank, group=_NODE_GROUP)
    return box[0]


def agree_to_stop(asked: bool, device: Any) -> bool:
    """Whether any process asks to stop (a signal reached it): every process calls this at the
    same step boundary, so they all stop after the same step. Blocking: call it off the event
    loop (the others' steps in flight need this process's loop to finish)."""
    import torch

    flag = torch.tensor([1.0 if asked else 0.0], device=device)
    all_reduce_sum(flag, metrics=True, what="the step boundary's vote on stopping")
    return bool(flag.item() > 0)
