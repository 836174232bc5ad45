"""ddptrain.diagnose on synthetic run folders: each verdict, thresholds from config.yaml, the predictions against
hand calculations, the what-if against a hand-computed ring all-reduce, the CLI's files, and the folders a real run
can leave behind (stopped, timing off, no record)."""

from __future__ import annotations

import ast
import json
import runpy
import sys
from pathlib import Path

import pytest
from PIL import Image

from ddptrain import diagnose
from ddptrain.diagnose.runs import read_metrics

PARTS = ("data", "compute", "comm", "optimizer", "other")


def rank_entry(rank: int, data=0.01, compute=0.8, comm=0.05, optimizer=0.02, other=0.01, mem=1.0) -> dict:
    """One rank's per-step figures, shaped like the by_rank entries of metrics.jsonl."""
    step = data + compute + comm + optimizer + other
    return {
        "rank": rank,
        "step_time_s": step,
        "time_data_s": data,
        "time_compute_s": compute,
        "time_comm_s": comm,
        "time_optimizer_s": optimizer,
        "time_other_s": other,
        "busy_s": step - comm,
        "mem_peak_gb": mem,
    }


def record(step: int, ranks: list[dict], window_steps: int = 5, tokens_per_step: float = 1000.0, **extra) -> dict:
    """A training record as the core writes it: means over ranks, step time the max, throughput from the window."""
    n = len(ranks)
    mean = {p: sum(r[f"time_{p}_s"] for r in ranks) / n for p in PARTS}
    step_time = max(r["step_time_s"] for r in ranks)
    busy = [r["busy_s"] for r in ranks]
    tokens = tokens_per_step * window_steps
    base = {
        "step": step,
        "epoch": 0,
        "loss": 2.0 - step / 100,
        "lr": 1e-4,
        "grad_norm": 1.0,
        "tokens": tokens,
        "target_tokens": tokens // 2,
        "tokens_per_s": tokens / (window_steps * step_time),
        "padding_fraction": 0.05,
        "rank_imbalance": 1.02,
        "peak_rank_tokens": 4096,
        "skipped_steps": 0,
        "allreduce_syncs_per_step": 1.0,
        "allreduce_calls_per_step": 1.0,
        "allreduce_bytes_per_step": 8 * 2**20,
        "elapsed_s": step * step_time,
        "window_steps": window_steps,
        "step_time_s": step_time,
        **{f"time_{p}_s": mean[p] for p in PARTS},
        "rank_time_imbalance": max(busy) / (sum(busy) / n),
        "slowest_rank": busy.index(max(busy)),
        "model_flops_per_step": 1e12,
        "tflops": 1e12 / n / step_time / 1e12,
        "mfu": None,
        "peak_tflops": None,
        "mem_peak_gb": max(r["mem_peak_gb"] for r in ranks),
        "mem_peak_gb_by_rank": [r["mem_peak_gb"] for r in ranks],
        "mem_reserved_gb_by_rank": None,
        "mem_total_gb": None,
        "alloc_retries": 0,
        "world_size": n,
        "by_rank": ranks,
    }
    return base | extra


def make_run(path: Path, records: list[dict], config: str | None = "trainer:\n  max_steps: 20\n", evals=()) -> Path:
    """A run folder: metrics.jsonl from ``records`` (and eval records), config.yaml from ``config``."""
    path.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in records] + [json.dumps(e) for e in evals]
    (path / "metrics.jsonl").write_text("\n".join(lines) + ("\n" if lines else ""))
    if config is not None:
        (path / "config.yaml").write_text(config)
    return path


def steady_run(path: Path, windows: int = 3, config: str | None = "trainer:\n  max_steps: 20\n", **rank_kw) -> Path:
    """``windows`` identical windows of 2 ranks with the given per-rank figures (one dict per rank, or shared)."""
    per_rank = [rank_kw.get(f"rank{i}", {k: v for k, v in rank_kw.items() if not k.startswith("rank")}) for i in (0, 1)]
    records = [record(5 * (w + 1), [rank_entry(i, **per_rank[i]) for i in (0, 1)]) for w in range(windows)]
    return make_run(path, records, config)


def levers_by_key(report: dict) -> dict:
    return {lever["key"]: lever for lever in report["levers"]}


# ----------------------------------------------------------------------------- one verdict each


def test_a_plain_run_is_compute_bound(tmp_path):
    report = diagnose.build_report(steady_run(tmp_path))
    assert report["verdict"] == "compute"
    assert report["findings"][0]["evidence"]["compute_share"] == pytest.approx(0.8 / 0.89)
    assert "trainer.compile" in levers_by_key(report)


def test_waiting_on_the_loader_is_data_bound_and_names_num_workers(tmp_path):
    report = diagnose.build_report(steady_run(tmp_path, data=0.3, compute=0.6, comm=0.05, optimizer=0.03, other=0.02))
    assert report["verdict"] == "data"
    assert report["findings"][0]["share"] == pytest.approx(0.3)
    lever = report["levers"][0]
    assert lever["key"] == "data.num_workers"
    # Hand count: num_workers=0, so one process does 0.3 s of loading per step; 2 workers do it in 0.15 s,
    # beside the 0.7 s the step spends not waiting: no wait left, step 0.7 s, 1000 tokens per step.
    assert lever["value"] == 2
    assert lever["predicted_step_time_s"] == pytest.approx(0.7)
    assert lever["predicted_tokens_per_s"] == pytest.approx(1000 / 0.7)


def test_exposed_all_reduce_is_communication_bound_and_names_accumulation_and_compression(tmp_path):
    report = diagnose.build_report(steady_run(tmp_path, data=0.01, compute=0.3, comm=0.5, optimizer=0.02, other=0.01))
    assert report["verdict"] == "communication"
    assert report["findings"][0]["evidence"]["exposed_comm_s"] == pytest.approx(0.5)
    keys = [lever["key"] for lever in report["levers"]]
    assert keys[0] == "optim.grad_accum_steps"
    assert "parallel.comm_hook" in keys
    assert levers_by_key(report)["parallel.comm_hook"]["value"] == "fp16_compress"  # gloo: no bf16 hook


FSDP2 = "parallel:\n  strategy: fsdp2\ntrainer:\n  max_steps: 20\n"


def test_an_fsdp2_run_reports_its_collectives_and_offers_its_own_levers(tmp_path):
    """parallel.strategy=fsdp2: the report sets out its all-gathers and reduce-scatters (none of DDP's all-reduce);
    communication-bound, it names FSDP2's levers, not DDP's accumulation, compression or buckets (accumulation gathers
    the weights again at every micro-step: no accumulation predictions either); compute-bound, no trainer.compile
    (refused under fsdp2)."""
    fsdp2 = {"reducescatter_calls_per_step": 3.0, "reducescatter_bytes_per_step": 4 * 2**20}
    fsdp2 |= {"allgather_calls_per_step": 10.0, "allgather_bytes_per_step": 12 * 2**20}
    ddp_keys = ("allreduce_calls_per_step", "allreduce_bytes_per_step", "allreduce_syncs_per_step")
    ranks = [rank_entry(i, compute=0.3, comm=0.5) for i in (0, 1)]
    records = [{k: v for k, v in record(5 * (w + 1), ranks, **fsdp2).items() if k not in ddp_keys} for w in range(3)]
    report = diagnose.build_report(make_run(tmp_path / "comm", records, FSDP2))
    assert report["verdict"] == "communication"
    assert [lever["set"] for lever in report["levers"]] == [
        "parallel.reshard_after_forward=false",
        "parallel.strategy=ddp",
    ]
    assert report["predictions"] == []
    summary = diagnose.render_markdown(report)
    assert "all-gather 12.00 MiB in 10.0 call(s); reduce-scatter 4.00 MiB in 3.0 call(s)" in summary
    assert "all-reduce per step" not in summary
    ranks = [rank_entry(i) for i in (0, 1)]
    records = [{k: v for k, v in record(5 * (w + 1), ranks, **fsdp2).items() if k not in ddp_keys} for w in range(3)]
    report = diagnose.build_report(make_run(tmp_path / "compute", records, FSDP2))
    assert report["verdict"] == "compute" and "trainer.compile" not in levers_by_key(report)


def test_a_plan_that_overloads_one_rank_is_imbalance(tmp_path):
    # Rank 1 gets 1.5× the tokens (planned) and computes 1.5× as long; rank 0 waits inside the all-reduce.
    records = [
        record(
            5 * w, [rank_entry(0, compute=0.4, comm=0.25), rank_entry(1, compute=0.6, comm=0.05)], rank_imbalance=1.5
        )
        for w in (1, 2, 3)
    ]
    report = diagnose.build_report(make_run(tmp_path, records))
    assert report["verdict"] == "imbalance"
    lever = levers_by_key(report)["data.batching"]
    assert lever["value"] == "token_budget"  # the default data.batching is length_grouped
    # The planned part (0.5 × mean compute 0.5 = 0.25) exceeds the measured wait (0.10): all of it goes.
    assert lever["predicted_step_time_s"] == pytest.approx(report["summary"]["step_time_s"] - 0.10)


def test_a_rank_slow_by_itself_is_a_straggler_and_is_named(tmp_path):
    records = [
        record(
            5 * w, [rank_entry(0, compute=0.4, comm=0.25), rank_entry(1, compute=0.6, comm=0.05)], rank_imbalance=1.0
        )
        for w in (1, 2, 3)
    ]
    report = diagnose.build_report(make_run(tmp_path, records))
    assert report["verdict"] == "straggler"
    assert report["findings"][0]["evidence"]["slowest_rank"] == 1
    assert "rank 1" in report["headline"]


def test_a_device_near_full_is_memory_bound(tmp_path):
    ranks = [rank_entry(0, mem=70.0), rank_entry(1, mem=70.0)]
    cuda = {"mem_total_gb": 80.0, "mem_reserved_gb_by_rank": [76.0, 70.0]}
    report = diagnose.build_report(make_run(tmp_path, [record(5 * w, ranks, **cuda) for w in (1, 2, 3)]))
    assert report["verdict"] == "memory"
    assert report["findings"][0]["evidence"]["rank"] == 0
    assert "model.gradient_checkpointing" in levers_by_key(report)
    assert report["levers"][0]["for"] == "memory"


def test_allocator_retries_are_memory_bound_even_with_room(tmp_path):
    ranks = [rank_entry(0, mem=10.0), rank_entry(1, mem=10.0)]
    cuda = {"mem_total_gb": 80.0, "mem_reserved_gb_by_rank": [12.0, 12.0], "alloc_retries": 3}
    report = diagnose.build_report(make_run(tmp_path, [record(5 * w, ranks, **cuda) for w in (1, 2, 3)]))
    assert report["verdict"] == "memory"
    assert "PYTORCH_CUDA_ALLOC_CONF" in levers_by_key(report)


def memory_run(path: Path, reserved, allocated=(70.0, 70.0), config="trainer:\n  max_steps: 20\n", **extra) -> Path:
    """Three windows on two 80 GiB CUDA devices with the given per-rank peaks (reserved None: not logged)."""
    ranks = [rank_entry(i, mem=gb) for i, gb in enumerate(allocated)]
    cuda = {"mem_total_gb": 80.0, "mem_reserved_gb_by_rank": reserved} | extra
    return make_run(path, [record(5 * w, ranks, **cuda) for w in (1, 2, 3)], config)


def test_a_rank_the_memory_plan_puts_near_full_is_flagged_before_it_runs_out(tmp_path):
    """Measured peaks with room (the run has not met its costliest batch yet), a plan that says otherwise."""
    ranks = [rank_entry(0, mem=40.0), rank_entry(1, mem=40.0)]
    for name, device, predicted, flagged in [
        ("cuda", {"mem_total_gb": 80.0}, [60.0, 77.0], True),
        ("cpu", {"mem_plan_device_gb": 16.0}, [15.5, 12.0], True),
        ("roomy", {"mem_total_gb": 80.0}, [60.0, 70.0], False),
    ]:
        plan = {"step": 0, "mem_predicted_gb_by_rank": predicted} | device
        windows = [record(5 * w, ranks, **device) for w in (1, 2, 3)]
        report = diagnose.build_report(make_run(tmp_path / name, [plan, *windows]))
        assert (report["verdict"] == "memory") == flagged, name
        assert [r["mem_predicted_gb"] for r in report["by_rank"]] == predicted, name
        assert report["summary"]["mem_predicted_gb"] == max(predicted), name
    again = [{"step": 0, "mem_predicted_gb_by_rank": [60.0, 77.0]}]
    again += [record(5 * w, ranks, mem_total_gb=80.0) for w in (1, 2, 3)]
    report = diagnose.build_report(make_run(tmp_path / "again", again))
    assert report["findings"][0]["rule"].startswith("rank 1 is predicted to need 77.0 of 80.0 GiB = 96%")
    markdown = diagnose.render_markdown(report)
    assert "predicted before the start: 77.00 GiB" in markdown and "| predicted GiB |" in markdown


def test_a_memory_tie_names_the_lowest_rank_as_the_balance_does(tmp_path):
    report = diagnose.build_report(memory_run(tmp_path, reserved=[76.0, 76.0]))
    assert report["findings"][0]["evidence"]["rank"] == 0
    assert report["findings"][0]["rule"].startswith("rank 0 reserved 76.0 of 80.0 GiB")


def test_memory_without_reserved_figures_says_allocated(tmp_path):
    report = diagnose.build_report(memory_run(tmp_path, reserved=None, allocated=(70.0, 76.0)))
    assert report["verdict"] == "memory"
    assert report["findings"][0]["rule"].startswith("rank 1 allocated 76.0 of 80.0 GiB")


def test_memory_without_per_rank_figures_names_no_rank(tmp_path):
    ranks = [rank_entry(0, mem=76.0), rank_entry(1, mem=76.0)]
    records = [
        {
            k: v
            for k, v in record(5 * w, ranks, mem_total_gb=80.0).items()
            if k not in ("by_rank", "mem_peak_gb_by_rank")
        }
        for w in (1, 2, 3)
    ]
    report = diagnose.build_report(make_run(tmp_path / "run", records))
    assert report["verdict"] == "memory" and report["by_rank"] == []
    finding = report["findings"][0]
    assert finding["rule"].startswith("the fullest rank allocated 76.0 of 80.0 GiB")
    assert "None" not in finding["rule"] + finding["why"] + report["headline"]


def test_levers_that_spend_memory_count_it_as_the_memory_rule_does(tmp_path):
    # 30 of 80 GiB allocated (62% free) but 60 reserved (25% free): the device has room only by allocated memory.
    config = "trainer:\n  max_steps: 20\nmodel:\n  gradient_checkpointing: true\n"
    tight = diagnose.build_report(memory_run(tmp_path / "tight", [60.0, 60.0], (30.0, 30.0), config))
    assert tight["verdict"] == "compute"
    assert "model.gradient_checkpointing" not in levers_by_key(tight)
    assert "data.micro_batch_size" not in levers_by_key(tight)
    roomy = diagnose.build_report(memory_run(tmp_path / "roomy", [30.0, 30.0], (30.0, 30.0), config))
    assert levers_by_key(roomy)["model.gradient_checkpointing"]["value"] is False
    assert levers_by_key(roomy)["data.micro_batch_size"]["value"] == 16


def test_perfectly_balanced_ranks_at_a_threshold_of_one_are_not_an_imbalance(tmp_path):
    # Equal busy time: measured 1.00 meets a threshold of 1.0, but no rank is busier than the mean.
    config = "trainer:\n  max_steps: 20\n  diagnose:\n    rank_time_imbalance: 1.0\n"
    report = diagnose.build_report(steady_run(tmp_path, config=config))
    assert report["summary"]["rank_time_imbalance"] == 1.0
    assert report["verdict"] == "compute"


def test_the_logged_balance_is_the_fallback_without_per_rank_rows(tmp_path):
    # No per-rank table: the records' own rank_time_imbalance and slowest_rank stand, the warm-up window left out.
    logged = [(1.9, 0), (1.3, 1), (1.3, 1)]
    records = [
        {k: v for k, v in record(5 * w, [rank_entry(0), rank_entry(1)]).items() if k != "by_rank"}
        | {"rank_time_imbalance": imbalance, "slowest_rank": slowest, "mem_peak_gb_by_rank": None}
        for w, (imbalance, slowest) in enumerate(logged, 1)
    ]
    report = diagnose.build_report(make_run(tmp_path, records))
    assert report["by_rank"] == []
    assert report["summary"]["rank_time_imbalance"] == pytest.approx(1.3)
    assert report["summary"]["slowest_rank"] == 1


def test_the_warm_up_window_is_left_out(tmp_path):
    warm = record(5, [rank_entry(0, data=2.0), rank_entry(1, data=2.0)])
    steady = [record(5 * w, [rank_entry(0), rank_entry(1)]) for w in (2, 3)]
    report = diagnose.build_report(make_run(tmp_path, [warm, *steady]))
    assert report["verdict"] == "compute"
    assert report["summary"]["time_data_s"] == pytest.approx(0.01)


def test_windows_are_weighted_by_their_steps(tmp_path):
    first = record(5, [rank_entry(0), rank_entry(1)])
    long = record(25, [rank_entry(0, data=0.1), rank_entry(1, data=0.1)], window_steps=20)
    short = record(30, [rank_entry(0, data=0.6), rank_entry(1, data=0.6)], window_steps=5)
    report = diagnose.build_report(make_run(tmp_path, [first, long, short]))
    assert report["summary"]["time_data_s"] == pytest.approx((20 * 0.1 + 5 * 0.6) / 25)


# ----------------------------------------------------------------------------- thresholds from config.yaml


def test_thresholds_in_config_yaml_change_the_verdict(tmp_path):
    figures = {"data": 0.12, "compute": 0.8, "comm": 0.05, "optimizer": 0.02, "other": 0.01}
    assert diagnose.build_report(steady_run(tmp_path / "default", **figures))["verdict"] == "data"
    raised = "trainer:\n  diagnose:\n    data_share: 0.2\n"
    assert diagnose.build_report(steady_run(tmp_path / "raised", config=raised, **figures))["verdict"] == "compute"


def test_comm_threshold_from_config_yaml(tmp_path):
    figures = {"data": 0.01, "compute": 0.8, "comm": 0.1, "optimizer": 0.02, "other": 0.01}
    assert diagnose.build_report(steady_run(tmp_path / "default", **figures))["verdict"] == "compute"
    lowered = "trainer:\n  diagnose:\n    comm_share: 0.05\n"
    report = diagnose.build_report(steady_run(tmp_path / "lowered", config=lowered, **figures))
    assert report["verdict"] == "communication"
    assert report["thresholds"]["comm_share"] == 0.05
    assert report["thresholds"]["data_share"] == 0.10  # the keys config.yaml lacks keep the schema's defaults


def test_planned_share_from_config_yaml_decides_imbalance_or_straggler(tmp_path):
    ranks = [rank_entry(0, compute=0.4, comm=0.25), rank_entry(1, compute=0.6, comm=0.05)]
    # Busy 0.44 and 0.64: measured 0.64 / 0.54 = 1.185; the planned excess 0.1 is 54% of 0.185: ≥ 50% → imbalance.
    records = [record(5 * w, ranks, rank_imbalance=1.1) for w in (1, 2, 3)]
    assert diagnose.build_report(make_run(tmp_path / "a", records))["verdict"] == "imbalance"
    strict = "trainer:\n  diagnose:\n    planned_share: 0.9\n"
    assert diagnose.build_report(make_run(tmp_path / "b", records, strict))["verdict"] == "straggler"


def test_a_folder_without_config_yaml_takes_the_schema_defaults(tmp_path):
    report = diagnose.build_report(steady_run(tmp_path, config=None, data=0.2))
    assert report["verdict"] == "data"
    assert report["thresholds"]["data_share"] == 0.10


# ----------------------------------------------------------------------------- predictions


ACCUM_RUN = {"data": 0.01, "compute": 0.09, "comm": 0.2, "optimizer": 0.02, "other": 0.03}


def test_accumulation_prediction_matches_a_hand_calculation(tmp_path):
    report = diagnose.build_report(steady_run(tmp_path, **ACCUM_RUN))
    # Hand count at grad_accum_steps=4 (from 1): data and compute ×4 = 0.40 s, exposed all-reduce 0.20 s,
    # optimizer 0.02 s and other 0.03 s once per step: 0.65 s for 4 × 1000 tokens.
    predicted = {p["change"]: p for p in report["predictions"]}["optim.grad_accum_steps=4"]
    assert predicted["step_time_s"] == pytest.approx(0.65)
    assert predicted["tokens_per_s"] == pytest.approx(4000 / 0.65)
    assert report["summary"]["tokens_per_s"] == pytest.approx(1000 / 0.35)


def test_accumulation_lever_suggests_two_when_that_is_enough_else_four(tmp_path):
    report = diagnose.build_report(steady_run(tmp_path / "far", **ACCUM_RUN))
    lever = levers_by_key(report)["optim.grad_accum_steps"]
    # Comm share at ×2: 0.2/0.45 = 44% ≥ 15%: ×4 (never more in one suggestion), 4000 tokens in 0.65 s.
    assert lever["value"] == 4
    assert lever["predicted_tokens_per_s"] == pytest.approx(4000 / 0.65)
    near = {"data": 0.01, "compute": 0.6, "comm": 0.15, "optimizer": 0.02, "other": 0.01}
    lever = levers_by_key(diagnose.build_report(steady_run(tmp_path / "near", **near)))["optim.grad_accum_steps"]
    assert lever["value"] == 2  # ×2: 0.15 / (2 × 0.61 + 0.18) = 11% < 15%


def test_accumulation_with_global_batch_size_changes_the_global_batch(tmp_path):
    # 32 rows per step over 2 ranks × 8 rows (data.micro_batch_size's default): grad_accum_steps is derived as 2.
    config = "optim:\n  global_batch_size: 32\n"
    report = diagnose.build_report(steady_run(tmp_path, config=config, **ACCUM_RUN))
    keys = levers_by_key(report)
    assert "optim.grad_accum_steps" not in keys
    assert keys["optim.global_batch_size"]["value"] == 32 * 4
    assert report["summary"]["grad_accum_steps"] == 2
    # The predictions change the global batch too: grad_accum_steps is derived, the user must not set it.
    predicted = {p["change"]: p for p in report["predictions"]}
    assert not [change for change in predicted if change.startswith("optim.grad_accum_steps=")]
    assert {"optim.global_batch_size=64", "optim.global_batch_size=128", "optim.global_batch_size=256"} <= {*predicted}
    # ×4 the micro-batches per step: the same hand count as at grad_accum_steps=4 from 1 (0.65 s for 4000 tokens).
    assert predicted["optim.global_batch_size=128"]["step_time_s"] == pytest.approx(0.65)
    assert predicted["optim.global_batch_size=128"]["tokens_per_s"] == pytest.approx(4000 / 0.65)


@pytest.mark.parametrize(
    ("config", "value", "why"),
    [
        ("", 4, "half the rows per micro-batch; with optim.grad_accum_steps=2 the global batch stays"),
        ("data:\n  micro_batch_size: 3\n", 1, "1/3 of the rows per micro-batch; with optim.grad_accum_steps=3 the"),
        (
            "data:\n  micro_batch_size: 4\noptim:\n  global_batch_size: 16\n",
            2,
            "half the rows per micro-batch; optim.global_batch_size=16 stays, so each step accumulates 2× the",
        ),
        ("data:\n  micro_batch_size: 1\n", None, None),
    ],
)
def test_a_smaller_micro_batch_keeps_the_global_batch_and_is_not_offered_at_one_row(tmp_path, config, value, why):
    report = diagnose.build_report(memory_run(tmp_path, [76.0, 70.0], config="trainer:\n  max_steps: 20\n" + config))
    assert report["verdict"] == "memory"
    lever = levers_by_key(report).get("data.micro_batch_size")
    if value is None:
        assert lever is None  # one row cannot be halved
        return
    assert lever["value"] == value
    assert lever["why"].startswith(why)
    if "global_batch_size" in config:
        assert "grad_accum_steps" not in lever["why"]  # derived from the global batch: not a key to set


def test_compression_halves_the_exposed_all_reduce(tmp_path):
    report = diagnose.build_report(steady_run(tmp_path, **ACCUM_RUN))
    lever = levers_by_key(report)["parallel.comm_hook"]
    assert lever["predicted_step_time_s"] == pytest.approx(0.35 - 0.1)


def test_time_spent_between_steps_stays_in_the_prediction(tmp_path):
    # The window took 20% longer than its steps (logging, evaluation): that time per step does not scale.
    records = [record(5 * w, [rank_entry(0, **ACCUM_RUN), rank_entry(1, **ACCUM_RUN)]) for w in (1, 2, 3)]
    for r in records:
        r["tokens_per_s"] = r["tokens"] / (r["window_steps"] * 0.35 * 1.2)
    report = diagnose.build_report(make_run(tmp_path, records))
    predicted = {p["change"]: p for p in report["predictions"]}["optim.grad_accum_steps=4"]
    assert predicted["tokens_per_s"] == pytest.approx(4000 / (0.65 + 0.07))


# ----------------------------------------------------------------------------- what-if


def test_what_if_matches_a_hand_computed_ring_all_reduce(tmp_path):
    report = diagnose.build_report(steady_run(tmp_path, **ACCUM_RUN))
    result = diagnose.what_if(report, nproc_per_node=8, link="nvlink")
    # 8 MiB in one bucket over NVLink (200 GB/s, 5 µs): 2·7/8 · 8 MiB / 200e9 + 2·7 · 5e-6 s, all of it exposed.
    ring = 2 * 7 / 8 * 8 * 2**20 / 200e9 + 14 * 5e-6
    target = result["target"]
    assert target["allreduce_s"] == pytest.approx(ring)
    assert target["exposed_comm_s"] == pytest.approx(ring)
    base = 0.01 + 0.09 + 0.02 + 0.03
    assert target["step_time_s"] == pytest.approx(base + ring)
    assert target["tokens_per_s"] == pytest.approx(500 * 8 / (base + ring))  # 1000 tokens per step over 2 ranks
    assert target["speedup"] == pytest.approx(8 * base / (base + ring))
    assert [r["nproc"] for r in result["rows"]] == [1, 2, 4, 8]


def test_what_if_hides_all_buckets_but_the_last_behind_backward(tmp_path):
    records = [
        record(5 * w, [rank_entry(0, **ACCUM_RUN), rank_entry(1, **ACCUM_RUN)], allreduce_calls_per_step=4.0)
        for w in (1, 2, 3)
    ]
    report = diagnose.build_report(make_run(tmp_path, records))
    result = diagnose.what_if(report, 4, "pcie", bus_bandwidth_gb_s=1.0, latency_us=0.0)
    bucket = 2 * 3 / 4 * 2 * 2**20 / 1e9  # 2 MiB per bucket over 1 GB/s
    backward = 2 / 3 * 0.09
    assert result["target"]["exposed_comm_s"] == pytest.approx(bucket + max(3 * bucket - backward, 0))


def test_what_if_pcie_crosses_a_slower_hop_beyond_four_ranks(tmp_path):
    result = diagnose.what_if(steady_run(tmp_path, **ACCUM_RUN), 8, "pcie")
    bandwidth = {r["nproc"]: r["bus_gb_s"] for r in result["rows"]}
    assert bandwidth[4] == 16.0 and bandwidth[8] == 8.0
    assert result["rows"][-1]["efficiency"] < result["rows"][-2]["efficiency"]


def test_what_if_refuses_an_unknown_link(tmp_path):
    with pytest.raises(ValueError, match="link=token-ring"):
        diagnose.what_if(steady_run(tmp_path), 8, "token-ring")


def test_what_if_takes_a_link_of_ones_own_given_its_bandwidth_and_latency(tmp_path):
    # The error for an unknown link says "or pass --bus-bandwidth and --latency-us": with both, it runs.
    result = diagnose.what_if(steady_run(tmp_path, **ACCUM_RUN), 8, "roce", bus_gb_s := 5.0, latency_us=20.0)
    ring = 2 * 7 / 8 * 8 * 2**20 / (bus_gb_s * 1e9) + 14 * 20e-6  # 8 MiB in one bucket, 2·7 hops of 20 µs
    assert result["link"] == "roce"
    assert result["target"]["bus_gb_s"] == bus_gb_s
    assert result["target"]["allreduce_s"] == pytest.approx(ring)
    with pytest.raises(ValueError, match=r"link=roce is not one of .*\(missing: --latency-us\)"):
        diagnose.what_if(steady_run(tmp_path), 8, "roce", bus_bandwidth_gb_s=5.0)


@pytest.mark.parametrize(
    ("config", "suggested"),
    [("", "optim.grad_accum_steps=k "), ("optim:\n  global_batch_size: 32\n", "optim.global_batch_size=k×32 ")],
)
def test_what_if_suggests_the_accumulation_key_the_run_sets(tmp_path, config, suggested):
    # With optim.global_batch_size set the trainer derives grad_accum_steps from it: the batch is the key to change.
    report = diagnose.build_report(steady_run(tmp_path, config=config, **ACCUM_RUN))
    result = diagnose.what_if(report, 8, "ethernet", bus_bandwidth_gb_s=0.1)
    assert result["target"]["efficiency"] < 0.9  # slow enough for the explanation to name what changes it
    text = " ".join(result["explanation"])
    assert suggested in text
    if config:
        assert "grad_accum_steps" not in text


# ----------------------------------------------------------------------------- CLI and the files it writes


def test_cli_writes_the_report_and_plots_that_open_as_images(tmp_path, capsys):
    run = steady_run(tmp_path, **ACCUM_RUN)
    assert diagnose.main([str(run), "--what-if", "parallel.nproc_per_node=8", "link=nvlink"]) == 0
    saved = json.loads((run / "report.json").read_text())
    assert saved["verdict"] == "communication"
    assert saved["what_if"]["target"]["nproc"] == 8
    assert {"verdict", "levers", "by_rank", "summary", "predictions"} <= saved.keys()
    assert saved["plots"] == ["loss_throughput.png", "time_by_rank.png"]
    assert all({"key", "value", "why"} <= lever.keys() for lever in saved["levers"])
    markdown = (run / "report.md").read_text()
    assert "communication" in markdown and "optim.grad_accum_steps=4" in markdown and "| rank |" in markdown
    for name in ("loss_throughput.png", "time_by_rank.png"):
        with Image.open(run / name) as image:
            image.verify()
            assert image.format == "PNG"
    out = capsys.readouterr().out
    assert "tokens/s" in out and "efficiency" in out


def test_cli_no_plots(tmp_path):
    run = steady_run(tmp_path)
    assert diagnose.main([str(run), "--no-plots"]) == 0
    assert (run / "report.md").exists() and not (run / "loss_throughput.png").exists()


def one_process_run(path: Path) -> Path:
    """Three windows of one process: no all-reduce, so no gradient bytes logged."""
    return make_run(path, [record(5 * w, [rank_entry(0, comm=0.0)], allreduce_bytes_per_step=None) for w in (1, 2, 3)])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--what-if", "parallel.nproc_per_node=eight", "link=nvlink"], "needs parallel.nproc_per_node=N"),
        (["--what-if", "parallel.nproc_per_node=8", "link=token-ring"], "link=token-ring is not one of"),
        (["--what-if", "parallel.nproc_per_node=0"], "parallel.nproc_per_node=0 must be 1 or more"),
        (["--what-if", "parallel.nproc_per_node=8", "--grad-mb", "0"], "--grad-mb 0 must be positive"),
        (["--what-if", "parallel.nproc_per_node=8", "--bus-bandwidth", "0"], "--bus-bandwidth 0 must be positive"),
        (["--grad-mb", "300"], "--grad-mb only apply to the what-if: add --what-if parallel.nproc_per_node=N"),
        (["--bus-bandwidth", "12", "--latency-us", "8"], "--bus-bandwidth, --latency-us only apply to the what-if"),
        (
            ["--what-if", "parallel.nproc_per_node=8", "link=roce", "--bus-bandwidth", "5"],
            "link=roce is not one of pcie, nvlink, ib, ethernet: pick one of them, or describe a link of your own with "
            "--bus-bandwidth GB/s and --latency-us (missing: --latency-us).",
        ),
    ],
)
def test_cli_refuses_a_malformed_command_before_writing_anything(tmp_path, capsys, args, message):
    run = steady_run(tmp_path, **ACCUM_RUN)
    assert diagnose.main([str(run), *args]) == 2
    assert message in capsys.readouterr().err
    assert not [p.name for p in run.iterdir() if p.name.startswith(("report", "loss_", "time_"))]


def test_cli_what_if_of_one_process_needs_grad_mb_and_takes_it(tmp_path, capsys):
    run = one_process_run(tmp_path)
    assert diagnose.main([str(run), "--no-plots", "--what-if", "parallel.nproc_per_node=4", "link=ib"]) == 2
    assert "pass --grad-mb" in capsys.readouterr().err
    assert (
        diagnose.main([str(run), "--no-plots", "--what-if", "parallel.nproc_per_node=4", "link=ib", "--grad-mb", "300"])
        == 0
    )
    saved = json.loads((run / "report.json").read_text())
    assert saved["what_if"]["grad_bytes_per_step"] == 300 * 2**20


def test_cli_what_if_on_a_link_of_ones_own(tmp_path, capsys):
    run = steady_run(tmp_path, **ACCUM_RUN)
    link = ["link=roce", "--bus-bandwidth", "5", "--latency-us", "20"]
    assert diagnose.main([str(run), "--no-plots", "--what-if", "parallel.nproc_per_node=8", *link]) == 0
    saved = json.loads((run / "report.json").read_text())["what_if"]
    assert (saved["link"], saved["latency_us"], saved["target"]["bus_gb_s"]) == ("roce", 20.0, 5.0)
    assert "link=roce" in capsys.readouterr().out


def test_python_m_diagnose_shows_the_verbs_help(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["python -m ddptrain.diagnose", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("ddptrain.diagnose", run_name="__main__")  # as python -m runs it
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the description to the terminal's width
    assert out.startswith("usage: ddptrain diagnose ")
    assert "A run's report: where each step's time went" in out


def test_console_summary_has_throughput_ranks_balance_verdict_and_levers(tmp_path):
    report = diagnose.build_report(steady_run(tmp_path, **ACCUM_RUN))
    text = diagnose.console_summary(report)
    assert "2,857 tokens/s" in text
    assert "\n     0 " in text and "\n     1 " in text
    assert "balance: planned 1.02, measured 1.00" in text
    assert "communication" in text and "1. optim.grad_accum_steps=4" in text


# ----------------------------------------------------------------------------- what real runs leave behind


def test_a_stopped_run_with_a_torn_last_line(tmp_path):
    records = [record(5 * w, [rank_entry(0), rank_entry(1)]) for w in (1, 2)]
    run = make_run(tmp_path, records)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 15, "loss": 1.')  # SIGTERM mid-write
    assert diagnose.main([str(run)]) == 0
    report = json.loads((run / "report.json").read_text())
    assert report["summary"]["last_step"] == 10
    assert any("stopped at step 10 of 20" in note for note in report["notes"])


def resumed_lines(path: Path, lines: list[dict], config: str = "trainer:\n  max_steps: 25\n") -> Path:
    """A run folder whose metrics.jsonl holds ``lines`` in this order, as appending processes leave it."""
    return make_run(path, [], config, evals=lines)


def window(step: int, data: float = 0.01, **extra) -> dict:
    """A training record of 2 ranks; ``data`` marks where it came from (warm-up 2.0, abandoned 0.5, steady 0.01).
    ``elapsed_s`` (seconds since its process started) is the step unless given."""
    return record(step, [rank_entry(0, data=data), rank_entry(1, data=data)], **({"elapsed_s": float(step)} | extra))


def test_a_resumed_run_keeps_the_later_record_of_each_step_and_leaves_each_warm_up_out(tmp_path):
    first = [window(5, data=2.0), window(10), window(15, data=0.5), window(20, data=0.5)]
    # Resumed from the step-10 checkpoint: steps 15 and 20 again, then 25; elapsed_s starts again with the process.
    later = [window(15, data=2.0, elapsed_s=1.0, loss=1.7), window(20, elapsed_s=2.0), window(25, elapsed_s=3.0)]
    report = diagnose.build_report(resumed_lines(tmp_path, first + later))
    s = report["summary"]
    # The steady windows are 10, 20 and 25: the abandoned 15 and 20 are gone, both warm-up windows left out.
    assert s["time_data_s"] == pytest.approx(0.01)
    assert (s["windows"], s["windows_used"], s["last_step"], s["processes"]) == (5, 3, 25, 2)
    assert s["loss_last"] == pytest.approx(2.0 - 25 / 100)
    assert any("restarted 1 time(s)" in note for note in report["notes"])


def test_a_restart_that_repeats_no_step_still_leaves_its_warm_up_out(tmp_path):
    # Resumed from the last logged step: the steps go on, only elapsed_s going down shows the new process.
    lines = [window(5, data=2.0), window(10), window(15, data=2.0, elapsed_s=1.0), window(20, elapsed_s=2.0)]
    s = diagnose.build_report(resumed_lines(tmp_path, lines))["summary"]
    assert (s["windows"], s["windows_used"]) == (4, 2)
    assert s["time_data_s"] == pytest.approx(0.01)


def test_a_run_resumed_and_stopped_again_ends_where_the_later_process_stopped(tmp_path):
    evals = [{"step": 10, "eval_loss": 2.0}, {"step": 20, "eval_loss": 1.5}]
    first = [window(5), window(10), evals[0], window(15), window(20), evals[1]]
    # Resumed from step 10, evaluated at 10 again, stopped after step 15 (no repeat of step 20).
    later = [{"step": 10, "eval_loss": 1.9}, window(15, elapsed_s=1.0, loss=1.0)]
    run = resumed_lines(tmp_path, first + later)
    train, kept_evals = read_metrics(run)
    assert [r["step"] for r in train] == [5, 10, 15]
    assert kept_evals == [{"step": 10, "eval_loss": 1.9}]  # the later eval at 10; 20 belonged to the abandoned steps
    assert [r["first_window"] for r in train] == [True, False, True]
    report = diagnose.build_report(run)
    assert report["summary"]["loss_last"] == 1.0
    assert any("stopped at step 15 of 25" in note for note in report["notes"])


def test_a_run_with_timing_off_says_so(tmp_path):
    timed_keys = {"step_time_s", "by_rank", "rank_time_imbalance", "slowest_rank", "tflops", "mfu"}
    timed_keys |= {f"time_{p}_s" for p in PARTS} | {k for k in record(5, [rank_entry(0)]) if k.startswith("mem_")}
    records = [
        {k: v for k, v in record(5 * w, [rank_entry(0), rank_entry(1)]).items() if k not in timed_keys} for w in (1, 2)
    ]
    run = make_run(tmp_path, records)
    assert diagnose.main([str(run)]) == 0
    report = json.loads((run / "report.json").read_text())
    assert report["verdict"] is None
    assert report["levers"][0]["set"] == "trainer.timing=true"
    assert "trainer.timing=false" in (run / "report.md").read_text()
    assert (run / "loss_throughput.png").exists() and not (run / "time_by_rank.png").exists()
    assert "no verdict" in diagnose.console_summary(report)


def test_a_run_without_records_is_a_clear_error(tmp_path, capsys):
    run = make_run(tmp_path, [], evals=[{"step": 0, "eval_loss": 2.0, "eval_tokens": 10}])
    (run / "train.log").write_text("RuntimeError: CUDA out of memory\n")
    with pytest.raises(diagnose.DiagnoseError, match="no training record"):
        diagnose.build_report(run)
    assert diagnose.main([str(run)]) == 2
    assert "CUDA out of memory" in capsys.readouterr().err


def test_a_folder_without_metrics_is_a_clear_error(tmp_path):
    with pytest.raises(diagnose.DiagnoseError, match=r"no metrics\.jsonl"):
        diagnose.build_report(tmp_path)
    with pytest.raises(diagnose.DiagnoseError, match="not a folder"):
        diagnose.build_report(tmp_path / "missing")


# ----------------------------------------------------------------------------- the package's shape


def test_names_used_across_the_diagnose_modules_are_public():
    """A name another module imports is part of its module's interface: it carries no leading underscore."""
    package = Path(diagnose.__file__).parent
    private = [
        f"{path.name} imports {alias.name} from {node.module}"
        for path in sorted(package.glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ddptrain")
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]
    assert private == []
