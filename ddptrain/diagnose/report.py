"""The report as data: ``build_report`` reads a run folder, summarizes it, applies the verdict rules and picks the
levers, and returns the verdict with its headline, findings, levers, predictions, per-rank table, summary,
thresholds and the notes a reader should know before trusting the figures.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ddptrain.config import DiagnoseConfig
from ddptrain.diagnose.levers import choose_levers, predict
from ddptrain.diagnose.rules import apply_rules
from ddptrain.diagnose.runs import (
    DiagnoseError,
    RunSettings,
    divergence,
    log_tail,
    measure_balance,
    measure_split,
    outside_the_steps,
    per_rank,
    read_metrics,
    steady_windows,
    summarize,
    timed_windows,
    weighted_mean,
)

# ----------------------------------------------------------------------------- the report


def build_report(run_dir: Path) -> dict:
    """The diagnosis of a run folder, as data.

    Args:
        run_dir: a run folder with ``metrics.jsonl`` (and ``config.yaml``; without it the schema's defaults stand).

    Returns:
        ``verdict`` (one of VERDICTS, or None when timing was off), ``headline``, ``findings`` (each rule that fired,
        verdict first, with its numbers), ``levers`` (ordered; ``key``, ``value``, ``set``, ``why`` and, when it
        follows from the measurements, ``predicted_step_time_s``, ``predicted_tokens_per_s``, ``gain``),
        ``predictions``, ``by_rank``, ``summary``, ``thresholds`` and ``notes``.

    Raises:
        DiagnoseError: no run folder, no metrics.jsonl, or no training record in it (the run stopped before its
            first log line).
    """
    run_dir = Path(run_dir)
    records, evals = read_metrics(run_dir)
    settings = RunSettings.load(run_dir)
    if not records:
        every = settings["trainer.log_every_n_steps"]
        raise DiagnoseError(
            f"{run_dir}/metrics.jsonl has no training record: the run stopped before its first log line "
            f"(trainer.log_every_n_steps={every}). Nothing to diagnose.{log_tail(run_dir)}"
        )
    summary = summarize(records, evals, settings) | preference_summary(records, evals)
    summary["outside"] = outside_the_steps(run_dir, evals)
    by_rank = per_rank(records)
    timed = steady_windows(timed_windows(records))
    summary["rank_time_imbalance_logged"] = weighted_mean(timed, "rank_time_imbalance")
    summary["slowest_rank_logged"] = _mode(r.get("slowest_rank") for r in timed)
    measure_balance(summary, by_rank)
    summary["split"] = measure_split(summary, by_rank)
    th = settings.thresholds()
    findings = apply_rules(summary, by_rank, th)
    levers = choose_levers(findings, summary, by_rank, settings, th)
    diverged = divergence(run_dir)
    if diverged is not None:  # whatever its speed, a run that diverged is first of all that: its levers alone
        findings, levers = [_diverged_finding(diverged), *findings], diverged["levers"]
    verdict = findings[0]["verdict"] if findings else None
    return {
        "run_dir": str(run_dir),
        "verdict": verdict,
        "headline": _headline(verdict, findings, summary),
        "findings": findings,
        "levers": levers,
        "predictions": predict(levers, summary, settings),
        "by_rank": by_rank,
        "summary": summary,
        "thresholds": asdict(th),
        "notes": _notes(summary, th),
    }


def _diverged_finding(record: dict) -> dict:
    """The finding of a run that stopped on a non-finite loss or gradient norm (``observe.nonfinite``)."""
    what = "the loss" if record["first_nonfinite"] == "loss" else "the gradient norm"
    ranks = record["nonfinite_loss_ranks"]
    where = f" on rank(s) {', '.join(map(str, ranks))}" if ranks else ""
    why = f"{what} was NaN or infinite at step {record['step']}{where}, and the run stopped there"
    rule = f"a step's gradient norm was not finite, and trainer.on_nonfinite={record['on_nonfinite']} stops the run"
    return {"verdict": "diverged", "lost_s": None, "share": None, "rule": rule, "why": why, "evidence": record}


def _mode(values: Any) -> Any:
    counted = Counter(v for v in values if v is not None)
    return counted.most_common(1)[0][0] if counted else None


def _headline(verdict: str | None, findings: list[dict], s: dict) -> str:
    if verdict is None:
        return "No verdict: trainer.timing was off, so the run logged no time split (loss and tokens/s only)."
    if verdict == "diverged":
        return f"diverged: {findings[0]['why']}."
    return f"{verdict}-bound: {findings[0]['why']}."


def _notes(s: dict, th: DiagnoseConfig) -> list[str]:
    """What the reader should know before trusting the figures."""
    notes = []
    if s["stopped_early"]:
        notes.append(
            f"The run stopped at step {s['last_step']} of {s['max_steps']} (stopped or crashed); the figures cover "
            f"its {s['windows']} window(s)."
        )
    if s["windows"] == 1:
        notes.append("One log window only: it includes warm-up, so the times are pessimistic.")
    elif s["windows"] == s["processes"]:
        notes.append(
            f"Each of the run's {s['processes']} processes logged one window only: every window includes warm-up, "
            "so the times are pessimistic."
        )
    if s["processes"] > 1:
        notes.append(
            f"The run was restarted {s['processes'] - 1} time(s) (metrics.jsonl is appended to): where a later "
            "process logged steps again, its records replace the earlier ones, and the first window of each process "
            "is left out as warm-up."
        )
    planned, measured = s.get("rank_imbalance"), s.get("rank_time_imbalance")
    if planned and planned >= th.rank_time_imbalance and (measured is None or measured < th.rank_time_imbalance):
        notes.append(
            f"The plan gives the busiest rank {planned:.2f}× the mean tokens per micro-step, but no rank is slow on "
            "average: which rank waits changes from step to step, and the waiting counts as exposed communication "
            "(data.batching=token_budget balances it)."
        )
    if s["device"] == "cpu" and s.get("timing"):
        notes.append(
            "CPU run: memory is each process's peak resident memory, and there is no MFU without trainer.peak_tflops."
        )
    return notes


def preference_summary(records: list[dict], evals: list[dict]) -> dict[str, Any]:
    """objective=dpo: the share of pairs won and the reward margin at the first and the last log window, and the last
    evaluation's share of held-out pairs won (``rewards_*``: nothing for a run that logs none)."""
    windows = [r for r in records if r.get("rewards_accuracy") is not None]
    if not windows:
        return {}
    scored = [e["eval_rewards_accuracy"] for e in evals if e.get("eval_rewards_accuracy") is not None]
    return {
        "rewards_accuracy": (windows[0]["rewards_accuracy"], windows[-1]["rewards_accuracy"]),
        "rewards_margin": (windows[0]["rewards_margin"], windows[-1]["rewards_margin"]),
        "eval_rewards_accuracy_last": scored[-1] if scored else None,
    }
