"""``make gpu-check``: the GPU path in tiers by GPU count, each bounded in time, then one table.

    python scripts/gpu_check.py [--gpus N] [--budget-s S] [--data ALPACA.jsonl --tokenizer QWEN2_DIR] [--keep DIR]
    python scripts/gpu_check.py --list [--gpus N]     # what it would run on 1, 2 and 8 GPUs (or on N); no GPU needed

Tiers (``TIERS``; ``--list`` prints each with its test ids and time budget):

- **one GPU** (tests/gpu/test_gpu.py): one process; fp16 and bf16 bases, bf16 autocast, the default precision,
  flash-attention and sdpa, Liger, torch.compile, gradient checkpointing, CUDA timing and MFU, a forkserver rank on
  CUDA, packed rows computed as if alone.
- **2 ranks on one GPU** (tests/gpu/test_gpu_shared.py): ``parallel=ddp2 parallel.backend=gloo``, both ranks on cuda:0
  (gloo all-reduces CUDA tensors through the host; NCCL refuses to share a device): accumulation with 1.0 all-reduce
  per optimizer step, gradient checkpointing, eval and samples, every save checked in full on the host
  (``trainer.save_check=full``), a resume bit-identical to the uninterrupted run, torch.compile under DDP.
- **memory plan** (tests/gpu/test_gpu_plan.py): the plan's peak against ``torch.cuda.max_memory_reserved`` of a real
  step, Qwen2.5-0.5B (random init), 1k and 4k tokens per micro-batch, gradient checkpointing off and on.
- **NCCL, a GPU per rank** (tests/gpu/test_gpu_ddp.py; 2 or more GPUs): the 2-rank runs over NCCL, torchrun,
  bf16_compress, each rank's process on its own GPU.
- **throughput** (``python -m ddptrain.bench.throughput --gpu --nproc <GPUs>``): ddptrain (length_grouped, packed)
  and the transformers Trainer (group_by_length) on the same model, precision (bf16) and rows: real tokens/s, MFU
  against the GPU's bf16 peak, peak memory. Data: ../shared/data (Alpaca, Qwen2 tokenizer) when present, else the
  bundled tiny_instruct rows and tiny tokenizer (the table says which).

Each tier runs as its own bounded process (its own pytest call and JUnit report), so the tiers that finished keep
their rows when a later one is killed for time; a killed tier is one row, "killed after N s". A tier's limit is its
budget plus what the tiers before it left unused. Budgets: 470 s in all on one GPU (under 8 minutes); with more GPUs
the NCCL tier (240 s) and 10 s per further GPU for the benchmark's start-up (each GPU is a rank that loads the model).
``--budget-s`` scales them all to another total. The budgets are estimates: no GPU run has been timed yet.

Exit status: 0 when every tier ran and passed (a pytest tier must pass at least one test, not skip them all); 1 when
one failed or was killed; 2 without CUDA, after the listing for 1, 2 and 8 GPUs (nothing was proven on a GPU).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"
ALPACA = SHARED_DATA / "alpaca" / "alpaca_data_52k.jsonl"
QWEN2_TOKENIZER = SHARED_DATA / "tokenizers" / "qwen2"
BUNDLED_DATA = REPO / "ddptrain" / "assets" / "tiny_instruct.jsonl"
BUNDLED_TOKENIZER = REPO / "ddptrain" / "assets" / "tiny_tokenizer"
VARIANTS = "ddptrain:length_grouped,ddptrain:packed,hf:group_by_length"
LISTED_GPU_COUNTS = (1, 2, 8)
Row = tuple[str, str, str, float]  # (tier, check, result, seconds)


@dataclass(frozen=True)
class Tier:
    """One bounded step of the check: a pytest file (``tests``) or the throughput benchmark (``tests`` empty)."""

    key: str
    title: str
    tests: tuple[str, ...]
    min_gpus: int
    budget_s: float  # on ``min_gpus`` GPUs
    per_more_gpu_s: float = 0.0  # added for each GPU beyond ``min_gpus``

    def budget(self, gpus: int) -> float:
        return self.budget_s + self.per_more_gpu_s * (gpus - self.min_gpus)


TIERS = (
    # Not yet timed on a GPU (none lent so far): the shared tier is three 2-rank runs (a compile among them), so it
    # gets the most; each tier also gets what the ones before it left unused. 1 GPU: 470 s in all.
    Tier("one-gpu", "one GPU, one process", ("tests/gpu/test_gpu.py",), 1, 120),
    Tier("shared-gpu", "2 ranks on one GPU (gloo)", ("tests/gpu/test_gpu_shared.py",), 1, 180),
    Tier("memory-plan", "memory plan vs max_memory_reserved", ("tests/gpu/test_gpu_plan.py",), 1, 40),
    Tier("nccl", "NCCL, a GPU per rank (2 ranks)", ("tests/gpu/test_gpu_ddp.py",), 2, 240),
    Tier("throughput", "throughput: ddptrain vs transformers Trainer", (), 1, 130, per_more_gpu_s=10),
)


def tiers_for(gpus: int, tiers: tuple[Tier, ...] = TIERS) -> list[Tier]:
    return [t for t in tiers if gpus >= t.min_gpus]


def total_budget(gpus: int, tiers: tuple[Tier, ...] = TIERS) -> float:
    return sum(t.budget(gpus) for t in tiers_for(gpus, tiers))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print each tier's tests and budget; run nothing")
    parser.add_argument("--gpus", type=int, default=None, help="plan for N GPUs (default: every visible one)")
    parser.add_argument("--data", type=Path, default=None, help="Alpaca .jsonl (default: ../shared/data, or bundled)")
    parser.add_argument("--tokenizer", type=Path, default=None, help="tokenizer folder matching --data")
    parser.add_argument("--budget-s", type=float, default=None, help="total wall-clock limit (default: the tiers')")
    parser.add_argument("--bench-steps", type=int, default=20, help="measured benchmark steps per job")
    parser.add_argument("--keep", type=Path, default=None, help="keep reports and benchmark runs here")
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- listing


@functools.cache
def collected(files: tuple[str, ...]) -> tuple[str, ...]:
    """The test ids pytest collects from ``files`` (collection needs no GPU: the skips apply when tests run).

    Raises:
        RuntimeError: pytest could not collect them (an import error), with its output.
    """
    if not files:
        return ()
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    ids = tuple(line.strip() for line in result.stdout.splitlines() if "::" in line)
    if result.returncode != 0 or not ids:
        raise RuntimeError(f"pytest could not collect {' '.join(files)}:\n{result.stdout[-3000:]}{result.stderr}")
    return ids


def tier_tests(tier: Tier) -> list[str]:
    """The test ids of one tier, or the benchmark's command for the throughput tier."""
    if not tier.tests:
        return ["python -m ddptrain.bench.throughput --gpu --nproc <GPUs> --variants " + VARIANTS]
    everything = collected(tuple(f for t in TIERS for f in t.tests))  # one collection for every tier
    return [i for i in everything if i.split("::")[0] in tier.tests]


def listing(counts: tuple[int, ...], scale: float = 1.0) -> str:
    lines = []
    for gpus in counts:
        tiers = tiers_for(gpus)
        plural = "s" if gpus > 1 else ""
        lines.append(f"\n== {gpus} GPU{plural}: {len(tiers)} tiers, budget {total_budget(gpus) * scale:.0f} s in all")
        for tier in tiers:
            tests = tier_tests(tier)
            what = f"{len(tests)} tests" if tier.tests else "1 benchmark"
            lines.append(f"-- {tier.key} ({tier.title}): {what}, budget {tier.budget(gpus) * scale:.0f} s")
            lines += [f"   {test}" for test in tests]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- running


def run_bounded(command: list[str], limit_s: float, stdout: int | None = None) -> tuple[int | None, str]:
    """Run ``command`` in its own process group; after ``limit_s`` kill the whole group.

    Returns:
        (exit status, or None when it was killed for time; its stdout when ``stdout`` is PIPE, else "").
    """
    proc = subprocess.Popen(command, cwd=REPO, stdout=stdout, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=max(limit_s, 1))
        return proc.returncode, out or ""
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # pytest's or the benchmark's workers too
        out, _ = proc.communicate()
        return None, out or ""


def test_rows(report: Path) -> list[tuple[str, str, float]]:
    """(test, outcome, seconds) for every test case in a pytest JUnit XML report; a test's ``row`` property (the
    memory plan's figures) is its outcome's detail."""
    rows = []
    for case in ET.parse(report).getroot().iter("testcase"):
        detail = next((p.get("value", "") for p in case.iter("property") if p.get("name") == "row"), "")
        outcome = f"passed: {detail}" if detail else "passed"
        for tag, word in (("failure", "FAILED"), ("error", "ERROR"), ("skipped", "skipped")):
            found = case.find(tag)
            if found is not None:
                reason = detail or (found.get("message") or "").replace("\n", " ")[:70]
                outcome = f"{word}: {reason}" if reason else word
                break
        rows.append((case.get("name", "?"), outcome, float(case.get("time", 0))))
    return rows


def run_test_tier(tier: Tier, limit_s: float, work: Path) -> tuple[bool, list[Row]]:
    """One pytest call for the tier, with its own JUnit report. Returns (passed, rows)."""
    report = work / f"{tier.key}.xml"
    report.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", *tier.tests, "-q", "-rA", "-p", "no:cacheprovider",
               "-o", "junit_family=xunit1", f"--junitxml={report}"]  # fmt: skip
    started = time.monotonic()
    status, _ = run_bounded(command, limit_s)
    seconds = time.monotonic() - started
    if status is None:
        return False, [(tier.key, "(the whole tier)", f"FAILED: killed after {limit_s:.0f} s", seconds)]
    if not report.is_file():
        return False, [(tier.key, "(the whole tier)", f"FAILED: pytest exited {status} without a report", seconds)]
    rows = [(tier.key, name, outcome, s) for name, outcome, s in test_rows(report)]
    ok = status == 0 and any(outcome.startswith("passed") for _, _, outcome, _ in rows)  # not all skipped
    if status != 0 and not rows:
        rows = [(tier.key, "(the whole tier)", f"FAILED: pytest exited {status}", seconds)]
    return ok, rows


def bench_rows(stdout: str, seconds: float) -> list[tuple[str, str, float]]:
    """One row per benchmark variant, from the benchmark's --json output."""
    report = json.loads(stdout[stdout.index('{\n  "setup"') :])
    results = report["results"]
    hf = max((v["tokens_per_s"] for k, v in results.items() if k.startswith("hf:")), default=None)
    rows = []
    for name, v in results.items():
        ratio = f", {v['tokens_per_s'] / hf:.2f}× HF" if hf else ""
        memory = f", peak {max(v['peak_cuda_mb'])} MB" if v.get("peak_cuda_mb") else ""
        mfu = f", MFU {v['mfu']:.1%}" if v.get("mfu") is not None else ""
        rows.append((name, f"{v['tokens_per_s']:,.0f} real tok/s{ratio}{mfu}{memory}", v["job_wall_s"]))
    return rows or [("bench", "no results", seconds)]


def run_bench_tier(tier: Tier, limit_s: float, work: Path, args: argparse.Namespace, gpus: int) -> tuple[bool, list]:
    data, tokenizer, _ = bench_data(args)
    command = [
        sys.executable, "-m", "ddptrain.bench.throughput", "--gpu", "--nproc", str(gpus), "--data", str(data),
        "--tokenizer", str(tokenizer), "--steps", str(args.bench_steps), "--warmup", "4", "--variants", VARIANTS,
        "--workdir", str(work / "bench"), "--json",
    ]  # fmt: skip
    started = time.monotonic()
    status, stdout = run_bounded(command, limit_s, stdout=subprocess.PIPE)
    seconds = time.monotonic() - started
    (work / "bench.json").write_text(stdout)
    if status is None:
        return False, [(tier.key, "bench", f"FAILED: killed after {limit_s:.0f} s", seconds)]
    if status != 0:
        return False, [(tier.key, "bench", f"FAILED: exit {status} (its output is above)", seconds)]
    return True, [(tier.key, name, outcome, s) for name, outcome, s in bench_rows(stdout, seconds)]


def run_tiers(tiers: list[Tier], gpus: int, scale: float, work: Path, args: argparse.Namespace) -> tuple[bool, list]:
    """Each tier in turn, bounded by its budget plus what the tiers before it left unused. Returns (all passed, rows
    of every tier, the killed ones included)."""
    ok, rows, carried = True, [], 0.0
    for tier in tiers:
        limit = tier.budget(gpus) * scale + carried
        started = time.monotonic()
        if tier.tests:
            passed, found = run_test_tier(tier, limit, work)
        else:
            passed, found = run_bench_tier(tier, limit, work, args, gpus)
        carried = max(0.0, limit - (time.monotonic() - started))
        ok, rows = ok and passed, rows + found
    return ok, rows


def bench_data(args: argparse.Namespace) -> tuple[Path, Path, bool]:
    """(data, tokenizer, bundled): --data/--tokenizer, else ../shared/data when present, else the bundled rows."""
    bundled = args.data is None and not (ALPACA.is_file() and QWEN2_TOKENIZER.is_dir())
    data = args.data or (BUNDLED_DATA if bundled else ALPACA)
    return data, args.tokenizer or (BUNDLED_TOKENIZER if bundled else QWEN2_TOKENIZER), bundled


def print_table(title: str, rows: list[Row]) -> None:
    print(f"\n{title}\n\n| tier | check | result | s |\n|---|---|---|---|")
    for tier, name, outcome, seconds in rows:
        print(f"| {tier} | {name} | {outcome} | {seconds:.0f} |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    visible = torch.cuda.device_count() if cuda else 0
    gpus = args.gpus or visible
    if args.list or not cuda:
        counts = (args.gpus,) if args.gpus else LISTED_GPU_COUNTS
        scale = args.budget_s / total_budget(counts[0]) if args.budget_s and len(counts) == 1 else 1.0
        print("gpu-check would run, per GPU count (tier, checks, time budget):" + listing(counts, scale))
        if not args.list:
            print("\ngpu-check: no CUDA device: nothing run (torch sees none); run on a GPU machine.", file=sys.stderr)
            return 2
        return 0
    if gpus > visible:
        print(f"gpu-check: --gpus {gpus} but only {visible} GPU(s) visible.", file=sys.stderr)
        return 2
    if gpus < visible:  # the tiers' processes see the first N: 2 ranks share one GPU only where there is one
        shown = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(visible)))).split(",")
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(shown[:gpus])
    started = time.monotonic()
    work = args.keep or Path(tempfile.mkdtemp(prefix="ddptrain-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    scale = args.budget_s / total_budget(gpus) if args.budget_s else 1.0
    ok, rows = run_tiers(tiers_for(gpus), gpus, scale, work, args)
    data, _, bundled = bench_data(args)
    source = "bundled tiny_instruct + tiny tokenizer (no ../shared/data)" if bundled else data.name
    title = (
        f"gpu-check: {gpus} of {visible} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA "
        f"{torch.version.cuda}; bench: {gpus} process(es), bf16, {args.bench_steps} steps, data {source}; "
        f"{time.monotonic() - started:.0f} s of {total_budget(gpus) * scale:.0f}; reports in {work}"
    )
    print_table(title, rows)
    print("\ngpu-check: " + ("passed" if ok else "FAILED (see the rows above)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
