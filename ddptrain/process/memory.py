"""What the C library does with freed memory: on request (plan.cpu_returns_freed_memory), glibc hands every large
freed block back to the system, so that a CPU process's resident set follows the tensors alive; and the figures
``/proc`` keeps of a process's memory. Standard library only.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from pathlib import Path

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
MMAP_THRESHOLD_BYTES = 65536


def proc_bytes(path: Path, key: str) -> int | None:
    """A ``key:  N kB`` line of a ``/proc`` file (``/proc/meminfo``, ``/proc/self/status``) in bytes; None where the
    file or the line is missing (not Linux)."""
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    return None


def return_freed_memory() -> bool:
    """From now on every block of 64 KiB or more this process allocates is mmapped, and unmapped when freed (glibc's
    ``mallopt``, as ``MALLOC_MMAP_THRESHOLD_=65536`` sets it at start): the resident set then follows what is alive.
    glibc's default keeps freed blocks for reuse and raises its threshold as large blocks are freed (30-80% above
    the tensors' peak, bench/README.md); handing them back costs every step its page faults (bench/README.md).

    Returns:
        Whether it took effect: False on a C library without glibc's ``mallopt`` (macOS has none; musl's changes
        nothing and returns 0).
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        return libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    except (OSError, AttributeError):  # no C library found, or one without mallopt
        return False
