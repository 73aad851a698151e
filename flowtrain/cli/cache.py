"""``flowtrain cache``: the data cache's entries with their sizes; ``--clean`` removes them.

::

    flowtrain cache                        # every entry, least recently used first, and the total
    flowtrain cache --clean                # remove every entry
    flowtrain cache --clean --max-gb 20    # remove the least recently used until the rest take 20 GB

Training tokenises a ``--data`` file once into a cache entry and maps it on every later run
(:mod:`flowtrain.data.cache`); it never deletes one, since an entry can hold hours of
tokenising. Every load marks its entry used, so ``--max-gb`` keeps what recent runs read. An
entry a build is still writing is never removed; one whose build died is removed by any
``--clean``. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import math
import time

from ..errors import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clean", action="store_true",
                   help="remove cache entries: all of them, or with --max-gb the least recently used until the rest fit")
    p.add_argument("--max-gb", type=float, default=None, metavar="GB",
                   help="with --clean: keep the most recently used entries that fit in GB gigabytes (10^9 bytes)")


def run(args: argparse.Namespace) -> int:
    from ..data.cache_entries import cache_root, entries, trim

    if args.max_gb is not None and not args.clean:
        raise ConfigError(f"--max-gb {args.max_gb:g} removes entries only with --clean: flowtrain cache --clean "
                          f"--max-gb {args.max_gb:g}")
    if args.max_gb is not None and not (math.isfinite(args.max_gb) and args.max_gb >= 0):
        raise ConfigError(f"--max-gb must be a finite number >= 0 (got {args.max_gb})")
    root = cache_root()
    if args.clean:
        removed = trim(0 if args.max_gb is None else round(args.max_gb * 1e9))  # 1.2345e-05 GB is 12,345 bytes
        left = entries()
        print(f"removed {_entries(removed)} ({_size(sum(e.size for e in removed))}) from {root}; "
              f"{_entries(left)} ({_size(sum(e.size for e in left))}) left"
              + ("; builds still running are left alone" if any(e.state == "building" for e in left) else ""))
        return 0
    found = entries()
    print(f"{root}: {_entries(found)}, {_size(sum(e.size for e in found))}, least recently used first")
    for e in found:
        shape = f"{e.rows:,} x {e.seq_len}" if e.rows is not None and e.seq_len is not None else "-"
        state = "" if e.state == "ready" else f"  ({e.state})"
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.used))
        print(f"  {used}  {_size(e.size):>9}  {shape:>16}  {e.path.name}  {e.source or '?'}{state}")
    return 0


def _entries(found: list) -> str:
    return "1 entry" if len(found) == 1 else f"{len(found)} entries"


def _size(n: int) -> str:
    """Bytes for a person: ``0 B``, ``12.3 kB``, ``4.5 MB``, ``1.20 GB`` (powers of 1000, as disks are sold)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}" if unit == "GB" else f"{n / scale:.1f} {unit}"
    return f"{n} B"
