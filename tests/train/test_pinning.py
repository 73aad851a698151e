"""Page-locking in place: what :func:`flowtrain.train.pinning.pin` records when CUDA refuses."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from flowtrain.train import pinning


def test_a_range_cuda_refuses_to_lock_is_counted_and_not_registered(monkeypatch):
    calls = []

    def register(ptr, nbytes, flags):
        calls.append((ptr, nbytes))
        return 712 if len(calls) == 1 else 0  # the first range: cudaErrorHostMemoryAlreadyRegistered

    monkeypatch.setattr(torch.cuda, "cudart", lambda: SimpleNamespace(cudaHostRegister=register))
    monkeypatch.setattr(pinning, "clear_cuda_error", lambda: None)
    monkeypatch.setattr(pinning, "_REGISTERED", [])
    monkeypatch.setattr(pinning, "_FAILED", [])
    refused, locked = torch.zeros(1000), torch.zeros(10, dtype=torch.float64)
    assert pinning.pin(refused) is False and pinning.pin(locked) is True
    assert calls == [(refused.data_ptr(), 4000), (locked.data_ptr(), 80)]
    assert pinning.failures() == (1, 4000)
    assert pinning._REGISTERED == [locked.data_ptr()]  # only the locked range waits for unpin_all
