"""The real entrypoint with the profiler on, the end-of-run report, and ``python -m ddptrain.diagnose``."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest

from tests.conftest import REPO, read_metrics
from tests.e2e.conftest import DEBUG_RUN_PROFILED_STEPS, FinishedRun

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def profiled_run(debug_run: FinishedRun) -> tuple[Path, subprocess.CompletedProcess]:
    """The session's 6-step run of the default tiny job, profiled on steps 3-5 (tests/e2e/conftest.py)."""
    assert DEBUG_RUN_PROFILED_STEPS == (3, 5)
    return debug_run.run_dir, debug_run.result


@pytest.fixture
def run_copy(profiled_run, tmp_path) -> Path:
    """A copy of the run folder, for a test that rewrites its report (other tests compare loggers with it)."""
    return Path(shutil.copytree(profiled_run[0], tmp_path / "run"))


def step_ranges(events: list[dict]) -> dict[int, tuple[float, float]]:
    """``ddptrain.step N`` ranges of the trace: N -> (start, end) in microseconds."""
    ranges = {}
    for event in events:
        name = event.get("name", "")
        if name.startswith("ddptrain.step ") and event.get("ph") == "X":
            ranges[int(name.split()[-1])] = (event["ts"], event["ts"] + event["dur"])
    return ranges


def test_profile_steps_write_a_trace_holding_the_forward_and_backward_of_those_steps(profiled_run) -> None:
    run_dir, _ = profiled_run
    traces = sorted((run_dir / "profile").glob("*.json"))
    assert [t.name for t in traces] == ["rank0_steps3-5.trace.json"], "only rank 0 (trainer.profile_ranks) traces"
    events = json.loads(traces[0].read_text())["traceEvents"]
    ranges = step_ranges(events)
    assert sorted(ranges) == [3, 4, 5]
    for step, (start, end) in ranges.items():
        inside = [e["name"] for e in events if e.get("ph") == "X" and start <= e["ts"] and e["ts"] + e["dur"] <= end]
        assert any(name == "aten::linear" for name in inside), f"no forward matmul in step {step}"
        assert any("Backward" in name for name in inside), f"no backward in step {step}"
        assert any(name.startswith("Optimizer.step") for name in inside), f"no optimizer step in step {step}"


def test_every_run_ends_with_a_report_and_a_verdict_on_the_console(profiled_run) -> None:
    """The default tiny job on 2 CPU ranks spends its steps in forward and backward: its verdict is compute."""
    run_dir, result = profiled_run
    report = json.loads((run_dir / "report.json").read_text())
    assert report["verdict"] == "compute", report
    assert "verdict" in (run_dir / "report.md").read_text().lower()
    assert f"Run report ({run_dir}/report.md): {report['verdict']}" in result.stderr, result.stderr[-3000:]
    # The report comes after training is over, before the last word.
    assert result.stderr.index("Run report (") < result.stderr.index("ddptrain: done. Results in"), result.stderr
    last = [r for r in read_metrics(run_dir) if "loss" in r][-1]
    assert report["summary"]["tokens_per_s"] > 0 and last["tokens_per_s"] > 0
    # plan.at_start=true: each rank's prediction beside its measured peak (no device size: no verdict from it).
    predicted = [r["mem_predicted_gb"] for r in report["by_rank"]]
    assert len(predicted) == 2 and all(0.05 < gb < 1.0 for gb in predicted), report["by_rank"]
    # Planning did not slow its steps: glibc kept its freed blocks (plan.cpu_returns_freed_memory=false, the
    # default), and the report says that its resident peaks hold them, naming the key that hands them back.
    markdown = (run_dir / "report.md").read_text()
    assert "predicted before the start:" in markdown and "for the training step" in markdown, markdown
    assert "glibc's freed blocks kept for reuse too" in markdown, markdown
    assert "`plan.cpu_returns_freed_memory=true`" in markdown, markdown
    assert "memory plan: predicted peak per rank" in (run_dir / "train.log").read_text()


def test_diagnose_rewrites_the_report_with_plots_from_the_run_folder(run_copy) -> None:
    run_dir = run_copy
    (run_dir / "report.json").unlink()
    result = subprocess.run(
        [sys.executable, "-m", "ddptrain.diagnose", str(run_dir)], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((run_dir / "report.json").read_text())["verdict"]
    pngs = sorted(run_dir.glob("*.png"))
    assert len(pngs) >= 2, pngs
    for png in pngs:
        assert matplotlib.image.imread(png).size > 0


def test_diagnose_what_if_estimates_another_scale(run_copy) -> None:
    run_dir = run_copy
    command = [sys.executable, "-m", "ddptrain.diagnose", str(run_dir), "--what-if", "parallel.nproc_per_node=8"]
    result = subprocess.run([*command, "link=nvlink"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "What if: parallel.nproc_per_node=8 link=nvlink" in result.stdout, result.stdout
    what_if = json.loads((run_dir / "report.json").read_text())["what_if"]
    assert what_if["nproc_per_node"] == 8 and what_if["link"] == "nvlink", what_if


def test_evaluations_samples_and_save_checks_show_in_the_report_apart_from_the_steps(profiled_run) -> None:
    """Two evaluations with samples (steps 3 and 6) and the saves at the end: each part's time is in report.md; the
    saves were proven to load (a normal run passes the check: the adapter loaded in peft computes its logits)."""
    run_dir, _ = profiled_run
    records = read_metrics(run_dir)
    evals = [r for r in records if "eval_s" in r]
    checks = [r for r in records if "save_check_s" in r]
    assert [r["step"] for r in evals] == [3, 6] and all(r["samples_s"] > 0 for r in evals)
    # Each evaluation that improved saved a checkpoint, read back, and best/, its verified copy; the end saved the
    # adapter, read back and loaded in peft.
    improved = [e for i, e in enumerate(evals) if all(e["eval_loss"] < b["eval_loss"] for b in evals[:i])]
    expected = [(e["step"], ["weights"], ["best"]) for e in improved] + [(6, ["adapter"], [])]
    names = lambda r, key: [Path(f).name for f in r.get(key, [])]  # noqa: E731
    assert [(r["step"], names(r, "save_check_folders"), names(r, "save_check_copies")) for r in checks] == expected
    assert [r.get("save_check_round_trip") for r in checks][-1] and checks[-1]["save_check_max_abs_diff"] <= 1e-5
    report = (run_dir / "report.md").read_text()
    seconds = sum(r["eval_s"] for r in evals)
    assert f"| evaluation | 2 | {seconds:.2f} | {seconds / 2:.2f} |" in report
    assert "| samples (trainer.eval_prompts) | 2 |" in report and f"| save checks | {len(checks)} |" in report
