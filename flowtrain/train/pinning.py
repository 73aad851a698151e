"""Page-locking host memory that already exists, and giving it back at the end of a run.

``fetch`` and ``offload_grad`` copy between the GPU and host buffers asynchronously only where
the host pages are locked. flowtrain locks its own allocations in place (``cudaHostRegister``)
rather than using torch's pinned allocator, which rounds every block up to a power of two (up
to 2x the memory for layer-sized buffers). A registered range outlives its tensor (freeing the
memory does not tell CUDA), so every range pinned here is recorded and :func:`unpin_all`
releases them all once a run is over::

    if not pin(t):        # the pages could not be locked: copies from t stay correct, only slower
        ...
    unpin_all()           # after the run's last copy
"""

from __future__ import annotations

import threading

import torch

#: host ranges :func:`pin` registered with CUDA, until :func:`unpin_all`
_REGISTERED: list[int] = []
_REGISTERED_LOCK = threading.Lock()
#: bytes of each range :func:`pin` could not lock, since the process started (:func:`failures`)
_FAILED: list[int] = []


def pin(t: torch.Tensor) -> bool:
    """Page-lock ``t``'s bytes in place; False (with CUDA's error cleared) where that failed,
    e.g. a range still registered from a freed tensor that was not unpinned."""
    nbytes = t.numel() * t.element_size()
    if int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)) != 0:
        clear_cuda_error()
        with _REGISTERED_LOCK:
            _FAILED.append(nbytes)
        return False
    with _REGISTERED_LOCK:
        _REGISTERED.append(t.data_ptr())
    return True


def failures() -> tuple[int, int]:
    """``(ranges, bytes)`` :func:`pin` could not lock in place since the process started: each
    then either stayed pageable or (``pinned_zeros``) became a block of torch's pinned
    allocator, rounded up to a power of two, which the plan does not count."""
    with _REGISTERED_LOCK:
        return len(_FAILED), sum(_FAILED)


def unpin_all() -> None:
    """Unregister every range :func:`pin` registered, so that a later run in the same process
    is not handed the same addresses still registered to the old pages. Waits for the GPU first
    (no copy may be in flight); a GPU already in error is left as it is."""
    with _REGISTERED_LOCK:
        ptrs, _REGISTERED[:] = list(_REGISTERED), []
    if not ptrs:
        return
    try:
        torch.cuda.synchronize()
    except RuntimeError:
        return
    for ptr in ptrs:
        if int(torch.cuda.cudart().cudaHostUnregister(ptr)) != 0:
            clear_cuda_error()


def clear_cuda_error() -> None:
    """A failed CUDA runtime call leaves its error as CUDA's "last error" until something reads
    it, and the next kernel launch anywhere would report it as its own: let a throwaway op read
    (and clear) it here."""
    try:
        torch.zeros(1, device="cuda").add_(1)
    except RuntimeError:
        pass
