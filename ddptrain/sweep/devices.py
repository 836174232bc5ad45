"""Which devices each job of a parallel sweep gets: disjoint GPU sets, or disjoint CPU cores with matching threads.

A parallel sweep (``hydra/launcher=parallel``) runs several DDP jobs at once on one machine. Jobs that share a GPU
fight over its memory, and jobs that share cores run slower together than one after another, so every job gets its
own slice: on CUDA ``parallel.nproc_per_node`` GPUs of its own (``CUDA_VISIBLE_DEVICES``), on the CPU a set of
cores of its own (the job's processes are pinned to it) and ``OMP_NUM_THREADS`` = its cores / its processes.

``DevicePool`` hands slices out as jobs start and takes them back as they end; it knows nothing of Hydra or torch,
so the slicing is tested without either. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddptrain.process.cpus import compact_ranges


@dataclass(frozen=True)
class Slice:
    """The devices of one job.

    Attributes:
        gpus: CUDA device ids (or UUIDs) for ``CUDA_VISIBLE_DEVICES``; empty for a CPU job.
        cpus: the cores the job's processes are pinned to.
        threads_per_rank: ``OMP_NUM_THREADS`` of each of the job's processes.
    """

    gpus: tuple[str, ...]
    cpus: tuple[int, ...]
    threads_per_rank: int

    def environment(self) -> dict[str, str]:
        """The variables a job's processes start with: its GPUs (none for a CPU job) and its threads."""
        env = {"OMP_NUM_THREADS": str(self.threads_per_rank)}
        # A CPU job sees no GPU at all: trainer.device=auto must not put it on a device another job holds.
        env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpus)
        return env

    def describe(self) -> str:
        where = f"GPUs {','.join(self.gpus)}" if self.gpus else f"cores {compact_ranges(self.cpus)}"
        return f"{where}, {self.threads_per_rank} thread(s) per process"


def visible_gpus(cuda_visible_devices: str | None, count: int) -> list[str]:
    """The GPUs a sweep may hand out: those ``CUDA_VISIBLE_DEVICES`` names, else ids ``0..count-1``.

    Args:
        cuda_visible_devices: the variable's value, None when unset.
        count: the number of GPUs CUDA sees (used when the variable is unset).
    """
    if cuda_visible_devices is None:
        return [str(i) for i in range(count)]
    return [d.strip() for d in cuda_visible_devices.split(",") if d.strip() and d.strip() != "-1"]


def default_jobs(devices: int, largest_job: int) -> int:
    """``hydra.launcher.jobs`` when unset: as many of the largest job as the devices (GPUs, or cores) hold, at
    least 1."""
    return max(1, devices // max(1, largest_job))


class DevicePool:
    """Disjoint slices for the jobs that run at once.

    GPU jobs take ``nproc`` free GPUs each, the lowest free first; each also gets an equal share of the cores (the
    cores divided by ``jobs``), so its loader workers and host work do not crowd another job's. CPU jobs take one of
    ``jobs`` equal groups of cores.

    Args:
        gpus: the GPUs to hand out (``visible_gpus``); empty on a machine without CUDA.
        cpus: the cores to hand out (``visible_cpus``).
        jobs: how many jobs run at once (``hydra.launcher.jobs``).

    Raises:
        ValueError: jobs < 1, or more jobs at once than cores.
    """

    def __init__(self, gpus: list[str], cpus: list[int], jobs: int) -> None:
        if jobs < 1:
            raise ValueError(f"hydra.launcher.jobs={jobs}: run at least 1 job at a time.")
        if jobs > len(cpus):
            raise ValueError(
                f"hydra.launcher.jobs={jobs} but this process may use {len(cpus)} cores: every job needs a core of "
                f"its own. Set hydra.launcher.jobs={len(cpus)} or fewer."
            )
        self.jobs = jobs
        self.gpus = list(gpus)
        share = len(cpus) // jobs
        self._core_groups = [tuple(cpus[i * share : (i + 1) * share]) for i in range(jobs)]
        self._free_gpus = list(gpus)
        self._free_groups = list(range(jobs))

    def fits(self, nproc: int, on_gpu: bool) -> str | None:
        """Why a job of ``nproc`` processes can never run here, or None when it can."""
        if on_gpu and nproc > len(self.gpus):
            return (
                f"it needs parallel.nproc_per_node={nproc} GPUs and {len(self.gpus)} are visible: lower "
                "parallel.nproc_per_node or make more GPUs visible (CUDA_VISIBLE_DEVICES)"
            )
        return None

    def take(self, nproc: int, on_gpu: bool) -> Slice | None:
        """A slice for a job of ``nproc`` processes, or None while too little is free (a running job must end)."""
        if not self._free_groups or (on_gpu and len(self._free_gpus) < nproc):
            return None
        cpus = self._core_groups[self._free_groups.pop(0)]
        gpus: tuple[str, ...] = ()
        if on_gpu:
            gpus = tuple(self._free_gpus[:nproc])
            del self._free_gpus[:nproc]
        return Slice(gpus=gpus, cpus=cpus, threads_per_rank=max(1, len(cpus) // nproc))

    def give_back(self, piece: Slice) -> None:
        """Return a finished job's slice."""
        self._free_groups.append(self._core_groups.index(piece.cpus))
        self._free_groups.sort()
        self._free_gpus = [g for g in self.gpus if g in self._free_gpus or g in piece.gpus]
