"""Wall time of one sweep run one job after another (Hydra's default launcher) and side by side
(``hydra/launcher=parallel``), interleaved so that both see the same machine.

    python -m ddptrain.bench.sweep [--repeats 3] [--steps 60] [--nproc 1] [-- extra overrides]

The sweep: ``optim.lr=0.001,0.002`` on the bundled tiny model and data, ``parallel.nproc_per_node=--nproc``
(``parallel=single`` for 1) per job, on the CPU, each job ``--steps`` optimizer steps. Each repeat runs the
sequential sweep, then the parallel one (``hydra.launcher.jobs`` left to its default: the cores divided by the
job's processes), each through the real command line in a fresh process, and times it from start to exit. Prints a
markdown table for ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ddptrain.process.cpus import visible_cpus

REPO = Path(__file__).resolve().parents[2]


def sweep_command(out: Path, parallel: bool, steps: int, nproc: int, extra: list[str]) -> list[str]:
    group = "parallel=single" if nproc == 1 else f"parallel.nproc_per_node={nproc}"
    command = [sys.executable, "-m", "ddptrain", "-m", group, "optim.lr=0.001,0.002"]
    command += [f"trainer.max_steps={steps}", "trainer.progress_bar=false", "trainer.device=cpu"]
    command += [f"trainer.output_dir={out}", f"hydra.sweep.dir={out}/sweep", *extra]
    return [*command, "hydra/launcher=parallel"] if parallel else command


def timed(command: list[str]) -> float:
    env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
    start = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"sweep failed ({' '.join(command)}):\n{result.stdout[-2000:]}{result.stderr[-3000:]}")
    return seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per job")
    parser.add_argument("--nproc", type=int, default=1, help="processes per job (parallel.nproc_per_node)")
    parser.add_argument("extra", nargs="*", help="more overrides for every job")
    args = parser.parse_args(argv)
    times: dict[str, list[float]] = {"one after another": [], "parallel": []}
    for _ in range(args.repeats):
        for way in times:
            with tempfile.TemporaryDirectory(prefix="ddptrain-bench-sweep-") as out:
                command = sweep_command(Path(out), way == "parallel", args.steps, args.nproc, args.extra)
                times[way].append(timed(command))
    cores = len(visible_cpus())
    print(f"cores={cores}, jobs=2 (optim.lr=0.001,0.002), nproc per job={args.nproc}, steps per job={args.steps}")
    print()
    print("| launcher | wall s: median (runs in order) |")
    print("|---|---|")
    for way, runs in times.items():
        print(f"| {way} | {statistics.median(runs):.1f} ({', '.join(f'{t:.1f}' for t in runs)}) |")
    pairs = [p / s for s, p in zip(times["one after another"], times["parallel"])]
    print()
    print(
        f"parallel / one after another, pair by pair: {', '.join(f'{r:.2f}' for r in pairs)}; "
        f"median {statistics.median(pairs):.2f}"
    )


if __name__ == "__main__":
    main()
