"""The sweep report: one row per job, best first, in ``report.md`` and ``report.csv``, with plots beside them.

``write_sweep_report(SWEEP_DIR)`` reads every job folder of a multirun (``<n>_<swept keys>/``: its ``job.json``,
``metrics.jsonl`` and ``config.yaml``) and writes into the sweep folder:

- ``report.csv``: one row per job: its number and folder, the overrides that tell it from the other jobs, status,
  steps, final training loss, last eval loss, the best evaluation (its step and its ``trainer.best_metric``),
  tokens/s, MFU, peak memory, exposed communication per step and its share of the step, wall time (over every
  attempt);
- ``report.md``: the same table, best first by eval loss (then by training loss; unfinished jobs after the finished
  ones, failed and unstarted jobs last),
  and below it what the table cannot say: why a job failed, which were skipped (finished by an earlier run of the
  sweep), resumed or interrupted;
- ``loss_curves.png`` (every job's training loss and, beside it, its eval loss, overlaid; over the optimizer steps
  or over the tokens trained on: ``x_axis``, ``auto`` choosing tokens when the jobs train on different numbers of
  tokens per step, as under different accumulation) and ``throughput_memory.png`` (tokens/s and peak memory per
  job, each bar labelled by the job's overrides).

It is written after every job (the Hydra callback in ``ddptrain/sweep/callback.py``), so it exists while the sweep
runs and after it was interrupted, and on demand: ``ddptrain report SWEEP_DIR``. The figures per job are
the ones the run's own diagnosis uses (``ddptrain.diagnose.runs``), so the two never disagree. No torch.
"""

from __future__ import annotations

import contextlib
import csv
import io
import itertools
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from ddptrain.cli import verb_parser
from ddptrain.diagnose.runs import DiagnoseError, RunSettings, read_metrics, summarize
from ddptrain.sweep import jobs

COLUMNS = (
    "job",
    "folder",
    "overrides",
    "status",
    "steps",
    "max_steps",
    "loss",
    "eval_loss",
    "best_step",
    "best_value",
    "tokens_per_s",
    "mfu",
    "mem_peak_gb",
    "time_comm_s",
    "comm_share",
    "wall_s",
)
CSV_FILE, MARKDOWN_FILE = "report.csv", "report.md"
LOSS_PLOT, THROUGHPUT_PLOT = "loss_curves.png", "throughput_memory.png"


def job_folders(sweep_dir: Path) -> list[Path]:
    """The job folders of a sweep, in job order: the subfolders Hydra made for a job (``.hydra/``) or that hold a
    job record."""
    found = [
        d
        for d in Path(sweep_dir).iterdir()
        if d.is_dir() and ((d / ".hydra").is_dir() or (d / jobs.JOB_FILE).is_file())
    ]
    return sorted(found, key=_job_number)


def _job_number(folder: Path) -> tuple[int, str]:
    head = folder.name.split("_", 1)[0]
    return (int(head), folder.name) if head.isdigit() else (sys.maxsize, folder.name)


def _overrides(folder: Path, record: dict[str, Any] | None) -> list[str]:
    if record is not None:
        return list(record.get("overrides", []))
    path = folder / ".hydra" / "overrides.yaml"
    return [str(o) for o in OmegaConf.load(path)] if path.is_file() else []


def _differing(all_overrides: list[list[str]]) -> list[list[str]]:
    """Each job's overrides that not every job shares: what tells the jobs apart (all of them for a lone job)."""
    if len(all_overrides) < 2:
        return all_overrides
    shared = set.intersection(*(set(o) for o in all_overrides))
    return [[o for o in overrides if o not in shared] for overrides in all_overrides]


def job_row(folder: Path, record: dict[str, Any] | None) -> dict[str, Any]:
    """One job's row (``COLUMNS``, plus ``notes``), from what its folder holds now and its record (``job.json``)."""
    status = jobs.status_of(record) or ("started" if (folder / "metrics.jsonl").exists() else "not started")
    row: dict[str, Any] = dict.fromkeys(COLUMNS)
    row |= {"job": _job_number(folder)[0], "folder": folder.name, "status": status, "notes": _notes(record, status)}
    row["curve"] = []  # (step, training loss) as logged: the loss plot's line for this job
    row["eval_curve"], row["tokens_at"] = [], []  # (step, eval loss); (step, tokens trained on so far)
    if record is not None:
        row["wall_s"] = _wall_s(record, status)
    with contextlib.suppress(DiagnoseError):  # no metrics yet: the row keeps its status and notes
        records, evals = read_metrics(folder)
        row["curve"] = [(r["step"], _finite(r.get("loss"))) for r in records]
        row["eval_curve"] = [(e["step"], _finite(e["eval_loss"])) for e in evals if "eval_loss" in e]
        row["tokens_at"] = _tokens_seen(records)
        if records:
            row |= _figures(summarize(records, evals, RunSettings.load(folder)))
    return row


def _tokens_seen(records: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(step, tokens trained on up to that step): each window's ``tokens`` added up, from (0, 0)."""
    seen, total = [(0, 0.0)], 0.0
    for r in records:
        total += _finite(r.get("tokens")) or 0.0
        seen.append((r["step"], total))
    return seen


def _at_tokens(step: float, seen: list[tuple[int, float]]) -> float:
    """The tokens trained on by ``step``: exact at a window's end, linear in between (an eval inside a window)."""
    for (s0, t0), (s1, t1) in itertools.pairwise(seen):
        if step <= s1:
            return t0 + (t1 - t0) * (step - s0) / max(s1 - s0, 1)
    return seen[-1][1]


def _wall_s(record: dict[str, Any], status: str) -> float | None:
    if status == jobs.RUNNING:  # still going: the time so far
        return float(record.get("earlier_wall_s", 0.0)) + max(0.0, time.time() - float(record["started_at"]))
    return record.get("wall_s")


def _figures(s: dict[str, Any]) -> dict[str, Any]:
    step, comm = s.get("step_time_s"), s.get("time_comm_s")
    return {
        "steps": s["last_step"],
        "max_steps": s["max_steps"],
        "loss": s["loss_last"],
        "eval_loss": s["eval_loss_last"],
        "best_step": s.get("best_step"),
        "best_value": s.get("best_value"),
        "best_metric": s.get("best_metric"),
        "tokens_per_s": s["tokens_per_s"],
        "mfu": s.get("mfu"),
        "mem_peak_gb": s.get("mem_peak_gb"),
        "time_comm_s": comm,
        "comm_share": comm / step if comm is not None and step else None,
    }


def _notes(record: dict[str, Any] | None, status: str) -> list[str]:
    if record is None:
        return []
    notes = []
    if record.get("skipped"):
        notes.append("skipped: finished in an earlier run of this sweep")
    if record.get("resumed"):
        notes.append(f"resumed from its last checkpoint (attempt {record.get('attempt')})")
    if status == jobs.FAILED and record.get("error"):
        notes.append(f"failed: {_cause(record['error'])} (the whole error: {jobs.JOB_FILE})")
    if status == jobs.INTERRUPTED:
        notes.append("interrupted: its process is gone; run the same sweep again to resume it")
    return notes


def _cause(error: str) -> str:
    """The line of an error that says what went wrong: a failed rank's line from the self-launcher's summary
    (``rank 0 (exit code 1): ValueError: ...``), else the last line."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    ranks = [line for line in lines if re.match(r"rank \d+ \(exit code", line)]
    return (ranks or lines or [""])[0 if ranks else -1]


def _rank_key(row: dict[str, Any]) -> tuple:
    """Best first: finished jobs by the best eval loss they reached (their best/ adapter's), then by training loss;
    then the unfinished ones (running, stopped, interrupted) the same way on what they logged so far; failed and
    unstarted jobs last, in job order."""
    reached = [loss for _, loss in row["eval_curve"] if loss is not None]
    eval_loss, loss = (min(reached) if reached else _finite(row["eval_loss"])), _finite(row["loss"])
    unusable = row["status"] == jobs.FAILED or (eval_loss is None and loss is None)
    return (
        unusable,
        row["status"] != jobs.FINISHED,
        eval_loss is None,
        eval_loss if eval_loss is not None else (loss if loss is not None else 0.0),
        row["job"],
    )


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def sweep_rows(sweep_dir: Path) -> list[dict[str, Any]]:
    """Every job's row, best first, ``overrides`` narrowed to what differs between the jobs."""
    folders = job_folders(sweep_dir)
    records = [jobs.read_record(f) for f in folders]  # read once: a running job may rewrite it meanwhile
    rows = [job_row(f, r) for f, r in zip(folders, records)]
    for row, differing in zip(rows, _differing([_overrides(f, r) for f, r in zip(folders, records)])):
        row["overrides"] = " ".join(differing)
    return sorted(rows, key=_rank_key)


def write_sweep_report(sweep_dir: Path, plots: bool = True, x_axis: str = "auto") -> list[dict[str, Any]]:
    """Write report.csv, report.md and (``plots``) the PNGs into the sweep folder; returns the rows, best first.
    ``x_axis``: the loss curves over ``steps``, ``tokens`` trained on, or ``auto`` (tokens where the jobs' tokens per
    step differ).

    Raises:
        FileNotFoundError: ``sweep_dir`` is not a folder, or is a training run's (its report.md stays).
    """
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise FileNotFoundError(f"{sweep_dir} is not a folder: pass a sweep folder (outputs/multirun/<date>_<time>).")
    if (sweep_dir / "metrics.jsonl").is_file():  # its report.md is the run report: not to be written over
        raise FileNotFoundError(
            f"{sweep_dir} is a training run, not a sweep: its report is `ddptrain diagnose {sweep_dir}` (report.md "
            "there). ddptrain report reads a sweep folder (outputs/multirun/<date>_<time>)."
        )
    rows = sweep_rows(sweep_dir)
    written = _plot(sweep_dir, rows, x_axis) if plots and rows else []
    _write_atomically(sweep_dir / CSV_FILE, _csv(rows))
    _write_atomically(sweep_dir / MARKDOWN_FILE, render_markdown(sweep_dir, rows, written))
    return rows


def _write_atomically(path: Path, text: str) -> None:
    with jobs.replaced_atomically(path) as partial:
        partial.write_text(text)


def _csv(rows: list[dict[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _csv_value(row[k]) for k in COLUMNS})
    return out.getvalue()


def _csv_value(value: Any) -> Any:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "" if value is None else value


def _cell(value: Any, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def _best_cell(row: dict[str, Any]) -> str:
    if row.get("best_step") is None or row.get("best_value") is None:
        return "–"
    return f"{row['best_value']:.4f} ({row['best_step']})"


def render_markdown(sweep_dir: Path, rows: list[dict[str, Any]], plots: list[str]) -> str:
    """The sweep report as markdown: the table best first, then the notes and the plots."""
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    lines = [
        f"# Sweep report: {sweep_dir}",
        "",
        f"{len(rows)} jobs" + "".join(f", {n} {status}" for status, n in sorted(counts.items())) + ".",
        "Best first by the best eval loss each job reached (then by training loss). 'best' is the job's best evaluation"
        " by trainer.best_metric"
        " and the step of the adapter in its best/ folder. Time in communication is the all-reduce time left exposed"
        " per optimizer step (trainer.timing=true).",
        "",
        "| rank | job | overrides | status | steps | loss | eval loss | best (step) | tokens/s | MFU | peak mem GiB |"
        " comm s/step | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for place, row in enumerate(rows, 1):
        steps = "–" if row["steps"] is None else f"{row['steps']}/{row['max_steps'] or '?'}"
        comm = _cell(row["time_comm_s"], ".3f")
        if row["comm_share"] is not None:
            comm += f" ({row['comm_share']:.0%})"
        lines.append(
            f"| {place} | {row['job']} | {row['overrides'] or '–'} | {row['status']} | {steps}"
            f" | {_cell(row['loss'], '.4f')}"
            f" | {_cell(row['eval_loss'], '.4f')} | {_best_cell(row)} | {_cell(row['tokens_per_s'], ',.0f')}"
            f" | {_cell(row['mfu'], '.1%')}"
            f" | {_cell(row['mem_peak_gb'], '.2f')} | {comm} | {_cell(row['wall_s'], '.0f')} |"
        )
    notes = [f"- job {row['job']} (`{row['folder']}`): {note}" for row in rows for note in row["notes"]]
    if notes:
        lines += ["", "## Notes", "", *notes]
    if plots:
        lines += ["", "## Plots", "", *(f"![{name}]({name})" for name in plots)]
    return "\n".join(lines) + "\n"


X_AXES = ("auto", "steps", "tokens")


def _plot(sweep_dir: Path, rows: list[dict[str, Any]], x_axis: str = "auto") -> list[str]:
    """loss_curves.png and throughput_memory.png; matplotlib's Agg canvas, no pyplot state."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    in_job_order = sorted(rows, key=lambda r: r["job"])
    labels = [r["overrides"] or r["folder"] for r in in_job_order]
    by_tokens = x_axis == "tokens" or (x_axis == "auto" and _tokens_per_step_differ(in_job_order))

    curves = Figure(figsize=(11, 4), layout="constrained")
    FigureCanvasAgg(curves)
    train_ax, eval_ax = curves.subplots(1, 2, sharex=True)
    for row, label in zip(in_job_order, labels):
        for ax, curve in ((train_ax, row["curve"]), (eval_ax, row["eval_curve"])):
            if curve:
                steps, losses = zip(*curve)
                xs = [_at_tokens(step, row["tokens_at"]) for step in steps] if by_tokens else steps
                ax.plot(xs, losses, marker=".", label=f"{row['job']}: {label}")
    for ax, name in ((train_ax, "training loss"), (eval_ax, "eval loss")):
        ax.set_xlabel("tokens trained on (all ranks)" if by_tokens else "optimizer step")
        ax.set_ylabel(name)
    if train_ax.lines or eval_ax.lines:
        (eval_ax if eval_ax.lines else train_ax).legend(fontsize="small")
    _save(curves, sweep_dir / LOSS_PLOT)

    bars = Figure(figsize=(8, 5), layout="constrained")
    FigureCanvasAgg(bars)
    speed_ax, memory_ax = bars.subplots(2, 1, sharex=True)
    places = list(range(len(in_job_order)))
    speed_ax.bar(places, [r["tokens_per_s"] or 0.0 for r in in_job_order], color="tab:green")
    speed_ax.set_ylabel("tokens/s (all ranks)")
    memory_ax.bar(places, [r["mem_peak_gb"] or 0.0 for r in in_job_order], color="tab:purple")
    memory_ax.set_ylabel("peak memory GiB (max rank)")
    memory_ax.set_xticks(places, labels, rotation=20, ha="right", fontsize="small")
    _save(bars, sweep_dir / THROUGHPUT_PLOT)
    return [LOSS_PLOT, THROUGHPUT_PLOT]


def _tokens_per_step_differ(rows: list[dict[str, Any]]) -> bool:
    """Whether the jobs train on different numbers of tokens per optimizer step (more than 5% apart): then a step
    of one job is not a step of another, and the curves compare over tokens."""
    per_step = [seen[-1][1] / seen[-1][0] for r in rows if (seen := r["tokens_at"]) and seen[-1][0] > 0]
    return len(per_step) > 1 and max(per_step) > 1.05 * min(per_step)


def _save(figure: Any, path: Path) -> None:
    with jobs.replaced_atomically(path) as partial:  # keeps the suffix: matplotlib picks the format from it
        figure.savefig(partial, dpi=100)


def console_lines(sweep_dir: Path, rows: list[dict[str, Any]], top: int = 3) -> str:
    """The end of a sweep on the console: where the report is, the best jobs, the failed ones."""
    lines = [f"Sweep report ({Path(sweep_dir) / MARKDOWN_FILE}): {len(rows)} jobs"]
    for place, row in enumerate(rows[:top], 1):
        lines.append(
            f"  {place}. job {row['job']} {row['overrides'] or ''}: {row['status']}, loss {_cell(row['loss'], '.4f')},"
            f" eval loss {_cell(row['eval_loss'], '.4f')}, best {_best_cell(row)},"
            f" {_cell(row['tokens_per_s'], ',.0f')} tokens/s"
        )
    failed = [r for r in rows if r["status"] == jobs.FAILED]
    if failed:
        named = ", ".join(f"job {r['job']} ({r['folder']})" for r in failed)
        lines.append(f"  failed: {named}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``ddptrain report SWEEP_DIR [--no-plots]``."""
    parser = verb_parser("report", "A sweep's report is also rewritten as each of its jobs ends.")
    parser.add_argument("sweep_dir", type=Path, help="the sweep folder (outputs/multirun/<date>_<time>)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument(
        "--x-axis",
        choices=X_AXES,
        default="auto",
        help="the loss curves over optimizer steps, tokens trained on, or auto (tokens when the jobs' tokens per "
        "step differ, as under different accumulation)",
    )
    args = parser.parse_args(argv)
    try:
        rows = write_sweep_report(args.sweep_dir, plots=not args.no_plots, x_axis=args.x_axis)
    except FileNotFoundError as err:
        print(f"ddptrain.report: {err}", file=sys.stderr)
        return 2
    if not rows:
        print(
            f"ddptrain.report: {args.sweep_dir} holds no job folder (<n>_<keys>/ with .hydra/ or job.json)",
            file=sys.stderr,
        )
        return 2
    print(console_lines(args.sweep_dir, rows))
    return 0
