"""``make gpu-check``: on a GPU machine, tests/gpu and then the GPU throughput benchmark, then one short table.

    python scripts/gpu_check.py [--data ALPACA.jsonl --tokenizer QWEN2_DIR] [--keep DIR]

1. ``python -m pytest tests/gpu``: on one GPU, fp16 and bf16 bases, bf16 autocast, the default precision,
   flash-attention and sdpa on packed rows against the same samples run alone (logits), Liger, torch.compile,
   gradient checkpointing; with 2 or more GPUs, 2-rank NCCL runs (tests/gpu/test_gpu_ddp.py): accumulation,
   gradient checkpointing, eval, save and a bit-identical resume, compile under DDP, torchrun, bf16_compress,
   one GPU per rank's process.
2. ``python -m ddptrain.bench.throughput --gpu --nproc <every visible GPU>``: ddptrain (length_grouped, packed)
   and the transformers Trainer (group_by_length) on the same model, precision (bf16) and rows; real tokens/s,
   MFU against the GPU's bf16 peak, and peak memory.
   Its data is ../shared/data (real Alpaca, Qwen2 tokenizer) when present, else the bundled
   tiny_instruct rows and tiny tokenizer (the table says which).

Both stay within ``--budget-s`` (570 s) on one GPU; the table comes last, and the exit status is 0 only
when no test failed and the benchmark ran. Without CUDA it stops at once: "no CUDA device: run on a GPU
machine".
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"
ALPACA = SHARED_DATA / "alpaca" / "alpaca_data_52k.jsonl"
QWEN2_TOKENIZER = SHARED_DATA / "tokenizers" / "qwen2"
BUNDLED_DATA = REPO / "ddptrain" / "assets" / "tiny_instruct.jsonl"
BUNDLED_TOKENIZER = REPO / "ddptrain" / "assets" / "tiny_tokenizer"
VARIANTS = "ddptrain:length_grouped,ddptrain:packed,hf:group_by_length"
MIN_BENCH_S = 150  # what the benchmark needs at least (3 jobs of 24 steps each, with start-up)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=None, help="Alpaca .jsonl (default: ../shared/data, or bundled)")
    parser.add_argument("--tokenizer", type=Path, default=None, help="tokenizer folder matching --data")
    parser.add_argument("--budget-s", type=float, default=570, help="wall-clock limit for tests + benchmark")
    parser.add_argument("--bench-steps", type=int, default=20, help="measured benchmark steps per job")
    parser.add_argument("--keep", type=Path, default=None, help="keep reports and benchmark runs here")
    return parser.parse_args(argv)


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
    """(test, outcome, seconds) for every test case in a pytest JUnit XML report."""
    rows = []
    for case in ET.parse(report).getroot().iter("testcase"):
        outcome = "passed"
        for tag, word in (("failure", "FAILED"), ("error", "ERROR"), ("skipped", "skipped")):
            found = case.find(tag)
            if found is not None:
                reason = (found.get("message") or "").replace("\n", " ")
                outcome = f"{word}: {reason[:70]}" if reason else word
                break
        rows.append((case.get("name", "?"), outcome, float(case.get("time", 0))))
    return rows


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
        rows.append((f"bench {name}", f"{v['tokens_per_s']:,.0f} real tok/s{ratio}{mfu}{memory}", v["job_wall_s"]))
    return rows or [("bench", "no results", seconds)]


def print_table(title: str, rows: list[tuple[str, str, float]]) -> None:
    print(f"\n{title}\n\n| check | result | s |\n|---|---|---|")
    for name, outcome, seconds in rows:
        print(f"| {name} | {outcome} | {seconds:.0f} |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device: run on a GPU machine (torch sees none).", file=sys.stderr)
        return 2
    started = time.monotonic()
    work = args.keep or Path(tempfile.mkdtemp(prefix="ddptrain-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    bundled = args.data is None and not (ALPACA.is_file() and QWEN2_TOKENIZER.is_dir())
    data = args.data or (BUNDLED_DATA if bundled else ALPACA)
    tokenizer = args.tokenizer or (BUNDLED_TOKENIZER if bundled else QWEN2_TOKENIZER)

    nproc = torch.cuda.device_count()  # every visible GPU: the benchmark's ranks, as a real job would use them
    report = work / "gpu-tests.xml"
    tests_limit = args.budget_s - MIN_BENCH_S
    pytest_command = [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-rA", "-p", "no:cacheprovider"]
    status, _ = run_bounded([*pytest_command, f"--junitxml={report}"], tests_limit)
    rows = test_rows(report) if report.is_file() else []
    tests_ok = status == 0 and any(outcome == "passed" for _, outcome, _ in rows)  # not all skipped
    if status is None:
        rows.append(("tests/gpu", f"FAILED: killed after {tests_limit:.0f} s", tests_limit))
    elif not rows:
        rows.append(("tests/gpu", f"FAILED: pytest exited {status} without a report", time.monotonic() - started))

    bench_command = [
        sys.executable, "-m", "ddptrain.bench.throughput", "--gpu", "--nproc", str(nproc), "--data", str(data),
        "--tokenizer", str(tokenizer), "--steps", str(args.bench_steps), "--warmup", "4", "--variants", VARIANTS,
        "--workdir", str(work / "bench"), "--json",
    ]  # fmt: skip
    bench_limit = args.budget_s - (time.monotonic() - started)
    bench_started = time.monotonic()
    status, stdout = run_bounded(bench_command, bench_limit, stdout=subprocess.PIPE)
    bench_s = time.monotonic() - bench_started
    (work / "bench.json").write_text(stdout)
    bench_ok = status == 0
    if status is None:
        rows.append(("bench", f"FAILED: killed after {bench_limit:.0f} s", bench_s))
    elif status != 0:
        rows.append(("bench", f"FAILED: exit {status} (its output is above)", bench_s))
    else:
        rows += bench_rows(stdout, bench_s)

    name = torch.cuda.get_device_name(0)
    source = "bundled tiny_instruct + tiny tokenizer (no ../shared/data)" if bundled else f"{data.name}"
    title = (
        f"gpu-check: {torch.cuda.device_count()} x {name}, torch {torch.__version__}, CUDA {torch.version.cuda}; "
        f"bench: {nproc} process(es), bf16, {args.bench_steps} steps, data {source}; "
        f"{time.monotonic() - started:.0f} s; "
        f"reports in {work}"
    )
    print_table(title, rows)
    ok = tests_ok and bench_ok
    print("\ngpu-check: " + ("passed" if ok else "FAILED (see the rows above)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
