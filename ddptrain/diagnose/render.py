"""Writing the report: ``write_report`` puts report.md (``render_markdown``), report.json and the PNG plots into
the run folder; ``console_summary`` is the short version printed at the end of a run and ``format_what_if`` the
what-if's table. matplotlib is imported only when a plot is drawn.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ddptrain.diagnose.report import build_report
from ddptrain.diagnose.runs import MIB, RANK_COLUMNS, TIME_COLUMNS, as_number, read_metrics

# ----------------------------------------------------------------------------- writing: markdown, JSON, plots


def write_report(run_dir: Path, plots: bool = True) -> dict:
    """Write ``report.md``, ``report.json`` and (``plots=True``) the PNG plots into the run folder.

    Args:
        run_dir: the run folder.
        plots: also draw loss_throughput.png and time_by_rank.png (matplotlib, Agg backend).

    Returns:
        The report (build_report's dict), with ``plots``: the PNG file names written.

    Raises:
        DiagnoseError: nothing to diagnose (see build_report).
    """
    run_dir = Path(run_dir)
    report = build_report(run_dir)
    report["plots"] = _plot(run_dir, report) if plots else []
    write_files(run_dir, report)
    return report


def write_files(run_dir: Path, report: dict) -> None:
    """Write ``report.json`` and ``report.md`` of ``report`` into ``run_dir`` (again after the what-if is added)."""
    (run_dir / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (run_dir / "report.md").write_text(render_markdown(report))


def _f(value: Any, fmt: str = ".3f", none: str = "–") -> str:
    return none if value is None else format(value, fmt)


def _lever_line(i: int, lever: dict) -> str:
    predicted = lever.get("predicted_tokens_per_s")
    effect = (
        f" → ~{predicted:,.0f} tokens/s ({lever['gain']:+.0%}), step {lever['predicted_step_time_s']:.3f} s"
        if predicted is not None
        else ""
    )
    return f"{i}. `{lever['set']}`{effect}: {lever['why'].rstrip('.')}."


def _rank_table(report: dict) -> list[str]:
    head = (
        "| rank | step s | data s | compute s | comm s | optimizer s | other s | busy s | mem peak GiB | reserved GiB "
        "| predicted GiB |"
    )
    lines = [head, "|" + "---:|" * 11]
    for r in report["by_rank"]:
        cells = (
            [str(r["rank"])]
            + [_f(r.get(c)) for c in RANK_COLUMNS]
            + [_f(r.get(m), ".2f") for m in ("mem_peak_gb", "mem_reserved_gb", "mem_predicted_gb")]
        )
        lines.append("| " + " | ".join(cells) + " |")
    return lines if report["by_rank"] else ["No per-rank figures were logged."]


def _split_table(s: dict) -> list[str]:
    step = s.get("step_time_s")
    if step is None:
        return ["Timing was off (`trainer.timing=false`): no time split, FLOP/s or memory were logged."]
    lines = ["| part | s per step | share |", "|---|---:|---:|"]
    for column in TIME_COLUMNS:
        value = s.get(column) or 0.0
        lines.append(f"| {column.removeprefix('time_').removesuffix('_s')} | {value:.4f} | {value / step:.0%} |")
    return [*lines, f"| **step** | **{step:.4f}** | |"]


def render_markdown(report: dict) -> str:
    """report.md: the verdict, the numbers, the levers with predictions, the per-rank table and how to read it."""
    s = report["summary"]
    lines = [f"# Run report: verdict `{report['verdict'] or 'none'}`", "", f"**{report['headline']}**", ""]
    lines += [f"Rule: {f['rule']}." for f in report["findings"][:1]] + [""]
    lines += ["## Numbers", "", *_numbers(s), "", "## Where a step's time goes", "", *_split_table(s), ""]
    lines += ["## Outside the steps", "", *_outside_table(s), ""]
    lines += ["## Levers, by expected gain", ""]
    lines += [_lever_line(i, lv) for i, lv in enumerate(report["levers"], 1)] or ["None."]
    lines += ["", "## Predictions", "", "| change | step s | tokens/s |", "|---|---:|---:|"]
    lines += [f"| `{p['change']}` | {p['step_time_s']:.3f} | {p['tokens_per_s']:,.0f} |" for p in report["predictions"]]
    lines += ["", "## Per rank", "", *_rank_table(report), "", "## Balance", "", *_balance_lines(s), ""]
    if len(report["findings"]) > 1:
        lines += (
            ["## Other findings", ""]
            + [f"- **{f['verdict']}**: {f['why']} ({f['rule']})." for f in report["findings"][1:]]
            + [""]
        )
    if report.get("what_if"):
        lines += ["## What if", "", *report["what_if"]["explanation"], ""]
    lines += [f"![{name}]({name})" for name in report.get("plots", [])]
    lines += ["", "## Notes", ""] + [f"- {n}" for n in report["notes"]] if report["notes"] else []
    return "\n".join([*lines, "", "## How to read this", "", HOW_TO_READ, ""])


def _numbers(s: dict) -> list[str]:
    mfu = f"{s['mfu']:.1%} of {s['peak_tflops']:.0f} TFLOP/s" if s.get("mfu") is not None else "– (no peak known)"
    return [
        f"- tokens/s: {_f(s['tokens_per_s'], ',.0f')} over steps {s['first_step']}–{s['last_step']} "
        f"({s['windows_used']} of {s['windows']} window(s) used: {_warm_up_text(s.get('processes') or 1)})",
        f"- tokens per optimizer step: {_f(s['tokens_per_step'], ',.0f')}; {s['world_size']} rank(s), "
        f"optim.grad_accum_steps={s['grad_accum_steps']}",
        f"- step time: {_f(s.get('step_time_s'))} s; TFLOP/s per rank: {_f(s.get('tflops'), '.3g')}; MFU: {mfu}",
        f"- memory peak: {_f(s.get('mem_peak_gb'), '.2f')} GiB of {_f(s.get('mem_total_gb'), '.1f', 'n/a')}"
        + _predicted_text(s)
        + f"; allocator retries: {_f(s.get('alloc_retries'), 'd')}",
        _comm_text(s),
        f"- loss: {_f(s['loss_first'], '.4f')} → {_f(s['loss_last'], '.4f')}"
        + (f"; eval loss {s['eval_loss_last']:.4f}" if s.get("eval_loss_last") is not None else "")
        + _best_text(s),
        *_rewards_text(s),
    ]


def _rewards_text(s: dict) -> list[str]:
    """objective=dpo: the pairs won and the reward margin, first log window to last, and the held-out pairs won."""
    if "rewards_accuracy" not in s:
        return []
    (won_first, won_last), (margin_first, margin_last) = s["rewards_accuracy"], s["rewards_margin"]
    held_out = s.get("eval_rewards_accuracy_last")
    return [
        f"- rewards (objective=dpo): pairs won {won_first:.1%} → {won_last:.1%}, margin {margin_first:.3f} → "
        f"{margin_last:.3f}" + (f"; held-out pairs won {held_out:.1%}" if held_out is not None else "")
    ]


def _comm_text(s: dict) -> str:
    """What the gradient synchronisation sent per step and rank: DDP's all-reduce, or FSDP2's collectives."""
    if s.get("strategy") != "fsdp2":
        return (
            f"- all-reduce per step and rank: {_f((s.get('allreduce_bytes_per_step') or 0) / MIB, '.2f')} MiB in "
            f"{_f(s.get('allreduce_calls_per_step'), '.1f')} call(s)"
        )
    parts = [
        f"{name} {_f((s.get(f'{op}_bytes_per_step') or 0) / MIB, '.2f')} MiB in "
        f"{_f(s.get(f'{op}_calls_per_step'), '.1f')} call(s)"
        for name, op in (("all-gather", "allgather"), ("reduce-scatter", "reducescatter"))
    ]
    # FSDP2 waits for its all-gathers inside the forward and backward: the step clock books that wait as compute.
    return f"- fsdp2 per step and rank: {'; '.join(parts)} (the all-gathers' wait is in the compute column)"


def _best_text(s: dict) -> str:
    """The best evaluation (trainer.best_metric), whose adapter ``<run>/best/`` holds (trainer.keep_best_n)."""
    if s.get("best_step") is None:
        return ""
    where = "its adapter: `best/`" if s.get("best_kept") else "not kept: trainer.keep_best_n=0"
    return f"; best {s['best_metric']} {s['best_value']:.4f} at step {s['best_step']} ({where})"


def _outside_table(s: dict) -> list[str]:
    """Time spent between the steps, by part: evaluating, generating samples, checking saved adapters."""
    outside = s.get("outside") or {}
    parts = (("evaluation", "eval"), ("samples (trainer.eval_prompts)", "samples"), ("save checks", "save_check"))
    rows = [(name, outside.get(f"{key}_count", 0), outside.get(f"{key}_s", 0.0)) for name, key in parts]
    if not any(count for _, count, _ in rows):
        return ["Nothing was evaluated, sampled or checked."]
    lines = ["| part | times | s in all | s each |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {n} | {sec:.2f} | {sec / n:.2f} |" for name, n, sec in rows if n]
    return lines


def _predicted_text(s: dict) -> str:
    """The memory plan's prediction beside the measured peak (runs that planned at start), and what each holds: the
    prediction the training step's peak, the measured peak the run's up to its last logged step."""
    if s.get("mem_predicted_gb") is None:
        return ""
    device = f" of {s['mem_plan_device_gb']:.1f}" if s.get("mem_plan_device_gb") else ""
    kept = (
        "; glibc's freed blocks kept for reuse too, which the plan leaves out (`plan.cpu_returns_freed_memory=true` "
        "hands them back, steps slower)"
        if s.get("mem_plan_freed_kept")
        else ""
    )
    return (
        f" (predicted before the start: {s['mem_predicted_gb']:.2f} GiB{device} for the training step, "
        "`ddptrain plan`; the peak measured is the run's up to its last logged step, the weights' loading "
        f"and any evaluation or save check before it included{kept})"
    )


def _warm_up_text(processes: int) -> str:
    if processes == 1:
        return "the first holds warm-up"
    return f"the run was restarted: the first of each of its {processes} processes holds warm-up"


def _balance_lines(s: dict) -> list[str]:
    return [
        f"- planned (rank_imbalance, from the batch plan): {_f(s.get('rank_imbalance'), '.2f')}",
        f"- measured (rank_time_imbalance, busy time): {_f(s.get('rank_time_imbalance'), '.2f')}, "
        f"slowest rank: {s.get('slowest_rank', '–')}",
    ]


HOW_TO_READ = """\
Times are seconds per optimizer step, averaged over the log windows (weighted by their steps, each process's
first window left out when there are others: the run's first, and the first after each restart). *data* is waiting
on the loader, *compute* forward and backward, *comm* the all-reduce that backward did not hide, *optimizer*
clip/step/zero_grad, *other* the rest. *busy* is a rank's step minus its exposed comm: a rank busier than the others
makes them wait inside the all-reduce.
The verdict is the rule that loses the most time per step among those over their threshold (`trainer.diagnose.*`);
memory comes first whenever it fires. Predictions assume the measured parts scale as described in
docs/diagnostics.md (per micro-batch: data and compute; per optimizer step: exposed comm, optimizer, other).
Check a prediction by running the lever: they are estimates, not promises."""


def _plot(run_dir: Path, report: dict) -> list[str]:
    """Draw the PNGs; returns their file names. matplotlib's Agg canvas is used directly (no pyplot state)."""
    records, evals = read_metrics(run_dir)
    written = [_plot_loss_throughput(run_dir / "loss_throughput.png", records, evals)]
    if report["by_rank"] and any("busy_s" in r for r in report["by_rank"]):
        written.append(_plot_time_by_rank(run_dir / "time_by_rank.png", report["by_rank"]))
    return written


def _figure(rows: int) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 2.8 * rows), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _plot_loss_throughput(path: Path, records: list[dict], evals: list[dict]) -> str:
    figure = _figure(2)
    loss_ax, speed_ax = figure.subplots(2, 1, sharex=True)
    steps = [r["step"] for r in records]
    loss_ax.plot(steps, [as_number(r.get("loss")) for r in records], marker=".", label="train loss")
    if evals:
        loss_ax.plot([e["step"] for e in evals], [as_number(e.get("eval_loss")) for e in evals], "o", label="eval loss")
    loss_ax.set_ylabel("loss")
    loss_ax.legend()
    speed_ax.plot(steps, [as_number(r.get("tokens_per_s")) for r in records], marker=".", color="tab:green")
    speed_ax.set_ylabel("tokens/s (all ranks)")
    speed_ax.set_xlabel("optimizer step")
    figure.savefig(path, dpi=100)
    return path.name


def _plot_time_by_rank(path: Path, by_rank: list[dict]) -> str:
    figure = _figure(1)
    ax = figure.subplots()
    ranks = [str(r["rank"]) for r in by_rank]
    bottom = [0.0] * len(by_rank)
    for column in TIME_COLUMNS:
        heights = [r.get(column, 0.0) for r in by_rank]
        ax.bar(ranks, heights, bottom=bottom, label=column.removeprefix("time_").removesuffix("_s"))
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xlabel("rank")
    ax.set_ylabel("seconds per optimizer step")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.savefig(path, dpi=100)
    return path.name


# ----------------------------------------------------------------------------- console


def console_summary(report: dict) -> str:
    """The short version for the console at the end of a run: throughput, MFU, time per rank, memory, balance, the
    verdict with its numbers and the top levers."""
    s = report["summary"]
    mfu = f"MFU {s['mfu']:.1%}" if s.get("mfu") is not None else "MFU n/a"
    lines = [
        f"Run report ({report['run_dir']}/report.md): {report['verdict'] or 'no verdict'}",
        f"  {_f(s['tokens_per_s'], ',.0f')} tokens/s · step {_f(s.get('step_time_s'))} s · {mfu} · "
        f"{_f(s.get('tflops'), '.3g')} TFLOP/s per rank",
    ]
    if report["by_rank"]:
        lines.append("  rank   step   data  compute   comm  optim  other  mem GiB")
        for r in report["by_rank"]:
            times = " ".join(f"{r.get(c, 0.0):6.3f}" for c in RANK_COLUMNS[:-1])
            lines.append(f"  {r['rank']:>4} {times} {_f(r.get('mem_reserved_gb') or r.get('mem_peak_gb'), '7.2f')}")
    lines.append(
        f"  balance: planned {_f(s.get('rank_imbalance'), '.2f')}, measured {_f(s.get('rank_time_imbalance'), '.2f')}"
        + (f" (slowest rank {s['slowest_rank']})" if s.get("slowest_rank") is not None else "")
    )
    lines.append(f"  {report['headline']}")
    for i, lever in enumerate(report["levers"][:3], 1):
        predicted = lever.get("predicted_tokens_per_s")
        effect = f"  → ~{predicted:,.0f} tokens/s ({lever['gain']:+.0%})" if predicted is not None else ""
        lines.append(f"  {i}. {lever['set']}{effect}")
    return "\n".join(lines)


def format_what_if(result: dict) -> str:
    """The what-if as a table, one row per number of ranks, and the explanation."""
    lines = [
        f"What if: parallel.nproc_per_node={result['nproc_per_node']} link={result['link']} "
        f"({result['grad_bytes_per_step'] / MIB:.1f} MiB of gradients per rank, {result['buckets']} bucket(s))",
        "  ranks  GB/s  all-reduce ms  exposed ms   step s   tokens/s  speedup  efficiency",
    ]
    for r in result["rows"]:
        lines.append(
            f"  {r['nproc']:>5} {r['bus_gb_s']:>5g} {r['allreduce_s'] * 1e3:>14.2f} {r['exposed_comm_s'] * 1e3:>11.2f} "
            f"{r['step_time_s']:>8.3f} {r['tokens_per_s']:>10,.0f} {r['speedup']:>7.2f}x {r['efficiency']:>10.0%}"
        )
    m = result["measured"]
    lines.append(
        f"  measured at {m['nproc']} rank(s): step {m['step_time_s']:.3f} s, "
        f"exposed comm {m['exposed_comm_s'] * 1e3:.2f} ms"
    )
    return "\n".join(lines + [f"  {line}" for line in result["explanation"]])
