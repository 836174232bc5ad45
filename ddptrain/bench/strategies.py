"""Tokens/s, peak memory per rank and collective bytes of ``parallel.strategy=fsdp2`` against DDP on 2 CPU ranks
(gloo), for LoRA and for a full fine-tune, interleaved so that both strategies see the same machine.

    python -m ddptrain.bench.strategies [--repeats 3] [--steps 40] [--warmup 5] [--fine-tunes lora full]
        [--model tiny_qwen2 | qwen2_5_0_5b_lora] [extra overrides ...]

Each run is the real command line in a fresh process: ``python -m ddptrain parallel=ddp2`` or ``parallel=fsdp2_2``,
``model.lora=true`` or ``false``, ``trainer.precision=fp32``, ``--warmup`` + ``--steps`` optimizer steps, no
evaluation and nothing saved, on the bundled tiny model and data unless told otherwise. ``--model
qwen2_5_0_5b_lora`` builds Qwen2.5-0.5B from its bundled architecture config with random fp32 weights and the
bundled tiny tokenizer. Each repeat runs, for each fine-tune, DDP then FSDP2. Read from each run's ``metrics.jsonl``,
logged every ``--warmup`` steps so that the first window holds the warm-up steps and nothing else:

- real tokens/s: the real (non-padding) tokens of both ranks over the steps after the warm-up, over the wall time
  from the end of the warm-up window to the end of the last (``elapsed_s``: logging between the steps included);
- peak memory per rank: ``mem_peak_gb_by_rank`` at the end of the run, each rank's peak resident set (``VmHWM``, the
  whole process since it started: interpreter, libraries, data, the model as built, then the steps);
- bytes per optimizer step and rank, as the collectives counted them: DDP's all-reduce (``allreduce_bytes_per_step``),
  FSDP2's reduce-scatter (the full gradients handed to it) and all-gather (the full parameters received).

Prints the medians over the repeats (the runs in order beside them) and the ratio FSDP2 / DDP, as markdown for
``bench/README.md``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch

from ddptrain.bench.sweep import timed
from ddptrain.diagnose.runs import as_number, read_metrics, weighted_mean

STRATEGIES = {"ddp": "parallel=ddp2", "fsdp2": "parallel=fsdp2_2"}
FINE_TUNES = {"lora": "model.lora=true", "full": "model.lora=false"}
MODELS = {
    "tiny_qwen2": ["model=tiny_qwen2"],
    # Qwen2.5-0.5B's shape, random fp32 weights: no download, and fp32 as the tiny runs.
    "qwen2_5_0_5b_lora": [
        "model=qwen2_5_0_5b_lora",
        "model.init=random",
        "model.tokenizer=${asset:tiny_tokenizer}",
        "model.dtype=fp32",
    ],
}
BYTES = ("allreduce_bytes_per_step", "reducescatter_bytes_per_step", "allgather_bytes_per_step")
MIB = 2**20


@dataclass(frozen=True)
class Measured:
    """What one run measured after its warm-up."""

    tokens_per_s: float
    step_s: float
    peak_gb_by_rank: list[float]
    bytes_per_step: dict[str, float | None]
    wall_s: float


def run_command(out: Path, strategy: str, fine_tune: str, args: argparse.Namespace) -> list[str]:
    """The command line of one run, writing its run folder under ``out``."""
    command = [sys.executable, "-m", "ddptrain", STRATEGIES[strategy], *MODELS[args.model], FINE_TUNES[fine_tune]]
    command += ["trainer.device=cpu", "trainer.precision=fp32", f"trainer.max_steps={args.warmup + args.steps}"]
    command += [f"trainer.log_every_n_steps={args.warmup}", "trainer.progress_bar=false", "trainer.resume=none"]
    command += ["trainer.save_final=false", "trainer.save_check=off", "data.eval_fraction=0"]
    return [*command, f"trainer.output_dir={out}", *args.extra]


def measure(run_dir: Path, warmup: int, wall_s: float) -> Measured:
    """The figures of one finished run from its ``metrics.jsonl`` (see the module's docstring)."""
    records, _ = read_metrics(run_dir)
    after = [r for r in records if r["step"] > warmup]
    start = next(r for r in records if r["step"] == warmup)
    seconds = after[-1]["elapsed_s"] - start["elapsed_s"]
    peaks = [max(as_number(r["mem_peak_gb_by_rank"][rank]) or 0.0 for r in records) for rank in range(2)]
    return Measured(
        tokens_per_s=sum(r["tokens"] for r in after) / seconds,
        step_s=seconds / (after[-1]["step"] - warmup),
        peak_gb_by_rank=peaks,
        bytes_per_step={key: weighted_mean(after, key) for key in BYTES},
        wall_s=wall_s,
    )


def run_once(strategy: str, fine_tune: str, args: argparse.Namespace) -> Measured:
    with tempfile.TemporaryDirectory(prefix="ddptrain-bench-strategies-") as out:
        wall_s = timed(run_command(Path(out), strategy, fine_tune, args))
        (metrics,) = Path(out).glob("*/metrics.jsonl")
        return measure(metrics.parent, args.warmup, wall_s)


def median_and_runs(values: list[float], spec: str) -> str:
    return f"{statistics.median(values):{spec}} ({', '.join(f'{v:{spec}}' for v in values)})"


def mib_cell(runs: list[Measured], key: str) -> str:
    values = [v for m in runs if (v := m.bytes_per_step[key]) is not None]
    return f"{statistics.median(values) / MIB:.2f}" if values else "–"


def print_tables(results: dict[tuple[str, str], list[Measured]], args: argparse.Namespace) -> None:
    speed = "real tok/s: median (runs in order) | s/step | peak GiB rank 0 | peak GiB rank 1"
    sent = "all-reduce MiB/step | reduce-scatter MiB/step | all-gather MiB/step"
    print(f"| fine-tune | strategy | {speed} | {sent} | run wall s |")
    print("|---|---|---|---:|---|---|---:|---:|---:|---:|")
    for (fine_tune, strategy), runs in results.items():
        peaks = [median_and_runs([m.peak_gb_by_rank[rank] for m in runs], ".3f") for rank in range(2)]
        cells = [median_and_runs([m.tokens_per_s for m in runs], ".0f")]
        cells += [f"{statistics.median(m.step_s for m in runs):.3f}", *peaks, *(mib_cell(runs, k) for k in BYTES)]
        cells += [f"{statistics.median(m.wall_s for m in runs):.1f}"]
        print(f"| {fine_tune} | {strategy} | " + " | ".join(cells) + " |")
    print()
    print("| fine-tune | fsdp2 / ddp tok/s (medians) | pair by pair | fsdp2 / ddp peak, rank 0 | rank 1 |")
    print("|---|---:|---|---:|---:|")
    for fine_tune in args.fine_tunes:
        ddp, fsdp = results[fine_tune, "ddp"], results[fine_tune, "fsdp2"]
        speed = statistics.median(m.tokens_per_s for m in fsdp) / statistics.median(m.tokens_per_s for m in ddp)
        pairs = ", ".join(f"{f.tokens_per_s / d.tokens_per_s:.2f}" for d, f in zip(ddp, fsdp))
        memory = [
            statistics.median(m.peak_gb_by_rank[rank] for m in fsdp)
            / statistics.median(m.peak_gb_by_rank[rank] for m in ddp)
            for rank in range(2)
        ]
        print(f"| {fine_tune} | {speed:.2f} | {pairs} | {memory[0]:.2f} | {memory[1]:.2f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ddptrain.bench.strategies", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="measured optimizer steps, after the warm-up")
    parser.add_argument("--warmup", type=int, default=5, help="optimizer steps left out (also the log window)")
    parser.add_argument("--fine-tunes", nargs="+", choices=list(FINE_TUNES), default=list(FINE_TUNES))
    parser.add_argument("--model", choices=list(MODELS), default="tiny_qwen2")
    parser.add_argument("extra", nargs="*", help="more overrides for every run (data.max_length=64, ...)")
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps < args.warmup or args.steps % args.warmup:
        parser.error(f"--steps ({args.steps}) must be a multiple of --warmup ({args.warmup}): one log window each")
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    started = time.perf_counter()
    results: dict[tuple[str, str], list[Measured]] = {(f, s): [] for f in args.fine_tunes for s in STRATEGIES}
    for _ in range(args.repeats):
        for fine_tune in args.fine_tunes:
            for strategy in STRATEGIES:  # ddp, then fsdp2: each pair back to back
                results[fine_tune, strategy].append(run_once(strategy, fine_tune, args))
    print(f"{datetime.now():%Y-%m-%d %H:%M}, {platform.node()}, torch {torch.__version__}, before the runs: {uptime}")
    print(
        f"model={args.model}, 2 ranks (gloo), fp32, steps={args.steps} after warmup={args.warmup}, "
        f"repeats={args.repeats}, overrides: {' '.join(args.extra) or 'none'}; "
        f"{time.perf_counter() - started:.0f} s for the command"
    )
    print()
    print_tables(results, args)


if __name__ == "__main__":
    main()
