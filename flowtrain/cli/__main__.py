"""``python -m flowtrain.cli ...``: the same as the ``flowtrain`` command."""

import sys

from . import main

sys.exit(main())
