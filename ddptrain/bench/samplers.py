"""Padding waste and rank imbalance of distributed batching, over one epoch of a real dataset.

Run from the repository root:

    python -m ddptrain.bench.samplers --data ../shared/data/alpaca/alpaca_data_52k.jsonl \\
        --tokenizer ../shared/data/tokenizers/qwen2 --world-size 4 --micro-batch-size 8

Each row is tokenized as the trainer does (Alpaca prompt, then response + EOS, no special tokens
added) and truncated to ``--max-length``. Every sampler then plans one full epoch for every rank and
the table reports, with the metrics of ANCHORS.md:

- padding waste: 1 - real / padded tokens over the epoch, all ranks;
- imbalance of a micro-step: max over ranks / mean over ranks of padded tokens (mean, p99, max);
- peak: the largest padded tokens of any one micro-batch (what sets activation memory);
- micro-steps per rank, and whether every sample was seen exactly once.

Padded tokens are rows x longest row rounded up to ``--pad-to-multiple-of`` (1, the default, is the
metric of ANCHORS.md); a packed row is its sample lengths summed. No GPU is needed.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import numpy as np

from ddptrain.config import Batching
from ddptrain.data.batch_cost import round_up
from ddptrain.data.plan import BatchingSpec, plan_epoch
from ddptrain.data.templates import format_alpaca

Plan = list[list[list[list[int]]]]  # plan[step][rank] = rows, each row a list of sample indices


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="Alpaca-style jsonl file")
    parser.add_argument("--tokenizer", required=True, help="tokenizer directory or hub name")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--pad-to-multiple-of", type=int, default=1, help="1 reproduces the ANCHORS.md metric")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epoch", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    return parser.parse_args(argv)


def token_lengths(data: Path, tokenizer_name: str, max_length: int) -> np.ndarray:
    """Tokens per row: prompt + response + EOS, truncated to ``max_length``.

    Returns:
        1-D int64 array, one length per row of ``data``.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_name)
    with data.open() as f:
        pairs = [format_alpaca(json.loads(line)) for line in f if line.strip()]
    prompts = tokenizer([p for p, _ in pairs], add_special_tokens=False)["input_ids"]
    responses = tokenizer([r for _, r in pairs], add_special_tokens=False)["input_ids"]
    lengths = np.array([len(p) + len(r) + 1 for p, r in zip(prompts, responses)], dtype=np.int64)
    return np.minimum(lengths, max_length)


# ----------------------------------------------------------------------------- samplers


def torch_distributed_sampler(lengths: np.ndarray, args) -> Plan:
    """torch DistributedSampler (shuffle, pads with repeats to divide evenly) + DataLoader(batch_size)."""
    from torch.utils.data import DistributedSampler

    shares = []
    for rank in range(args.world_size):
        sampler = DistributedSampler(range(len(lengths)), args.world_size, rank, shuffle=True, seed=args.seed)
        sampler.set_epoch(args.epoch)
        shares.append(_batches(list(sampler), args.micro_batch_size))
    return _zip_ranks(shares)


def hf_group_by_length(lengths: np.ndarray, args) -> Plan:
    """transformers Trainer ``group_by_length`` under accelerate.

    The Trainer builds ``LengthGroupedSampler(per_device_batch * grad_accum)``; accelerate's
    ``BatchSamplerShard`` deals consecutive per-device batches to ranks in turn and, with
    ``even_batches``, completes the last round with samples from the start of the epoch.
    """
    import torch
    from transformers.trainer_pt_utils import LengthGroupedSampler

    generator = torch.Generator().manual_seed(args.seed + args.epoch)
    sampler = LengthGroupedSampler(
        args.micro_batch_size * args.grad_accum, lengths=lengths.tolist(), generator=generator
    )
    order = list(sampler)
    round_size = args.world_size * args.micro_batch_size
    order += order[: -len(order) % round_size]
    batches = _batches(order, args.micro_batch_size)
    return _zip_ranks([batches[rank :: args.world_size] for rank in range(args.world_size)])


def hf_batch_rebalance(lengths: np.ndarray, args) -> Plan | None:
    """transformers ``BatchRebalanceSampler`` as the Trainer builds it (one instance per rank)."""
    from transformers import trainer_pt_utils

    if not hasattr(trainer_pt_utils, "BatchRebalanceSampler"):
        return None
    shares = []
    for rank in range(args.world_size):
        sampler = trainer_pt_utils.BatchRebalanceSampler(
            lengths=lengths.tolist(),
            effective_batch_size=args.micro_batch_size * args.grad_accum * args.world_size,
            dp_size=args.world_size,
            grad_accum=args.grad_accum,
            seed=args.seed,
            rank=rank,
            drop_last=False,  # TrainingArguments.dataloader_drop_last default
        )
        sampler.set_epoch(args.epoch)
        shares.append([list(batch) for batch in sampler])
    return _zip_ranks(shares)


def ddptrain_plan(lengths: np.ndarray, args, mode: Batching, budget: int) -> Plan:
    """One of ddptrain's modes, as every rank computes it."""
    spec = BatchingSpec(
        mode=mode,
        world_size=args.world_size,
        micro_batch_size=args.micro_batch_size,
        max_tokens_per_batch=budget,
        grad_accum_steps=args.grad_accum,
        pad_to_multiple_of=args.pad_to_multiple_of,
        seed=args.seed,
    )
    plan = plan_epoch(lengths, spec, args.epoch)
    return [[[list(row) for row in batch] for batch in step] for step in plan]


def _batches(order: list[int], size: int) -> list[list[list[int]]]:
    """Consecutive batches of ``size`` one-sample rows (the last may be short)."""
    return [[[i] for i in order[s : s + size]] for s in range(0, len(order), size)]


def _zip_ranks(shares: list[list]) -> Plan:
    """Per-rank lists of micro-batches to micro-steps; a rank without a batch gets an empty one."""
    n_steps = max(len(share) for share in shares)
    return [[share[i] if i < len(share) else [] for share in shares] for i in range(n_steps)]


def _as_rows(plan: Plan) -> Plan:
    """HF samplers yield flat index lists; make every index a one-sample row."""
    return [[[row if isinstance(row, list) else [row] for row in batch] for batch in step] for step in plan]


# ----------------------------------------------------------------------------- metrics


def measure(plan: Plan, lengths: np.ndarray, pad: int, packed: bool) -> dict:
    """The ANCHORS.md metrics of one epoch's plan.

    Returns:
        A dict of padding waste, imbalance mean/p99/max, peak, mean padded tokens per micro-batch,
        micro-steps per rank, duplicate and dropped sample counts.
    """
    real = np.zeros((len(plan), len(plan[0])), dtype=np.int64)
    padded = np.zeros_like(real)
    for i, step in enumerate(plan):
        for r, batch in enumerate(step):
            row_lengths = [int(lengths[row].sum()) for row in batch]
            real[i, r] = sum(row_lengths)
            longest = max(row_lengths, default=0)
            padded[i, r] = len(batch) * (longest if packed else round_up(longest, pad))
    imbalance = padded.max(axis=1) / padded.mean(axis=1)
    counts = Counter(i for step in plan for batch in step for row in batch for i in row)
    steps_per_rank = sorted({int((padded[:, r] > 0).sum()) for r in range(padded.shape[1])})
    return {
        "padding_waste": float(1 - real.sum() / padded.sum()),
        "imbalance_mean": float(imbalance.mean()),
        "imbalance_p99": float(np.percentile(imbalance, 99)),
        "imbalance_max": float(imbalance.max()),
        "peak_padded_tokens": int(padded.max()),
        "mean_padded_tokens": float(padded[padded > 0].mean()),
        "micro_steps_per_rank": steps_per_rank,
        "duplicated": sum(c - 1 for c in counts.values()),
        "dropped": len(lengths) - len(counts),
    }


def run(args) -> tuple[np.ndarray, int, list[dict]]:
    """Tokenize, plan every sampler, measure.

    Returns:
        ``(lengths, token budget used for token_budget/packed, one result dict per sampler)``.
    """
    lengths = token_lengths(args.data, args.tokenizer, args.max_length)
    pad = args.pad_to_multiple_of
    rows: list[tuple[str, Plan | None, bool]] = [
        ("torch DistributedSampler (random)", torch_distributed_sampler(lengths, args), False),
        ("transformers group_by_length", hf_group_by_length(lengths, args), False),
    ]
    rebalance = hf_batch_rebalance(lengths, args)
    rows.append(("transformers batch_rebalance" + (" (not installed)" if rebalance is None else ""), rebalance, False))
    grouped = ddptrain_plan(lengths, args, Batching.length_grouped, 0)
    # Same average padded tokens per micro-batch as length_grouped, but never below one longest sample.
    budget = max(round(measure(grouped, lengths, pad, False)["mean_padded_tokens"]), round_up(int(lengths.max()), pad))
    rows += [
        ("ddptrain random", ddptrain_plan(lengths, args, Batching.random, 0), False),
        ("ddptrain length_grouped", grouped, False),
        (f"ddptrain token_budget (T={budget})", ddptrain_plan(lengths, args, Batching.token_budget, budget), False),
        (f"ddptrain packed (T={budget})", ddptrain_plan(lengths, args, Batching.packed, budget), True),
    ]
    results = [
        {"sampler": name, **(measure(_as_rows(plan), lengths, pad, packed) if plan is not None else {})}
        for name, plan, packed in rows
    ]
    return lengths, budget, results


def format_table(lengths: np.ndarray, budget: int, results: list[dict], args) -> str:
    """A markdown table with a header that states the setup."""
    p50, p99 = np.percentile(lengths, [50, 99])
    lines = [
        f"{len(lengths)} samples, length p50 {p50:.0f} / p99 {p99:.0f} / max {lengths.max()}; "
        f"{args.world_size} ranks x micro-batch {args.micro_batch_size}, grad_accum {args.grad_accum}, "
        f"pad to multiple of {args.pad_to_multiple_of}, seed {args.seed}, epoch {args.epoch}. "
        f"token_budget/packed: T = {budget} = max(mean padded tokens per micro-batch of ddptrain length_grouped, "
        "longest sample).",
        "",
        "| sampler | padding waste | imbalance mean | p99 | max | peak padded tok | mean padded tok/mb "
        "| micro-steps per rank | coverage |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "padding_waste" not in r:
            lines.append(f"| {r['sampler']} | – | – | – | – | – | – | – | – |")
            continue
        steps = "/".join(str(s) for s in r["micro_steps_per_rank"])
        coverage = "exactly once" if not r["duplicated"] else f"{r['duplicated']} repeated"
        lines.append(
            f"| {r['sampler']} | {100 * r['padding_waste']:.1f}% | {r['imbalance_mean']:.3f} "
            f"| {r['imbalance_p99']:.3f} | {r['imbalance_max']:.3f} | {r['peak_padded_tokens']} "
            f"| {r['mean_padded_tokens']:.0f} | {steps} | {coverage}, {r['dropped']} dropped |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Print the table (or JSON) for one setup."""
    args = parse_args(argv)
    lengths, budget, results = run(args)
    if args.json:
        print(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "budget": budget, "results": results}))
    else:
        print(format_table(lengths, budget, results, args))


if __name__ == "__main__":
    main()
