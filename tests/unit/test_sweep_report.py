"""The sweep report from job folders: one row per job, best first, failures and skips said, CSV and plots."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from PIL import Image

from ddptrain.sweep import jobs
from ddptrain.sweep.report import COLUMNS, main, write_sweep_report

SHARED = ["trainer.max_steps=4", "trainer.progress_bar=False"]


def make_job(sweep: Path, num: int, lr: str, status: str, loss: float | None, eval_loss: float | None, **extra) -> Path:
    folder = sweep / f"{num}_optim.lr={lr}"
    (folder / ".hydra").mkdir(parents=True)
    record = {"num": num, "overrides": [f"optim.lr={lr}", *SHARED], "status": status, "wall_s": 10.0 + num, **extra}
    record.setdefault("host", "elsewhere")  # not this machine: a running record stays running
    jobs.write_record(folder, record)
    if loss is not None:
        lines = [
            {
                "step": 2,
                "loss": loss + 1,
                "tokens": 1000,
                "tokens_per_s": 100.0 * (num + 1),
                "window_steps": 2,
                "mem_peak_gb": 1.0,
            },
            {
                "step": 4,
                "loss": loss,
                "tokens": 1000,
                "tokens_per_s": 200.0 * (num + 1),
                "window_steps": 2,
                "mem_peak_gb": 1.5 + num,
            },
        ]
        if eval_loss is not None:
            lines.append({"step": 4, "eval_loss": eval_loss, "eval_tokens": 10})
        (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder


def test_rows_best_first_with_the_overrides_that_differ(tmp_path) -> None:
    make_job(tmp_path, 0, "0.001", "finished", loss=2.0, eval_loss=1.9)
    make_job(tmp_path, 1, "0.002", "finished", loss=1.5, eval_loss=1.4, skipped=True)
    make_job(
        tmp_path,
        2,
        "0.003",
        "failed",
        loss=None,
        eval_loss=None,
        error="ddptrain: training failed:\n"
        "  rank 1 (exit code 1): ValueError: bad row\n  The traceback of each failed rank is printed above.",
    )
    make_job(tmp_path, 3, "0.004", "running", loss=3.0, eval_loss=None, started_at=0.0)
    rows = write_sweep_report(tmp_path)
    assert [r["job"] for r in rows] == [1, 0, 3, 2], "eval loss, then training loss only, then the failure"
    assert [r["overrides"] for r in rows] == ["optim.lr=0.002", "optim.lr=0.001", "optim.lr=0.004", "optim.lr=0.003"]
    assert [r["status"] for r in rows] == ["finished", "finished", "running", "failed"]
    best = rows[0]
    # The figures are the ones the job logged: last loss, last eval loss, steady tokens/s, the highest peak.
    assert (best["loss"], best["eval_loss"], best["tokens_per_s"], best["mem_peak_gb"]) == (1.5, 1.4, 400.0, 2.5)
    assert (best["steps"], best["wall_s"]) == (4, 11.0)

    with (tmp_path / "report.csv").open() as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == list(COLUMNS) and len(table) == 4
    assert [t["job"] for t in table] == ["1", "0", "3", "2"] and table[3]["status"] == "failed"

    markdown = (tmp_path / "report.md").read_text()
    assert markdown.count("\n| ") == 5, "a header and 4 rows"
    assert "job 1 (`1_optim.lr=0.002`): skipped: finished in an earlier run" in markdown
    assert "job 2 (`2_optim.lr=0.003`): failed: rank 1 (exit code 1): ValueError: bad row" in markdown
    for name in ("loss_curves.png", "throughput_memory.png"):
        with Image.open(tmp_path / name) as image:
            image.verify()
            assert image.format == "PNG" and image.size[0] > 100
        assert f"({name})" in markdown


def test_an_interrupted_job_and_one_not_started(tmp_path) -> None:
    gone = 2**22 + 17  # above the default pid_max: no such process
    make_job(tmp_path, 0, "0.001", "running", loss=2.0, eval_loss=None, host=jobs.socket.gethostname(), pid=gone)
    (tmp_path / "1_optim.lr=0.002" / ".hydra").mkdir(parents=True)
    rows = write_sweep_report(tmp_path, plots=False)
    assert [(r["job"], r["status"]) for r in rows] == [(0, "interrupted"), (1, "not started")]
    assert "run the same sweep again to resume it" in (tmp_path / "report.md").read_text()
    assert not (tmp_path / "loss_curves.png").exists()


def test_the_command_writes_the_same_report(tmp_path, capsys) -> None:
    make_job(tmp_path, 0, "0.001", "finished", loss=2.0, eval_loss=1.9)
    make_job(tmp_path, 1, "0.002", "finished", loss=1.5, eval_loss=1.4)
    write_sweep_report(tmp_path)
    written = {name: (tmp_path / name).read_text() for name in ("report.csv", "report.md")}
    for name in written:
        (tmp_path / name).unlink()
    assert main([str(tmp_path)]) == 0
    assert {name: (tmp_path / name).read_text() for name in written} == written
    assert "1. job 1 optim.lr=0.002: finished, loss 1.5000, eval loss 1.4000" in capsys.readouterr().out
    assert main([str(tmp_path / "nowhere")]) == 2


def job_with_evals(sweep: Path, num: int, accum: int, eval_losses: list[float]) -> None:
    """A job of ``optim.grad_accum_steps=accum``: ``accum`` times the tokens per step, an eval every 2 steps."""
    folder = sweep / f"{num}_optim.grad_accum_steps={accum}"
    (folder / ".hydra").mkdir(parents=True)
    jobs.write_record(folder, {"num": num, "overrides": [f"optim.grad_accum_steps={accum}"], "status": "finished"})
    lines = []
    for i, eval_loss in enumerate(eval_losses, 1):
        step = 2 * i
        lines.append(
            {"step": step, "loss": 3.0 - i / 10, "tokens": 2000 * accum, "window_steps": 2, "tokens_per_s": 1e3}
        )
        lines.append({"step": step, "eval_loss": eval_loss, "eval_tokens": 10})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_the_report_compares_eval_curves_over_tokens_names_each_best_and_labels_bars_by_overrides(
    tmp_path, monkeypatch
) -> None:
    job_with_evals(tmp_path, 0, accum=1, eval_losses=[2.5, 2.2, 2.4])
    job_with_evals(tmp_path, 1, accum=4, eval_losses=[2.3, 2.1, 2.0])
    drawn = {}

    def keep(figure, path):  # the figures as drawn, instead of their PNGs
        drawn[path.name] = figure

    monkeypatch.setattr("ddptrain.sweep.report._save", keep)
    rows = write_sweep_report(tmp_path)
    assert [(r["job"], r["best_step"], r["best_value"]) for r in rows] == [(1, 6, 2.0), (0, 4, 2.2)]
    assert "| 2.2000 (4) |" in (tmp_path / "report.md").read_text()
    train_ax, eval_ax = drawn["loss_curves.png"].axes
    assert eval_ax.get_ylabel() == "eval loss" and train_ax.get_xlabel().startswith("tokens trained on")
    # Over tokens: job 1 trains 4x the tokens per step, so its eval at step 6 sits at 4x job 0's.
    ends = {line.get_label(): line.get_xdata()[-1] for line in eval_ax.lines}
    assert ends == {"0: optim.grad_accum_steps=1": 6000, "1: optim.grad_accum_steps=4": 24000}
    bars = drawn["throughput_memory.png"].axes[1]
    assert [t.get_text() for t in bars.get_xticklabels()] == ["optim.grad_accum_steps=1", "optim.grad_accum_steps=4"]
    write_sweep_report(tmp_path, x_axis="steps")
    assert drawn["loss_curves.png"].axes[1].lines[0].get_xdata()[-1] == 6


def test_a_training_run_folder_is_refused_and_its_run_report_kept(tmp_path, capsys) -> None:
    """``ddptrain report`` pointed at one run's folder (``ddptrain diagnose`` writes that run's report.md): it exits 2
    naming the verb that reports a run, and writes nothing over the run's report."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    (tmp_path / "report.md").write_text("# Run report\n")
    assert main([str(tmp_path)]) == 2
    assert f"is a training run, not a sweep: its report is `ddptrain diagnose {tmp_path}`" in capsys.readouterr().err
    assert (tmp_path / "report.md").read_text() == "# Run report\n" and not (tmp_path / "report.csv").exists()
