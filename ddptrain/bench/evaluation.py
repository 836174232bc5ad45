"""What evaluating and proving a save cost: eval on 1 rank against 2 ranks, and the save check against the save.

    python -m ddptrain.bench.evaluation --data ../shared/data/alpaca/alpaca_data_52k.jsonl
    python -m ddptrain.bench.evaluation --save-check-only

Eval: the bundled tiny model on an eval split of ``--eval-rows`` rows (odd), evaluated by the product's
``evaluation.metrics.evaluate`` in a 1-rank and a 2-rank group, interleaved ``--repeats`` times (one thread per rank,
as CPU runs here use); each timing is the fastest of ``--passes`` passes over the split, after one warm-up pass.
It prints both times, their ratio and the two eval losses (they must agree to 1e-6: the same batches, summed in
float64).

Save check: a LoRA adapter (r 16, every linear) of the bundled tiny model and of Qwen2.5-0.5B (random weights from
its architecture config) saved as a checkpoint with and without ``trainer.save_check`` (the default, ``every``, at a
save before the last: the read-back), the read-back alone, and the round trip through plain peft alone (on one thread
and on all cores, beside the model and mirrored on the host as a GPU run checks); the fastest of ``--repeats``. What
the checks cost a run: ``python -m ddptrain.bench.save_check``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from ddptrain.config import RunConfig

EVAL_FILE = "eval-times.json"


def time_evaluations(cfg: RunConfig, run_dir: str, store_port: int | None) -> None:
    """Worker: build the run (no training), evaluate ``passes`` times; rank 0 writes the times and the loss."""
    from ddptrain import parallel
    from ddptrain.evaluation.metrics import evaluate
    from ddptrain.trainer import Trainer

    env = parallel.init_distributed(cfg.parallel, cfg.trainer.device, store_port)
    try:
        trainer = Trainer(cfg, env, Path(run_dir))
        passes = int(os.environ["DDPTRAIN_BENCH_PASSES"])
        times, metrics = [], {}
        for _ in range(passes + 1):  # the first pass warms up
            parallel.barrier()
            start = time.perf_counter()
            metrics = evaluate(trainer.loss_module, trainer.data.eval_batches(), trainer.autocast, env.device)
            times.append(time.perf_counter() - start)
        if env.is_rank_zero:
            lengths = [int(n) for n in trainer.data.eval["length"]]
            record = {"seconds": min(times[1:]), "eval_loss": metrics["eval_loss"], "lengths": lengths}
            (Path(run_dir) / EVAL_FILE).write_text(json.dumps(record))
    finally:
        parallel.teardown()


def eval_config(data: str | None, ranks: int, eval_rows: int, output: Path) -> RunConfig:
    from ddptrain.preview import compose_run_config

    rows = 4 * eval_rows + 1
    overrides = [
        f"parallel.nproc_per_node={ranks}",
        "parallel.start_method=forkserver",
        "trainer.device=cpu",
        "trainer.progress_bar=false",
        "trainer.resume=none",
        f"trainer.output_dir={output}",
        f"data.max_rows={rows}",
        f"data.eval_fraction={eval_rows / rows}",
    ]
    if data:
        overrides += ["data=alpaca", f"data.path={data}"]
    return compose_run_config(overrides, None, "train")


def bench_eval(args: argparse.Namespace) -> None:
    from ddptrain.data.plan import eval_batch_plan
    from ddptrain.launch import launch

    os.environ["DDPTRAIN_BENCH_PASSES"] = str(args.passes)
    results: dict[int, list[dict]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for ranks in (1, 2):
                run_dir = Path(tmp) / f"r{repeat}-{ranks}"
                run_dir.mkdir()
                launch(eval_config(args.data, ranks, args.eval_rows, Path(tmp)), run_dir, entrypoint=time_evaluations)
                results[ranks].append(json.loads((run_dir / EVAL_FILE).read_text()))
    one, two = (min(r["seconds"] for r in results[n]) for n in (1, 2))
    losses = {n: results[n][0]["eval_loss"] for n in (1, 2)}
    lengths = results[1][0]["lengths"]
    print(f"eval split: {len(lengths)} rows ({'Alpaca' if args.data else 'bundled tiny_instruct'})")
    print(f"padded tokens per rank: {padded_per_rank(lengths, 8, eval_batch_plan(lengths, 8, 2))} as planned;")
    dealt = eval_batch_plan(lengths, 8, 1)[0]
    dealt = sorted(dealt, key=lambda b: lengths[b[-1]])
    print(f"  {padded_per_rank(lengths, 8, [dealt[0::2], dealt[1::2]])} dealt round-robin by length")
    print("| ranks | eval s (fastest) | eval loss |")
    print("|---:|---:|---:|")
    for n in (1, 2):
        print(f"| {n} | {min(r['seconds'] for r in results[n]):.3f} | {losses[n]:.10f} |")
    print(f"2 ranks / 1 rank: {two / one:.2f}x; |eval loss difference| {abs(losses[1] - losses[2]):.2e}")


def padded_per_rank(lengths: list[int], micro_batch_size: int, plan: list[list[list[int]]]) -> list[int]:
    return [sum(len(b) * max(lengths[i] for i in b) for b in batches) for batches in plan]


def lora_as_if_trained(overrides: list[str]) -> tuple[Any, torch.nn.Module, Any]:
    """The run config of ``overrides`` on the CPU, its LoRA model with ``lora_B`` drawn as if trained (it starts at
    zero: the adapter would do nothing), and its tokenizer."""
    from ddptrain.model import build_model, build_tokenizer
    from ddptrain.preview import compose_run_config

    cfg = compose_run_config([*overrides, "trainer.device=cpu"], None, "train")
    torch.manual_seed(0)
    module = build_model(cfg.model, seed=0, device=torch.device("cpu"))
    for name, p in module.named_parameters():
        if "lora_B" in name:
            p.data.normal_(std=0.02)
    return cfg, module, build_tokenizer(cfg.model)


def bench_save_check(model: str, repeats: int) -> dict[str, float]:
    """Seconds to save a checkpoint without and with the check (``trainer.save_check=every`` at a save before the
    last: the read-back), of the read-back alone, and of the round trip through plain peft beside the model and
    mirrored on the host (fastest of ``repeats``; the round trip on one thread and on all cores)."""
    from ddptrain import checkpoint
    from ddptrain.config import SaveCheckMode
    from ddptrain.evaluation import host
    from ddptrain.evaluation.peft_check import PeftRoundTrip, Probe
    from ddptrain.evaluation.readback import ReadBack
    from ddptrain.evaluation.save_check import build_save_checks
    from ddptrain.model.precision import TORCH_DTYPES

    overrides = [f"model={model}"]
    if model != "tiny_qwen2":
        overrides += ["model.init=random", "model.tokenizer=${asset:tiny_tokenizer}"]
    cfg, module, tokenizer = lora_as_if_trained(overrides)
    rows = [tokenizer("Sort 3, 1, 2.").input_ids, tokenizer("Reverse: red sparrow").input_ids]
    probe = Probe.from_rows(rows, 0)
    dtype, attn = TORCH_DTYPES[cfg.model.dtype], cfg.model.attn_implementation.value
    round_trip = PeftRoundTrip(module.model, probe, dtype, attn)
    mirrored = PeftRoundTrip(module.model, probe, dtype, attn, on_cpu=True)  # as a GPU run checks, on the host
    files = checkpoint.AdapterFiles(tokenizer, cfg.model, seed=0)
    names = ("save", "save with the check", "the read-back alone", "round trip, 1 thread", "round trip, all cores")
    timings: dict[str, list[float]] = {name: [] for name in (*names, "mirrored, all cores")}
    with tempfile.TemporaryDirectory() as tmp:
        base = checkpoint.base_model_path(cfg.model, Path(tmp))
        checks = build_save_checks(SaveCheckMode.every, module.model, base, dtype, attn, rows, 0, on_gpu=False)
        read_back = ReadBack(module.model, base)
        plain = checkpoint.CheckpointWriter(Path(tmp), keep_last_n=1, files=files)
        checked = checkpoint.CheckpointWriter(Path(tmp), keep_last_n=1, files=files, check=checks)
        meta = {"epoch": 0, "position": 0}
        plain.save(module.model, {"step": 0}, {"step": 0, **meta})  # writes the random base once, outside the timing
        for step in range(1, repeats + 1):
            for name, writer in (("save", plain), ("save with the check", checked)):
                start = time.perf_counter()
                folder = writer.save(module.model, {"step": step}, {"step": step, **meta}) / checkpoint.WEIGHTS
                timings[name].append(time.perf_counter() - start)
            start = time.perf_counter()
            read_back(folder, folder)
            timings["the read-back alone"].append(time.perf_counter() - start)
            for name, alone, cores in (
                ("round trip, 1 thread", round_trip, 1),
                ("round trip, all cores", round_trip, host.host_cores()),
                ("mirrored, all cores", mirrored, host.host_cores()),
            ):
                with mock.patch.object(host, "host_cores", lambda n=cores: n):  # what the check raises threads to
                    start = time.perf_counter()
                    alone([(folder, folder)])
                    timings[name].append(time.perf_counter() - start)
    return {name: min(values) for name, values in timings.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ddptrain.bench.evaluation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", help="an Alpaca-style .jsonl (default: the bundled tiny_instruct rows)")
    parser.add_argument("--eval-rows", type=int, default=401)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--save-check-only", action="store_true")
    parser.add_argument("--models", nargs="+", default=["tiny_qwen2", "qwen2_5_0_5b_lora"])
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if not args.save_check_only:
            bench_eval(args)
        names = ("save", "save with the check", "the read-back alone", "round trip, 1 thread", "round trip, all cores")
        print("| model | " + " | ".join(f"{n} s" for n in (*names, "mirrored, all cores")) + " |")
        print("|---|" + "---:|" * (len(names) + 1))
        for model in args.models:
            with contextlib.redirect_stderr(open(os.devnull, "w")):
                found = bench_save_check(model, args.repeats)
            cells = [found[k] for k in (*names, "mirrored, all cores")]
            print(f"| {model} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    finally:
        torch.set_num_threads(threads)  # called in-process (tests/e2e/test_bench.py): the caller's threads back


if __name__ == "__main__":
    main()
