"""What the save check (``trainer.save_check``) costs a run: the checks of the saves an evaluation makes, set beside the
training steps between two evaluations.

    python -m ddptrain.bench.save_check                     # Qwen2.5-0.5B, random init, bf16, CPU
    python -m ddptrain.bench.save_check --models tiny_qwen2 --steps 4

For each model (a LoRA adapter, r 16 on every linear, ``lora_B`` drawn as if trained):

- **a training step**: a run as ``python -m ddptrain`` makes it on this CPU by default (``parallel=ddp2``: 2 ranks,
  one thread each; the bundled tiny_instruct rows, ``data.micro_batch_size=8``) but at ``data.max_length=256``
  (``--max-length``: the memory plan's lever that fits two ranks of Qwen2.5-0.5B in this machine's 23 GiB; 30 of the
  4,000 rows are longer than 512 tokens, so the typical step is unchanged), ``--steps`` steps logged one by one; the
  step time is the median of the gaps between ``elapsed_s`` of consecutive records, the first left out (warm-up);
- **an improving evaluation's saves**: rank 0's writer, as ``checkpoint.build_checkpointer`` builds it for the run's
  ``trainer.save_check``, saves a checkpoint that is the best so far (the checkpoint and ``best/``: what every
  evaluation saves while the eval loss falls, the costliest case) with the check and with ``trainer.save_check=off``;
  one thread, as rank 0 runs under torchrun; fastest of ``--repeats``;
- **the end**: the last checkpoint and ``adapter/``, the same way, once.

The check's share of a run that evaluates every ``--eval-every`` steps is the check's seconds per evaluation over the
steps' seconds between two evaluations (evaluation and save themselves left out of the wall time: the share is an
upper bound); the end's check is added once, over a run of ``--run-evaluations`` evaluations.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

RANDOM_INIT = ["model.init=random", "model.tokenizer=${asset:tiny_tokenizer}"]


def model_overrides(model: str) -> list[str]:
    """The overrides that build ``model`` here: the tiny model as it ships, a Qwen2.5 from its architecture config."""
    return [f"model={model}"] + ([] if model == "tiny_qwen2" else RANDOM_INIT)


def step_seconds(model: str, steps: int, max_length: int) -> float:
    """The median seconds of a training step of ``model`` in the default CPU run (2 ranks) at ``data.max_length``, the
    first step left out."""
    from ddptrain.launch import launch
    from ddptrain.preview import compose_run_config

    with tempfile.TemporaryDirectory() as tmp:
        overrides = [
            *model_overrides(model),
            "parallel.start_method=forkserver",
            "trainer.device=cpu",
            "trainer.progress_bar=false",
            "trainer.resume=none",
            f"trainer.max_steps={steps}",
            "trainer.log_every_n_steps=1",
            "trainer.save_final=false",
            "trainer.save_check=off",
            "data.eval_fraction=0",
            f"data.max_length={max_length}",
            f"trainer.output_dir={tmp}",
        ]
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        launch(compose_run_config(overrides, None, "train"), run_dir)
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        elapsed = [r["elapsed_s"] for r in map(json.loads, lines) if "loss" in r and "elapsed_s" in r]
    gaps = [b - a for a, b in itertools.pairwise(elapsed)]
    return statistics.median(gaps)


class _Order:
    """The data-order fingerprint a checkpoint's manifest records (nothing to compare here)."""

    values: dict[str, Any] = {}  # noqa: RUF012

    def changes_from(self, saved: dict[str, Any]) -> list[str]:
        return []


def save_seconds(model: str, save_check: str, repeats: int) -> dict[str, float]:
    """Rank 0's seconds for an improving evaluation's saves (fastest of ``repeats``) and for the end's, with
    ``trainer.save_check=<save_check>``, and the seconds the checks' records report for each."""
    from ddptrain import checkpoint
    from ddptrain.bench.evaluation import lora_as_if_trained
    from ddptrain.evaluation.best import build_best_tracker
    from ddptrain.parallel import DistEnv

    cfg, module, tokenizer = lora_as_if_trained([*model_overrides(model), f"trainer.save_check={save_check}"])
    rows = [tokenizer("Sort 3, 1, 2.").input_ids, tokenizer("Reverse the order of these words: red sparrow").input_ids]
    env = DistEnv(0, 0, 1, 1, torch.device("cpu"), "gloo")
    found: dict[str, list[float]] = {"evaluation": [], "evaluation check": [], "end": [], "end check": []}
    with tempfile.TemporaryDirectory() as tmp:
        best = build_best_tracker(cfg.trainer, has_eval=True)
        files = checkpoint.AdapterFiles(tokenizer, cfg.model, seed=0)
        writer = checkpoint.build_checkpointer(
            env, Path(tmp), cfg.trainer, files, module.model, {}, {}, _Order(), best, rows
        ).writer
        files.ensure_base(Path(tmp))  # a random base is written once per run: not a cost of the saves timed here
        for step in range(1, repeats + 1):
            evaluated = {"eval_loss": 1.0 / step, "step": step}
            meta = {"step": step, "epoch": 0, "position": step, "eval": evaluated, "best": True}
            start = time.perf_counter()
            writer.save(module.model, {"step": step}, meta)
            found["evaluation"].append(time.perf_counter() - start)
            found["evaluation check"].append(writer.checked.get("save_check_s", 0.0))
        step = repeats + 1
        start = time.perf_counter()
        writer.save(module.model, {"step": step}, {"step": step, "epoch": 0, "position": step})
        end_check = writer.checked.get("save_check_s", 0.0)
        writer.save_final(module.model)
        found["end"].append(time.perf_counter() - start)
        found["end check"].append(end_check + writer.checked.get("save_check_s", 0.0))
        keys = ("merged_weights", "merged_worst_share", "merged_max_abs_diff")
        merged = {k: writer.checked.get(f"save_check_{k}") for k in keys}
    return {
        **{name: min(values) for name, values in found.items()},
        **{k.replace("_", " "): v for k, v in merged.items()},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ddptrain.bench.save_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["qwen2_5_0_5b_lora"])
    parser.add_argument("--steps", type=int, default=6, help="training steps timed (the first is left out)")
    # At 512 (the default) the costliest batch of Qwen2.5-0.5B plans 14 GiB per rank: 2 ranks do not fit 23 GiB.
    parser.add_argument("--max-length", type=int, default=256, help="data.max_length of the timed steps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--run-evaluations", type=int, default=20)
    args = parser.parse_args(argv)
    rows, threads = [], torch.get_num_threads()
    try:
        for model in args.models:
            step = step_seconds(model, args.steps, args.max_length)
            torch.set_num_threads(1)  # rank 0 under torchrun (OMP_NUM_THREADS=1); the check may raise it for itself
            with contextlib.redirect_stderr(open(os.devnull, "w")):
                checked = save_seconds(model, "every", args.repeats)
                plain = save_seconds(model, "off", args.repeats)
            per_eval = checked["evaluation"] - plain["evaluation"]
            end = checked["end"] - plain["end"]
            between = args.eval_every * step
            run = args.run_evaluations * between
            rows.append((model, step, plain["evaluation"], checked["evaluation"], per_eval, end, between, run))
            if checked["merged weights"] is not None:
                print(
                    f"{model}: the merged model at the end, {checked['merged weights']} adapted weights within "
                    f"{checked['merged worst share']:.3g} of their bound; its logits "
                    f"{checked['merged max abs diff']:.4g} from the training model's"
                )
    finally:
        torch.set_num_threads(threads)  # called in-process (tests/e2e/test_bench.py): the caller's threads back
    print(
        f"| model | step s | an evaluation's saves, no check s | with the check s | the check s | the end's check s "
        f"| share per {args.eval_every} steps | share of a {args.run_evaluations}-evaluation run |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for model, step, plain_s, checked_s, per_eval, end, between, run in rows:
        share = per_eval / between
        run_share = (args.run_evaluations * per_eval + end) / run
        print(
            f"| {model} | {step:.3f} | {plain_s:.3f} | {checked_s:.3f} | {per_eval:.3f} | {end:.3f} "
            f"| {100 * share:.2f}% | {100 * run_share:.2f}% |"
        )


if __name__ == "__main__":
    main()
