"""One job of a sweep: its record (``job.json`` in its folder), and what running it again means.

Every job of a multirun, whichever launcher starts it, runs through ``run_sweep_job``, which keeps
``<job folder>/job.json`` up to date: its overrides, its status (``running``, ``finished``, ``failed``,
``stopped``, ``aborted``), when it started and ended, its wall time over every attempt, the ``objective`` it returned
to Hydra (its final eval loss, else its final training loss) and, for a failure, the error. That record is what
makes a sweep resumable and reportable:

- run the same multirun again with the same ``hydra.sweep.dir`` and a finished job is skipped (its record says
  so: ``skipped``), while an interrupted one trains again in its own folder, where ``trainer.resume=auto`` (the
  default) continues from its last checkpoint;
- the sweep report reads the records (``ddptrain/sweep/report.py``), also while the sweep is still running, or
  after it was killed (a ``running`` record whose process is gone is ``interrupted``).

A job that fails raises ``JobFailed``, an ordinary exception, so Hydra records it and the sweep goes on with the
next job; a job stopped by SIGTERM or Ctrl-C stops the whole sweep (the user asked it to stop), exiting as a
stopped run does. Standard library only: the report reads records without torch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ddptrain.process import signals
from ddptrain.process.started import Start

log = logging.getLogger(__name__)

JOB_FILE = "job.json"
RUNNING, FINISHED, FAILED, STOPPED, ABORTED = "running", "finished", "failed", "stopped", "aborted"
INTERRUPTED = "interrupted"  # read only: a running record whose process is gone


class JobFailed(RuntimeError):
    """A sweep job failed; the message says which job, why, and where its output is."""


def read_record(job_dir: Path) -> dict[str, Any] | None:
    """The job's record, or None when it has none (or an unreadable one: it is written again)."""
    try:
        return json.loads((Path(job_dir) / JOB_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


@contextlib.contextmanager
def replaced_atomically(path: Path) -> Iterator[Path]:
    """A name beside ``path`` to write the new file under; once written, it replaces ``path`` in one step. A report
    read while jobs still write (or several jobs of a parallel sweep rewriting the report as they end) sees the old
    file or the new one, never half of one."""
    # Host and pid: the jobs of a sweep on several machines share its folder, and two of them may have the same pid.
    partial = path.with_name(f".{path.stem}.{socket.gethostname()}.{os.getpid()}{path.suffix}")
    try:
        yield partial
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)  # only left when the write failed


def write_record(job_dir: Path, record: dict[str, Any]) -> None:
    """Write ``job.json`` atomically (``replaced_atomically``)."""
    path = Path(job_dir) / JOB_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with replaced_atomically(path) as partial:
        partial.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def status_of(record: dict[str, Any] | None) -> str | None:
    """The record's status, with a ``running`` job whose process no longer exists read as ``interrupted``.

    On this host the process id tells. On another, only a record of an earlier attempt of the Slurm job this process
    runs in is known to be dead: Slurm requeued the job (same SLURM_JOB_ID, a higher SLURM_RESTART_COUNT), maybe
    onto another node, after killing its processes before they could say they ended.
    """
    if record is None:
        return None
    if record.get("status") != RUNNING:
        return record.get("status")
    if record.get("host") == socket.gethostname():
        return RUNNING if _alive(int(record.get("pid", -1))) else INTERRUPTED
    job, restart = slurm_attempt()
    earlier_attempt = job is not None and record.get("slurm_job") == job and record.get("slurm_restart", 0) < restart
    return INTERRUPTED if earlier_attempt else RUNNING


def slurm_attempt() -> tuple[str | None, int]:
    """The Slurm job this process runs in and how often it was requeued (None, 0 outside Slurm)."""
    return os.environ.get("SLURM_JOB_ID"), int(os.environ.get("SLURM_RESTART_COUNT", "0"))


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


def run_sweep_job(train: Callable[[], float | None], job_dir: Path, overrides: list[str], num: int) -> float | None:
    """Run one sweep job, or skip it when its folder holds the same job, finished.

    Args:
        train: runs the job (``launch.run`` on its config) and returns its objective (``launch.objective``).
        job_dir: the job's folder (Hydra's output dir for it): also its run folder.
        overrides: the job's overrides (``hydra.overrides.task``), which identify it.
        num: the job's number in the sweep (``hydra.job.num``).

    Returns:
        The objective: this run's, or the recorded one of a finished job that was skipped.

    Raises:
        JobFailed: the job failed, or its folder holds a different job (another sweep's).
        SystemExit: the job was stopped (exit code 75) or aborted (130): the sweep ends too.
    """
    job_dir = Path(job_dir)
    previous = read_record(job_dir)
    _refuse_another_job(previous, job_dir, overrides, num)
    if not Start.from_environ().is_rank_zero:
        return _as_another_rank(train, previous)
    if previous is not None and status_of(previous) == RUNNING:
        raise JobFailed(
            f"job {num}: {job_dir} is in use by a running job (process {previous.get('pid')} on "
            f"{previous.get('host')}): wait for it, or stop it, before running this sweep again."
        )
    if previous is not None and previous.get("status") == FINISHED:
        log.warning("job %d (%s) finished in an earlier run of this sweep: skipped", num, " ".join(overrides))
        write_record(job_dir, {**previous, "skipped": True, "resumed": False})
        return previous.get("objective")
    record = _started(job_dir, overrides, num, previous)
    write_record(job_dir, record)
    try:
        value = train()
    except SystemExit as stop:
        _ended_by_exit(job_dir, record, stop)
    except Exception as err:
        _ended(job_dir, record, FAILED, error=f"{type(err).__name__}: {err}")
        raise
    _ended(job_dir, record, FINISHED, objective=value)
    return value


def _refuse_another_job(previous: dict[str, Any] | None, job_dir: Path, overrides: list[str], num: int) -> None:
    """Every rank refuses a folder that holds another job (the same verdict on each: none waits for a rank 0 that
    refused)."""
    if previous is not None and sorted(previous.get("overrides", [])) != sorted(overrides):
        raise JobFailed(
            f"job {num}: {job_dir} holds a job with other overrides ({' '.join(previous.get('overrides', []))}) "
            f"than this one ({' '.join(overrides)}): rerun with the same command to resume that sweep, or give "
            "this one a folder of its own (hydra.sweep.dir=...)."
        )


def _as_another_rank(train: Callable[[], float | None], record: dict[str, Any] | None) -> Any:
    """A rank other than 0 of a job whose tasks are its ranks (``hydra/launcher=slurm_multinode``): rank 0 keeps the
    record; this one trains with it, or skips with it the job an earlier run of the sweep finished."""
    if record is not None and record.get("status") == FINISHED:
        return record.get("objective")
    return train()


def _started(job_dir: Path, overrides: list[str], num: int, previous: dict[str, Any] | None) -> dict[str, Any]:
    earlier = previous or {}
    slurm_job, slurm_restart = slurm_attempt()
    wall = float(earlier.get("wall_s", 0.0))
    if status_of(previous) == INTERRUPTED:  # killed: it never wrote its end, but its metrics say when it last worked
        wall = _wall_until_last_write(job_dir, earlier)
    return {
        "num": num,
        "overrides": overrides,
        "status": RUNNING,
        "attempt": int(earlier.get("attempt", 0)) + 1,
        # An earlier attempt left a complete checkpoint (its manifest is written last): trainer.resume=auto
        # continues from it.
        "resumed": any((job_dir / "checkpoints").glob("step-*/manifest.json")),
        "skipped": False,
        "started_at": time.time(),
        "earlier_wall_s": wall,
        "wall_s": wall,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "slurm_job": slurm_job,
        "slurm_restart": slurm_restart,
    }


def _wall_until_last_write(job_dir: Path, record: dict[str, Any]) -> float:
    """An interrupted attempt's wall time: from its start to the last write of its metrics (or nothing, if none)."""
    metrics = job_dir / "metrics.jsonl"
    started = float(record.get("started_at", 0.0))
    until = metrics.stat().st_mtime if metrics.is_file() else started
    return float(record.get("earlier_wall_s", 0.0)) + max(0.0, until - started)


def _ended(job_dir: Path, record: dict[str, Any], status: str, **fields: Any) -> None:
    ended = time.time()
    wall = record["earlier_wall_s"] + ended - record["started_at"]
    record.update(status=status, ended_at=ended, wall_s=wall, **fields)
    with contextlib.suppress(OSError):  # a full disk must not hide the job's own error
        write_record(job_dir, record)


def _ended_by_exit(job_dir: Path, record: dict[str, Any], stop: SystemExit) -> None:
    """The job called sys.exit: finished (0), stopped or aborted (end the sweep too), or failed (go on)."""
    code = stop.code
    if code in (None, 0):
        _ended(job_dir, record, FINISHED, objective=None)
        return
    if code in (signals.STOPPED_EXIT_CODE, signals.ABORTED_EXIT_CODE):
        _ended(job_dir, record, STOPPED if code == signals.STOPPED_EXIT_CODE else ABORTED)
        raise stop
    message = code if isinstance(code, str) else f"exit code {code}"
    if code == signals.DIVERGED_EXIT_CODE:
        message = f"diverged (exit code {code}): a step's loss or gradient norm was not finite (metrics.jsonl)"
    _ended(job_dir, record, FAILED, error=message)
    # Into the job's own output too (a parallel sweep's output.log): the launcher's summary names every rank's error,
    # where the tracebacks above may hold only the rank that elastic reported first (one ended by another's failure).
    log.error("job %d failed: %s", record["num"], message)
    raise JobFailed(f"job {record['num']} ({' '.join(record['overrides'])}) failed: {message}") from None
