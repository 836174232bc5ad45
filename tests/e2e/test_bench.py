"""Every ``python -m ddptrain.bench.*`` command, at the smallest size, so that the commands behind the numbers in
bench/README.md cannot break unnoticed. Each runs its ``main`` in this process with tiny arguments (the launches
fork their ranks from the test session's forkserver); what it prints is checked against what it was given.

The two sweep benchmarks (``startup``, ``sweep``) time whole sweeps of the real command line, a minute each even
tiny: here their timer is replaced by one that composes every command's overrides with Hydra instead of running it,
so a renamed key or group fails here. The sweeps themselves run in tests/e2e/test_sweeps.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddptrain.bench import chat_tokenize, data_prep, samplers, startup, sweep, throughput, throughput_memory
from tests.conftest import QWEN2_TOKENIZER, REPO, compose_config, requires_shared

pytestmark = pytest.mark.e2e

TINY_TOKENIZER = REPO / "ddptrain" / "assets" / "tiny_tokenizer"
TINY_DATA = REPO / "ddptrain" / "assets" / "tiny_instruct.jsonl"
ROWS = 24


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> Path:
    """The first ROWS rows of the bundled Alpaca-style data."""
    path = tmp_path_factory.mktemp("bench") / "rows.jsonl"
    path.write_text("".join(TINY_DATA.read_text().splitlines(keepends=True)[:ROWS]))
    return path


def table_rows(output: str) -> list[list[str]]:
    """The body rows of the markdown table in ``output``."""
    lines = [line for line in output.splitlines() if line.startswith("| ") and not line.startswith("|---")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:]]


def test_data_prep_times_both_workloads(rows, capsys) -> None:
    data_prep.main(["--data", str(rows), "--tokenizer", str(TINY_TOKENIZER), "--num-proc", "1", "--max-length", "64"])
    table = {row[0]: row for row in table_rows(capsys.readouterr().out)}
    assert set(table) == {"alpaca", f"mixture x{data_prep.COPIES}"}, table
    alpaca, mixture = int(table["alpaca"][1]), int(table[f"mixture x{data_prep.COPIES}"][1])
    assert 0 < alpaca <= ROWS and mixture == data_prep.COPIES * alpaca, table  # 4 copies of the same rows


@requires_shared
def test_chat_tokenize_times_both_paths_of_both_workloads(rows, capsys) -> None:
    """Qwen2's tokenizer: the one at hand with its own chat template (the bundled one has none)."""
    chat_tokenize.main(["--data", str(rows), "--tokenizer", str(QWEN2_TOKENIZER), "--rows", "10", "--repeats", "1"])
    table = {row[0]: row for row in table_rows(capsys.readouterr().out)}
    assert set(table) == {"one exchange", "two exchanges"}, table
    assert [int(row[1]) for row in table.values()] == [10, 10], table  # conversations of 1 and 2 of the 24 rows
    assert all(float(row[2]) > 0 and float(row[3]) > 0 for row in table.values()), table


def test_samplers_plans_every_sampler_over_the_epoch(rows, capsys) -> None:
    argv = ["--data", str(rows), "--tokenizer", str(TINY_TOKENIZER), "--world-size", "2", "--micro-batch-size", "2"]
    samplers.main([*argv, "--max-length", "64", "--json"])
    results = {r["sampler"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    ours = [r for name, r in results.items() if name.startswith("ddptrain ")]
    assert len(results) == 7 and len(ours) == 4, sorted(results)
    assert all(r["duplicated"] == 0 for r in ours), ours
    budgeted = [r for name, r in results.items() if "token_budget" in name or "packed" in name]
    assert len(budgeted) == 2 and all(r["dropped"] == 0 for r in budgeted), budgeted


@requires_shared
def test_throughput_runs_each_way_of_training(tmp_path, monkeypatch, capsys) -> None:
    """ddptrain, the transformers Trainer and the hand-written loop, 1 warm-up and 1 measured step each."""
    real_overrides = throughput.base_overrides
    monkeypatch.setattr(
        throughput, "base_overrides", lambda *a: [*real_overrides(*a), "parallel.start_method=forkserver"]
    )
    variants = "ddptrain:packed,hf:group_by_length,hand:token_budget"
    throughput.main(
        [
            *("--data", str(TINY_DATA), "--tokenizer", str(QWEN2_TOKENIZER), "--rows", "8", "--max-length", "64"),
            *("--steps", "1", "--warmup", "1", "--micro-batch-size", "1", "--nproc", "1", "--variants", variants),
            "--json",
            *("--workdir", str(tmp_path)),
        ]
    )
    results = json.loads(capsys.readouterr().out)["results"]
    assert sorted(results) == sorted(variants.split(",")), results
    for name, result in results.items():
        assert result["real_tokens"] > 0 and result["tokens_per_s"] > 0, (name, result)
        assert len(result["peak_rss_mb"]) == 1, (name, result)  # the rank reported


@requires_shared
def test_throughput_memory_measures_both_scopes(tmp_path, monkeypatch, capsys) -> None:
    """Each of the four measurements runs the command the benchmark builds for it, ``python -m
    ddptrain.bench.throughput_memory --child ...``, through that module's own entry point, in this process: a fresh
    process would cost seconds of imports each on 2 cores, and a smoke test needs no clean heap."""
    children, real_run = [], subprocess.run

    def run_child_here(command, **kwargs):
        if command[:4] != [sys.executable, "-m", "ddptrain.bench.throughput_memory", "--child"]:
            return real_run(command, **kwargs)
        children.append(command)
        out = io.StringIO()
        with monkeypatch.context() as patch, contextlib.redirect_stdout(out):
            patch.setattr(sys, "argv", command[2:])
            throughput_memory._child_main()
        return subprocess.CompletedProcess(command, 0, stdout=out.getvalue(), stderr="")

    monkeypatch.setattr(throughput_memory.subprocess, "run", run_child_here)
    throughput.main(
        [
            *("--memory", "--data", str(TINY_DATA), "--tokenizer", str(QWEN2_TOKENIZER), "--micro-batch-size", "1"),
            *("--memory-length", "64", "--loss-chunk-tokens", "32", "--workdir", str(tmp_path), "--json"),
        ]
    )
    runs = json.loads(capsys.readouterr().out)["runs"]
    measured = sorted((r["scope"], r["checkpointing"]) for r in runs)
    assert measured == [("decoder", False), ("decoder", True), ("loss", False), ("loss", True)], runs
    assert all(r["activation_peak_mb"] > 0 and r["seconds"] > 0 for r in runs), runs
    assert len(children) == 4, children


def composes(command: list[str]) -> float:
    """Stands in for the benchmarks' timer: the command's overrides compose (a sweep's first value), 1 s."""
    overrides = command[command.index("ddptrain") + 1 :]
    assert overrides[0] == "-m", command  # a multirun
    kept = [o for o in overrides[1:] if not o.startswith("hydra")]
    compose_config([re.sub(r"=([^,]*),.*", r"=\1", o) for o in kept])
    return 1.0


@pytest.mark.parametrize("bench", [startup, sweep], ids=["startup", "sweep"])
def test_the_sweep_benchmarks_build_commands_that_compose(bench, monkeypatch, capsys) -> None:
    timed = []
    monkeypatch.setattr(bench, "timed", lambda command: timed.append(command) or composes(command))
    bench.main(["--repeats", "1", "--steps", "1"])
    table = table_rows(capsys.readouterr().out)
    assert len(timed) == (4 if bench is startup else 2) and len(table) == 2, (timed, table)


@contextlib.contextmanager
def threads_put_back():
    """The save check's benchmarks run on one thread, as torchrun leaves rank 0; called here, in the test session's
    process, they must give its threads back, or every later test in it runs on one. Set to 2 for the call, so that
    a benchmark that leaves 1 behind is seen whatever the session had."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
        assert torch.get_num_threads() == 2, "the benchmark left torch on another number of threads"
    finally:
        torch.set_num_threads(before)


def test_the_evaluation_benchmark_times_a_save_with_and_without_its_check(capsys) -> None:
    from ddptrain.bench import evaluation

    with threads_put_back():
        evaluation.main(["--save-check-only", "--models", "tiny_qwen2", "--repeats", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny_qwen2 |")]
    assert len(rows) == 1
    cells = [float(cell) for cell in rows[0].strip("|").split("|")[1:]]
    # save, save with the check, the read-back alone, the round trip on 1 thread and on all cores, mirrored
    assert len(cells) == 6 and all(c > 0 for c in cells)


def test_the_save_check_benchmark_sets_the_checks_of_a_run_beside_its_steps(capsys) -> None:
    from ddptrain.bench import save_check

    with threads_put_back():
        save_check.main(["--models", "tiny_qwen2", "--steps", "3", "--repeats", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny_qwen2 |")]
    assert len(rows) == 1 and float(rows[0].split("|")[2]) > 0, rows  # a step was timed
    assert all(c.strip().endswith("%") for c in rows[0].strip("|").split("|")[-2:]), rows
    # What it times: with the default every save read back and the end's round trip (its merged weights compared), and
    # without the check nothing (the seconds the checks' records report).
    checked, plain = (save_check.save_seconds("tiny_qwen2", mode, 1) for mode in ("every", "off"))
    assert checked["evaluation check"] > 0 and checked["end check"] > 0 and checked["merged weights"] > 0
    assert plain["evaluation check"] == plain["end check"] == 0 and plain["merged weights"] is None


def test_the_dpo_reference_benchmark_times_both_references_and_the_table(capsys) -> None:
    """Both references run (the real command line, 1 warm-up step and 1 measured); the precomputed run's table time
    comes from its log, and adapter_off has none."""
    from ddptrain.bench import dpo_reference

    dpo_reference.main(["--repeats", "1", "--steps", "1", "--warmup", "1", "parallel.start_method=forkserver"])
    table = {row[0]: row for row in table_rows(capsys.readouterr().out)}
    assert set(table) == {"adapter_off", "precomputed"}
    assert table["adapter_off"][3] == "–" and float(table["precomputed"][3]) > 0, table


def test_the_dpo_parity_benchmark_sets_both_losses_of_each_step_side_by_side(capsys) -> None:
    """2 steps of 4 pairs of the tiny model in ddptrain and in TRL (a development dependency): a row per step, the
    same first loss (both start from the same LoRA model: ln 2), and each side's seconds per step."""
    pytest.importorskip("trl")
    from ddptrain.bench import dpo_parity

    dpo_parity.main(["--model", "tiny", "--steps", "2", "--pairs", "4", "parallel.start_method=forkserver"])
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert [row[0] for row in rows] == ["1", "2"] and rows[0][1] == rows[0][2] == "0.693147", rows
    assert re.search(r"s/step after the first: ddptrain \d+\.\d+, TRL \d+\.\d+", out), out
