"""One JSON line for a baseline runner's result, whatever happens (``torchtitan_moe.py``,
``nemo_moe.py``, ``unsloth_lora.py``): the run's own dict, or ``fail`` with the error, the
traceback on stderr, and the fields every runner's result shares::

    sys.exit(json_line.report({"job": "x", "failed": True}, lambda: run(...), "x"))
    tok_s = json_line.steady_tokens_per_s(step_seconds, batch * seq)   # the steps after the first
    {**result, **json_line.gpu_fields()}                                # peaks and the card's name

Exit status: 0 for a result, 3 for a run out of GPU memory (``h200.sh`` then tries a smaller
setting), 1 for any other failure or a result marked ``failed``.
"""

from __future__ import annotations

import json
import logging
from typing import Callable

import torch


def report(fail: dict, run: Callable[[], dict], what: str) -> int:
    """Print ``run()``'s dict as one JSON line, or ``fail`` with the error; the exit status."""
    try:
        result = run()
    except torch.OutOfMemoryError as e:
        print(json.dumps({**fail, "error": "out of GPU memory: " + str(e).splitlines()[0][:200]}), flush=True)
        return 3
    except BaseException as e:  # one JSON line whatever happens; the traceback goes to stderr
        logging.exception("%s run failed", what)
        print(json.dumps({**fail, "error": f"{type(e).__name__}: {str(e)[:300]}"}), flush=True)
        return 3 if "out of memory" in str(e) else 1
    print(json.dumps(result), flush=True)
    return 1 if result.get("failed") else 0


def steady_tokens_per_s(step_seconds: list[float], tokens_per_step: int) -> float:
    """Tokens a second over the steps after the first (the first alone if there is one)."""
    timed = step_seconds[1:] or step_seconds
    return tokens_per_step / (sum(timed) / len(timed))


def gpu_fields() -> dict:
    """The run's GPU memory peaks, allocated and reserved (GiB), and the card's name."""
    return {"gpu_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "gpu_reserved_peak_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
            "gpu": torch.cuda.get_device_name()}
