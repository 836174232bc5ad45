"""The step clock's booking, on a clock the test drives (the 2-rank runs with injected delays are in
tests/distributed/test_diagnose_injected.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddptrain import parallel
from ddptrain.observe import timing


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class FakeTime:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_each_phase_goes_to_its_column_and_exposed_comm_leaves_compute(one_rank_group) -> None:
    now, comm = FakeTime(), parallel.CommCounter(timed=True)
    clock = timing.StepClock(torch.device("cpu"), comm, now=now)
    timeline = [("data", 0.0), ("to_device", 1.0), ("sync", 1.5), ("forward", 1.7), ("backward", 2.7)]
    for phase, at in timeline:
        now.t = at
        clock.enter(phase, 1, 0)
    # DDP's hook ran from 3.0 to 3.4 inside backward; backward returned at 4.0, waiting for the all-reduce.
    comm.hook_intervals.append((3.0, 3.4))
    for phase, at in [("optimizer", 4.0), ("other", 4.2), ("log", 4.3)]:
        now.t = at
        clock.enter(phase, 1)
    now.t = 5.0  # logging took 0.7 s: not step time
    record = clock.close_window(flops_per_step=8e12, peak_tflops=None)
    expected = {"data": 1.0, "compute": 1.0 + 0.3, "comm": 0.2 + 1.0, "optimizer": 0.2, "other": 0.5 + 0.1}
    for column, seconds in expected.items():
        assert record[f"time_{column}_s"] == pytest.approx(seconds), column
    assert record["step_time_s"] == pytest.approx(4.3)
    assert record["tflops"] == pytest.approx(8 / 4.3)
    assert record["by_rank"][0]["busy_s"] == pytest.approx(4.3 - 1.2)


def test_a_window_counts_only_the_steps_it_timed(one_rank_group) -> None:
    """A window resumed from a checkpoint holds steps trained before the restart; the clock's per-step
    figures divide by the steps it saw itself."""
    now = FakeTime()
    clock = timing.StepClock(torch.device("cpu"), parallel.CommCounter(timed=True), now=now)
    for step in (1, 2):
        micro_steps = [("forward", 0.1), ("backward", 0.3), ("forward", 0.5), ("backward", 0.7)]
        for phase, offset in [("data", 0.0), *micro_steps, ("optimizer", 0.9)]:
            now.t = step + offset
            clock.enter(phase, step, 0)
    now.t = 3.0
    clock.enter("log", 2)
    record = clock.close_window(flops_per_step=0.0, peak_tflops=None)
    assert record["step_time_s"] == pytest.approx(1.0)  # 2 s over 2 steps (1 s of start excluded)
    assert record["tflops"] is None and record["mfu"] is None  # no FLOP count: unknown, not zero


def test_a_started_process_reports_its_own_peak_not_its_launchers() -> None:
    """A rank's report sets its resident peak beside the plan: a process started by one that held 1 GiB (a launcher,
    a pytest worker) reports what it held itself. Linux's ru_maxrss carries the starter's peak across exec."""
    import subprocess
    import sys

    from ddptrain.observe.timing import peak_rss_bytes

    held = bytearray(1 << 30)  # touched: zero-filled pages are resident
    held[::4096] = b"\x01" * len(held[::4096])
    child = subprocess.run(
        [sys.executable, "-c", "from ddptrain.observe.timing import peak_rss_bytes; print(peak_rss_bytes())"],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    assert peak_rss_bytes() >= 1 << 30
    assert int(child.stdout) < (1 << 30) // 2, "the child reported its starter's peak"
    del held
