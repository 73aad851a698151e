"""``python -m flowtrain ...``: the same as the ``flowtrain`` command (and what ``torchrun -m
flowtrain train ...`` starts in each process)."""

import sys

from .cli import main

sys.exit(main())
