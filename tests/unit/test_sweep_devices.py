"""Device slices for the jobs of a parallel sweep: disjoint GPUs, or disjoint cores with matching threads."""

from __future__ import annotations

import pytest

from ddptrain.sweep.devices import DevicePool, compact_ranges, default_jobs, visible_gpus

EIGHT_GPUS = visible_gpus(None, 8)
SIXTEEN_CORES = list(range(16))


def take_all(pool: DevicePool, nproc: int, on_gpu: bool) -> list:
    slices = []
    while (piece := pool.take(nproc, on_gpu)) is not None:
        slices.append(piece)
    return slices


@pytest.mark.parametrize(
    ("nproc", "jobs", "expected"), [(4, 2, ["0,1,2,3", "4,5,6,7"]), (2, 4, ["0,1", "2,3", "4,5", "6,7"])]
)
def test_eight_gpus_give_each_job_its_own_gpus(nproc, jobs, expected) -> None:
    assert default_jobs(len(EIGHT_GPUS), nproc) == jobs
    slices = take_all(DevicePool(EIGHT_GPUS, SIXTEEN_CORES, jobs), nproc, on_gpu=True)
    assert [piece.environment()["CUDA_VISIBLE_DEVICES"] for piece in slices] == expected
    # Each job also gets its own share of the cores, and as many threads per process as the share allows.
    cores = [set(piece.cpus) for piece in slices]
    assert all(len(c) == 16 // jobs for c in cores) and set.union(*cores) == set(SIXTEEN_CORES)
    assert sum(len(c) for c in cores) == 16, "no core in two jobs"
    assert all(piece.threads_per_rank == 16 // jobs // nproc for piece in slices)


def test_a_finished_job_gives_its_gpus_to_the_next() -> None:
    pool = DevicePool(EIGHT_GPUS, SIXTEEN_CORES, 2)
    first, second = pool.take(4, True), pool.take(4, True)
    assert pool.take(4, True) is None, "every GPU is taken"
    pool.give_back(first)
    third = pool.take(4, True)
    assert third.gpus == first.gpus and not set(third.gpus) & set(second.gpus)
    assert third.cpus == first.cpus


def test_mixed_sizes_wait_for_enough_free_gpus() -> None:
    pool = DevicePool(EIGHT_GPUS, SIXTEEN_CORES, 4)
    big = pool.take(4, True)
    small = [pool.take(2, True), pool.take(2, True)]
    assert pool.take(2, True) is None
    assert sorted(g for piece in [big, *small] for g in piece.gpus) == EIGHT_GPUS
    pool.give_back(small[0])
    assert pool.take(4, True) is None, "a 4-GPU job waits until 4 are free"
    assert pool.take(2, True).gpus == small[0].gpus


def test_cuda_visible_devices_is_respected() -> None:
    gpus = visible_gpus("2,3,5,7", 8)
    slices = take_all(DevicePool(gpus, SIXTEEN_CORES, 2), 2, on_gpu=True)
    assert [piece.gpus for piece in slices] == [("2", "3"), ("5", "7")]


@pytest.mark.parametrize(
    ("cores", "nproc", "jobs", "threads"), [(16, 2, 8, 1), (16, 1, 4, 4), (2, 1, 2, 1), (2, 2, 2, 1)]
)
def test_cpu_jobs_get_disjoint_cores_and_matching_threads(cores, nproc, jobs, threads) -> None:
    slices = take_all(DevicePool([], list(range(cores)), jobs), nproc, on_gpu=False)
    assert len(slices) == jobs
    assert sorted(c for piece in slices for c in piece.cpus) == list(range(cores // jobs * jobs)), "disjoint"
    for piece in slices:
        assert piece.threads_per_rank == threads
        assert piece.environment() == {"OMP_NUM_THREADS": str(threads), "CUDA_VISIBLE_DEVICES": ""}


def test_default_jobs_on_cpu_and_sizes_that_do_not_fit() -> None:
    assert default_jobs(2, 1) == 2 and default_jobs(2, 2) == 1 and default_jobs(2, 4) == 1
    pool = DevicePool(EIGHT_GPUS[:2], [0, 1], 1)
    assert "parallel.nproc_per_node=4" in pool.fits(4, on_gpu=True)
    assert pool.fits(4, on_gpu=False) is None
    with pytest.raises(ValueError, match=r"hydra\.launcher\.jobs=3 .* 2 cores"):
        DevicePool([], [0, 1], 3)
    with pytest.raises(ValueError, match=r"hydra\.launcher\.jobs=0"):
        DevicePool([], [0, 1], 0)


def test_core_ranges_read_as_users_write_them() -> None:
    assert compact_ranges([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"
    assert compact_ranges([5]) == "5"


def test_the_launcher_counts_the_gpus_cuda_visible_devices_names(monkeypatch) -> None:
    from ddptrain.sweep import launcher

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    jobs = [launcher.Job(i, [], None, None, nproc=2, on_gpu=launcher._on_gpu("auto")) for i in range(3)]
    assert all(job.on_gpu for job in jobs), "auto means the GPUs when some are visible"
    pool = launcher._device_pool(None, jobs)
    assert pool.jobs == 2, "4 GPUs / 2 per job"
    assert [pool.take(2, True).gpus, pool.take(2, True).gpus] == [("4", "5"), ("6", "7")]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not launcher._on_gpu("auto"), "no GPU visible: auto is the CPU"
    cpu_jobs = [launcher.Job(i, [], None, None, nproc=1, on_gpu=False) for i in range(5)]
    assert launcher._device_pool(None, cpu_jobs).jobs == min(5, len(launcher.visible_cpus()))
