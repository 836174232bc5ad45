"""The run diagnosis on 2 gloo ranks, against slowdowns the test injects (tests/distributed/workers_diagnose.py).

Each injected delay must land in its own time column (within INJECTED_REL of what was injected), the step time
must be the wall time between optimizer steps by the test's own clock, the end-of-run report must name the right
verdict and levers, and its predictions for more accumulation must match measured runs, compute- and
communication-bound. The figures come from the product's timers; the injected seconds and the clock are the test's.
"""

from __future__ import annotations

import itertools
import json
import pickle
from pathlib import Path

import pytest

from ddptrain.launch import launch
from tests.conftest import compose_config, read_metrics, timed_alone
from tests.distributed.workers_diagnose import (
    BALLAST_BYTES,
    COLLECTIVE_DELAY_S,
    COMM_DELAY_S,
    DELAY_S,
    SCENARIOS_FILE,
    train_scenarios,
)

pytestmark = pytest.mark.dist

BASE = [
    "parallel=ddp2",
    "data.max_rows=400",
    "data.eval_fraction=0",
    "trainer.progress_bar=false",
    "trainer.save_final=false",
    "trainer.log_every_n_steps=4",
    "parallel.timeout_s=120",
]
STEPS = "trainer.max_steps=16"
COMPUTE_STEPS = "trainer.max_steps=12"  # 2 windows after the first, of 0.2-0.7 s steps
COMM_STEPS = "trainer.max_steps=12"  # 2 windows after the first: each step sleeps COMM_DELAY_S, far above the noise
# Full packed rows: every micro-batch holds the same number of tokens, so compute per micro-batch is the
# same at any accumulation and the prediction is judged on what it models, not on which rows came up. Short rows
# keep compute per micro-batch well under COMM_DELAY_S: the communication-bound run then gains about 3x from 4x the
# accumulation, the compute-bound pair (PACKED_LONG, below) 1.06-1.22x, so that no fixed gain passes both (1024-token
# rows gave the communication-bound run 1.5x).
PACKED = ["data.batching=packed", "data.max_tokens_per_batch=256", "data.max_length=256"]
PACKED_LONG = ["data.batching=packed", "data.max_tokens_per_batch=1024", "data.max_length=512"]
SCENARIOS = {
    # name: (overrides, injection)
    # 2 epochs of 9 steps: memory every epoch; rank 1 holds extra memory from step 3 on.
    "plain": (["trainer.epochs=2", "data.max_rows=144"], "ballast_on_rank_one"),
    "data": ([STEPS], "slow_loader"),
    "untimed": ([STEPS, "trainer.timing=false"], "none"),
    "straggler": ([STEPS], "slow_rank_one"),
    "comm": ([COMM_STEPS, *PACKED], "slow_all_reduce"),
    "comm_accum4": ([COMM_STEPS, *PACKED, "optim.grad_accum_steps=4"], "slow_all_reduce"),
    # Without the slow all-reduce: compute-bound, where 4x the accumulation gains little. Longer packed rows than the
    # communication runs': at 256 tokens a micro-batch computed in 0.03 s, 8% slower at 4x the accumulation on an
    # idle machine, and CI's noise on that put the prediction 33% off once. Each run twice, interleaved: the faster of
    # each pair is compared (noise only slows a run; the same run measured 9,700 and 11,900 tokens/s here, idle).
    # FSDP2, with and without a delay in each of its collectives: the time inside them is communication.
    "fsdp2": ([COMM_STEPS, *PACKED, "parallel.strategy=fsdp2"], "none"),
    "fsdp2_slow_collectives": ([COMM_STEPS, *PACKED, "parallel.strategy=fsdp2"], "slow_collectives"),
    "compute": ([COMPUTE_STEPS, *PACKED_LONG], "none"),
    "compute_accum4": ([COMPUTE_STEPS, *PACKED_LONG, "optim.grad_accum_steps=4"], "none"),
    "compute_again": ([COMPUTE_STEPS, *PACKED_LONG], "none"),
    "compute_accum4_again": ([COMPUTE_STEPS, *PACKED_LONG, "optim.grad_accum_steps=4"], "none"),
}
# How far a time column may be from the delay injected into it. A delay booked in another column shows as 0 there,
# one booked twice as 2x: 40% tells both apart, and leaves room for a loaded 2-core machine (at 20% the straggler
# case once passed 15 ms inside its bound).
INJECTED_REL = 0.4
# How far the predicted tokens/s of 4x the accumulation may be from the measured run.
PREDICTED_REL = 0.25


TIMED = [name for name in SCENARIOS if name != "untimed"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pytestconfig) -> Path:
    """All scenarios, trained one after another in one 2-rank process group, with nothing running beside them: two
    runs' tokens/s are compared (the accumulation prediction), so both must see the same machine."""
    root = tmp_path_factory.mktemp("diagnose")
    scenarios = [
        (name, compose_config([*BASE, f"trainer.output_dir={root}", *extra]), injection)
        for name, (extra, injection) in SCENARIOS.items()
    ]
    (root / SCENARIOS_FILE).write_bytes(pickle.dumps(scenarios))
    with timed_alone(pytestconfig):
        launch(scenarios[0][1], root, entrypoint=train_scenarios)
    return root


def train_records(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "loss" in r]


def steady(run_dir: Path, key: str) -> float:
    """``key`` averaged over the windows after the first (which holds the warm-up), weighted by steps."""
    records = train_records(run_dir)[1:]
    return sum(r[key] * r["window_steps"] for r in records) / sum(r["window_steps"] for r in records)


def steady_by_rank(run_dir: Path, rank: int, key: str) -> float:
    records = train_records(run_dir)[1:]
    total = sum(r["by_rank"][rank][key] * r["window_steps"] for r in records)
    return total / sum(r["window_steps"] for r in records)


def report(run_dir: Path) -> dict:
    return json.loads((run_dir / "report.json").read_text())


def lever_keys(run_dir: Path) -> list[str]:
    return [lever["key"] for lever in report(run_dir)["levers"]]


def assert_close(measured: float, expected: float, rel: float, what: str) -> None:
    assert abs(measured - expected) <= rel * expected, f"{what}: measured {measured:.4f} s, expected {expected:.4f}"


def test_a_plain_run_is_compute_bound(runs) -> None:
    assert report(runs / "plain")["verdict"] == "compute", report(runs / "plain")


def test_a_slow_loader_is_diagnosed_as_data_and_shows_in_the_data_column(runs) -> None:
    added = steady(runs / "data", "time_data_s") - steady(runs / "plain", "time_data_s")
    assert_close(added, DELAY_S, INJECTED_REL, "time_data_s added by a loader sleeping per micro-batch")
    assert report(runs / "data")["verdict"] == "data"
    assert "data.num_workers" in lever_keys(runs / "data")


def test_a_slow_rank_is_a_straggler_named_by_its_rank(runs) -> None:
    slow = steady_by_rank(runs / "straggler", 1, "time_compute_s")
    fast = steady_by_rank(runs / "straggler", 0, "time_compute_s")
    assert_close(slow - fast, DELAY_S, INJECTED_REL, "rank 1's compute time over rank 0's")
    # Rank 0 waits for rank 1 in the all-reduce: that wait is communication, not work.
    waited = steady_by_rank(runs / "straggler", 0, "time_comm_s") - steady_by_rank(runs / "plain", 0, "time_comm_s")
    assert_close(waited, DELAY_S, INJECTED_REL, "rank 0's exposed communication")
    diagnosis = report(runs / "straggler")
    assert diagnosis["verdict"] == "straggler", diagnosis
    assert diagnosis["summary"]["slowest_rank"] == 1
    assert all(r["slowest_rank"] == 1 for r in train_records(runs / "straggler")[1:])


def test_slow_communication_is_diagnosed_and_shows_in_the_comm_column(runs) -> None:
    added = steady(runs / "comm", "time_comm_s") - steady(runs / "plain", "time_comm_s")
    assert_close(added, COMM_DELAY_S, INJECTED_REL, "time_comm_s added by a comm hook sleeping once per step")
    assert report(runs / "comm")["verdict"] == "communication"
    assert {"optim.grad_accum_steps", "parallel.comm_hook"} <= set(lever_keys(runs / "comm"))


def test_fsdp2_s_collectives_are_booked_as_communication(runs) -> None:
    """Under parallel.strategy=fsdp2 a delay in every all-gather and reduce-scatter lands in the comm column, as many
    times a step as the step's collectives (counted where FSDP2 calls them), not in compute; the report calls the run
    communication-bound and names FSDP2's lever, not DDP's."""
    slow, plain = runs / "fsdp2_slow_collectives", runs / "fsdp2"
    calls = {name: steady(slow, f"{name}_calls_per_step") for name in ("allgather", "reducescatter")}
    assert (
        calls
        == {name: steady(plain, f"{name}_calls_per_step") for name in calls}
        == {
            "allgather": 5,
            "reducescatter": 2,
        }
    ), calls
    injected = sum(calls.values()) * COLLECTIVE_DELAY_S
    added = steady(slow, "time_comm_s") - steady(plain, "time_comm_s")
    assert_close(added, injected, INJECTED_REL, "time_comm_s added by a delay in every collective")
    compute_added = steady(slow, "time_compute_s") - steady(plain, "time_compute_s")
    assert compute_added < INJECTED_REL * injected, compute_added
    assert report(slow)["verdict"] == "communication"
    levers = set(lever_keys(slow))
    assert "parallel.reshard_after_forward" in levers and "parallel.comm_hook" not in levers, levers


def predicted_tokens_per_s(run_dir: Path, change: str) -> float:
    (prediction,) = [p for p in report(run_dir)["predictions"] if p["change"] == change]
    return prediction["tokens_per_s"]


def fastest(runs: Path, name: str) -> Path:
    """The run ``name``, or its repeat ``name``_again where there is one, whichever had the more tokens/s."""
    repeats = [runs / name, *([runs / f"{name}_again"] if (runs / f"{name}_again").is_dir() else [])]
    return max(repeats, key=lambda run: steady(run, "tokens_per_s"))


def test_the_predicted_gain_of_more_accumulation_matches_measured_runs_compute_and_communication_bound(runs) -> None:
    """From a compute-bound run and a communication-bound one, each report predicts the tokens/s of 4x the
    accumulation; each is held to a run measured at 4x. The two gain so differently that no fixed gain is within
    PREDICTED_REL of both (checked here): the prediction must come from the run's own time split."""
    gains = {}
    for name in ("compute", "comm"):
        base, more = fastest(runs, name), fastest(runs, f"{name}_accum4")
        predicted = predicted_tokens_per_s(base, "optim.grad_accum_steps=4")
        measured = steady(more, "tokens_per_s")
        gains[name] = measured / steady(base, "tokens_per_s")
        split = {c: round(steady(base, c), 4) for c in ("step_time_s", "time_compute_s", "time_comm_s")}
        why = f"{base.name}: predicted {predicted:.0f} tokens/s from {split}, measured {measured:.0f} at 4x"
        assert abs(predicted - measured) <= PREDICTED_REL * measured, why
    print(f"measured gains of 4x the accumulation: {gains}")
    assert gains["comm"] / gains["compute"] > (1 + PREDICTED_REL) / (1 - PREDICTED_REL), f"measured gains {gains}"


def test_the_step_time_is_the_wall_time_between_optimizer_steps_on_every_rank(runs) -> None:
    """Held to when each optimizer step ended by the test's own clock (a hook on the optimizer, outside the
    product's step clock), window by window after the first: the logged step time leaves out only the logging
    between the windows (no eval, no checkpoint)."""
    for name in TIMED:
        ends = [json.loads((runs / name / f"step_ends{rank}.json").read_text()) for rank in (0, 1)]
        for before, record in itertools.pairwise(train_records(runs / name)):
            for rank, figures in enumerate(record["by_rank"]):
                wall = ends[rank][record["step"] - 1] - ends[rank][before["step"] - 1]
                timed = figures["step_time_s"] * record["window_steps"]
                assert 0.9 * wall <= timed <= 1.02 * wall, (name, record["step"], rank, timed, wall)
                assert min(figures[f"time_{c}_s"] for c in ("data", "compute", "comm", "optimizer", "other")) >= 0


def test_logged_flops_are_the_flops_of_the_batches_each_rank_trained_on(runs) -> None:
    for name in TIMED:
        per_rank = [json.loads((runs / name / f"flops{rank}.json").read_text()) for rank in (0, 1)]
        step = 0
        for record in train_records(runs / name):
            window = range(step, step + record["window_steps"])
            counted = sum(flops[i] for flops in per_rank for i in window)
            assert record["model_flops_per_step"] * record["window_steps"] == pytest.approx(counted, rel=1e-9)
            achieved = record["model_flops_per_step"] / 2 / record["step_time_s"] / 1e12  # per rank
            assert record["tflops"] == pytest.approx(achieved, rel=1e-9)
            assert record["mfu"] is None  # a CPU without trainer.peak_tflops
            step = window.stop


def test_timing_off_logs_no_time_split_and_trains_the_same(runs) -> None:
    records = train_records(runs / "untimed")
    assert all("time_compute_s" not in r and "tflops" not in r for r in records)
    # DDP's built-in all-reduce ran (no Python hook): nothing was counted, so nothing is claimed.
    assert all(r["allreduce_bytes_per_step"] is None for r in records)
    assert report(runs / "untimed")["verdict"] is None
    same_run = train_records(runs / "data")  # the same config; its loader only slept
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in same_run], rel=1e-6)


def test_memory_peaks_are_logged_for_every_rank_in_every_epoch(runs) -> None:
    records = train_records(runs / "plain")
    assert {r["epoch"] for r in records} == {0, 1}
    for record in records:
        assert len(record["mem_peak_gb_by_rank"]) == 2
        assert record["mem_peak_gb"] == max(record["mem_peak_gb_by_rank"])
    # Rank 1 took BALLAST_BYTES more at step 3: from the window holding step 3 on, its peak shows them.
    for record in records[1:]:
        rank0, rank1 = record["mem_peak_gb_by_rank"]
        assert rank1 - rank0 >= 0.8 * BALLAST_BYTES / 2**30, record["mem_peak_gb_by_rank"]
