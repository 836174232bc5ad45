"""What ``parallel.start_method`` costs a sweep run one job after another: wall time of the same sweep of 2-rank jobs
with 1 job and with ``--jobs`` jobs, for ``spawn`` and ``forkserver``, interleaved so that both see the same machine.

    python -m ddptrain.bench.startup [--repeats 3] [--jobs 3] [--steps 2]

Each job is the bundled tiny model on 2 self-launched CPU ranks (``parallel=ddp2``) for ``--steps`` optimizer steps,
through the real command line (Hydra's default launcher runs the jobs one after another in one process). The
difference between the two sweeps, divided by the extra jobs, is what one more job costs: its start-up and its
training. Prints a markdown table for ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from ddptrain.bench.sweep import timed

METHODS = ("spawn", "forkserver")


def sweep_command(out: Path, method: str, jobs: int, steps: int) -> list[str]:
    lrs = ",".join(f"{0.001 * (i + 1):g}" for i in range(jobs))
    command = [sys.executable, "-m", "ddptrain", "-m", "parallel=ddp2", f"optim.lr={lrs}"]
    command += [f"parallel.start_method={method}", f"trainer.max_steps={steps}", "trainer.progress_bar=false"]
    command += ["trainer.save_final=false", "trainer.device=cpu"]
    return [*command, f"trainer.output_dir={out}", f"hydra.sweep.dir={out}/sweep"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=3, help="jobs of the longer sweep (the shorter has 1)")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per job")
    args = parser.parse_args(argv)
    if args.jobs < 2:
        parser.error("--jobs must be at least 2")
    times: dict[tuple[str, int], list[float]] = {(m, n): [] for m in METHODS for n in (1, args.jobs)}
    for _ in range(args.repeats):
        for method, jobs in times:
            with tempfile.TemporaryDirectory(prefix="ddptrain-bench-startup-") as out:
                times[method, jobs].append(timed(sweep_command(Path(out), method, jobs, args.steps)))
    header = f"| start method | 1 job: wall s, median (runs) | {args.jobs} jobs: wall s, median (runs) |"
    print(f"{header} each further job, s |")
    print("|---|---|---|---|")
    for method in METHODS:
        one, many = times[method, 1], times[method, args.jobs]
        further = (statistics.median(many) - statistics.median(one)) / (args.jobs - 1)
        print(f"| `{method}` | {median_and_runs(one)} | {median_and_runs(many)} | {further:.1f} |")


def median_and_runs(seconds: list[float]) -> str:
    return f"{statistics.median(seconds):.1f} ({', '.join(f'{s:.1f}' for s in seconds)})"


if __name__ == "__main__":
    main()
