"""The real entrypoint, as users run it: ``python -m ddptrain`` and ``torchrun -m ddptrain``."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from ddptrain.data import Collator, RowsDataset, build_datasets
from ddptrain.export import load_run_config
from ddptrain.model import CausalLMLoss
from tests.conftest import (
    ALPACA,
    REPO,
    RUN_TAG,
    assert_no_process_left,
    read_metrics,
    requires_shared,
    run_ddptrain,
    run_dirs,
)

pytestmark = pytest.mark.e2e
TORCHRUN = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", "2"]
METRIC_FIELDS = {"step", "epoch", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "elapsed_s"}
BATCH_FIELDS = {"padding_fraction", "rank_imbalance", "peak_rank_tokens"}
# What rank 1 may print (observe.console.setup_logging): "[rank1] HH:MM:SS WARNING logger: message", or ERROR.
RANK1_WARNING = re.compile(r"^\[rank1\] \d\d:\d\d:\d\d (WARNING|ERROR|CRITICAL) ")


def alpaca_args(output_dir: Path, cache: Path, steps: int = 20) -> list[str]:
    return [
        "data=alpaca",
        f"data.path={ALPACA}",
        "data.max_rows=2000",
        "data.max_length=256",
        "data.eval_fraction=0.02",
        f"data.cache_dir={cache}",
        f"trainer.max_steps={steps}",
        "trainer.log_every_n_steps=5",
        "trainer.progress_bar=false",
        "parallel.timeout_s=60",
        f"trainer.output_dir={output_dir}",
    ]


def eval_loss_from_saved_adapter(run_dir: Path) -> float:
    """Rebuild the eval split from the saved config and score it with plain transformers + peft."""
    cfg = load_run_config(run_dir)
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "adapter")
    eval_set = build_datasets(cfg.data, tokenizer, cfg.trainer.seed).eval
    base = AutoModelForCausalLM.from_pretrained(run_dir / "base")
    scorer = CausalLMLoss(PeftModel.from_pretrained(base, run_dir / "adapter")).eval()
    collate = Collator(tokenizer.pad_token_id)
    rows = RowsDataset(eval_set)
    total = tokens = 0.0
    with torch.no_grad():
        for i in range(len(eval_set)):
            loss_sum, n = scorer(**collate([rows[(i,)]]))
            total, tokens = total + float(loss_sum), tokens + float(n)
    return total / tokens


def reported_run_dir(result: subprocess.CompletedProcess) -> Path:
    """The run folder the run's last line names: once, by rank 0 alone."""
    assert result.returncode == 0, result.stderr[-3000:]
    reported = re.findall(r"Results in (\S+)", result.stderr)
    assert len(reported) == 1, f"rank 0, and only rank 0, reports the results: {reported}"
    return Path(reported[0])


def check_training_run(run_dir: Path, result: subprocess.CompletedProcess) -> None:
    assert reported_run_dir(result) == run_dir
    check_two_ranks_only_rank0_informs(result.stderr)
    records = read_metrics(run_dir)
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [5, 10, 15, 20]
    for record in train:
        assert record.keys() >= METRIC_FIELDS | BATCH_FIELDS
        assert record["tokens"] > 0 and record["tokens_per_s"] > 0
    assert train[-1]["loss"] < train[0]["loss"] - 0.3, [r["loss"] for r in train]
    (final_eval,) = [r for r in records if "eval_loss" in r]
    assert eval_loss_from_saved_adapter(run_dir) == pytest.approx(final_eval["eval_loss"], rel=1e-5)
    # The last checkpoint read back, best/ verified as its copy (checked once), adapter/ read back and loaded in peft.
    checked = [r for r in records if "save_check_s" in r]
    assert [r["step"] for r in checked] == [20, 20] and len(checked[0]["save_check_folders"]) == 1
    assert [Path(f).name for f in checked[0]["save_check_copies"]] == ["best"]
    assert "save_check_round_trip" not in checked[0] and checked[1]["save_check_max_abs_diff"] <= 1e-5
    # trainer.precision=auto (the default) on a CPU: fp32, and the run's config and log say so.
    assert "\n  precision: fp32\n" in (run_dir / "config.yaml").read_text()
    assert "trainer.precision=auto on cpu: fp32, no autocast" in (run_dir / "train.log").read_text()
    # The first training row as the model sees it: Alpaca's prompt, then its response marked as trained.
    logged = (run_dir / "train.log").read_text()
    assert "data: training row 0 as the model sees it, trained text between [[ and ]]" in logged
    assert "\n\n### Response:\n[[" in logged
    assert not (run_dir / "adapter" / "adapter_model.safetensors").read_bytes().count(b"module.")


def check_two_ranks_only_rank0_informs(stderr: str) -> None:
    """The group had two ranks, and rank 1 logged nothing below WARNING (rank 0 alone tells the story)."""
    assert len(re.findall(r"INFO ddptrain\.launch: rank 0 of 2 on ", stderr)) == 1, "rank 0 of a 2-rank group"
    assert "rank 1 of 2" not in stderr, "rank 1 logged at INFO (its 'rank 1 of 2 on ...' line)"
    other = [line for line in stderr.splitlines() if "[rank1]" in line and not RANK1_WARNING.match(line)]
    assert not other, f"rank 1 printed lines that are not its WARNING/ERROR log lines: {other[:5]}"


# ddp2 × micro-batch 4 × 2 micro-steps = 16 samples per optimizer step.
GLOBAL_BATCH = ["optim.global_batch_size=16", "data.micro_batch_size=4", "trainer.max_steps=2"]


@pytest.fixture(scope="module")
def runs_started_together(tmp_path_factory, datasets_cache) -> tuple[Path, dict[str, subprocess.CompletedProcess]]:
    """Two self-launched 2-rank runs started at the same moment into one output folder, as a user starting two jobs
    would: each must find its own free port and make its own run folder. The three tests below read them: one is
    the Alpaca run, the other sets optim.global_batch_size."""
    out = tmp_path_factory.mktemp("together")
    quiet = ["trainer.progress_bar=false", "trainer.save_final=false", "parallel.timeout_s=60"]
    runs = {
        "alpaca": [*alpaca_args(out, datasets_cache), "parallel.start_method=spawn"],  # the shipped default
        "global_batch": [*GLOBAL_BATCH, *quiet, f"trainer.output_dir={out}"],
    }
    with ThreadPoolExecutor(len(runs)) as pool:
        results = dict(zip(runs, pool.map(run_ddptrain, runs.values())))
    return out, results


@requires_shared
def test_two_runs_started_together_both_succeed(runs_started_together) -> None:
    out, results = runs_started_together
    assert [r.returncode for r in results.values()] == [0, 0], [r.stderr[-3000:] for r in results.values()]
    dirs = run_dirs(out)
    assert len(dirs) == 2 and all((d / "metrics.jsonl").is_file() for d in dirs), "one run folder per run"
    assert {reported_run_dir(r) for r in results.values()} == set(dirs)


@requires_shared
def test_python_m_ddptrain_self_launches_two_ranks(runs_started_together) -> None:
    _, results = runs_started_together
    check_training_run(reported_run_dir(results["alpaca"]), results["alpaca"])


@requires_shared
def test_global_batch_size_sets_the_accumulation_of_a_two_rank_run(runs_started_together) -> None:
    _, results = runs_started_together
    run_dir = reported_run_dir(results["global_batch"])
    assert "optim.global_batch_size=16 gives optim.grad_accum_steps=2" in results["global_batch"].stderr
    assert "grad_accum_steps: 2" in (run_dir / "config.yaml").read_text()
    assert ", 2 per optimizer step" in (run_dir / "train.log").read_text()


@requires_shared
def test_torchrun_two_ranks(tmp_path, datasets_cache) -> None:
    result = run_ddptrain(alpaca_args(tmp_path / "out", datasets_cache), launcher=TORCHRUN)
    (run_dir,) = run_dirs(tmp_path / "out")  # exactly one run directory for both ranks
    check_training_run(run_dir, result)


def test_multirun_gives_each_job_its_own_folder_and_group(tmp_path) -> None:
    result = run_ddptrain(
        [
            "-m",
            "optim.grad_accum_steps=1,2",
            "trainer.max_steps=3",
            "trainer.progress_bar=false",
            "data.max_rows=300",
            f"trainer.output_dir={tmp_path}",
        ]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (sweep,) = run_dirs(tmp_path / "multirun")
    jobs = run_dirs(sweep)
    assert [j.name.split("_")[0] for j in jobs] == ["0", "1"]
    assert [j.name for j in jobs] == ["0_optim.grad_accum_steps=1", "1_optim.grad_accum_steps=2"], "swept keys only"
    for job, accum in zip(jobs, (1, 2)):
        assert read_metrics(job)[-1]["step"] == 3, "each job trains its own 3 steps"
        assert f"grad_accum_steps: {accum}" in (job / "config.yaml").read_text()
    assert len(re.findall(r"INFO ddptrain\.launch: rank 0 of 2 on ", result.stderr)) == 2, "one 2-rank group per job"


# Each case: the overrides, and patterns that must all match the error (re.MULTILINE). They name the
# key exactly as the user typed it: "trainer.max_step" must not be satisfied by "trainer.max_steps".
BAD_CONFIGS = {
    "misspelled key": (
        ["trainer.max_step=3"],
        [
            r"Could not override 'trainer\.max_step'",
            r"Key 'max_step' not in 'TrainerConfig'",
            r"full_key: trainer\.max_step$",
        ],
    ),
    "wrong type": (
        ["trainer.max_steps=abc"],
        [r"Value 'abc' of type 'str' could not be converted to Integer", r"full_key: trainer\.max_steps$"],
    ),
    "unknown option": (
        ["parallel=ddp3"],
        [r"Could not find 'parallel/ddp3'", r"Available options in 'parallel'", r"^\s+ddp2$"],
    ),
    "missing data file": (
        ["data.path=/no/such/rows.jsonl"],
        [r"^ {2}- data\.path=/no/such/rows\.jsonl: no such file\. Point data\.path at a \.json, \.jsonl or \.parquet"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_fails_fast_naming_the_key(case, tmp_path) -> None:
    overrides, patterns = BAD_CONFIGS[case]
    marker = f"trainer.output_dir={tmp_path}/bad-config-marker"
    start = time.monotonic()
    result = run_ddptrain([*overrides, marker], timeout=60)
    assert result.returncode != 0
    assert time.monotonic() - start < 30
    missing = [p for p in patterns if not re.search(p, result.stderr, re.MULTILINE)]
    assert not missing, f"the error lacks {missing}:\n{result.stderr[-3000:]}"
    assert "Traceback" not in result.stderr, "a config error is a message, not a crash"
    assert not started_a_worker(tmp_path), "a worker started before the config was checked"
    assert_no_process_left(marker)


def started_a_worker(output_dir: Path) -> bool:
    """Rank 0's worker opens train.log first thing (before that, Hydra may only have made .hydra/)."""
    return any(output_dir.rglob("train.log")) or any(output_dir.rglob("metrics.jsonl"))


def test_torchrun_size_mismatch_fails_fast(tmp_path) -> None:
    marker = f"trainer.output_dir={tmp_path}/mismatch-marker"
    start = time.monotonic()
    result = run_ddptrain(["parallel=ddp4", marker], timeout=90, launcher=TORCHRUN)
    assert result.returncode != 0
    assert time.monotonic() - start < 45
    assert "parallel.nproc_per_node=4 but torchrun started 2" in result.stdout + result.stderr
    assert not started_a_worker(tmp_path)
    assert_no_process_left(marker)


def test_busy_master_port_fails_fast_with_the_fix(tmp_path) -> None:
    marker = f"trainer.output_dir={tmp_path}"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        start = time.monotonic()
        env_result = subprocess.run(
            [sys.executable, "-m", "ddptrain", marker, "trainer.device=cpu"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
            env={**os.environ, "MASTER_PORT": str(port), RUN_TAG: marker},
        )
    assert env_result.returncode != 0
    assert time.monotonic() - start < 30
    assert f"MASTER_PORT={port} is already in use" in env_result.stderr
    assert "Unset MASTER_PORT" in env_result.stderr
    assert not started_a_worker(tmp_path)
    assert_no_process_left(marker)


def test_multirun_under_torchrun_is_refused(tmp_path) -> None:
    marker = f"trainer.output_dir={tmp_path}"
    result = run_ddptrain(["-m", "optim.grad_accum_steps=1,2", marker], timeout=90, launcher=TORCHRUN)
    assert result.returncode != 0
    assert "ddptrain train -m" in result.stdout + result.stderr
    assert not any(tmp_path.iterdir()), "refused before Hydra made a sweep folder or a job ran"
    assert_no_process_left(marker)
