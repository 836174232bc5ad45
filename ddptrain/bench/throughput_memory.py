"""Gradient checkpointing's effect on activation memory (``python -m ddptrain.bench.throughput --memory``).

The benchmark model (``throughput_model.MODEL_CONFIG``), built by ddptrain's ``build_model`` with and
without ``model.gradient_checkpointing``, runs one forward + backward of ddptrain's loss module on
``--micro-batch-size`` rows of ``--memory-length`` tokens: real Alpaca samples (ddptrain's
tokenization, prompt masked) laid end to end, the first token of each sample not a target, as
packing does.

Each measurement runs in a fresh process (peak RSS never goes down) with one thread and
``MALLOC_MMAP_THRESHOLD_=65536``, so that freed activations go back to the OS and RSS follows the
live heap. A thread samples RSS (``/proc/self/statm``) every 0.2 ms during the pass; the activation
peak is the highest RSS minus the RSS just before the forward (weights, batch and allocator state
from a small warm-up pass already in). Two scopes are measured:

- ``loss``: what training runs, decoder + LM head on the target positions + cross-entropy;
- ``decoder``: the transformer blocks alone (backward from the sum of the last hidden state), the
  part that checkpointing recomputes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ddptrain.bench.throughput_model import LORA_RANK, write_model_config

PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRss:
    """Highest RSS seen by a sampling thread while the block runs (torch ops release the GIL)."""

    def __enter__(self) -> PeakRss:
        self.peak = self.base = _rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes())
            time.sleep(0.0002)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())


def packed_rows(args: argparse.Namespace, tokenizer) -> dict[str, Any]:
    """``rows`` x ``length`` tokens of real Alpaca samples end to end, with their masked labels."""
    import torch

    from ddptrain.config import DataConfig
    from ddptrain.data import build_datasets

    rows, length = args.micro_batch_size, args.memory_length
    cfg = DataConfig(path=str(args.data), max_length=length, max_rows=rows * length // 40 + 100)
    data = build_datasets(cfg, tokenizer, args.seed).train
    ids: list[int] = []
    labels: list[int] = []
    for sample in data:
        ids += sample["input_ids"]
        labels += [-100, *sample["labels"][1:]]
        if len(ids) >= rows * length:
            break
    n = rows * length
    assert len(ids) >= n, "not enough rows for the memory batch"
    return {
        "input_ids": torch.tensor(ids[:n]).view(rows, length),
        "labels": torch.tensor(labels[:n]).view(rows, length),
        "attention_mask": torch.ones(rows, length, dtype=torch.long),
    }


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One measurement in this (fresh) process: build, warm up, then one measured forward + backward."""
    import torch

    from ddptrain.config import ModelConfig, ModelInit
    from ddptrain.model import build_model, build_tokenizer

    torch.set_num_threads(1)
    cfg = ModelConfig(
        name_or_path=str(args.model_dir),
        init=ModelInit.random,
        tokenizer=str(args.tokenizer),
        lora_rank=LORA_RANK,
        lora_alpha=32,
        lora_dropout=0.0,
        gradient_checkpointing=args.checkpointing,
        loss_chunk_tokens=args.loss_chunk_tokens,
    )
    batch = packed_rows(args, build_tokenizer(cfg))
    module = build_model(cfg, args.seed, torch.device("cpu"))
    module.train()

    def step(b: dict[str, Any]) -> None:
        if args.scope == "loss":
            loss_sum, n = module(**b)
            (loss_sum / n).backward()
        else:
            hidden = module.decoder(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).last_hidden_state
            hidden.sum().backward()

    step({k: v[:1, :64] for k, v in batch.items()})  # lazy initialisation outside the measurement
    module.zero_grad(set_to_none=False)  # gradient buffers exist before the measured pass
    started = time.perf_counter()
    with PeakRss() as rss:
        step(batch)
    seconds = time.perf_counter() - started
    return {
        "checkpointing": args.checkpointing,
        "scope": args.scope,
        "activation_peak_mb": (rss.peak - rss.base) / 2**20,
        "maxrss_minus_base_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - rss.base / 2**20,
        "seconds": seconds,
        "target_tokens": int((batch["labels"][:, 1:] != -100).sum()),
    }


def measure(args: argparse.Namespace, model_dir: Path, checkpointing: bool, scope: str) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "ddptrain.bench.throughput_memory", "--child",
        "--data", str(args.data), "--tokenizer", str(args.tokenizer), "--model-dir", str(model_dir),
        "--micro-batch-size", str(args.micro_batch_size), "--memory-length", str(args.memory_length),
        "--scope", scope, "--seed", str(args.seed), "--loss-chunk-tokens", str(args.loss_chunk_tokens),
    ] + (["--checkpointing"] if checkpointing else [])  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(args: argparse.Namespace, repeats: int = 1) -> None:
    """Interleave with/without checkpointing for each scope; print the table (or JSON)."""
    import tempfile

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ddptrain-bench-mem-"))
    model_dir = write_model_config(workdir)
    runs: list[dict[str, Any]] = []
    for _ in range(repeats):
        for scope in ("loss", "decoder"):
            for checkpointing in (False, True):
                runs.append(measure(args, model_dir, checkpointing, scope))
                print(f"[bench] {runs[-1]}", file=sys.stderr, flush=True)
    rows = []
    for scope in ("loss", "decoder"):
        off = [r for r in runs if r["scope"] == scope and not r["checkpointing"]]
        on = [r for r in runs if r["scope"] == scope and r["checkpointing"]]
        peak_off = statistics.median(r["activation_peak_mb"] for r in off)
        peak_on = statistics.median(r["activation_peak_mb"] for r in on)
        time_off = statistics.median(r["seconds"] for r in off)
        time_on = statistics.median(r["seconds"] for r in on)
        rows.append((scope, peak_off, peak_on, 1 - peak_on / peak_off, time_off, time_on))
    if args.json:
        print(json.dumps({"runs": runs}, indent=2))
        return
    print(
        f"{args.micro_batch_size} rows x {args.memory_length} tokens, fp32, 1 thread, one forward + backward, "
        f"model.loss_chunk_tokens={args.loss_chunk_tokens}"
    )
    print("| scope | activation peak, no checkpointing (MB) | with checkpointing (MB) | saved | s (off → on) |")
    print("|---|---|---|---|---|")
    for scope, off, on, saved, t_off, t_on in rows:
        print(f"| {scope} | {off:.0f} | {on:.0f} | {saved:.0%} | {t_off:.2f} → {t_on:.2f} |")


def _child_main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--memory-length", type=int, default=1024)
    parser.add_argument("--scope", choices=("loss", "decoder"), default="loss")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--loss-chunk-tokens", type=int, default=512)
    print(json.dumps(child(parser.parse_args())))


if __name__ == "__main__":
    _child_main()
