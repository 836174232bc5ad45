"""What the GPU tiers share: a run of the real entrypoint watched through nvidia-smi, and its logged losses."""

from __future__ import annotations

import math
import subprocess
import threading
import time
from pathlib import Path

from tests.conftest import read_metrics, run_ddptrain, run_dirs


def gpus_of_processes() -> dict[int, set[str]]:
    """pid -> the GPUs (UUIDs) on which that process holds memory now, from nvidia-smi."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    held: dict[int, set[str]] = {}
    for line in out.splitlines():
        pid, _, uuid = line.partition(",")
        if pid.strip().isdigit():
            held.setdefault(int(pid), set()).add(uuid.strip())
    return held


def train_watching_gpus(
    args: list[str], launcher: list[str] | None = None, timeout: float = 400
) -> tuple[Path, list[dict], dict]:
    """Run ddptrain and poll nvidia-smi meanwhile. Returns (run folder, logged records, pid -> GPUs ever held)."""
    seen: dict[int, set[str]] = {}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for pid, gpus in gpus_of_processes().items():
                seen.setdefault(pid, set()).update(gpus)
            time.sleep(0.5)

    already = set(gpus_of_processes())  # other processes on these GPUs (and this one) are no ranks of the run
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        result = run_ddptrain(args, timeout=timeout, launcher=launcher)
    finally:
        done.set()
        watcher.join()
    assert result.returncode == 0, result.stderr[-4000:]
    out = Path(next(a.split("=", 1)[1] for a in args if a.startswith("trainer.output_dir=")))
    (run_dir,) = run_dirs(out)
    return run_dir, read_metrics(run_dir), {pid: gpus for pid, gpus in seen.items() if pid not in already and gpus}


def losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records if "loss" in r]


def assert_trains(records: list[dict], steps: int, every: int = 5) -> None:
    """Every logged window ran, every loss is finite, and the last sits well below the first."""
    logged = [r["step"] for r in records if "loss" in r]
    assert logged == list(range(every, steps + 1, every)), logged
    found = losses(records)
    assert all(math.isfinite(x) for x in found) and found[-1] < found[0] - 0.3, found


def resumed_from_step_10(args: list[str], run_dir: Path, records: list[dict], out: Path) -> tuple[Path, list[dict]]:
    """``run_dir`` (trained with ``args`` to step 20, logging every 5 steps) resumed from its step-10 checkpoint into
    ``out``; its steps 15 and 20 must log the uninterrupted run's losses, bit for bit. Returns the resumed folder and
    records."""
    resumed_dir, resumed, _ = train_watching_gpus(
        [*args, f"trainer.output_dir={out}", f"trainer.resume={run_dir}/checkpoints/step-00000010"]
    )
    after = [r for r in resumed if "loss" in r]
    assert [r["step"] for r in after] == [15, 20]
    assert losses(after) == losses(records)[2:], "the resumed steps differ from the uninterrupted run's"
    return resumed_dir, resumed


def eval_losses_at(step: int, *runs: list[dict]) -> list[list[float]]:
    """Each run's eval losses logged at ``step``."""
    return [[r["eval_loss"] for r in run if r.get("step") == step and "eval_loss" in r] for run in runs]
