"""Runs that several end-to-end modules read: each is trained once per session."""

from __future__ import annotations

import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import assert_no_process_left, run_ddptrain, run_dirs

DEBUG_RUN_STEPS = 6
DEBUG_RUN_PROFILED_STEPS = (3, 5)
DEBUG_RUN_EVAL_EVERY = 3  # evaluations at steps 3 and 6 (the end)
DEBUG_RUN_PROMPTS = ("Reverse the order of these words.", "Spell the word 'ocean' letter by letter.")


@dataclass(frozen=True)
class FinishedRun:
    run_dir: Path
    result: subprocess.CompletedProcess
    seconds: float


@pytest.fixture(scope="session")
def debug_run(tmp_path_factory: pytest.TempPathFactory) -> FinishedRun:
    """One run of the default tiny job (trainer=debug: every step logged) on 2 CPU ranks through the real CLI, with
    all three loggers (W&B offline), the profiler on steps 3-5, and an evaluation with samples of two prompts at
    steps 3 and 6. test_loggers.py and test_profile_and_report.py read it; a test that changes the run folder works
    on a copy."""
    out = tmp_path_factory.mktemp("debug-run")
    marker = f"debug-run-{uuid.uuid4().hex}"  # in the output folder, hence in RUN_TAG of every process
    first, last = DEBUG_RUN_PROFILED_STEPS
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "offline")  # the documented way; logger.wandb.mode=offline is tested in unit
        for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):  # not the user's home
            patch.setenv(var, str(out / "wandb-home"))
        patch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # were W&B to go online, it would fail here
        start = time.monotonic()
        result = run_ddptrain(
            [
                "trainer=debug",
                f"trainer.max_steps={DEBUG_RUN_STEPS}",
                "logger=[tensorboard,wandb,mlflow]",
                f"trainer.profile_steps=[{first},{last}]",
                "trainer.progress_bar=false",
                f"trainer.eval_every_n_steps={DEBUG_RUN_EVAL_EVERY}",
                f"trainer.eval_prompts=[{','.join(repr(p) for p in DEBUG_RUN_PROMPTS)}]",
                "trainer.eval_max_new_tokens=8",
                "plan.at_start=true",  # the memory plan at start, beside the measured peaks in the report
                "parallel.timeout_s=60",
                f"trainer.output_dir={out / marker}",
            ],
            timeout=240,
        )
        seconds = time.monotonic() - start
    assert result.returncode == 0, result.stderr[-3000:]
    assert_no_process_left(marker)  # W&B's service process ended with the run
    (run_dir,) = run_dirs(out / marker)
    return FinishedRun(run_dir, result, seconds)
