"""One JSON line for a baseline runner's result, whatever happens (``torchtitan_moe.py``,
``unsloth_lora.py``): the run's own dict, or ``fail`` with the error, the traceback on stderr::

    sys.exit(json_line.report({"job": "x", "failed": True}, lambda: run(...), "x"))

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
