"""The checkpoint format: its version, written into every manifest, and every read of an older version, here alone.

Versions this code reads (``READS``):

- 1: every checkpoint written before the manifest said ``format_version``. Its parts may lack what later code
  keeps: the per-rank log window (``windows``: the run's first checkpoints kept one window for all ranks) and, in
  a window, the FLOP count (``flops``) and the overflow count under its current name (``overflowed_steps``, once
  ``skipped``); its data order lacks ``sources`` where the run had no mixture.
- 2: the manifest says ``format_version: 2``; every per-rank part is there under its current name, but the state
  keeps no best evaluation (``best``: trainer.keep_best_n and early stopping came later).
- 3: the state keeps ``best`` too; a manifest may carry the step's ``eval`` metrics.
- 4: a sharded model's checkpoint (``parallel.strategy=fsdp2``) holds ``sharded/``, every rank's shards of the
  trainable weights and of the optimizer state, and its state keeps no ``optimizer``; a replica's is a version 3
  one. Read as 3: a version-3 checkpoint has no ``sharded/`` and resumes a DDP run.
- 5 (``FORMAT_VERSION``): the sampler's state says the number of processes its position counts micro-steps of
  (``world_size``), so a run on another number resumes at the same place in the plan. Earlier versions' position
  counts those of the manifest's ``world_size``, the processes that wrote it.

``upgrade_manifest`` and ``upgrade_state`` turn a checkpoint of any version in ``READS`` into the current shape, so
the parts that load from it (the log window, the data order, the checkpointer) read one shape only. A checkpoint of
a version this code does not read (written by a newer ddptrain) is refused, naming both.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

FORMAT_VERSION = 5
READS = (1, 2, 3, 4, 5)
VERSION_KEY = "format_version"


class UnreadableFormat(RuntimeError):
    """A checkpoint written in a format this ddptrain does not read."""


def version_of(manifest: Mapping[str, Any]) -> int:
    """The format a manifest was written in (1 when it does not say)."""
    return int(manifest.get(VERSION_KEY, 1))


def upgrade_manifest(manifest: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The manifest in the current shape (its ``format_version``, if any, kept: ``upgrade_state`` needs it).

    Raises:
        UnreadableFormat: a format not in ``READS``, naming the folder, its version and the ones read here.
    """
    version = version_of(manifest)
    if version not in READS:
        raise UnreadableFormat(
            f"{folder} is checkpoint format {version}; this ddptrain reads formats {', '.join(map(str, READS))}. "
            "Resume it with the ddptrain that wrote it (or a newer one), or start afresh with trainer.resume=none."
        )
    if version == 1:
        # A run without a mixture kept no sources; the current data order says so with an empty list.
        manifest = {**manifest, "data_order": {"sources": [], **manifest["data_order"]}}
    return manifest


def upgrade_state(
    state: dict[str, Any],
    version: int,
    fresh: Mapping[str, Any],
    world_size: int,
    fresh_shared: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The trainer state of a checkpoint written in ``version``, in the current format.

    Args:
        state: as loaded from the checkpoint.
        version: its manifest's ``version_of``.
        fresh: this rank's per-rank parts as they stand before the resume (a part the checkpoint lacks starts from
            here, on every rank).
        world_size: the ranks the checkpoint was written by (the length of each per-rank list).
        fresh_shared: the shared parts as they stand before the resume (``best``, which formats 1 and 2 lack,
            starts from here).

    Returns:
        A new state; ``missing`` lists the parts that start afresh (``state["missing"]``).
    """
    if version < 5:
        state = {**state, "sampler": {"world_size": world_size, **state["sampler"]}}
    if version >= 3:
        return {**state, "missing": []}
    shared = {name: value for name, value in (fresh_shared or {}).items() if name not in state}
    missing = [name for name in fresh if name not in state] if version == 1 else []
    upgraded = {**state, **shared, **{name: [fresh[name]] * world_size for name in missing}}
    upgraded["missing"] = [*missing, *shared]
    if version == 1 and "windows" in upgraded:
        upgraded["windows"] = [_window_from_v1(window) for window in upgraded["windows"]]
    return upgraded


def _window_from_v1(window: dict[str, Any]) -> dict[str, Any]:
    """A log window of format 1: the overflow count was once named ``skipped``; FLOPs were not counted."""
    renamed = {("overflowed_steps" if key == "skipped" else key): value for key, value in window.items()}
    return {"flops": 0.0, **renamed}
