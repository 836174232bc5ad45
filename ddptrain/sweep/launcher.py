"""What ``hydra/launcher=parallel`` does: run a sweep's jobs side by side, each a DDP group on its own devices.

The parent (the ``ddptrain train -m`` process) composes every job's config, resolves its folder (so the
``${now:}`` of the sweep folder is read once, here), and keeps up to ``hydra.launcher.jobs`` jobs running. Each
job runs in a fresh process (``concurrent.futures`` over a ``spawn`` context: nothing of the parent's torch or
CUDA state is inherited) that first takes its device slice (``devices.Slice``: ``CUDA_VISIBLE_DEVICES``, pinned
cores, ``OMP_NUM_THREADS``), sends its output to ``<job folder>/output.log``, then runs Hydra's ``run_job``, so
callbacks, ``.hydra/`` and the job record are as with the default launcher. ddptrain's self-launch gives each job
its own free port (a ``MASTER_PORT`` set in the environment would be shared by every job: it is dropped).

A failed job does not stop the others: at the end the parent names every failed job and writes the sweep report,
and Hydra exits non-zero. SIGTERM or Ctrl-C reaches every running job (each saves a checkpoint and stops, as a run
does), no further job starts, and the sweep exits as a stopped run does; running it again resumes it.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import signal
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides, run_job, setup_globals
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from ddptrain.process import signals
from ddptrain.process.cpus import visible_cpus
from ddptrain.sweep.devices import DevicePool, Slice, default_jobs, visible_gpus
from ddptrain.sweep.jobs import JobFailed, read_record

log = logging.getLogger(__name__)
OUTPUT_LOG = "output.log"


@dataclass
class Job:
    """One job of the sweep as the parent sees it."""

    idx: int
    overrides: list[str]
    config: DictConfig
    folder: Path
    nproc: int
    on_gpu: bool


def launch_in_parallel(launcher: Any, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[JobReturn]:
    """Run the jobs, ``launcher.jobs`` at a time; returns their JobReturns in job order.

    Args:
        launcher: the ``ParallelLauncher`` (its ``jobs``, ``config``, ``hydra_context``, ``task_function``).
        job_overrides: each job's overrides, from the sweeper.
        initial_job_idx: the number of the first job (a sweeper may launch in batches).

    Raises:
        ValueError: ``hydra.launcher.jobs`` or a job's size does not fit the machine (before any job starts).
        SystemExit: a job was stopped or aborted by a signal (after the running jobs have ended).
    """
    setup_globals()
    sweep_dir = Path(str(launcher.config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    jobs = [_compose(launcher, list(o), initial_job_idx + i, sweep_dir) for i, o in enumerate(job_overrides)]
    pool = _device_pool(launcher.jobs, jobs)
    for job in jobs:
        if why := pool.fits(job.nproc, job.on_gpu):
            raise ValueError(f"job {job.idx} ({' '.join(job.overrides)}) cannot run here: {why}.")
    log.info("Launching %d jobs, %d at a time, in %s", len(jobs), pool.jobs, sweep_dir)
    returns, stopped = _run_all(launcher, jobs, pool)
    _summarize(sweep_dir, jobs, returns)
    _raise_if_stopped(returns, stopped)
    return [returns[job.idx] for job in jobs]


def _compose(launcher: Any, overrides: list[str], idx: int, sweep_dir: Path) -> Job:
    """A job's config, with its folder resolved here (the child must not resolve ``${now:}`` again)."""
    config = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, overrides)
    with open_dict(config):
        config.hydra.job.id = idx
        config.hydra.job.num = idx
    HydraConfig.instance().set_config(config)
    subdir = str(OmegaConf.select(config, "hydra.sweep.subdir"))
    with read_write(config.hydra.sweep), open_dict(config.hydra.sweep):
        config.hydra.sweep.dir = str(sweep_dir)
        config.hydra.sweep.subdir = subdir
    nproc = OmegaConf.select(config, "parallel.nproc_per_node") or 1
    device = str(OmegaConf.select(config, "trainer.device"))
    return Job(idx, overrides, config, sweep_dir / subdir, int(nproc), on_gpu=_on_gpu(device))


def _on_gpu(device: str) -> bool:
    if device == "cpu":
        return False
    if device == "cuda":
        return True
    return bool(_gpus())  # auto: CUDA when a GPU is visible


def _gpus() -> list[str]:
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is not None:
        return visible_gpus(value, 0)
    import torch  # only to count GPUs: the parent never initialises CUDA (the jobs' processes do)

    return visible_gpus(None, torch.cuda.device_count())


def _device_pool(jobs_at_once: int | None, jobs: list[Job]) -> DevicePool:
    on_gpu = any(job.on_gpu for job in jobs)
    gpus = _gpus() if on_gpu else []
    cpus = visible_cpus()
    largest = max(job.nproc for job in jobs)
    if jobs_at_once is None:
        jobs_at_once = min(default_jobs(len(gpus) if on_gpu else len(cpus), largest), len(jobs))
    if isinstance(jobs_at_once, bool) or not isinstance(jobs_at_once, int):
        raise ValueError(f"hydra.launcher.jobs={jobs_at_once!r}: give a whole number of jobs, or null for automatic.")
    return DevicePool(gpus, cpus, jobs_at_once)


def _run_all(launcher: Any, jobs: list[Job], pool: DevicePool) -> tuple[dict[int, JobReturn | SystemExit], bool]:
    """Start jobs as slices free up, until they have all ended or a stop came (a signal here, or a job stopped by
    one: no further job starts then).

    Returns:
        Each ended job's JobReturn (or the SystemExit of a job stopped by a signal), and whether the sweep stops.
    """
    waiting, running = list(jobs), {}
    results: dict[int, JobReturn | SystemExit] = {}
    # Hydra's singletons (its config store, the job runtime) as the job's process needs them; not the OmegaConf
    # resolvers, which are local functions that do not pickle: the child registers its own.
    singleton_state = Singleton.get_state()["instances"]
    with _forward_stop_signals() as stop:
        while waiting or running:
            while waiting and not stop.requested and (piece := pool.take(waiting[0].nproc, waiting[0].on_gpu)):
                job = waiting.pop(0)
                running[_submit(launcher, job, piece, singleton_state)] = (job, piece)
            if not running:
                break  # stopped: the jobs not yet started stay for the next run of the sweep
            done, _ = wait(list(running), return_when=FIRST_COMPLETED)
            for future in done:
                job, piece = running.pop(future)
                pool.give_back(piece)
                results[job.idx] = _outcome(future, job)
                log.info("job %d %s", job.idx, _describe(results[job.idx], job))
                if isinstance(results[job.idx], SystemExit):  # stopped by a signal sent to it: so is the sweep
                    stop.note(signal.SIGTERM)
    return results, stop.requested


def _submit(launcher: Any, job: Job, piece: Slice, singleton_state: Any) -> Future:
    log.info("job %d (%s) on %s: %s", job.idx, " ".join(filter_overrides(job.overrides)), piece.describe(), job.folder)
    # One fresh process per job: CUDA_VISIBLE_DEVICES and thread counts only take effect in a process that has
    # not loaded torch yet, and a job's DDP workers inherit them from it.
    executor = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    future = executor.submit(
        _run_job_in_slice,
        piece,
        job.folder,
        launcher.hydra_context,
        launcher.task_function,
        job.config,
        singleton_state,
    )
    executor.shutdown(wait=False)
    return future


def _run_job_in_slice(
    piece: Slice, folder: Path, hydra_context: Any, task_function: Any, config: DictConfig, singleton_state: Any
) -> JobReturn:
    """In the job's own process: take the slice, send the output to the job folder, run the job as Hydra does."""
    os.environ.update(piece.environment())
    os.environ.pop("MASTER_PORT", None)  # every job picks its own free port
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, piece.cpus)
    folder.mkdir(parents=True, exist_ok=True)
    _redirect_output(folder / OUTPUT_LOG)
    from omegaconf.basecontainer import BaseContainer

    from ddptrain.config import register_configs

    Singleton.set_state({"instances": singleton_state, "omegaconf_resolvers": BaseContainer._resolvers})
    setup_globals()  # Hydra's resolvers (now, hydra, ...)
    register_configs()  # ddptrain's (asset, swept)
    ret = run_job(
        hydra_context=hydra_context,
        task_function=task_function,
        config=config,
        job_dir_key="hydra.sweep.dir",
        job_subdir_key="hydra.sweep.subdir",
    )
    return _picklable(ret)


def _picklable(ret: JobReturn) -> JobReturn:
    """The JobReturn as it can travel back to the parent: its configs as plain containers (the typed ones hold
    dataclasses of this process's plugin scan, which the parent cannot unpickle), a failure whose exception does not
    pickle as a RuntimeError with the same message."""
    value = ret._return_value
    try:
        pickle.loads(pickle.dumps(value))  # some exceptions pickle but do not unpickle (a required argument)
    except Exception:
        value = RuntimeError(f"{type(value).__name__}: {value}")
    plain = JobReturn(
        overrides=ret.overrides,
        cfg=OmegaConf.create(OmegaConf.to_container(ret.cfg, resolve=False)),
        hydra_cfg=OmegaConf.create(OmegaConf.to_container(ret.hydra_cfg, resolve=False)),
        working_dir=ret.working_dir,
        task_name=ret.task_name,
        status=ret.status,
    )
    plain._return_value = value
    return plain


def _redirect_output(path: Path) -> None:
    """This process's stdout and stderr, and so its DDP workers', go to the job folder: jobs side by side would
    interleave their lines on the console."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _outcome(future: Future, job: Job) -> JobReturn | SystemExit:
    """The job's JobReturn; its SystemExit when a signal stopped it; a failed JobReturn when its process died (killed
    for memory, say) or ended with an exception Hydra does not catch."""
    try:
        return future.result()
    except SystemExit as stop:
        return stop
    except BaseException as err:
        died = JobReturn(overrides=job.overrides, status=JobStatus.FAILED, working_dir=str(job.folder))
        died._return_value = JobFailed(
            f"job {job.idx}: its process ended with {type(err).__name__}: {err} (output: {job.folder / OUTPUT_LOG})"
        )
        return died


def _describe(result: JobReturn | SystemExit, job: Job) -> str:
    if isinstance(result, SystemExit):
        return f"stopped (exit code {result.code}): {job.folder}"
    if result.status == JobStatus.FAILED:
        return f"failed: {result._return_value} (output: {job.folder / OUTPUT_LOG})"
    record = read_record(job.folder) or {}
    return f"{'skipped, finished in an earlier run' if record.get('skipped') else 'finished'}: {job.folder}"


def _raise_if_stopped(results: dict[int, JobReturn | SystemExit], stopped: bool) -> None:
    """After a stop (a signal here, or a job stopped or aborted), end the sweep as a stopped run ends: exit code 130
    if a job aborted, else 75. The jobs not started yet stay for the next run of the sweep."""
    codes = [r.code for r in results.values() if isinstance(r, SystemExit)]
    if codes or stopped:
        raise SystemExit(signals.ABORTED_EXIT_CODE if signals.ABORTED_EXIT_CODE in codes else signals.STOPPED_EXIT_CODE)


def _failed(result: JobReturn | SystemExit | None) -> bool:
    return isinstance(result, JobReturn) and result.status == JobStatus.FAILED


def _summarize(sweep_dir: Path, jobs: list[Job], returns: dict[int, JobReturn | SystemExit]) -> None:
    """Name every failed job, then write the sweep report (Hydra skips on_multirun_end when a job failed)."""
    failed = [job for job in jobs if _failed(returns.get(job.idx))]
    if failed:
        names = "; ".join(f"job {job.idx} in {job.folder}" for job in failed)
        log.error(
            "%d of %d jobs failed: %s (the output of each: output.log in its folder)", len(failed), len(jobs), names
        )
    from ddptrain.sweep.callback import refresh

    rows = refresh(sweep_dir)
    if rows and failed:
        from ddptrain.sweep.report import console_lines

        print(console_lines(sweep_dir, rows), file=sys.stderr)


@contextlib.contextmanager
def _forward_stop_signals() -> Iterator[signals.StopRequest]:
    """SIGTERM or Ctrl-C: pass it on to every running job's process (each saves and stops) and start no more.

    A terminal's Ctrl-C reaches the jobs too; the copy sent here arrives within milliseconds, which a job takes for
    the same request (``signals.REPEAT_WINDOW_S``). The parent itself never aborts: it waits for its jobs.
    """
    stop = signals.StopRequest()

    def handle(signum: int, frame: Any) -> None:
        stop.note(signum)
        for child in multiprocessing.active_children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signum)

    previous = {s: signal.signal(s, handle) for s in signals.STOP_SIGNALS}
    try:
        yield stop
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
