"""Runs that cannot work end in seconds, through the real CLI, with the key and the fix, and leave nothing running."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from tests.conftest import (
    QWEN2_TOKENIZER,
    RUN_TAG,
    assert_no_process_left,
    processes_mentioning,
    requires_shared,
    run_ddptrain,
)

pytestmark = pytest.mark.e2e
WALL_LIMIT_S = 30


def processes_left_behind(marker: str, grace_s: float = 5.0) -> list[str]:
    """Processes of the run still alive ``grace_s`` after the CLI returned (then killed, so they do not linger).

    Self-launched workers are spawned as ``python -c "from multiprocessing.spawn import ..."``: their
    command line names no output folder (``pgrep -f <output_dir>`` finds the launcher only), but they
    inherit ``RUN_TAG``, the run's command line, in their environment, which ``processes_mentioning`` reads.
    """
    deadline = time.monotonic() + grace_s
    while (left := processes_mentioning(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for process in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(process.split(":", 1)[0]), signal.SIGKILL)
    return left


def run_marked(args: list[str], tmp_path: Path) -> tuple[str, str, float, int]:
    """Run the CLI with a unique output folder as the marker: (output, marker, seconds, return code)."""
    marker = f"refusal-{uuid.uuid4().hex}"
    start = time.monotonic()
    try:
        result = run_ddptrain([*args, f"trainer.output_dir={tmp_path / marker}"], timeout=120)
    except subprocess.TimeoutExpired:
        left = processes_left_behind(marker, grace_s=0)  # subprocess.run killed the launcher only
        pytest.fail(f"still running after 120 s; killed {len(left)} leftover processes: {left}")
    elapsed = time.monotonic() - start
    return result.stdout + result.stderr, marker, elapsed, result.returncode


def test_the_leftover_checks_see_a_process_of_the_run_by_its_command_line_or_its_environment() -> None:
    """The no-process-left-behind checks (this file's ``processes_left_behind``, conftest's ``assert_no_process_left``)
    can fail: a live process naming the run on its command line, and one tagged only in its environment as a
    spawned worker is (its command line does not show the run's arguments), are both found, and killed."""
    marker = f"refusal-{uuid.uuid4().hex}"
    by_cmdline = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker])
    by_environ = subprocess.Popen(["sleep", "60"], env={**os.environ, RUN_TAG: f"python -m ddptrain {marker}"})
    try:
        # Popen returns once exec has begun, which can be before the kernel sets up the new environment:
        # /proc/PID/environ may read empty for a moment.
        environ = Path(f"/proc/{by_environ.pid}/environ")
        deadline = time.monotonic() + 10
        while marker.encode() not in environ.read_bytes() and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(AssertionError, match="processes left behind") as caught:
            assert_no_process_left(marker)
        assert f"{by_cmdline.pid}:" in str(caught.value) and f"{by_environ.pid}:" in str(caught.value)
        found = sorted(p.split(":", 1)[0] for p in processes_left_behind(marker, grace_s=0.5))
        assert found == sorted([str(by_cmdline.pid), str(by_environ.pid)])
        assert by_cmdline.wait(timeout=10) == -signal.SIGKILL and by_environ.wait(timeout=10) == -signal.SIGKILL
    finally:
        for proc in (by_cmdline, by_environ):
            proc.kill()
            proc.wait()
    assert not processes_mentioning(marker)


@pytest.mark.skipif(torch.cuda.is_available(), reason="parallel.backend=auto picks nccl on a CUDA machine")
def test_bf16_compress_on_cpu_is_refused_before_any_worker_starts(tmp_path) -> None:
    output, marker, elapsed, rc = run_marked(["parallel.comm_hook=bf16_compress", "trainer.device=auto"], tmp_path)
    assert rc != 0, output[-3000:]
    assert elapsed < WALL_LIMIT_S, output[-3000:]
    assert "ddptrain: invalid configuration:" in output
    assert (
        "parallel.comm_hook=bf16_compress needs NCCL (PyTorch's hook refuses gloo), but parallel.backend=auto "
        "means gloo here (trainer.device=auto and no CUDA device is visible): "
        "use parallel.comm_hook=fp16_compress (or none) on CPU"
    ) in output
    assert "starting 2 workers" not in output
    assert "Traceback" not in output
    assert not processes_left_behind(marker)


def test_bf16_compress_with_trainer_device_cpu_is_refused_before_any_worker_starts(tmp_path) -> None:
    output, marker, elapsed, rc = run_marked(["parallel.comm_hook=bf16_compress", "trainer.device=cpu"], tmp_path)
    assert rc != 0 and elapsed < WALL_LIMIT_S, output[-3000:]
    assert "parallel.backend=auto means gloo with trainer.device=cpu: use parallel.comm_hook=fp16_compress" in output
    assert "starting 2 workers" not in output and "Traceback" not in output
    assert not processes_left_behind(marker)


@requires_shared
def test_a_tokenizer_the_model_cannot_embed_stops_the_run_with_the_fix(tmp_path) -> None:
    # The default tiny model (4,352 embeddings) with the full Qwen2 tokenizer; few rows, as the data is not the point.
    args = [f"model.tokenizer={QWEN2_TOKENIZER}", "data.max_rows=64", "trainer.progress_bar=false"]
    output, marker, elapsed, rc = run_marked(args, tmp_path)
    assert rc != 0, output[-3000:]
    assert elapsed < WALL_LIMIT_S, output[-3000:]
    assert "IndexError" not in output, "the run reached the embedding"
    # The launcher's closing summary (what the user reads last) carries the whole message.
    summary = output[output.rindex("ddptrain: training failed:") :]
    assert f"model.tokenizer={QWEN2_TOKENIZER} has 151,646 tokens" in summary
    assert "ddptrain/assets/tiny_qwen2 embeds only 4,352 token ids" in summary
    assert "Use the model's own tokenizer" in summary
    assert "pick a model whose vocabulary covers this tokenizer (at least 151,646 embeddings)" in summary
    assert not processes_left_behind(marker)


def test_a_run_the_memory_plan_says_will_not_fit_stops_before_loading_weights(tmp_path) -> None:
    """2 ranks, the default tiny job's first 400 rows on a device declared at 0.04 GiB: its costliest micro-batch is
    planned at about 0.1 GiB (the tensors alone: plan.resident_baseline_gb=0 leaves out the process's resident set at
    start, about 0.4 GiB, which no setting changes). Stopped on every rank before any weight loads, with the plan and
    the fix (plan.stop_if_no_fit=false, which starts it all the same, is tested in tests/unit/test_plan.py)."""
    args = [
        "plan.device_memory_gb=0.04",
        "plan.resident_baseline_gb=0",
        "data.max_rows=400",
        "trainer.progress_bar=false",
    ]
    output, marker, elapsed, rc = run_marked(args, tmp_path)
    # It runs beside the 2-rank tests (tests/conftest.py): twice the others' bound; alone it takes about 19 s.
    assert rc != 0 and elapsed < 2 * WALL_LIMIT_S, output[-3000:]
    assert "DOES NOT FIT: predicted peak" in output and "levers (the fullest rank's peak" in output
    assert "trainable of" not in output, "the model was built"  # build_model logs its parameter count
    summary = output[output.rindex("ddptrain: training failed:") :]
    failures = [line.strip() for line in summary.splitlines() if "(exit code" in line]
    assert failures and all("RunDoesNotFit: the run does not fit: predicted peak" in f for f in failures), summary
    assert "predicted to fit with " in summary and "To start anyway: plan.stop_if_no_fit=false." in summary
    assert not processes_left_behind(marker)
