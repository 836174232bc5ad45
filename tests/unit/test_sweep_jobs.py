"""A sweep job's record (job.json): a finished job is skipped on a rerun, a failure lets the sweep go on, a stop
ends it, and a folder holding another job is refused."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ddptrain.process import signals
from ddptrain.sweep import jobs

OVERRIDES = ["optim.lr=0.001", "trainer.max_steps=5"]


def test_a_finished_job_is_skipped_when_the_sweep_runs_again(tmp_path) -> None:
    calls = []
    assert jobs.run_sweep_job(lambda: calls.append(1) or 2.5, tmp_path, OVERRIDES, 0) == 2.5
    first = jobs.read_record(tmp_path)
    assert first["status"] == "finished" and first["objective"] == 2.5 and not first["skipped"]
    assert jobs.run_sweep_job(lambda: calls.append(1) or 9.9, tmp_path, OVERRIDES, 0) == 2.5
    assert calls == [1], "the second run did not train again"
    again = jobs.read_record(tmp_path)
    assert again["skipped"] and again["wall_s"] == first["wall_s"]


def dead_pid() -> int:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(gone.stdout)


def test_an_interrupted_job_trains_again_and_says_it_resumed(tmp_path) -> None:
    started = time.time() - 100
    killed = {"overrides": OVERRIDES, "status": "running", "attempt": 1, "started_at": started, "earlier_wall_s": 4.0}
    jobs.write_record(tmp_path, {**killed, "wall_s": 4.0, "host": jobs.socket.gethostname(), "pid": dead_pid()})
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    os.utime(tmp_path / "metrics.jsonl", (started + 30, started + 30))  # its last write: 30 s into the attempt
    (tmp_path / "checkpoints" / "step-00000004").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-00000004" / "manifest.json").write_text("{}")
    assert jobs.run_sweep_job(lambda: 1.0, tmp_path, list(reversed(OVERRIDES)), 3) == 1.0, "order does not matter"
    record = jobs.read_record(tmp_path)
    assert record["status"] == "finished" and record["resumed"] and record["attempt"] == 2
    assert 34.0 <= record["wall_s"] < 40.0, "4 s before, 30 s of the killed attempt, and this one's"


def test_a_job_still_running_in_its_folder_is_not_started_twice(tmp_path) -> None:
    alive = {"overrides": OVERRIDES, "status": "running", "host": jobs.socket.gethostname(), "pid": os.getpid()}
    jobs.write_record(tmp_path, alive)
    with pytest.raises(jobs.JobFailed, match=f"in use by a running job \\(process {os.getpid()}"):
        jobs.run_sweep_job(lambda: 1.0, tmp_path, OVERRIDES, 0)


def test_a_folder_holding_another_job_is_refused(tmp_path) -> None:
    jobs.run_sweep_job(lambda: 1.0, tmp_path, OVERRIDES, 0)
    with pytest.raises(jobs.JobFailed, match=r"other overrides .*hydra\.sweep\.dir"):
        jobs.run_sweep_job(lambda: 1.0, tmp_path, ["optim.lr=0.002", "trainer.max_steps=5"], 0)


def test_a_failure_is_recorded_and_raised_as_an_exception_the_sweep_survives(tmp_path) -> None:
    def fails() -> float:
        sys.exit("ddptrain: training failed:\n  rank 1 (exit code 1): ValueError: bad row")

    with pytest.raises(jobs.JobFailed, match=r"rank 1 .*bad row") as caught:
        jobs.run_sweep_job(fails, tmp_path, OVERRIDES, 2)
    assert not isinstance(caught.value, SystemExit)
    record = jobs.read_record(tmp_path)
    assert record["status"] == "failed" and "ValueError: bad row" in record["error"]


def test_an_exception_is_recorded_and_raised_unchanged(tmp_path) -> None:
    def fails() -> float:
        raise ValueError("data.path=x.jsonl:3: not valid JSON")

    with pytest.raises(ValueError, match="not valid JSON"):
        jobs.run_sweep_job(fails, tmp_path, OVERRIDES, 0)
    assert jobs.read_record(tmp_path)["error"] == "ValueError: data.path=x.jsonl:3: not valid JSON"


@pytest.mark.parametrize(
    ("code", "status"), [(signals.STOPPED_EXIT_CODE, "stopped"), (signals.ABORTED_EXIT_CODE, "aborted")]
)
def test_a_stop_by_signal_ends_the_sweep(tmp_path, code, status) -> None:
    with pytest.raises(SystemExit) as caught:
        jobs.run_sweep_job(lambda: sys.exit(code), tmp_path, OVERRIDES, 0)
    assert caught.value.code == code
    assert jobs.read_record(tmp_path)["status"] == status


def test_a_running_record_whose_process_is_gone_reads_as_interrupted(tmp_path) -> None:
    record = {"status": "running", "pid": dead_pid(), "host": jobs.socket.gethostname()}
    assert jobs.status_of(record) == "interrupted"
    assert jobs.status_of({**record, "pid": jobs.os.getpid()}) == "running"
    assert jobs.status_of({**record, "host": "another-node"}) == "running", "no way to tell on another host"


def test_the_other_ranks_of_a_job_whose_tasks_are_its_ranks_leave_the_record_to_rank_0(tmp_path, monkeypatch) -> None:
    """hydra/launcher=slurm_multinode: every task runs the job. Rank 1 finds rank 0's fresh ``running`` record (a live
    process: rank 0's) and trains with it, writing nothing; when rank 0 found the job finished, rank 1 skips it too."""
    rank1 = {"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_GLOBALID": "1", "SUBMITIT_LOCAL_LOCALID": "1"}
    rank1 |= {"SUBMITIT_LOCAL_NTASKS": "2", "SUBMITIT_LOCAL_JOB_NUM_NODES": "1", "SUBMITIT_LOCAL_JOB_ID": "77"}
    for name, value in rank1.items():
        monkeypatch.setenv(name, value)
    rank0_running = {"overrides": OVERRIDES, "status": "running", "host": jobs.socket.gethostname(), "pid": os.getpid()}
    jobs.write_record(tmp_path, rank0_running)
    calls = []
    assert jobs.run_sweep_job(lambda: calls.append(1) or 3.0, tmp_path, OVERRIDES, 0) == 3.0
    assert calls == [1] and jobs.read_record(tmp_path) == rank0_running, "rank 1 trained and left the record alone"
    jobs.write_record(tmp_path, {**rank0_running, "status": "finished", "objective": 2.0})
    assert jobs.run_sweep_job(lambda: calls.append(1) or 3.0, tmp_path, OVERRIDES, 0) == 2.0
    assert calls == [1], "rank 1 skipped the job rank 0 skips"


def test_a_record_left_running_by_an_earlier_attempt_of_this_slurm_job_is_interrupted(tmp_path, monkeypatch) -> None:
    """Slurm requeued the job after killing it (its record still says running), maybe onto another node, where the
    process id says nothing: the job id, which a requeue keeps, and the restart count, which it raises, say it was
    this job's own earlier attempt."""
    left = {"overrides": OVERRIDES, "status": "running", "host": "node-that-was-preempted", "pid": 4242}
    left |= {"slurm_job": "777", "slurm_restart": 0, "started_at": time.time(), "earlier_wall_s": 0.0}
    jobs.write_record(tmp_path, left)
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert jobs.status_of(jobs.read_record(tmp_path)) == "interrupted"
    assert jobs.run_sweep_job(lambda: 1.5, tmp_path, OVERRIDES, 0) == 1.5
    # The same attempt (a second sweep in one allocation), or another job: that one may still be running there.
    for job, restart in (("777", "0"), ("778", "1")):
        monkeypatch.setenv("SLURM_JOB_ID", job)
        monkeypatch.setenv("SLURM_RESTART_COUNT", restart)
        jobs.write_record(tmp_path, left)
        with pytest.raises(jobs.JobFailed, match="in use by a running job"):
            jobs.run_sweep_job(lambda: 1.5, tmp_path, OVERRIDES, 0)


def test_every_rank_refuses_a_folder_holding_another_job(tmp_path, monkeypatch) -> None:
    """Rank 1 reaches the same verdict as rank 0 from the record, instead of waiting for a rank 0 that refused."""
    for name, value in {
        "SUBMITIT_EXECUTOR": "local",
        "SUBMITIT_LOCAL_GLOBALID": "1",
        "SUBMITIT_LOCAL_LOCALID": "1",
        "SUBMITIT_LOCAL_NTASKS": "2",
        "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
        "SUBMITIT_LOCAL_JOB_ID": "77",
    }.items():
        monkeypatch.setenv(name, value)
    jobs.write_record(tmp_path, {"overrides": ["optim.lr=0.5"], "status": "finished"})
    with pytest.raises(jobs.JobFailed, match="holds a job with other overrides"):
        jobs.run_sweep_job(lambda: 1.0, tmp_path, OVERRIDES, 0)
