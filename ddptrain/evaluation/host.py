"""What a save check needs of the host it runs on: its cores, and how much memory it can still hand out.

- ``all_cores``: torchrun sets ``OMP_NUM_THREADS=1`` when it starts several processes, so rank 0 would load and run the
  check's models on one thread while every other rank waits for it (they poll the store, asleep). For the length of
  the check torch's thread count is raised to the cores this process may run on, then put back. On this project's
  shared 2-core machine, another engineer's jobs holding about one core, it measured from no gain to 17% for
  Qwen2.5-0.5B and cost up to 0.36 s on the tiny model (bench/README.md): noise, not a speed-up shown. It is there
  for a GPU node, whose host has tens of cores idle while the other ranks wait, where it has not been measured.
- ``mem_available_bytes``: the kernel's estimate of the memory that can still be handed out without swapping
  (``MemAvailable`` of ``/proc/meminfo``). A GPU run's check with ``trainer.save_check=full`` keeps its copy of the
  base on the host between checks only while this leaves room for it (``peft_check.KEEP_BASE_ROOM``): the memory plan
  counts the device, not the host.

The check builds its models with transformers' own classes where Liger patched them: ``ddptrain.model.liger.unpatched``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from ddptrain.process.memory import proc_bytes

MEMINFO = Path("/proc/meminfo")


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity: a Slurm or taskset mask counts, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS)
        return os.cpu_count() or 1


@contextlib.contextmanager
def all_cores() -> Iterator[int]:
    """torch's intra-op threads raised to ``host_cores()`` for the body, then put back as they were.

    Yields:
        The thread count the body runs with.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(max(before, host_cores()))
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def mem_available_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes, or None where there is none to read (not Linux)."""
    return proc_bytes(MEMINFO, "MemAvailable")
