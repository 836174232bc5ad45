"""Sweeps through the real entrypoint: jobs side by side on disjoint cores (``hydra/launcher=parallel``), a failed
job that lets the others finish, the sweep report, and a killed sweep that resumes where it stopped."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
from PIL import Image
from safetensors.torch import load_file

from ddptrain.sweep.report import COLUMNS
from tests.conftest import (
    REPO,
    RUN_TAG,
    assert_no_process_left,
    read_metrics,
    read_written_metrics,
    run_ddptrain,
    train_in_process,
)

pytestmark = pytest.mark.e2e

TINY_DATA = REPO / "ddptrain" / "assets" / "tiny_instruct.jsonl"
QUIET = ["trainer.progress_bar=false", "data.eval_fraction=0.02"]


def sweep_args(sweep_dir: Path, *args: str) -> list[str]:
    return ["-m", *args, *QUIET, f"trainer.output_dir={sweep_dir.parent}", f"hydra.sweep.dir={sweep_dir}"]


def job_dirs(sweep_dir: Path) -> list[Path]:
    folders = [p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return sorted(folders, key=lambda p: int(p.name.split("_")[0]))


def stamp(line: str) -> datetime:
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")


def training_interval(job: Path) -> tuple[datetime, datetime]:
    """From the job's own train.log: the line that starts the training loop, and the last line of a step."""
    lines = (job / "train.log").read_text().splitlines()
    start = next(line for line in lines if "ddptrain.trainer: training " in line)
    end = [line for line in lines if "ddptrain.checkpoint: saved checkpoint" in line][-1]
    return stamp(start), stamp(end)


def logged_interval(job: Path) -> tuple[datetime, datetime]:
    """From the first to the last time-stamped line of the job's train.log."""
    stamps = [stamp(line) for line in (job / "train.log").read_text().splitlines() if line[:2] == "20"]
    return stamps[0], stamps[-1]


def cores_of(job: Path) -> str:
    """The cores rank 0 of the job ran on, as its train.log says; checks it ran one thread per core it had."""
    (line,) = [line for line in (job / "train.log").read_text().splitlines() if "rank 0 of " in line]
    threads, cores = re.search(r"(\d+) thread\(s\) on cores (\S+)", line).groups()
    processes = int(re.search(r"rank 0 of (\d+)", line).group(1))
    assert int(threads) == max(1, len(expand(cores)) // processes), line
    return cores


def expand(cores: str) -> list[int]:
    """``0-2,5`` -> [0, 1, 2, 5]."""
    found = []
    for part in cores.split(","):
        low, _, high = part.partition("-")
        found += range(int(low), int(high or low) + 1)
    return found


def test_a_parallel_sweep_runs_its_jobs_at_the_same_time_on_their_own_cores(tmp_path) -> None:
    sweep = tmp_path / "sweep"
    args = ["hydra/launcher=parallel", "parallel=single", "optim.lr=0.001,0.002", "trainer.max_steps=30"]
    result = run_ddptrain(sweep_args(sweep, *args, "data.max_rows=300"))
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = job_dirs(sweep)
    assert [j.name for j in jobs] == ["0_optim.lr=0.001", "1_optim.lr=0.002"]
    for job in jobs:
        assert [r["step"] for r in read_metrics(job) if "loss" in r][-1] == 30
        assert (job / "adapter").is_dir()
    (a_start, a_end), (b_start, b_end) = (training_interval(j) for j in jobs)
    assert a_start < b_end and b_start < a_end, (
        f"the jobs trained one after another: {a_start}-{a_end}, {b_start}-{b_end}"
    )
    cores = [cores_of(j) for j in jobs]
    assert cores[0] != cores[1] and not set(expand(cores[0])) & set(expand(cores[1])), f"shared cores: {cores}"
    assert "2 jobs, 2 at a time" in result.stdout + result.stderr


def write_rows(path: Path, rows: int, bad_line: bool = False) -> Path:
    lines = TINY_DATA.read_text().splitlines()[:rows]
    if bad_line:
        lines.insert(rows // 2, '{"instruction": not json')
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_parallel_sweep_of_ddp_jobs_survives_a_failed_job_and_reports_every_job(tmp_path) -> None:
    files = [write_rows(tmp_path / f"rows{i}.jsonl", 240 + 20 * i) for i in range(3)]
    files.insert(2, write_rows(tmp_path / "broken.jsonl", 240, bad_line=True))
    sweep = tmp_path / "sweep"
    paths = ",".join(str(f) for f in files)
    args = ["hydra/launcher=parallel", "hydra.launcher.jobs=2", "parallel=ddp2", f"data.path={paths}"]
    result = run_ddptrain(
        sweep_args(sweep, *args, "trainer.max_steps=3", "data.max_length=128", "parallel.timeout_s=60")
    )
    assert result.returncode != 0, "a failed job makes the sweep fail"
    output = result.stdout + result.stderr
    assert f"1 of 4 jobs failed: job 2 in {sweep}/2_data.path=" in output, output[-3000:]
    jobs = job_dirs(sweep)
    assert len(jobs) == 4
    for i, job in enumerate(jobs):
        output = (job / "output.log").read_text()
        assert ("not valid JSON" in output) == (i == 2), output[-2000:]  # the broken row's error, in its job's output
        assert (job / "adapter").is_dir() == (i != 2), "every other job finished"
    # Jobs 0 and 1 ran at the same time (hydra.launcher.jobs=2): from its first log line to its last, by each rank 0's
    # own train.log. Their 3 steps are too short to overlap reliably on a loaded machine; their whole runs are not.
    (a_start, a_end), (b_start, b_end) = (logged_interval(j) for j in jobs[:2])
    assert a_start < b_end and b_start < a_end, (
        f"jobs 0 and 1 ran one after another: {a_start}-{a_end}, {b_start}-{b_end}"
    )

    with (sweep / "report.csv").open() as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == list(COLUMNS) and len(table) == 4
    by_job = {int(row["job"]): row for row in table}
    assert by_job[2]["status"] == "failed" and table[-1]["job"] == "2", "the failure is marked and ranked last"
    for job in (0, 1, 3):
        row = by_job[job]
        logged = [r for r in read_metrics(jobs[job]) if "loss" in r][-1]
        assert (
            row["status"] == "finished" and row["steps"] == "3" and float(row["loss"]) == pytest.approx(logged["loss"])
        )
        assert float(row["tokens_per_s"]) > 0 and float(row["mem_peak_gb"]) > 0 and float(row["wall_s"]) > 0
    assert "failed: rank " in (sweep / "report.md").read_text()
    for name in ("loss_curves.png", "throughput_memory.png"):
        with Image.open(sweep / name) as image:
            image.verify()

    written = {name: (sweep / name).read_text() for name in ("report.csv", "report.md")}
    for name in written:
        (sweep / name).unlink()
    again = subprocess.run([sys.executable, "-m", "ddptrain.report", str(sweep)], capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert {name: (sweep / name).read_text() for name in written} == written, "the command and the callback agree"


LEARNING_RATES = ["0.001", "0.002", "0.003"]
RESUMABLE_RUN = ["parallel=single", "trainer.max_steps=12", "trainer.save_every_n_steps=4", "data.max_rows=300"]
RESUMABLE_RUN += ["trainer.log_every_n_steps=1"]
RESUMABLE = [*RESUMABLE_RUN, f"optim.lr={','.join(LEARNING_RATES)}"]


def adapters(sweep: Path) -> list[dict]:
    return [load_file(str(j / "adapter" / "adapter_model.safetensors")) for j in job_dirs(sweep)]


def reference_adapters(folder: Path) -> list[dict]:
    """The final adapter of each job of the RESUMABLE sweep, never killed: each job's run launched from this process
    (its one rank forks from the session's forkserver), not through a sweep of its own. What is compared is only the
    weights; the sweep that is killed and run again goes through the command line."""
    found = []
    for i, lr in enumerate(LEARNING_RATES):
        run_dir = train_in_process(folder / f"{i}_optim.lr={lr}", [*RESUMABLE_RUN, f"optim.lr={lr}", *QUIET])
        found.append(load_file(str(run_dir / "adapter" / "adapter_model.safetensors")))
    return found


def test_a_killed_sweep_run_again_skips_what_finished_and_resumes_the_rest(tmp_path) -> None:
    reference = reference_adapters(tmp_path / "reference")

    sweep = tmp_path / "sweep"
    # The overrides run_ddptrain gives the rerun below (a sweep run again with other overrides is refused).
    rerun_args = [*RESUMABLE, "parallel.start_method=forkserver"]
    command = [sys.executable, "-m", "ddptrain", *sweep_args(sweep, *rerun_args), "trainer.device=cpu"]
    tag = f"resumable-sweep-{os.getpid()}-{time.monotonic_ns()}"
    proc = subprocess.Popen(
        command,
        cwd=REPO,
        env={**os.environ, RUN_TAG: tag},
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    second_job_checkpoint = None
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            found = list(sweep.glob("1_*/checkpoints/step-00000004/manifest.json")) if sweep.exists() else []
            if found:
                second_job_checkpoint = found[0]
                break
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # as a crash or a lost node would: nothing gets to save
        proc.wait(timeout=30)
    assert second_job_checkpoint is not None, "the sweep never reached its second job's first checkpoint"
    assert_no_process_left(tag)
    assert not (job_dirs(sweep)[1] / "adapter").exists(), "killed before the second job finished"
    # The report of the killed sweep, from its folder: the first job finished, the second interrupted.
    killed = subprocess.run([sys.executable, "-m", "ddptrain.report", str(sweep)], capture_output=True, text=True)
    assert killed.returncode == 0, killed.stderr
    with (sweep / "report.csv").open() as f:
        assert [(r["job"], r["status"]) for r in csv.DictReader(f)] == [("0", "finished"), ("1", "interrupted")]

    rerun = run_ddptrain(sweep_args(sweep, *rerun_args))
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    first, second, _third = job_dirs(sweep)
    starts = re.findall(r"training 12 steps on 1 ranks, from step (\d+)", (second / "train.log").read_text())
    assert len(starts) == 2 and starts[0] == "0" and int(starts[1]) >= 4, f"the second attempt resumed: {starts}"
    report = (sweep / "report.md").read_text()
    assert "job 0 (`0_optim.lr=0.001`): skipped: finished in an earlier run of this sweep" in report
    assert "job 1 (`1_optim.lr=0.002`): resumed from its last checkpoint (attempt 2)" in report
    assert "| 2 | optim.lr=0.003 | finished | 12/12 |" in report and "job 2 (`2_optim.lr=0.003`)" not in report
    assert (first / "train.log").read_text().count("ddptrain.trainer: training 12 steps") == 1, "not trained again"

    # The default launcher's report comes from the Hydra callback alone; the command writes the same.
    written = {name: (sweep / name).read_text() for name in ("report.csv", "report.md")}
    for name in written:
        (sweep / name).unlink()
    subprocess.run([sys.executable, "-m", "ddptrain.report", str(sweep)], capture_output=True, check=True)
    assert {name: (sweep / name).read_text() for name in written} == written, "the command and the callback agree"

    got_all = adapters(sweep)
    assert len(got_all) == len(reference) == 3
    for got, want in zip(got_all, reference):
        assert got.keys() == want.keys()
        assert all((got[k] == want[k]).all() for k in got), "resumed sweep differs from the uninterrupted one"


def test_submitit_local_runs_a_two_job_sweep(tmp_path) -> None:
    sweep = tmp_path / "sweep"
    args = ["hydra/launcher=submitit_local", "parallel=single", "optim.lr=0.001,0.002", "trainer.max_steps=4"]
    result = run_ddptrain(sweep_args(sweep, *args, "data.max_rows=200"))
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    jobs = job_dirs(sweep)
    # Named by the swept key although submitit's job processes have a command line of their own.
    assert [j.name for j in jobs] == ["0_optim.lr=0.001", "1_optim.lr=0.002"]
    for job in jobs:
        assert [r["step"] for r in read_metrics(job) if "loss" in r][-1] == 4 and (job / "adapter").is_dir()
    assert (sweep / ".submitit").is_dir(), "the jobs ran through submitit"
    with (sweep / "report.csv").open() as f:
        assert [row["status"] for row in csv.DictReader(f)] == ["finished", "finished"]


def _submitit_tasks(root: int) -> list[int]:
    """The processes submitit started for the job's tasks (each runs ``submitit.core._submit``), among ``root``'s
    descendants only: never another test's."""
    found, todo = [], [root]
    while todo:
        children = subprocess.run(["pgrep", "-P", str(todo.pop())], capture_output=True, text=True).stdout.split()
        for pid in map(int, children):
            todo.append(pid)
            with contextlib.suppress(FileNotFoundError):
                if b"submitit.core._submit" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(pid)
    return found


def test_a_submitit_job_whose_tasks_are_its_ranks_saves_on_usr2_and_resumes_when_requeued(tmp_path) -> None:
    """``hydra.launcher.tasks_per_node=2`` under submitit_local: the job's two tasks are ranks 0 and 1 of one group
    (as srun starts them under hydra/launcher=slurm_multinode), in one run folder. SIGUSR2 to every task, as Slurm
    sends it ahead of the time limit, makes both save one checkpoint and stop; submitit then requeues the job, which
    resumes from that checkpoint and finishes."""
    sweep = tmp_path / "sweep"
    args = ["hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2", "hydra.launcher.timeout_min=5"]
    args += ["parallel=ddp2", "trainer.max_steps=60", "trainer.log_every_n_steps=1"]
    args += ["data.max_rows=300", "data.max_length=128", "trainer.save_every_n_steps=1000"]
    command = [sys.executable, "-m", "ddptrain", *sweep_args(sweep, *args), "trainer.device=cpu"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", RUN_TAG: " ".join(command)}
    env.pop("MASTER_PORT", None)
    sweeper = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    job = sweep / "0_"  # a sweep of one job: no key takes more than one value
    deadline, training = time.monotonic() + 120, False
    while not training and time.monotonic() < deadline and sweeper.poll() is None:
        metrics = job / "metrics.jsonl"
        training = metrics.is_file() and any(r.get("step", 0) >= 3 for r in read_written_metrics(job))
        time.sleep(0.1)
    assert training, "the job never reached step 3"
    tasks = _submitit_tasks(sweeper.pid)
    assert len(tasks) == 2, tasks
    for pid in tasks:
        os.kill(pid, signal.SIGUSR2)
    output, _ = sweeper.communicate(timeout=240)
    assert sweeper.returncode == 0, output[-4000:]

    assert job_dirs(sweep) == [job], "one run folder for both ranks"
    log = (job / "train.log").read_text()
    assert "rank 0 of 2" in log and "SIGUSR2: finishing this step, saving a checkpoint" in log, log[-3000:]
    submitit_logs = "".join(p.read_text() for p in (sweep / ".submitit").rglob("*_log.*"))
    assert "Requeued job" in submitit_logs, submitit_logs[-3000:]
    steps = [r["step"] for r in read_metrics(job) if "loss" in r]
    record = json.loads((job / "job.json").read_text())
    assert record["status"] == "finished" and record["attempt"] == 2 and record["resumed"] is True, record
    assert steps == list(range(1, 61)), "the requeued job went on from the step the first attempt saved"
    stopped_at, last = sorted(int(p.name.split("-")[1]) for p in (job / "checkpoints").glob("step-*"))
    assert 3 <= stopped_at < last == 60
    assert f"training 60 steps on 2 ranks, from step {stopped_at}" in log, "the second attempt resumed from the save"
    assert_no_process_left(env[RUN_TAG])


@pytest.mark.parametrize(
    ("preset", "extra", "expected"),
    [
        ("slurm", [], ["--nodes=1", "--ntasks-per-node=1", "--gpus-per-node=4"]),
        ("slurm_multinode", ["hydra.launcher.nodes=3"], ["--nodes=3", "--ntasks-per-node=4", "--gpus-per-node=4"]),
    ],
    ids=["one-node", "several-nodes"],
)
def test_a_slurm_preset_submits_the_nodes_tasks_and_gpus_of_the_job(tmp_path, preset, extra, expected) -> None:
    """The real submission path up to sbatch: a stand-in sbatch (and srun, which submitit looks for) records the
    script it is given and refuses, as a machine without Slurm would. One node: one task that starts the workers;
    several: one task per rank (parallel=ddp4: 4 per node, one GPU each)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text('#!/bin/sh\ncp "$1" "$SBATCH_RECORD"\necho "sbatch: no Slurm here" >&2\nexit 1\n')
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    record, sweep = tmp_path / "submitted.sh", tmp_path / "sweep"
    command = [sys.executable, "-m", "ddptrain", "-m", f"hydra/launcher={preset}", "parallel=ddp4", *extra]
    command += ["hydra.launcher.partition=gpu", "hydra.launcher.timeout_min=90", "optim.lr=0.001,0.002"]
    command += [f"trainer.output_dir={tmp_path}", f"hydra.sweep.dir={sweep}", "trainer.device=cuda"]
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SBATCH_RECORD": str(record)}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "sbatch: no Slurm here" in result.stderr, result.stderr[-2000:]
    script = record.read_text()
    for line in (*expected, "--partition=gpu", "--time=90", "--signal=USR2@120"):
        assert f"#SBATCH {line}\n" in script, script
    assert "#SBATCH --array=0-1%" in script, "one array task per sweep job"
    assert "#SBATCH --job-name=ddptrain\n" in script
    (srun,) = [line for line in script.splitlines() if line.startswith("srun ")]
    assert srun.endswith(f"{sys.executable} -u -m submitit.core._submit {sweep}/.submitit/%j"), srun


def test_the_optuna_recipe_runs_three_trials_and_the_report_ranks_them(tmp_path) -> None:
    sweep = tmp_path / "sweep"
    args = ["-m", "--config-dir", "recipes", "--config-name", "optuna_lr_rank", "hydra.sweeper.n_trials=3"]
    args += ["parallel=single", "trainer.max_steps=10", "data.max_rows=300"]
    args += [f"trainer.output_dir={tmp_path}", f"hydra.sweep.dir={sweep}"]
    result = run_ddptrain(args)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    jobs = job_dirs(sweep)
    assert len(jobs) == 3 and all(re.fullmatch(r"\d_model\.lora_rank=\d+,optim\.lr=[0-9.e-]+", j.name) for j in jobs)
    # Optuna minimised what each trial returned: its best eval loss, as the trial logged it (here its only one).
    logged = {j.name.split("_")[0]: [r["eval_loss"] for r in read_metrics(j) if "eval_loss" in r][-1] for j in jobs}
    best_of = {j.name.split("_")[0]: json.loads((j / "best" / "best.json").read_text())["eval_loss"] for j in jobs}
    assert best_of == logged
    best = yaml_value(sweep / "optimization_results.yaml", "best_value")
    assert best == pytest.approx(min(best_of.values()))
    with (sweep / "report.csv").open() as f:
        table = list(csv.DictReader(f))
    assert [float(row["eval_loss"]) for row in table] == pytest.approx(sorted(logged.values()))
    assert [row["job"] for row in table] == sorted(logged, key=logged.get), "ranked best first by eval loss"


def yaml_value(path: Path, key: str) -> float:
    from omegaconf import OmegaConf

    return float(OmegaConf.load(path)[key])
