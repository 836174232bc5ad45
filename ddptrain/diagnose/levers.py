"""The levers: for each finding, the config changes to make, as keys the user types, and where the effect follows
from what was measured, the predicted step time and tokens/s (the step model with the lever's part scaled).
``choose_levers`` orders them by expected gain, one per key; ``predict`` adds gradient accumulation at ×2, ×4, ×8
(as the global batch when ``optim.global_batch_size`` is set).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from ddptrain.config import DiagnoseConfig
from ddptrain.diagnose.runs import BACKWARD_SHARE, MIB, RunSettings, StepSplit, exposed_s, fullest_memory, step_split

# Padding at or above this share of the padded tokens makes data.batching=packed a compute lever.
PADDING_SHARE = 0.15


# ----------------------------------------------------------------------------- levers and predictions


def _lever(key: str, value: Any, why: str, base: StepSplit | None = None, new: StepSplit | None = None) -> dict:
    """One change to make, as the user types it, with its predicted effect when ``new`` is given."""
    lever: dict[str, Any] = {"key": key, "value": value, "set": f"{key}={_typed(value)}", "why": why}
    if base is not None and new is not None:
        lever |= {
            "predicted_step_time_s": new.step_s,
            "predicted_tokens_per_s": new.tokens_per_s,
            "gain": new.tokens_per_s / base.tokens_per_s - 1.0,
        }
    return lever


def _typed(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _accum_target(split: StepSplit, th: DiagnoseConfig) -> int:
    """×2 when that brings the exposed all-reduce under its threshold, else ×4.

    Never more than ×4 in one suggestion: the global batch grows as much, which changes the optimization more than
    a throughput lever should decide alone, and the prediction would reach far from what was measured. The
    predictions table lists ×8 too.
    """
    doubled = split.accumulate(2)
    return 2 if doubled.comm_wire / doubled.step_s < th.comm_share else 4


def _accum_lever(s: dict, split: StepSplit, st: RunSettings, th: DiagnoseConfig) -> dict:
    ratio, current, global_batch = _accum_target(split, th), s["grad_accum_steps"], st["optim.global_batch_size"]
    # With optim.global_batch_size set, grad_accum_steps is derived from it: the key to change is the batch.
    key, value = (
        ("optim.global_batch_size", global_batch * ratio)
        if global_batch
        else ("optim.grad_accum_steps", current * ratio)
    )
    why = (
        f"the exposed all-reduce ({split.comm_wire:.3f} s) happens once per optimizer step: {ratio}× the micro-batches "
        f"per step divide it per sample by {ratio}. The global batch grows {ratio}×: keep an eye on optim.lr."
    )
    return _lever(key, value, why, split, split.accumulate(ratio))


def _on_nccl(s: dict, st: RunSettings) -> bool:
    backend = st["parallel.backend"]
    return backend == "nccl" or (backend == "auto" and s["device"] == "cuda")


def _compress_lever(s: dict, split: StepSplit, st: RunSettings) -> dict | None:
    if st["parallel.comm_hook"] != "none":
        return None
    # bf16 keeps fp32's range (no overflow of large gradients) but DDP's bf16 hook needs nccl.
    value = "bf16_compress" if _on_nccl(s, st) else "fp16_compress"
    why = (
        f"all-reduce 16-bit gradients instead of 32-bit: half the bytes, so about half the exposed "
        f"{split.comm_wire:.3f} s{'' if value == 'bf16_compress' else ' (bf16_compress keeps fp32 range, needs nccl)'}"
    )
    return _lever("parallel.comm_hook", value, why, split, replace(split, comm_wire=split.comm_wire / 2))


def _bucket_lever(s: dict, split: StepSplit, st: RunSettings) -> dict | None:
    """Few buckets: the all-reduce waits for the end of backward, so split it; many tiny ones: latency, so merge."""
    sent, calls, cap = (
        s.get("allreduce_bytes_per_step"),
        s.get("allreduce_calls_per_step"),
        st["parallel.bucket_cap_mb"],
    )
    if not sent or not calls:
        return None
    if calls <= 2 and sent >= 4 * MIB:
        value = max(1, math.ceil(sent / 4 / MIB))
        exposed = exposed_s(split.comm_wire / 4, 3 * split.comm_wire / 4, BACKWARD_SHARE * split.compute)
        why = (
            f"{sent / MIB:.1f} MiB go in {calls:.0f} bucket(s) that start when backward is over; {value} MiB buckets "
            f"make 4 of them, and all but the last can run while backward still computes"
        )
        return _lever(
            "parallel.bucket_cap_mb", value, why, split, replace(split, comm_wire=min(exposed, split.comm_wire))
        )
    if calls >= 16 and sent / calls < MIB:
        why = (
            f"{calls:.0f} all-reduce calls of {sent / calls / 1024:.0f} KiB each per step: each pays the link's latency"
        )
        return _lever("parallel.bucket_cap_mb", cap * 4, why)
    return None


def _comm_levers(s: dict, by_rank: list[dict], st: RunSettings, th: DiagnoseConfig) -> list[dict]:
    split = step_split(s)
    if s.get("strategy") == "fsdp2":
        return _fsdp2_levers(st)
    levers = [_accum_lever(s, split, st, th), _compress_lever(s, split, st), _bucket_lever(s, split, st)]
    return [lever for lever in levers if lever]


def _fsdp2_levers(st: RunSettings) -> list[dict]:
    """FSDP2's own: keep the gathered layers to the backward (one all-gather of each layer per micro-step instead of
    two, at the memory of every layer gathered: ddptrain plan says whether it fits), or DDP where a replica
    fits (one all-reduce per step, no all-gathers). Not predicted: the step clock does not time FSDP2's all-gathers
    apart from the compute they wait in. Accumulation does not help here: each micro-step gathers the weights again."""
    levers = []
    if st["parallel.reshard_after_forward"]:
        why = "each layer's weights are gathered again for its backward: keep them instead (more memory; plan first)"
        levers.append(_lever("parallel.reshard_after_forward", False, why))
    why = "where a whole replica fits (ddptrain plan parallel.strategy=ddp), DDP gathers no weights"
    return [*levers, _lever("parallel.strategy", "ddp", why)]


def _workers_needed(loader_s: float, budget_s: float, current: int) -> int:
    """The fewest loader workers (more than now, at most 16) that keep up with a step without waiting."""
    for workers in (2, 4, 8, 16):
        if workers > current and loader_s / workers <= budget_s:
            return workers
    return max(16, current)


def _data_levers(s: dict, by_rank: list[dict], st: RunSettings, th: DiagnoseConfig) -> list[dict]:
    """data.num_workers: workers prepare the next batches while the step computes.

    With W workers the loader produces a step's batches every P/W seconds, P being one process's loader work per
    step: the measured wait when W = 0, else W × the step time (a loader that keeps the step waiting sets its pace).
    """
    split, workers = step_split(s), st["data.num_workers"]
    budget = split.step_s - split.data
    loader_s = split.data if workers == 0 else workers * split.step_s
    target = _workers_needed(loader_s, budget, workers)
    if target <= workers:
        return []  # already at the most workers worth suggesting: the loader's own work must shrink
    new = replace(split, data=max(loader_s / target - budget, 0.0))
    why = (
        f"the loader work of a step ({loader_s:.3f} s in one process) spread over {target} workers runs beside the "
        f"{budget:.3f} s of the step that is not waiting; each worker holds a copy of the dataset in CPU memory"
    )
    if s["device"] == "cpu":
        why += ", and on CPU the workers share the cores with training"
    return [_lever("data.num_workers", target, why, split, new)]


def _balance_lever(s: dict, split: StepSplit, st: RunSettings) -> dict | None:
    """A balanced batch plan removes the planned part of the wait, never more than was measured."""
    batching = st["data.batching"]
    value = {"random": "token_budget", "length_grouped": "token_budget", "token_budget": "packed"}.get(batching)
    if value is None or (value == "packed" and st["objective.name"] == "dpo"):  # a pair's sequences stay apart
        return None
    planned = max((s.get("rank_imbalance") or 1.0) - 1.0, 0.0)
    removed = min(split.comm_wait, planned * split.compute)
    budget = s.get("peak_rank_tokens")
    limit = f" with data.max_tokens_per_batch={int(budget)} (the largest micro-batch this run held)" if budget else ""
    why = (
        f"data.batching={value}{limit} gives every rank about the same padded tokens per micro-step; the plan "
        f"gave the busiest {s.get('rank_imbalance') or 1.0:.2f}× the mean{_global_batch_note(st)}"
    )
    return _lever("data.batching", value, why, split, replace(split, comm_wait=split.comm_wait - removed))


def _global_batch_note(st: RunSettings) -> str:
    """token_budget and packed batching refuse optim.global_batch_size (rows per step are not fixed): say so."""
    if st["optim.global_batch_size"] is None:
        return ""
    return "; replace optim.global_batch_size with optim.grad_accum_steps, which these batchings need"


def _imbalance_levers(s: dict, by_rank: list[dict], st: RunSettings, th: DiagnoseConfig) -> list[dict]:
    lever = _balance_lever(s, step_split(s), st)
    return [lever] if lever else []


def _straggler_levers(s: dict, by_rank: list[dict], st: RunSettings, th: DiagnoseConfig) -> list[dict]:
    """A rank slow by itself: its loader (then more workers) or its device (then run without it)."""
    split, slowest = step_split(s), s.get("slowest_rank")
    rows = {r["rank"]: r for r in by_rank}
    levers = []
    mean_data = sum(r.get("time_data_s", 0.0) for r in by_rank) / max(len(by_rank), 1)
    if slowest in rows and rows[slowest].get("time_data_s", 0.0) - mean_data > (s.get("busy_excess_s") or 0.0) / 2:
        levers += _data_levers(s, by_rank, st, th)
    world, nproc = s["world_size"], st["parallel.nproc_per_node"]
    if world > 1 and nproc == world:
        # Without the slow rank: every rank keeps pace, and the step carries (N-1)/N of the tokens.
        new = replace(split, comm_wait=0.0, tokens=split.tokens * (world - 1) / world)
        why = (
            f"rank {slowest} holds every step back by {split.comm_wait:.3f} s; check its device (clocks, temperature, "
            f"other processes) or leave it out (CUDA_VISIBLE_DEVICES without it)"
        )
        levers.append(_lever("parallel.nproc_per_node", world - 1, why, split, new))
    return levers


def _memory_levers(s: dict, by_rank: list[dict], st: RunSettings, th: DiagnoseConfig) -> list[dict]:
    """Cheapest in speed first: smaller loss chunks, bf16, smaller micro-batches, then recomputation."""
    split, levers = step_split(s), []
    chunk = st["model.loss_chunk_tokens"]
    if chunk == 0 or chunk > 128:
        why = "the LM head's logits (chunk × vocabulary × 4 bytes) are formed a chunk of target tokens at a time"
        levers.append(_lever("model.loss_chunk_tokens", 512 if chunk == 0 else chunk // 2, why))
    if st["trainer.precision"] == "fp32" and s["device"] == "cuda":
        levers.append(_lever("trainer.precision", "bf16", "bf16 activations take half the memory (and run faster)"))
    levers.append(_smaller_batch_lever(s, st))
    levers = [lever for lever in levers if lever]
    if not st["model.gradient_checkpointing"]:
        # Recomputation runs the forward again in backward: about 1/3 more compute (forward ≈ 1/3 of fwd+bwd).
        why = "keep only layer inputs and recompute the rest in backward: activations shrink to about one per layer"
        levers.append(
            _lever("model.gradient_checkpointing", True, why, split, replace(split, compute=split.compute * 4 / 3))
        )
    if s.get("alloc_retries"):
        why = "the allocator retried; expandable segments (an environment variable) let it grow blocks in place"
        levers.append(_lever("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True", why))
    return levers


def _smaller_batch_lever(s: dict, st: RunSettings) -> dict | None:
    """Fewer rows (or tokens) per micro-batch and as many more micro-batches per step: the same global batch.

    The rows go down to the largest divisor of data.micro_batch_size up to half of it (half when it is even), so
    accumulation can make up for them exactly; at one row there is nothing to take away.
    """
    if st["data.batching"] in ("token_budget", "packed"):
        value = st["data.max_tokens_per_batch"] // 2
        return _lever("data.max_tokens_per_batch", value, "half the tokens per micro-batch: half the activations")
    rows = st["data.micro_batch_size"]
    value = next((d for d in range(rows // 2, 0, -1) if rows % d == 0), None)
    if value is None:
        return None
    ratio = rows // value
    share = "half" if ratio == 2 else f"1/{ratio} of"
    global_batch = st["optim.global_batch_size"]
    if global_batch:
        # The trainer derives the accumulation from optim.global_batch_size: it grows by itself.
        keep = f"optim.global_batch_size={global_batch} stays, so each step accumulates {ratio}× the micro-batches"
    else:
        keep = f"with optim.grad_accum_steps={ratio * s['grad_accum_steps']} the global batch stays"
    return _lever("data.micro_batch_size", value, f"{share} the rows per micro-batch; {keep}")


def _compute_levers(s: dict, by_rank: list[dict], st: RunSettings, th: DiagnoseConfig) -> list[dict]:
    """Faster kernels and fewer FLOPs; on CPU only compilation, recomputation and padding apply."""
    split, cuda, levers = step_split(s), s["device"] == "cuda", []
    if st["model.gradient_checkpointing"] and _memory_headroom(s, by_rank) >= 0.3:
        why = "memory has room: stop recomputing the forward in backward (about 1/4 of the compute)"
        levers.append(
            _lever("model.gradient_checkpointing", False, why, split, replace(split, compute=split.compute * 3 / 4))
        )
    padding = s.get("padding_fraction") or 0.0
    if padding >= PADDING_SHARE and st["data.batching"] != "packed" and st["objective.name"] != "dpo":
        why = f"{padding:.0%} of the padded tokens are padding, computed for nothing: packing removes them"
        why += _global_batch_note(st)
        levers.append(
            _lever("data.batching", "packed", why, split, replace(split, compute=split.compute * (1 - padding)))
        )
    if cuda and st["trainer.precision"] == "fp32":
        levers.append(_lever("trainer.precision", "bf16", "fp32 matmuls run far below the tensor cores' bf16 peak"))
    if cuda and not st["model.liger_kernel"]:
        levers.append(_lever("model.liger_kernel", True, "fused RMSNorm/SwiGLU/RoPE kernels: fewer memory round trips"))
    # Not yet under fsdp2 or objective=dpo: refused there.
    if not st["trainer.compile"] and st["parallel.strategy"] != "fsdp2" and st["objective.name"] != "dpo":
        levers.append(_lever("trainer.compile", True, "torch.compile fuses the small ops between the matmuls"))
    if cuda and _memory_headroom(s, by_rank) >= 0.5 and st["data.batching"] in ("random", "length_grouped"):
        value = 2 * st["data.micro_batch_size"]
        levers.append(
            _lever("data.micro_batch_size", value, "half the memory is free: larger matmuls use the GPU better")
        )
    return levers


def _memory_headroom(s: dict, by_rank: list[dict]) -> float:
    """The free share of the fullest rank's device (0 when unknown: no lever that spends memory blindly).

    Measured as the memory rule measures it (reserved where known, else allocated): a lever that spends memory is
    not offered on room the rule would call full.
    """
    total, (used, _, _) = s.get("mem_total_gb"), fullest_memory(s, by_rank)
    return 1.0 - used / total if total and used is not None else 0.0


_LEVERS = {
    "communication": _comm_levers,
    "data": _data_levers,
    "imbalance": _imbalance_levers,
    "straggler": _straggler_levers,
    "memory": _memory_levers,
    "compute": _compute_levers,
}


def choose_levers(
    findings: list[dict], s: dict, by_rank: list[dict], st: RunSettings, th: DiagnoseConfig
) -> list[dict]:
    """The levers of every finding, one per key (the verdict's wins), ordered by expected gain.

    Under a memory verdict its own levers come first, in their order (cheapest in speed first); then levers that
    predict a gain, largest first; then those without a prediction; last those predicted to cost speed.
    """
    if not findings:
        why = "timing was off: the verdict needs the time split, which trainer.timing=true measures"
        return [_lever("trainer.timing", True, why)]
    levers: dict[str, dict] = {}
    for finding in findings:
        for lever in _LEVERS[finding["verdict"]](s, by_rank, st, th):
            levers.setdefault(lever["key"], lever | {"for": finding["verdict"]})
    first = [lv for lv in levers.values() if findings[0]["verdict"] == "memory" and lv["for"] == "memory"]
    rest = [lv for lv in levers.values() if lv not in first]
    gains = sorted((lv for lv in rest if lv.get("gain", 0) > 0), key=lambda lv: -lv["gain"])
    return first + gains + [lv for lv in rest if "gain" not in lv] + [lv for lv in rest if lv.get("gain", 1) <= 0]


def predict(levers: list[dict], s: dict, st: RunSettings) -> list[dict]:
    """Every predicted change: the levers', and accumulation at ×2, ×4, ×8 whatever the verdict.

    With optim.global_batch_size set, accumulation is derived from it: the change is the global batch ×2, ×4, ×8.
    """
    predictions = [
        {"change": lv["set"], "step_time_s": lv["predicted_step_time_s"], "tokens_per_s": lv["predicted_tokens_per_s"]}
        for lv in levers
        if "predicted_tokens_per_s" in lv
    ]
    split, global_batch = step_split(s), st["optim.global_batch_size"]
    key, current = (
        ("optim.global_batch_size", global_batch)
        if global_batch
        else ("optim.grad_accum_steps", s.get("grad_accum_steps") or 1)
    )
    if split is None or s.get("strategy") == "fsdp2":  # FSDP2 gathers the weights again at every micro-step
        return predictions
    for ratio in (2, 4, 8):
        new = split.accumulate(ratio)
        change = f"{key}={current * ratio}"
        if all(p["change"] != change for p in predictions):
            predictions.append({"change": change, "step_time_s": new.step_s, "tokens_per_s": new.tokens_per_s})
    return predictions
