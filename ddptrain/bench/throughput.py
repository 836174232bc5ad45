"""Training throughput: ddptrain vs the transformers Trainer vs a hand-written DDP loop.

Run from the repository root (2 CPU processes, gloo; about 8 minutes on 2 cores):

    python -m ddptrain.bench.throughput --data ../shared/data/alpaca/alpaca_data_52k.jsonl \\
        --tokenizer ../shared/data/tokenizers/qwen2 --steps 30 --warmup 5

Every way trains the same model (a 4-layer, 256-wide Qwen2 with the real 151,936-token vocabulary,
random weights from one seed, LoRA r=16 on every linear layer) on the same first ``--rows`` Alpaca
rows, tokenized once by ddptrain (Alpaca prompt masked out of the labels, EOS appended, cut at
``--max-length``), with 8 rows per rank per step (or, for token_budget and packed, the same padded
tokens per micro-batch on average), no accumulation, the same precision, AdamW and clipping. Each
is its own 2-process DDP job started through ``ddptrain.launch.launch``:

- ``ddptrain``: ``python -m ddptrain`` minus Hydra's command line: ``launch.worker`` -> ``Trainer.fit``,
  once per batching mode (length_grouped is the default; token_budget and packed);
- ``hf``: transformers ``Trainer`` with its ``train_sampling_strategy`` (group_by_length,
  batch_rebalance), the peft model, a padding collator and the model's own loss;
- ``hand``: plain ``DDP`` over ddptrain's loss module fed ddptrain's exact micro-batches; the floor
  for framework overhead;
- ``untimed``: ``ddptrain`` with ``trainer.timing=false`` (no step clock, DDP's built-in all-reduce
  instead of the timed Python comm hook): what measuring costs (``make bench-timing``).

Throughput is real (non-padding) tokens of all ranks over the measured steps divided by their wall
time (end of the last warm-up step to end of the last step). Peak RSS is each rank's ``ru_maxrss``.
With CUDA (``--gpu``, or automatic when a GPU is visible) the same jobs run with nccl and bf16 and
the table adds MFU. ``--memory`` measures what gradient checkpointing saves instead (see
``throughput_memory.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddptrain.bench.throughput_model import LORA_RANK, MODEL_CONFIG, write_model_config

DEFAULT_VARIANTS = (
    "ddptrain:length_grouped",
    "ddptrain:token_budget",
    "ddptrain:packed",
    "hand:token_budget",
    "hf:group_by_length",
)


@dataclass(frozen=True)
class Variant:
    """One way of training: ``kind`` (ddptrain, hf, hand) and its batching (or HF's strategy)."""

    kind: str
    batching: str

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.batching}"

    @classmethod
    def parse(cls, text: str) -> Variant:
        kind, _, batching = text.partition(":")
        modes = {"ddptrain": ("random", "length_grouped", "token_budget", "packed"),
                 "untimed": ("random", "length_grouped", "token_budget", "packed"),
                 "hand": ("random", "length_grouped", "token_budget", "packed"),
                 "hf": ("random", "group_by_length", "batch_rebalance")}  # fmt: skip
        if batching not in modes.get(kind, ()):
            raise ValueError(
                f"--variants {text}: expected KIND:MODE with KIND:MODE one of "
                + ", ".join(f"{k}:{m}" for k, ms in modes.items() for m in ms)
            )
        return cls(kind, batching)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="Alpaca-style .jsonl file")
    parser.add_argument("--tokenizer", required=True, help="tokenizer directory (Qwen2)")
    parser.add_argument("--steps", type=int, default=20, help="measured optimizer steps")
    parser.add_argument("--warmup", type=int, default=4, help="steps run before measuring")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default=None, help="fp32 on CPU, bf16 on GPU")
    parser.add_argument("--rows", type=int, default=2000, help="use the first N rows of --data")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=8, help="rows per rank per step")
    parser.add_argument("--nproc", type=int, default=2, help="DDP processes")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="comma-separated KIND:MODE")
    parser.add_argument("--repeats", type=int, default=1, help="run the variant list N times (order rotated)")
    parser.add_argument("--gpu", action="store_true", help="require CUDA: nccl, bf16 and MFU (default when visible)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="per-GPU peak for MFU")
    parser.add_argument("--memory", action="store_true", help="gradient-checkpointing memory check instead")
    parser.add_argument("--memory-length", type=int, default=1024, help="--memory: tokens per row")
    parser.add_argument("--loss-chunk-tokens", type=int, default=512, help="--memory: model.loss_chunk_tokens")
    parser.add_argument("--workdir", type=Path, default=None, help="keep run folders here (default: a temp dir)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be at least 1 (the clock starts at the end of warm-up).")
    return args


# ----------------------------------------------------------------------------- setup


def compose(overrides: list[str]):
    """The real Hydra config, composed as ``python -m ddptrain <overrides>`` would."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from ddptrain.cli import CONF_DIR
    from ddptrain.config import register_configs, to_run_config

    register_configs()
    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        return to_run_config(hydra_compose("train", overrides=overrides))


def base_overrides(args: argparse.Namespace, workdir: Path, model_dir: Path, cuda: bool) -> list[str]:
    return [
        "data=alpaca",
        f"data.path={args.data.resolve()}",
        "data.eval_fraction=0",
        f"data.max_rows={args.rows}",
        f"data.max_length={args.max_length}",
        f"data.micro_batch_size={args.micro_batch_size}",
        f"data.cache_dir={workdir / 'datasets-cache'}",
        "model=tiny_qwen2",
        f"model.name_or_path={model_dir}",
        "model.init=random",
        f"model.tokenizer={Path(args.tokenizer).resolve()}",
        f"model.lora_rank={LORA_RANK}",
        "model.lora_alpha=32",
        "model.lora_dropout=0.0",
        "model.lora_target_modules=all-linear",
        "optim.lr=2e-4",
        "optim.warmup_steps=0",
        "optim.grad_accum_steps=1",
        f"parallel.nproc_per_node={args.nproc}",
        f"parallel.backend={'nccl' if cuda else 'gloo'}",
        f"trainer.device={'cuda' if cuda else 'cpu'}",
        f"trainer.precision={args.precision}",
        f"trainer.seed={args.seed}",
        f"trainer.max_steps={args.warmup + args.steps}",
        # A record at the end of warm-up and at the end, and only a few in between.
        f"trainer.log_every_n_steps={_gcd(args.warmup, args.steps)}",
        "trainer.save_final=false",
        "trainer.progress_bar=false",
        f"trainer.output_dir={workdir / 'outputs'}",
    ]


def _gcd(a: int, b: int) -> int:
    import math

    return math.gcd(a, b)


def token_budget(cfg, nproc: int) -> tuple[int, dict[str, float]]:
    """Padded tokens per micro-batch that match length_grouped's mean (at least one full row).

    Tokenizes the rows once here (the workers then read the datasets cache).

    Returns:
        The budget, and the real tokens per row of the rows used.
    """
    import numpy as np

    from ddptrain.config import Batching
    from ddptrain.data import build_datasets
    from ddptrain.data.plan import BatchingSpec, micro_batch_cost, plan_epoch
    from ddptrain.model import build_tokenizer

    data = build_datasets(cfg.data, build_tokenizer(cfg.model), cfg.trainer.seed)
    lengths = np.asarray(data.train["length"])
    spec = BatchingSpec(
        Batching.length_grouped,
        nproc,
        cfg.data.micro_batch_size,
        cfg.data.max_length,
        pad_to_multiple_of=cfg.data.pad_to_multiple_of,
        seed=cfg.trainer.seed,
    )
    padded = [micro_batch_cost(b, lengths, spec)[1] for step in plan_epoch(lengths, spec, 0) for b in step]
    budget = max(round(statistics.mean(padded)), cfg.data.max_length)
    return budget, {"rows": len(lengths), "mean_len": float(lengths.mean()), "max_len": int(lengths.max())}


# ----------------------------------------------------------------------------- running


def run_variant(variant: Variant, args, workdir: Path, overrides: list[str], index: int) -> dict[str, Any]:
    """One 2-process job; returns the per-rank results merged."""
    from ddptrain.bench.throughput_jobs import run_job
    from ddptrain.launch import launch

    batching = variant.batching if variant.kind != "hf" else "length_grouped"
    # untimed: ddptrain with trainer.timing=false (no step clock, DDP's built-in all-reduce, no comm hook).
    timing = ["trainer.timing=false"] if variant.kind == "untimed" else []
    cfg = compose([*overrides, f"data.batching={batching}", *timing])
    run_dir = workdir / "runs" / f"{index:02d}_{variant.kind}_{variant.batching}"
    run_dir.mkdir(parents=True, exist_ok=True)
    job = {
        "kind": "ddptrain" if variant.kind == "untimed" else variant.kind,
        "warmup": args.warmup,
        "steps": args.steps,
        "hf_strategy": variant.batching,
    }
    (run_dir / "job.json").write_text(json.dumps(job))
    started = time.perf_counter()
    launch(cfg, run_dir, run_job)
    ranks = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(args.nproc)]
    seconds = [r["seconds"] for r in ranks]
    real = sum(r["real_tokens"] for r in ranks)
    target = sum(r["target_tokens"] for r in ranks)
    cpu = sum(r["cpu_seconds"] for r in ranks)
    return {
        "variant": variant.name,
        "seconds": max(seconds),
        "cpu_seconds": cpu,
        "tokens_per_cpu_s": real / cpu,
        "real_tokens": real,
        "target_tokens": target,
        "tokens_per_s": real / max(seconds),
        "s_per_step": max(seconds) / args.steps,
        "peak_rss_mb": [round(r["peak_rss_mb"]) for r in ranks],
        "peak_cuda_mb": [round(r["peak_cuda_mb"]) for r in ranks if "peak_cuda_mb" in r],
        "job_wall_s": time.perf_counter() - started,
    }


def model_flops(real_tokens: int, target_tokens: int) -> float:
    """Training FLOPs the model needs for these tokens (see bench/README.md for the formula).

    Per real token: forward 2*N_base + 2*N_lora, backward 2*N_base (activation gradients only: the
    base is frozen) + 4*N_lora (activation and weight gradients). The LM head (vocab x hidden,
    frozen) runs only where a label is: 2*N_head forward + 2*N_head backward per target token.
    Attention scores (4 * layers * hidden * context per token forward) are left out.
    """
    c = MODEL_CONFIG
    d, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    kv = d // c["num_attention_heads"] * c["num_key_value_heads"]
    linears = [(d, d), (d, kv), (d, kv), (d, d), (d, inter), (d, inter), (inter, d)]
    n_base = layers * sum(i * o for i, o in linears)
    n_lora = layers * sum(LORA_RANK * (i + o) for i, o in linears)
    n_head = c["vocab_size"] * d
    return real_tokens * (4 * n_base + 6 * n_lora) + target_tokens * 4 * n_head


def summarize(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Median over repeats per variant."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by_name.setdefault(r["variant"], []).append(r)
    summary = {}
    for name, runs in by_name.items():
        best = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]
        summary[name] = {
            **best,
            "tokens_per_cpu_s": statistics.median(r["tokens_per_cpu_s"] for r in runs),
            "all_tokens_per_s": [round(r["tokens_per_s"], 1) for r in runs],
        }
    return summary


def table(summary: dict[str, dict[str, Any]], nproc: int, peak_tflops: float | None) -> str:
    """Markdown table with ratios to the HF Trainer (its best strategy) and to the hand loop (same batching)."""
    hf = [v for k, v in summary.items() if k.startswith("hf:")]
    hf_best = max((v["tokens_per_s"] for v in hf), default=None)
    hf_best_cpu = max((v["tokens_per_cpu_s"] for v in hf), default=None)
    lines = [
        "| way | batching | real tok/s (runs) | × HF best | real tok/CPU-s | × HF best | vs hand loop (CPU-s/token) "
        "| s/step | real tok/step | peak RSS MB (per rank) |" + (" MFU |" if peak_tflops else ""),
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if peak_tflops else ""),
    ]
    for name, v in summary.items():
        kind, batching = name.split(":")
        ratio = f"{v['tokens_per_s'] / hf_best:.2f}×" if hf_best else "n/a"
        ratio_cpu = f"{v['tokens_per_cpu_s'] / hf_best_cpu:.2f}×" if hf_best_cpu else "n/a"
        hand = summary.get(f"hand:{batching}")
        vs_hand = "n/a"
        if hand and kind in ("ddptrain", "untimed"):
            vs_hand = f"{hand['tokens_per_cpu_s'] / v['tokens_per_cpu_s'] - 1:+.1%}"
        per_step = v["real_tokens"] / max(1, round(v["seconds"] / v["s_per_step"]))
        rss = " / ".join(str(x) for x in v["peak_rss_mb"])
        runs = ", ".join(f"{x:.0f}" for x in v["all_tokens_per_s"])
        row = (
            f"| {kind} | {batching} | {v['tokens_per_s']:.0f} ({runs}) | {ratio} | {v['tokens_per_cpu_s']:.0f} | "
            f"{ratio_cpu} | {vs_hand} | {v['s_per_step']:.2f} | {per_step:.0f} | {rss} |"
        )
        if peak_tflops:
            mfu = model_flops(v["real_tokens"], v["target_tokens"]) / (v["seconds"] * nproc * peak_tflops * 1e12)
            row += f" {mfu:.1%} |"
        lines.append(row)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.memory:
        from ddptrain.bench.throughput_memory import main as memory_main

        memory_main(args)
        return
    import torch

    cuda = torch.cuda.is_available()
    if args.gpu and not cuda:
        sys.exit("--gpu: this torch build sees no CUDA device; drop --gpu to benchmark on CPU.")
    if cuda and torch.cuda.device_count() < args.nproc:
        sys.exit(f"--nproc {args.nproc} needs {args.nproc} GPUs, {torch.cuda.device_count()} visible.")
    args.precision = args.precision or ("bf16" if cuda else "fp32")
    if not cuda:
        os.environ["OMP_NUM_THREADS"] = "1"  # one core per rank; 2 ranks on 2 cores
    peak = args.peak_tflops
    if cuda and peak is None:  # the product's table of dense peaks (ddptrain/observe/flops.py)
        from ddptrain.config import DType
        from ddptrain.observe.flops import lookup_peak_tflops

        peak = lookup_peak_tflops(torch.cuda.get_device_name(0), DType(args.precision))
    variants = [Variant.parse(v.strip()) for v in args.variants.split(",") if v.strip()]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ddptrain-bench-"))
    overrides = base_overrides(args, workdir, write_model_config(workdir), cuda)
    budget, data_stats = token_budget(compose(overrides), args.nproc)
    overrides.append(f"data.max_tokens_per_batch={budget}")
    results = []
    for repeat in range(args.repeats):
        order = variants[repeat % len(variants) :] + variants[: repeat % len(variants)]
        for variant in order:
            print(f"[bench] repeat {repeat + 1}/{args.repeats}: {variant.name}", file=sys.stderr, flush=True)
            results.append(run_variant(variant, args, workdir, overrides, len(results)))
            print(f"[bench]   {results[-1]['tokens_per_s']:.0f} real tok/s", file=sys.stderr, flush=True)
    summary = summarize(results)
    header = {
        "device": torch.cuda.get_device_name(0) if cuda else f"cpu ({os.cpu_count()} cores)",
        "nproc": args.nproc,
        "precision": args.precision,
        "steps": args.steps,
        "warmup": args.warmup,
        "token_budget": budget,
        **data_stats,
        "torch": torch.__version__,
    }
    if args.json:
        for v in summary.values():  # the table's MFU, for scripts/gpu_check.py
            seconds = v["seconds"] * args.nproc * (peak or 0) * 1e12
            v["mfu"] = model_flops(v["real_tokens"], v["target_tokens"]) / seconds if cuda and peak else None
        print(json.dumps({"setup": {**header, "peak_tflops": peak}, "results": summary, "runs": results}, indent=2))
        return
    print(", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in header.items()))
    print(table(summary, args.nproc, peak if cuda else None))


if __name__ == "__main__":
    main()
