"""Reading a run folder into figures: metrics.jsonl's records, config.yaml's settings, and their averages.

``read_metrics`` reads the records as the run's history (a resumed run's repeated steps replaced by the later ones)
and ``RunSettings`` the settings (a key config.yaml lacks takes the schema's default); the averaging helpers weigh
each log window by its optimizer steps and leave each process's warm-up window out (``steady_windows``);
``summarize``, ``per_rank`` and ``measure_balance`` give the run's figures, its per-rank table and its measured
balance. ``StepSplit`` is the step model: one optimizer step's time split by how each part scales when the config
changes, which the rules, the levers and the what-if all reason with (``step_split`` reads it from a summary,
``exposed_s`` is its overlap of the all-reduce with backward).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from enum import Enum
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from ddptrain.config import (
    DataConfig,
    DiagnoseConfig,
    ModelConfig,
    ObjectiveConfig,
    OptimConfig,
    ParallelConfig,
    TrainerConfig,
)
from ddptrain.evaluation.best import BestRule

# The record's time columns, in the order of the report's tables and the stacked bars.
TIME_COLUMNS = ("time_data_s", "time_compute_s", "time_comm_s", "time_optimizer_s", "time_other_s")
RANK_COLUMNS = ("step_time_s", *TIME_COLUMNS, "busy_s")
# Backward is about 2/3 of forward+backward (twice the forward's matmuls): the window in which DDP's
# buckets can all-reduce while gradients are still being produced.
BACKWARD_SHARE = 2.0 / 3.0
MIB = 2**20


class DiagnoseError(RuntimeError):
    """Nothing to diagnose: no run folder, no metrics.jsonl, or no training record in it."""


# ----------------------------------------------------------------------------- reading the run folder


def as_number(value: Any) -> float | None:
    """A finite float, or None: missing, null, or the "nan"/"inf" strings metrics.jsonl writes for non-finite values."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """The training and the eval records of ``<run_dir>/metrics.jsonl``, as the run's history, step by step.

    The file is opened in append mode, so a run resumed from a checkpoint older than its last log line logs the
    steps after the checkpoint again, and each start of a process logs another warm-up window. A restart shows as
    ``elapsed_s`` (seconds since the process started) going down from one training record to the next, or ``step``
    not increasing. What a later process logs replaces the records at and after its first step (the run went back
    on them: a run resumed and stopped again ends where the later process stopped), and of two eval records for the
    same step the later stands. Each training record gets ``first_window``: true for the first window its process
    logged (the file's first, and the first after each restart), which holds warm-up. A line that does not parse
    (the torn last line of a killed run) is skipped.

    Args:
        run_dir: a run folder.

    Returns:
        (training records, eval records), each in step order, one per step.

    Raises:
        DiagnoseError: no such folder or no metrics.jsonl in it.
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not Path(run_dir).is_dir():
        raise DiagnoseError(f"{run_dir} is not a folder: pass a run folder (the one holding metrics.jsonl).")
    if not path.exists():
        raise DiagnoseError(
            f"{run_dir} has no metrics.jsonl: the run stopped before it started training.{log_tail(run_dir)}"
        )
    train: list[dict] = []
    evals: list[dict] = []
    previous = None  # the file's last training record so far, kept or not
    for record in _parsed_lines(path):
        step = record["step"]
        if SAVE_CHECK_KEY in record or DIVERGED_KEY in record:  # a save's record, a divergence: not the history
            continue
        if "eval_loss" in record or "samples_s" in record:
            evals = [e for e in evals if e["step"] != step] + [record]
            continue
        restarted = previous is not None and _restarted(previous, record)
        if restarted:
            train = [r for r in train if r["step"] < step]
            evals = [e for e in evals if e["step"] < step]
        train.append(record | {"first_window": previous is None or restarted})
        previous = record
    return train, sorted(evals, key=lambda e: e["step"])


SAVE_CHECK_KEY = "save_check_s"
"""The key of the record a save's check logs (``evaluation.save_check``)."""
DIVERGED_KEY = "diverged"
"""The key of the record a diverged run ends with (``observe.nonfinite``)."""


def divergence(run_dir: Path) -> dict | None:
    """The record of the divergence the run ended with, or None: none was logged, or a later process trained on past
    it (the run was resumed with other settings)."""
    found = None
    for record in _parsed_lines(Path(run_dir) / "metrics.jsonl"):
        if DIVERGED_KEY in record:
            found = record
        elif found is not None and "loss" in record and record["step"] > found["step"]:
            found = None
    return found


def outside_the_steps(run_dir: Path, evals: list[dict]) -> dict[str, float]:
    """Seconds the run spent outside its training steps, by part, over the whole run: evaluating (``eval_s``),
    generating the samples (``samples_s``) and checking that saved adapters load (``save_check_s``)."""
    checks = [r for r in _parsed_lines(Path(run_dir) / "metrics.jsonl") if SAVE_CHECK_KEY in r]
    parts = {"eval_s": evals, "samples_s": evals, SAVE_CHECK_KEY: checks}
    found = {key: sum(as_number(r.get(key)) or 0.0 for r in records) for key, records in parts.items()}
    counts = {f"{key.removesuffix('_s')}_count": sum(key in r for r in records) for key, records in parts.items()}
    return found | counts


def _parsed_lines(path: Path) -> list[dict]:
    """The file's records that parse and carry a numeric step."""
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and as_number(record.get("step")) is not None:
            records.append(record)
    return records


def _restarted(previous: dict, record: dict) -> bool:
    """Whether ``record`` was logged by a later process than ``previous`` (two training records, in file order).

    Within one process the step only grows and ``elapsed_s`` (seconds since the process started) never goes down.
    """
    before, now = as_number(previous.get("elapsed_s")), as_number(record.get("elapsed_s"))
    return record["step"] <= previous["step"] or (before is not None and now is not None and now < before)


def log_tail(run_dir: Path, lines: int = 5) -> str:
    """The last lines of train.log, for an error that says why a run left nothing to diagnose."""
    log = Path(run_dir) / "train.log"
    if not log.exists():
        return ""
    tail = log.read_text(errors="replace").splitlines()[-lines:]
    return "\nLast lines of train.log:\n" + "\n".join(f"  {line}" for line in tail) if tail else ""


# The schema of each config group: a key config.yaml lacks takes its default from here.
_GROUPS = {
    "model": ModelConfig,
    "data": DataConfig,
    "parallel": ParallelConfig,
    "optim": OptimConfig,
    "trainer": TrainerConfig,
    "objective": ObjectiveConfig,
}
_ABSENT = object()


def _plain(value: Any) -> Any:
    """An Enum as its value, an OmegaConf container as plain Python."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


class RunSettings:
    """The run's ``config.yaml``, read key by key as the user types keys.

    A key the file lacks, or a missing file, takes the schema's default (``ddptrain.config``), so a folder from an
    older version, or one whose config.yaml was lost, is still diagnosed with the settings it most likely ran with.
    """

    def __init__(self, cfg: DictConfig | None):
        self.cfg = cfg

    @classmethod
    def load(cls, run_dir: Path) -> RunSettings:
        """Read ``<run_dir>/config.yaml``; no file gives the schema's defaults."""
        path = Path(run_dir) / "config.yaml"
        return cls(OmegaConf.load(path) if path.exists() else None)

    def __getitem__(self, key: str) -> Any:
        if self.cfg is not None:
            value = OmegaConf.select(self.cfg, key, default=_ABSENT, throw_on_missing=False)
            if value is not _ABSENT and value != "???":
                return _plain(value)
        group, *path = key.split(".")
        node: Any = _GROUPS[group]()
        for name in path:
            node = getattr(node, name)
        return _plain(node)

    def thresholds(self) -> DiagnoseConfig:
        """``trainer.diagnose.*`` from config.yaml, each missing one at DiagnoseConfig's default."""
        return DiagnoseConfig(**{f.name: float(self[f"trainer.diagnose.{f.name}"]) for f in fields(DiagnoseConfig)})


# ----------------------------------------------------------------------------- averaging the windows


def _weight(record: dict) -> float:
    """A window counts by its optimizer steps (a short last window of a stopped run counts less)."""
    return as_number(record.get("window_steps")) or 1.0


def weighted_mean(records: list[dict], key: str) -> float | None:
    """The window_steps-weighted mean of ``key`` over the records that have it."""
    pairs = [(_weight(r), v) for r in records if (v := as_number(r.get(key))) is not None]
    total = sum(w for w, _ in pairs)
    return sum(w * v for w, v in pairs) / total if total else None


def steady_windows(records: list[dict]) -> list[dict]:
    """The windows that hold no warm-up: all but each process's first (``first_window``: the file's first, and the
    first after each restart) when that leaves any, else all of them. A first window holds warm-up (first
    allocations, the loader's first fetch, compilation), which says nothing about the steps that follow."""
    steady = [r for r in records if not r.get("first_window")]
    return steady or records


def timed_windows(records: list[dict]) -> list[dict]:
    """The windows that logged the time split (trainer.timing=true)."""
    return [r for r in records if as_number(r.get("step_time_s")) is not None]


def _throughput(records: list[dict]) -> tuple[float | None, float | None]:
    """Tokens/s over the windows (all tokens / all window seconds) and tokens per optimizer step."""
    pairs = [(t, as_number(r.get("tokens_per_s"))) for r in records if (t := as_number(r.get("tokens"))) is not None]
    seconds = sum(t / tps for t, tps in pairs if tps)
    tokens = sum(t for t, tps in pairs if tps)
    steps = sum(_weight(r) for r in records if as_number(r.get("tokens")) is not None)
    per_step = sum(t for t, _ in pairs) / steps if steps else None
    return (tokens / seconds if seconds else None), per_step


def per_rank(records: list[dict]) -> list[dict]:
    """Each rank's time columns averaged over the steady timed windows, and its memory peaks over the whole run
    (the costliest micro-batch comes first, in the warm-up window: that window counts for memory)."""
    sums: dict[int, dict[str, float]] = {}
    for record in steady_windows(timed_windows(records)):
        for entry in record.get("by_rank") or []:
            acc = sums.setdefault(int(entry["rank"]), {"_w": 0.0} | {c: 0.0 for c in RANK_COLUMNS})
            acc["_w"] += _weight(record)
            for column in RANK_COLUMNS:
                acc[column] += _weight(record) * _rank_value(entry, column)
    rows = {rank: {"rank": rank} | {c: acc[c] / acc["_w"] for c in RANK_COLUMNS} for rank, acc in sums.items()}
    memory = (
        ("mem_peak_gb_by_rank", "mem_peak_gb"),
        ("mem_reserved_gb_by_rank", "mem_reserved_gb"),
        ("mem_predicted_gb_by_rank", "mem_predicted_gb"),  # the memory plan's, logged once at start
    )
    for key, name in memory:
        for rank, peak in enumerate(_max_by_rank(records, key)):
            rows.setdefault(rank, {"rank": rank})[name] = peak
    return [rows[rank] for rank in sorted(rows)]


def _rank_value(entry: dict, column: str) -> float:
    """A per-rank figure; busy_s, when absent, is the rank's step minus its exposed comm (its definition)."""
    value = as_number(entry.get(column))
    if value is None and column == "busy_s":
        return _rank_value(entry, "step_time_s") - _rank_value(entry, "time_comm_s")
    return value or 0.0


def _max_by_rank(records: list[dict], key: str) -> list[float | None]:
    """Per rank, the largest value of a per-rank list column over all records."""
    peaks: list[float | None] = []
    for record in records:
        for rank, value in enumerate(record.get(key) or []):
            peaks += [None] * (rank + 1 - len(peaks))
            if (v := as_number(value)) is not None:
                peaks[rank] = v if peaks[rank] is None else max(peaks[rank], v)
    return peaks


def _max(records: list[dict], key: str) -> float | None:
    values = [v for r in records if (v := as_number(r.get(key))) is not None]
    return max(values) if values else None


# ----------------------------------------------------------------------------- the step model


@dataclass(frozen=True)
class StepSplit:
    """One optimizer step's wall time, split by how each part scales when the config changes.

    ``data``, ``compute`` and ``comm_wait`` (fast ranks waiting inside the all-reduce for the slowest one) recur
    with every micro-batch; ``comm_wire`` (the all-reduce left exposed after backward), ``optimizer`` and ``other``
    happen once per optimizer step; ``outside`` is wall time per step spent between steps (logging, evaluation).
    All are seconds per optimizer step; ``tokens`` are real tokens per optimizer step over all ranks.
    """

    data: float
    compute: float
    comm_wire: float
    comm_wait: float
    optimizer: float
    other: float
    outside: float
    tokens: float

    @property
    def step_s(self) -> float:
        return self.data + self.compute + self.comm_wire + self.comm_wait + self.optimizer + self.other

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.step_s + self.outside, 1e-12)

    def accumulate(self, ratio: float) -> StepSplit:
        """The step with ``ratio`` times as many micro-batches: per-micro-batch parts and tokens scale, the
        once-per-step parts (the exposed all-reduce above all) do not."""
        return replace(
            self,
            data=self.data * ratio,
            compute=self.compute * ratio,
            comm_wait=self.comm_wait * ratio,
            tokens=self.tokens * ratio,
        )


def step_split(summary: dict) -> StepSplit | None:
    """The measured step as a StepSplit (None when timing was off)."""
    parts = summary.get("split")
    return StepSplit(**parts) if parts else None


def measure_split(summary: dict, by_rank: list[dict]) -> dict | None:
    """Split the mean exposed communication into wire time and waiting for the slowest rank.

    The slowest rank waits for nobody, so its exposed comm (the least of any rank's) is the all-reduce itself; what
    the other ranks show beyond it is waiting, which scales with the micro-batches that cause it, not with bytes.
    """
    step = summary.get("step_time_s")
    if step is None:
        return None
    data, compute, comm, optimizer = (summary.get(c) or 0.0 for c in TIME_COLUMNS[:4])
    ranks_comm = [r["time_comm_s"] for r in by_rank if "time_comm_s" in r]
    wire = min(min(ranks_comm), comm) if ranks_comm else comm
    other = summary.get("time_other_s")
    other = max(step - data - compute - comm - optimizer, 0.0) if other is None else other
    tokens = summary.get("tokens_per_step") or 0.0
    wall = tokens / summary["tokens_per_s"] if summary.get("tokens_per_s") else step
    return {
        "data": data,
        "compute": compute,
        "comm_wire": wire,
        "comm_wait": comm - wire,
        "optimizer": optimizer,
        "other": other,
        "outside": max(wall - (data + compute + comm + optimizer + other), 0.0),
        "tokens": tokens,
    }


def exposed_s(last_bucket_s: float, other_buckets_s: float, backward_s: float) -> float:
    """Overlap model: all buckets but the last can all-reduce behind backward; the last never can."""
    return last_bucket_s + max(other_buckets_s - backward_s, 0.0)


# ----------------------------------------------------------------------------- summary


def summarize(records: list[dict], evals: list[dict], settings: RunSettings) -> dict:
    """The run's figures: throughput over the steady windows, the mean time split, balance, FLOP/s, memory."""
    steady, timed = steady_windows(records), steady_windows(timed_windows(records))
    tokens_per_s, tokens_per_step = _throughput(steady)
    last = records[-1]
    max_steps = settings["trainer.max_steps"]
    world_size = int(as_number(last.get("world_size")) or settings["parallel.nproc_per_node"] or 1)
    summary: dict[str, Any] = {
        "first_step": records[0]["step"],
        "last_step": last["step"],
        "max_steps": max_steps,
        "stopped_early": None if max_steps is None else last["step"] < max_steps,
        "windows": len(records),
        "windows_used": len(timed or steady),
        # The processes whose windows the history keeps: more than one when the run was resumed.
        "processes": sum(1 for r in records if r.get("first_window")),
        "world_size": world_size,
        "grad_accum_steps": _grad_accum_steps(settings, world_size),
        "global_batch_size": settings["optim.global_batch_size"],
        "tokens_per_s": tokens_per_s,
        "tokens_per_step": tokens_per_step,
        "loss_first": as_number(records[0].get("loss")),
        "loss_last": as_number(last.get("loss")),
        "eval_loss_last": _last_eval_loss(evals),
        "padding_fraction": weighted_mean(steady, "padding_fraction"),
        "rank_imbalance": weighted_mean(steady, "rank_imbalance"),
        "peak_rank_tokens": _max(records, "peak_rank_tokens"),
        "allreduce_bytes_per_step": weighted_mean(steady, "allreduce_bytes_per_step"),
        "allreduce_calls_per_step": weighted_mean(steady, "allreduce_calls_per_step"),
        # parallel.strategy=fsdp2: its reduce-scatters and all-gathers in place of the all-reduce
        "strategy": settings["parallel.strategy"],
        **{
            f"{op}_{what}_per_step": weighted_mean(steady, f"{op}_{what}_per_step")
            for op in ("reducescatter", "allgather")
            for what in ("bytes", "calls")
        },
        "timing": bool(timed),
    }
    for key in ("step_time_s", *TIME_COLUMNS, "tflops", "mfu", "peak_tflops", "model_flops_per_step"):
        summary[key] = weighted_mean(timed, key)
    summary |= _memory_summary(records)
    return summary | best_eval(evals, settings)


def _last_eval_loss(evals: list[dict]) -> float | None:
    losses = [e for e in evals if "eval_loss" in e]
    return as_number(losses[-1]["eval_loss"]) if losses else None


def best_eval(evals: list[dict], settings: RunSettings) -> dict:
    """The best evaluation by ``trainer.best_metric`` (its direction as ``trainer.greater_is_better`` says), as the
    run's best tracker chose it: ``best_metric``, ``best_step`` and ``best_value`` (None without an evaluation)."""
    metric = settings["trainer.best_metric"]
    rule = BestRule.build(metric, settings["trainer.greater_is_better"], keep_best_n=1)
    scored = [(value, e) for e in evals if (value := as_number(e.get(metric))) is not None]
    best = rule.best_first(scored)[0] if scored else None  # stable: of equal values the earliest, as the tracker
    found = {"best_metric": metric, "best_step": best and best["step"], "best_value": best and best[metric]}
    return found | {"best_kept": settings["trainer.keep_best_n"] > 0}


def _grad_accum_steps(settings: RunSettings, world_size: int) -> int:
    """Micro-batches per optimizer step; with optim.global_batch_size set it is derived, as the trainer derives it."""
    global_batch = settings["optim.global_batch_size"]
    if global_batch:
        return max(global_batch // (world_size * settings["data.micro_batch_size"]), 1)
    return settings["optim.grad_accum_steps"]


def _memory_summary(records: list[dict]) -> dict:
    """Memory peaks over every window (warm-up included: the costliest micro-batch is scheduled first)."""
    retries = [v for r in records if (v := as_number(r.get("alloc_retries"))) is not None]
    total = _max(records, "mem_total_gb")
    predicted = [v for r in records for v in r.get("mem_predicted_gb_by_rank") or [] if as_number(v) is not None]
    return {
        "mem_peak_gb": _max(records, "mem_peak_gb"),
        "mem_predicted_gb": max(predicted) if predicted else None,
        "mem_plan_device_gb": _max(records, "mem_plan_device_gb"),
        # CPU, plan.cpu_returns_freed_memory=false: glibc's freed blocks kept for reuse are in the peak, not the plan
        "mem_plan_freed_kept": any(r.get("mem_plan_freed_kept") for r in records),
        "mem_total_gb": total,
        "alloc_retries": int(sum(retries)) if retries else None,
        # CUDA reports a device total; on CPU it is null and the peaks are the processes' resident memory.
        "device": "cuda" if total is not None else "cpu",
    }


def fullest_memory(summary: dict, by_rank: list[dict]) -> tuple[float | None, int | None, str]:
    """The fullest rank's memory: (GiB, rank, "reserved" or "allocated"); a tie names the lowest rank.

    Reserved memory is what the device has given the allocator, so it is what runs out; a rank without it counts
    its peak allocated. Without per-rank memory, the run's peak allocated stands, and no rank is named (None).
    """
    used = [
        (gb, r["rank"], "reserved" if r.get("mem_reserved_gb") else "allocated")
        for r in by_rank
        if (gb := r.get("mem_reserved_gb") or r.get("mem_peak_gb")) is not None
    ]
    if not used:
        return summary.get("mem_peak_gb"), None, "allocated"
    return max(used, key=lambda row: (row[0], -row[1]))


def measure_balance(summary: dict, by_rank: list[dict]) -> None:
    """Measured balance from the run-averaged per-rank busy time (a rank slow in every window stands out), falling
    back to the records' own rank_time_imbalance when there is no per-rank table."""
    busy = [(r["busy_s"], r["rank"]) for r in by_rank if "busy_s" in r]
    mean = sum(b for b, _ in busy) / len(busy) if busy else 0.0
    if mean > 0:
        slowest_busy, slowest = max(busy, key=lambda pair: (pair[0], -pair[1]))  # a tie names the lowest rank
        summary |= {"rank_time_imbalance": slowest_busy / mean, "slowest_rank": slowest, "busy_mean_s": mean}
        summary["busy_excess_s"] = slowest_busy - mean
        return
    summary["rank_time_imbalance"] = summary.get("rank_time_imbalance_logged")
    summary["slowest_rank"] = summary.get("slowest_rank_logged")
