"""What a save check needs of the host it runs on: all of its cores, room for a copy of the base, and transformers'
own model classes.

- ``all_cores``: torchrun sets ``OMP_NUM_THREADS=1`` when it starts several processes, so rank 0 would load and run the
  check's models on one thread while every other rank waits for it (they poll the store, asleep). For the length of
  the check torch's thread count is raised to the cores this process may run on, then put back.
- ``mem_available_bytes``: the kernel's estimate of the memory that can still be handed out without swapping
  (``MemAvailable`` of ``/proc/meminfo``); the check keeps its copy of the base between checks only when there is
  room for it and more.
- ``unpatched``: ``model.liger_kernel=true`` replaces attributes of transformers' modeling module of the model family
  (the RMSNorm, MLP and rotary classes and functions, the causal LM's ``forward``) for the whole process, and Liger's
  Triton kernels fail on the host's tensors. ``keep_originals`` records that module as transformers defined it,
  before the patch; inside ``unpatched()`` the recorded attributes are put back (the check's models are built and run
  with transformers' own classes), and Liger's are restored when it ends. Rank 0 runs nothing else meanwhile: the
  training model does not run during the check (a GPU run's check mirrors it on the host).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

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
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# ----------------------------------------------------------------------------- transformers' own classes

_ORIGINALS: dict[str, dict[Any, dict[str, Any]]] = {}
"""Per modeling module (by name): the attributes of the module and of each class it defines, as transformers defined
them (recorded before anything patched them)."""
_MISSING = object()


def modeling_module(config: Any) -> types.ModuleType | None:
    """The transformers module that defines the causal LM of ``config``'s model family (imported if need be): the one
    ``AutoModelForCausalLM`` builds it from, else ``transformers.models.<type>.modeling_<type>``; None if neither."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return sys.modules[MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__module__]
    except KeyError:  # a family AutoModelForCausalLM does not build (a vision-language model)
        name = config.model_type.replace("-", "_")
        with contextlib.suppress(ImportError):
            return importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    return None


def keep_originals(module: types.ModuleType | None) -> None:
    """Record ``module``'s attributes and those of the classes it defines, once: call it before they are patched (a
    later call, after a patch, keeps the first record). None: nothing to record."""
    if module is None or module.__name__ in _ORIGINALS:
        return
    owners: dict[Any, dict[str, Any]] = {module: dict(vars(module))}
    for value in vars(module).values():
        if isinstance(value, type) and value.__module__ == module.__name__:
            owners[value] = dict(vars(value))
    _ORIGINALS[module.__name__] = owners


def _put(owners: dict[Any, dict[str, Any]], replaced: dict[Any, dict[str, Any]]) -> None:
    """Give each owner (a module, a class) the attributes listed for it where it holds others; what they held goes
    into ``replaced`` as the call goes (so that a failure half-way can still be undone)."""
    for owner, attrs in owners.items():
        for name, value in attrs.items():
            current = vars(owner).get(name, _MISSING)
            if current is value:
                continue
            replaced.setdefault(owner, {})[name] = current
            if value is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


@contextlib.contextmanager
def unpatched() -> Iterator[None]:
    """The modeling modules ``keep_originals`` recorded, and their classes, as transformers defined them for the body;
    what they held before (Liger's kernels) is put back when it ends, whatever happened in it."""
    replaced: dict[Any, dict[str, Any]] = {}
    try:
        for owners in _ORIGINALS.values():
            _put(owners, replaced)
        yield
    finally:
        _put(replaced, {})
