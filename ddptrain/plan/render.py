"""The memory plan as text: the table ``ddptrain plan`` prints and a run logs at start."""

from __future__ import annotations

from ddptrain.plan.budget import GIB, RESIDENT_AT_START, MemoryPlan, StepPeak

LABEL = 46  # the breakdown's first column: its longest row names the key that sets it
WORST_CASE = "any data (every row at data.max_length, every token trained)"
THIS_DATA = "this data (rows as wide as its longest, as many tokens trained as its most-trained rows)"


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def _shape(step: StepPeak) -> str:
    s = step.candidate.shape
    layout = f"1 packed row of {s.width} tokens" if s.packed else f"{s.rows} x {s.width} tokens"
    if s.pairs:
        layout = f"{s.pairs} pairs, their chosen and rejected sequences {layout}"
    return f"{layout}, {s.targets} trained ({step.candidate.where})"


def strategy_line(plan: MemoryPlan) -> str:
    """What each rank holds under parallel.strategy, in words."""
    if plan.strategy != "fsdp2":
        return "parallel.strategy=ddp: every rank holds the whole model, its gradients and AdamW's states"
    where = "in host memory (parallel.cpu_offload=true)" if plan.host else "on the device"
    return (
        f"parallel.strategy=fsdp2: every rank holds 1/{plan.world_size} of the weights (trainable ones as fp32 "
        f"masters), of their gradients and of AdamW's states {where}, and gathers the layers it computes"
    )


def _breakdown(plan: MemoryPlan) -> list[str]:
    """The table: one row per thing a rank holds, one column per rank (GiB)."""
    width = max([LABEL, *(len(name) + 2 for name in [*plan.sharding, *plan.fixed])])
    lines = [f"{'GiB per rank':<{width}}" + "".join(f"{'rank ' + str(s.candidate.rank):>10}" for s in plan.ranks)]

    def row(label: str, values: list[int]) -> None:
        lines.append(f"{label:<{width}}" + "".join(f"{_gib(v):>10}" for v in values))

    n = len(plan.ranks)
    shard = f", 1/{plan.world_size}" if plan.strategy == "fsdp2" else ""
    for dtype, size in sorted(plan.weights.items()):
        row(f"weights{shard} ({dtype})", [size] * n)
    row(f"gradients{shard} ({plan.trainable:,} trainable)", [plan.gradients] * n)
    row(f"optimizer states{shard} (AdamW)", [plan.optimizer] * n)
    for name, size in plan.sharding.items():
        row(name, [size] * n)
    row("activations kept for backward", [s.activations for s in plan.ranks])
    row("transient (LM head, backward)", [s.transient for s in plan.ranks])
    for name, size in plan.fixed.items():
        row(name, [size] * n)
    if plan.device == "cuda":
        row(
            f"allocator slack (plan.allocator_slack: {plan.slack_share:.0%})",
            [plan.peak(s) - plan.held - s.activations - s.transient for s in plan.ranks],
        )
    row("peak", [plan.peak(s) for s in plan.ranks])
    return lines


def render_plan(plan: MemoryPlan, title: str) -> str:
    """The per-rank breakdown (GiB), the eval peak, the verdict, the largest batch that fits and the levers."""
    lines = [title, strategy_line(plan), "", *_breakdown(plan), ""]
    if plan.host:
        lines.append(
            f"in host memory (parallel.cpu_offload=true), beside the table: {_gib(plan.host)} GiB per rank of "
            "shards, their gradients and AdamW's states"
        )
    if RESIDENT_AT_START in plan.fixed:
        lines.append(
            "resident at start: this process before any weight loads (interpreter, libraries, tokenized data), "
            "measured; the report's resident peak holds it"
        )
    for s in plan.ranks:
        lines.append(f"rank {s.candidate.rank}'s costliest micro-batch: {_shape(s)}")
    if plan.eval is not None:
        lines.append(f"evaluation peak: {_gib(plan.peak(plan.eval))} GiB ({_shape(plan.eval)})")
    if plan.save_check:
        lines.append(
            f"save check peak (rank 0, trainer.save_check): {_gib(plan.check_peak)} GiB, of which "
            f"{_gib(plan.save_check)} GiB the saved weights loaded again (LoRA: the base, and the probe's logits)"
        )
    lines += ["", verdict(plan)]
    if plan.largest_on_data:
        lines.append(f"largest that fits {THIS_DATA}: {plan.largest_on_data}")
    if plan.largest:
        lines.append(f"largest that fits {WORST_CASE}: {plan.largest}")
    if plan.levers:
        lines.append(
            f"levers (the fullest rank's peak, now {_gib(plan.peak(plan.fullest))} GiB; each planned on this data):"
        )
        width = max(len(lever.overrides) for lever in plan.levers)
        for lever in sorted(plan.levers, key=lambda lever: lever.peak):
            saved = plan.peak(plan.fullest) - lever.peak
            note = f" ({lever.note})" if lever.note else ""
            lines.append(f"  {lever.overrides:<{width}}  {_gib(lever.peak)} GiB, {_gib(saved)} GiB less{note}")
    return "\n".join(lines)


def verdict(plan: MemoryPlan) -> str:
    """One line: fits (with the margin) or does not (by how much), or no verdict without a device size."""
    worst, rank = plan.worst, plan.fullest.candidate.rank
    when = "evaluation" if plan.eval is not None and plan.peak(plan.eval) > plan.peak(plan.fullest) else f"rank {rank}"
    if plan.check_peak > max(plan.peak(plan.fullest), plan.peak(plan.eval) if plan.eval else 0):
        when = "rank 0's save check"
    if plan.device_bytes is None:
        return (
            f"predicted peak {_gib(worst)} GiB ({when}); no device size to compare with: set plan.device_memory_gb "
            "(GiB per device) for a verdict"
        )
    share = worst / plan.device_bytes
    limit = (
        f"{_gib(plan.device_bytes)} GiB ({plan.limit_source})"
        if plan.limit_source
        else f"{_gib(plan.device_bytes)} GiB"
    )
    if plan.fits:
        return (
            f"fits: predicted peak {_gib(worst)} GiB ({when}) of {limit}, {share:.0%} used, "
            f"{_gib(plan.device_bytes - worst)} GiB to spare"
        )
    over = _gib(worst - plan.device_bytes)
    return f"DOES NOT FIT: predicted peak {_gib(worst)} GiB ({when}) of {limit}, {over} GiB over"
