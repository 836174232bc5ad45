"""DPO's two references on 2 CPU ranks: ``objective.reference=adapter_off`` (a reference forward in every step)
against ``precomputed`` (one pass over the pairs before training, then none), interleaved so that both see the same
machine.

    python -m ddptrain.bench.dpo_reference [--repeats 3] [--steps 40] [--warmup 5] [extra overrides ...]

Each run is the real command line in a fresh process: ``python -m ddptrain objective=dpo data=tiny_preference``
with ``objective.reference=adapter_off`` or ``precomputed``, ``trainer.precision=fp32``, ``--warmup`` + ``--steps``
optimizer steps, no evaluation and nothing saved, on the bundled tiny model unless told otherwise. Each precomputed
run has a datasets cache of its own, so that it computes its table (a second run of the same data would read it).
Read from each run:

- s/step and real tokens/s after the warm-up (``metrics.jsonl``, logged every ``--warmup`` steps: the wall time from
  the end of the warm-up window to the end of the last, ``bench.strategies.measure``);
- the precomputation: the seconds ``train.log`` gives for the train set's table;
- the whole command's wall time.

Prints the medians over the repeats (the runs in order beside them) and the ratio precomputed / adapter_off, as
markdown for ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from pathlib import Path

from ddptrain.bench.strategies import Measured, measure, median_and_runs
from ddptrain.bench.sweep import timed

REFERENCES = ("adapter_off", "precomputed")
TABLE_TIME = re.compile(r"reference: the train set's .* pairs' log-probabilities computed .* in ([0-9.]+) s")


def run_command(out: Path, reference: str, args: argparse.Namespace) -> list[str]:
    """The command line of one run, writing its run folder and its datasets cache under ``out``."""
    command = [sys.executable, "-m", "ddptrain", "objective=dpo", "data=tiny_preference", "parallel=ddp2"]
    command += [f"objective.reference={reference}", f"data.cache_dir={out / 'cache'}", "trainer.device=cpu"]
    command += ["trainer.precision=fp32", f"trainer.max_steps={args.warmup + args.steps}", "trainer.resume=none"]
    command += [f"trainer.log_every_n_steps={args.warmup}", "trainer.progress_bar=false", "data.eval_fraction=0"]
    command += ["trainer.save_final=false", "trainer.save_check=off", "trainer.eval_every_n_steps=0"]
    return [*command, f"trainer.output_dir={out / 'runs'}", *args.extra]


def run_once(reference: str, args: argparse.Namespace) -> tuple[Measured, float | None]:
    """One run's figures, and the seconds its reference table took (None: adapter_off)."""
    with tempfile.TemporaryDirectory(prefix="ddptrain-bench-dpo-") as out:
        wall_s = timed(run_command(Path(out), reference, args))
        (metrics,) = Path(out).glob("runs/*/metrics.jsonl")
        found = TABLE_TIME.search((metrics.parent / "train.log").read_text())
        return measure(metrics.parent, args.warmup, wall_s), float(found.group(1)) if found else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ddptrain.bench.dpo_reference", description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="measured optimizer steps, after the warm-up")
    parser.add_argument("--warmup", type=int, default=5, help="optimizer steps before the measured ones")
    parser.add_argument("extra", nargs="*", help="more overrides for every run")
    args = parser.parse_args(argv)
    runs: dict[str, list[tuple[Measured, float | None]]] = {reference: [] for reference in REFERENCES}
    for _ in range(args.repeats):
        for reference in REFERENCES:
            runs[reference].append(run_once(reference, args))
    print("| objective.reference | s/step: median (runs in order) | real tok/s | table s | run wall s |")
    print("|---|---|---:|---:|---:|")
    for reference, measured in runs.items():
        tables = [seconds for _, seconds in measured if seconds is not None]
        cells = [
            median_and_runs([m.step_s for m, _ in measured], ".4f"),
            f"{statistics.median(m.tokens_per_s for m, _ in measured):.0f}",
            f"{statistics.median(tables):.1f}" if tables else "–",
            f"{statistics.median(m.wall_s for m, _ in measured):.1f}",
        ]
        print(f"| {reference} | " + " | ".join(cells) + " |")
    off, pre = ([m.step_s for m, _ in runs[r]] for r in REFERENCES)
    pairs = ", ".join(f"{p / o:.2f}" for o, p in zip(off, pre))
    print(f"\nprecomputed / adapter_off s/step: {statistics.median(pre) / statistics.median(off):.2f} ({pairs})")


if __name__ == "__main__":
    main()
