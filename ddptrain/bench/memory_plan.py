"""The memory plan's predictions for two real architectures: per-rank peak of a LoRA micro-step, no weights needed.

    python -m ddptrain.bench.memory_plan [--tokens 1024,4096,8192] [--world-size 4]
    python -m ddptrain.bench.memory_plan --presets     # every conf/model preset at its full size


Qwen2.5-7B and Qwen2.5-0.5B (the bundled architecture configs), LoRA r=16 on every linear layer, bf16 weights and
bf16 autocast, model.loss_chunk_tokens=512, on CUDA ranks of a DDP job: for one micro-batch of each token count (one
row, no padding, half of its positions trained), with gradient checkpointing off and on, the predicted per-rank peak
and its parts, simulated on fake tensors (``ddptrain.plan.simulate``). Prints a markdown table for bench/README.md,
with the seconds each prediction took on this machine. On a GPU (``--measure``) each row is also run for real and
``torch.cuda.max_memory_reserved`` printed beside the prediction.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch

from ddptrain.config import DType, ModelConfig, PlanConfig
from ddptrain.config.hydra import ASSETS_DIR
from ddptrain.model import architecture_config
from ddptrain.plan.budget import GIB
from ddptrain.plan.simulate import BatchShape, FakeModel

MODELS = {"Qwen2.5-7B": "model_configs/qwen2.5-7b", "Qwen2.5-0.5B": "model_configs/qwen2.5-0.5b"}


def model_config(name: str, checkpointing: bool) -> ModelConfig:
    base = ModelConfig(name_or_path=str(ASSETS_DIR / MODELS[name]), init="random", dtype="bf16", lora_rank=16)
    return dataclasses.replace(base, lora_dropout=0.05, gradient_checkpointing=checkpointing)


def predicted(fake: FakeModel, shape: BatchShape, world_size: int) -> dict[str, float]:
    """The per-rank peak's parts in GiB (as ``plan.budget.MemoryPlan.peak`` adds them, DDP's buckets as gradients)."""
    weights = sum(fake.parameter_bytes().values())
    _, trainable = fake.trainable_parameters()
    step = fake.step(shape)
    allocated = weights + 3 * trainable + step.peak  # gradients in the buckets, AdamW's two states
    costs = PlanConfig()  # the fixed costs' defaults (plan.cuda_context_gb, plan.nccl_gb, plan.allocator_slack)
    fixed = (costs.cuda_context_gb + (costs.nccl_gb if world_size > 1 else 0.0)) * GIB
    return {
        "weights": weights / GIB,
        "activations": step.saved / GIB,
        "transient": (step.peak - step.saved) / GIB,
        "peak": (allocated * (1 + costs.allocator_slack) + fixed) / GIB,
    }


def measured_reserved_gib(cfg: ModelConfig, shape: BatchShape) -> float:
    """The real step on this GPU (one rank, no DDP): ``max_memory_reserved`` after a forward and backward."""
    from ddptrain.model import build_model

    device = torch.device("cuda")
    model = build_model(cfg, seed=0, device=device).train()
    ids = torch.randint(0, 1000, (shape.rows, shape.width), device=device)
    targets = torch.arange(shape.targets, device=device)
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, _ = model(ids, ids.clone(), target_index=targets)
    loss.backward()
    torch.cuda.synchronize()
    reserved = torch.cuda.max_memory_reserved() / GIB
    del model, loss
    torch.cuda.empty_cache()
    return reserved


# glibc serves allocations below its mmap threshold from heaps it keeps after a free, and raises the threshold
# as large blocks are freed: the resident set then stays above the live tensors. A fixed threshold returns every
# large block on free, so that the peak resident set measures what was alive, as max_memory_allocated does on a GPU.
LIVE_MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def cpu_check(shapes: list[tuple[int, int]]) -> None:
    """The bundled tiny Qwen2 (fp32, LoRA r=16, dropout 0.05) on this CPU: each micro-step's predicted bytes beyond
    what was alive before it, against the peak resident memory it added, each measured in a fresh process."""
    import json
    import os
    import subprocess
    import sys

    from ddptrain.config import DType
    from ddptrain.config.hydra import ASSETS_DIR

    print("| micro-batch | checkpointing | predicted (GiB) | measured (GiB) | measured, glibc's default (GiB) |")
    print("|---|---|---:|---:|---:|")
    for rows, width in shapes:
        for checkpointing in (False, True):
            cfg = dataclasses.replace(
                ModelConfig(name_or_path=str(ASSETS_DIR / "tiny_qwen2"), init="random", dtype="fp32"),
                lora_dropout=0.05,
                gradient_checkpointing=checkpointing,
            )
            fake = FakeModel(architecture_config(cfg), cfg, DType.fp32)
            shape = BatchShape(rows, width, rows * width // 2)
            measured = []
            for env in (LIVE_MEMORY_ENV, {}):
                command = [sys.executable, "-m", "ddptrain.bench.memory_plan", "--measure-cpu-step"]
                command.append(json.dumps([rows, width, checkpointing]))
                out = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True, check=True)
                measured.append(float(out.stdout.split()[-1]))
            print(
                f"| {rows} x {width} | {'on' if checkpointing else 'off'} | {fake.step(shape).peak / GIB:.3f} | "
                f"{measured[0]:.3f} | {measured[1]:.3f} |",
                flush=True,
            )


def measure_cpu_step(rows: int, width: int, checkpointing: bool, path: str | None = None) -> float:
    """The peak resident memory one real micro-step adds (GiB), from a process that has built the model, its
    gradients and the batch (the planner counts those as held before the step). ``path``: an architecture config
    folder (default: the bundled tiny Qwen2)."""
    import gc
    import resource

    from ddptrain.config.hydra import ASSETS_DIR
    from ddptrain.model import build_model

    torch.set_num_threads(1)
    cfg = dataclasses.replace(
        ModelConfig(name_or_path=path or str(ASSETS_DIR / "tiny_qwen2"), init="random", dtype="fp32"),
        lora_dropout=0.05,
        gradient_checkpointing=checkpointing,
    )
    model = build_model(cfg, seed=0, device=torch.device("cpu")).train()
    ids = torch.randint(0, 4000, (rows, width))
    mask = torch.ones(rows, width, dtype=torch.long)
    mask[1:, width // 2 :] = 0
    targets = torch.randperm(rows * (width - 1))[: rows * width // 2].sort().values
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    small, _ = model(ids[:1, :64], ids[:1, :64].clone(), mask[:1, :64])  # one-time allocations before the baseline
    small.backward()
    del small
    gc.collect()
    with open("/proc/self/statm") as f:
        baseline = int(f.read().split()[1]) * resource.getpagesize()
    loss, _ = model(ids, ids.clone(), mask, target_index=targets)
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return (peak - baseline) / GIB


def parameter_count(cfg: ModelConfig) -> int:
    """The model's parameters, counted on the meta device (nothing allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(architecture_config(cfg))
    return sum(p.numel() for p in model.parameters())


def plan_presets(world_size: int, tokens: int = 4096, device_gb: float = 80.0) -> None:
    """Every model preset (``conf/model/*.yaml`` but the bundled tiny one) at its full size, as the preset sets it
    (dtype, attention kernel, LoRA) with gradient checkpointing on: one micro-batch of ``tokens`` tokens (one row,
    half of its positions trained) on CUDA ranks of a DDP job, against ``device_gb`` GiB."""
    from ddptrain.cli import CONF_DIR
    from ddptrain.preview import compose_run_config

    print(
        f"| preset | parameters | LoRA trainable | weights (GiB) | activations kept (GiB) | transient (GiB) "
        f"| predicted peak (GiB) | fits {device_gb:.0f} GB | planned in (s) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|")
    shape = BatchShape(rows=1, width=tokens, targets=tokens // 2, padded=False)
    for preset in sorted(Path(CONF_DIR, "model").glob("*.yaml")):
        cfg = compose_run_config([f"model={preset.stem}", "model.init=random"], None, "train").model
        if cfg.dtype == DType.fp32:  # the bundled tiny model: nothing to plan at a GPU's size
            continue
        cfg = dataclasses.replace(cfg, gradient_checkpointing=True)
        started = time.perf_counter()
        fake = FakeModel(architecture_config(cfg), cfg, DType.bf16)
        parts = predicted(fake, shape, world_size)
        seconds = time.perf_counter() - started
        trainable, _ = fake.trainable_parameters()
        print(
            f"| {preset.stem} | {parameter_count(cfg) / 1e9:.2f} B | {trainable / 1e6:.1f} M | "
            f"{parts['weights']:.2f} | "
            f"{parts['activations']:.2f} | {parts['transient']:.2f} | {parts['peak']:.2f} | "
            f"{'yes' if parts['peak'] <= device_gb else 'no'} | {seconds:.1f} |",
            flush=True,
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1024,4096,8192", help="tokens per micro-batch, comma-separated")
    parser.add_argument("--world-size", type=int, default=4, help="ranks of the DDP job (NCCL buffers from 2)")
    parser.add_argument("--measure", action="store_true", help="also run each step on this GPU")
    parser.add_argument(
        "--cpu-check", action="store_true", help="predicted against measured on this CPU (the tiny Qwen2)"
    )
    parser.add_argument("--presets", action="store_true", help="every model preset at full size, 4k tokens, 80 GB")
    parser.add_argument("--measure-cpu-step", help=argparse.SUPPRESS)  # [rows, width, checkpointing, path?]
    args = parser.parse_args(argv)
    if args.measure_cpu_step:
        import json

        print(measure_cpu_step(*json.loads(args.measure_cpu_step)))
        return
    if args.presets:
        plan_presets(args.world_size)
        return
    if args.cpu_check:
        cpu_check([(8, 512), (16, 2048)])
        return
    tokens = [int(t) for t in args.tokens.split(",")]
    measured_head = " measured reserved (GiB) |" if args.measure else ""
    print(
        "| model | tokens | checkpointing | weights (GiB) | activations kept (GiB) | transient (GiB) "
        f"| predicted peak (GiB) |{measured_head} planned in (s) |"
    )
    print("|---|---:|---|---:|---:|---:|---:|" + ("---:|" if args.measure else "") + "---:|")
    for name in MODELS:
        for checkpointing in (False, True):
            cfg = model_config(name, checkpointing)
            started = time.perf_counter()
            fake = FakeModel(architecture_config(cfg), cfg, DType.bf16)
            built = time.perf_counter() - started
            for n in tokens:
                shape = BatchShape(rows=1, width=n, targets=n // 2, padded=False)
                started = time.perf_counter()
                parts = predicted(fake, shape, args.world_size)
                seconds = time.perf_counter() - started + built
                built = 0.0
                measured = f" {measured_reserved_gib(cfg, shape):.2f} |" if args.measure else ""
                print(
                    f"| {name} | {n:,} | {'on' if checkpointing else 'off'} | {parts['weights']:.2f} | "
                    f"{parts['activations']:.2f} | {parts['transient']:.2f} | {parts['peak']:.2f} |{measured} "
                    f"{seconds:.1f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
