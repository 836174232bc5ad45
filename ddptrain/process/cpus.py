"""The cores this process may use, and how to write a set of them: shared by the launcher (threads per rank, the
pinning it logs) and the parallel sweep's device pool. Standard library only.
"""

from __future__ import annotations

import os


def compact_ranges(cpus: tuple[int, ...] | list[int]) -> str:
    """``0-3,8`` for cores 0, 1, 2, 3 and 8."""
    parts, start, previous = [], None, None
    for cpu in sorted(cpus):
        if start is None:
            start = previous = cpu
        elif cpu == previous + 1:
            previous = cpu
        else:
            parts.append(f"{start}-{previous}" if previous != start else f"{start}")
            start = previous = cpu
    if start is not None:
        parts.append(f"{start}-{previous}" if previous != start else f"{start}")
    return ",".join(parts)


def visible_cpus() -> list[int]:
    """The cores this process may run on (its affinity, which a batch scheduler may have narrowed)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))
