"""The what-if at another scale: the measured step with its all-reduce replaced by a ring all-reduce model on a
chosen link (``LINKS``: typical achieved bus bandwidth and per-hop latency), at 1, 2, 4, … ranks and the target.
``what_if`` returns the rows and an explanation in words, calibrated against what the run measured at its own scale.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ddptrain.diagnose.report import build_report
from ddptrain.diagnose.runs import BACKWARD_SHARE, MIB, DiagnoseError, StepSplit, exposed_s, step_split

# ----------------------------------------------------------------------------- what-if: another scale


@dataclass(frozen=True)
class Link:
    """A link's all-reduce bus bandwidth (GB/s, as nccl-tests reports busbw) and per-hop latency."""

    bus_gb_s: float
    latency_us: float
    shared_beyond: int | None = None
    """Past this many ranks the ring crosses a slower hop (PCIe: the link between the two CPU sockets)."""
    shared_gb_s: float | None = None

    def bandwidth(self, nproc: int) -> float:
        if self.shared_beyond is not None and nproc > self.shared_beyond:
            return self.shared_gb_s
        return self.bus_gb_s


# Typical achieved all-reduce bus bandwidth, not the marketing figure; override with --bus-bandwidth/--latency-us.
LINKS = {
    "pcie": Link(bus_gb_s=16.0, latency_us=10.0, shared_beyond=4, shared_gb_s=8.0),  # Gen4 x16, 4 GPUs per socket
    "nvlink": Link(bus_gb_s=200.0, latency_us=5.0),  # A100/H100 NVLink + NVSwitch, one node
    "ib": Link(bus_gb_s=20.0, latency_us=15.0),  # one 200 Gb/s HDR NIC per GPU, across nodes
    "ethernet": Link(bus_gb_s=1.25, latency_us=50.0),  # 10 GbE, TCP (gloo or nccl sockets)
}


def ring_allreduce_s(nbytes: float, nproc: int, bus_gb_s: float, latency_us: float) -> float:
    """Seconds of one ring all-reduce: 2(N−1)/N · bytes / bus bandwidth + 2(N−1) · latency (0 for one process)."""
    if nproc <= 1:
        return 0.0
    return 2 * (nproc - 1) / nproc * nbytes / (bus_gb_s * 1e9) + 2 * (nproc - 1) * latency_us * 1e-6


def _as_report(report_or_run_dir: dict | Path | str) -> dict:
    return report_or_run_dir if isinstance(report_or_run_dir, dict) else build_report(Path(report_or_run_dir))


def _scale_row(split: StepSplit, s: dict, nproc: int, link: Link, grad_bytes: float, buckets: int) -> dict:
    """Step time and throughput at ``nproc`` ranks, each keeping its micro-batches (weak scaling)."""
    base = split.data + split.compute + split.optimizer + split.other
    bus = link.bandwidth(nproc)
    per_bucket = ring_allreduce_s(grad_bytes / buckets, nproc, bus, link.latency_us)
    exposed = exposed_s(per_bucket, (buckets - 1) * per_bucket, BACKWARD_SHARE * split.compute)
    step = base + exposed
    tokens_per_rank = split.tokens / s["world_size"]
    return {
        "nproc": nproc,
        "bus_gb_s": bus,
        "allreduce_s": buckets * per_bucket,
        "exposed_comm_s": exposed,
        "step_time_s": step,
        "tokens_per_s": tokens_per_rank * nproc / (step + split.outside),
    }


def what_if(
    report_or_run_dir: dict | Path | str,
    nproc_per_node: int,
    link: str,
    bus_bandwidth_gb_s: float | None = None,
    latency_us: float | None = None,
    grad_bytes: float | None = None,
) -> dict:
    """Estimate step time, tokens/s and scaling efficiency at ``nproc_per_node`` ranks.

    Each rank keeps its measured data, compute, optimizer and other time per step (its micro-batches do not change);
    the all-reduce of the measured gradient bytes follows the ring model on ``link``, split into the measured number
    of buckets, all but the last of which can hide behind backward (≈ 2/3 of compute). Ranks are assumed balanced.

    Args:
        report_or_run_dir: a report from build_report, or a run folder.
        nproc_per_node: the number of processes to estimate.
        link: a key of LINKS (pcie, nvlink, ib, ethernet), or a name of your own with both figures below.
        bus_bandwidth_gb_s, latency_us: override the table's figures (a flat bandwidth, no shared hop).
        grad_bytes: gradient bytes per rank per step, when the run did not log allreduce_bytes_per_step.

    Returns:
        ``rows`` (1, 2, 4, … ranks and the target), ``target``, the model's inputs and ``explanation`` lines.

    Raises:
        ValueError: a link not in LINKS without both figures, or a non-positive number of processes.
        DiagnoseError: the run logged no time split or no gradient bytes.
    """
    report = _as_report(report_or_run_dir)
    s, split = report["summary"], step_split(report["summary"])
    chosen = resolve_link(link, bus_bandwidth_gb_s, latency_us)
    if nproc_per_node < 1:
        raise ValueError(f"parallel.nproc_per_node={nproc_per_node} must be 1 or more.")
    if split is None:
        raise DiagnoseError("the what-if needs the measured time split: rerun with trainer.timing=true.")
    grad_bytes = _gradient_bytes(s, grad_bytes)
    buckets = max(round(s.get("allreduce_calls_per_step") or 1), 1)
    sizes = sorted({1, s["world_size"], nproc_per_node} | {2**i for i in range(1, 12) if 2**i < nproc_per_node})
    rows = [_scale_row(split, s, n, chosen, grad_bytes, buckets) for n in sizes]
    for row in rows:
        row["speedup"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
        row["efficiency"] = row["speedup"] / row["nproc"]
    target = next(r for r in rows if r["nproc"] == nproc_per_node)
    result = {
        "nproc_per_node": nproc_per_node,
        "link": link,
        "latency_us": chosen.latency_us,
        "grad_bytes_per_step": grad_bytes,
        "buckets": buckets,
        "backward_s": BACKWARD_SHARE * split.compute,
        "compute_per_step_s": split.data + split.compute + split.optimizer + split.other,
        "measured": {"nproc": s["world_size"], "exposed_comm_s": split.comm_wire, "step_time_s": split.step_s},
        "rows": rows,
        "target": target,
    }
    result["explanation"] = _explain(result, s)
    return result


def _gradient_bytes(summary: dict, given: float | None) -> float:
    """Gradient bytes per rank per step: ``given``, else what the run logged.

    Raises:
        DiagnoseError: neither (a one-process run logs none), naming the flag to pass.
    """
    grad_bytes = given or summary.get("allreduce_bytes_per_step")
    if not grad_bytes:
        raise DiagnoseError(
            "the run logged no allreduce_bytes_per_step (one process?): pass --grad-mb, the trainable gradients' MiB."
        )
    return grad_bytes


def resolve_link(name: str, bus_gb_s: float | None, latency_us: float | None) -> Link:
    """The link the what-if models: ``LINKS[name]`` with the given figures in place of the table's, or a link of the
    user's own (any other name) when both its bus bandwidth and its latency are given.

    Raises:
        ValueError: a name not in LINKS without both figures.
    """
    if name in LINKS:
        link = LINKS[name]
        if bus_gb_s is not None:
            link = Link(bus_gb_s=bus_gb_s, latency_us=link.latency_us)
        return replace(link, latency_us=latency_us) if latency_us is not None else link
    missing = [flag for flag, value in (("--bus-bandwidth", bus_gb_s), ("--latency-us", latency_us)) if value is None]
    if missing:
        raise ValueError(
            f"link={name} is not one of {', '.join(LINKS)}: pick one of them, or describe a link of your own with "
            f"--bus-bandwidth GB/s and --latency-us (missing: {' and '.join(missing)})."
        )
    return Link(bus_gb_s=bus_gb_s, latency_us=latency_us)


def _calibration(result: dict) -> list[str]:
    """Compare the model with what the run measured at its own scale; far apart, the run's link is not the table's."""
    m = result["measured"]
    row = next(r for r in result["rows"] if r["nproc"] == m["nproc"])
    if m["nproc"] < 2 or m["exposed_comm_s"] <= 3 * row["exposed_comm_s"] + 1e-3:
        return []
    n, hops = m["nproc"], 2 * (m["nproc"] - 1) * result["latency_us"] * 1e-6
    wire = m["exposed_comm_s"] - hops
    fitted = 2 * (n - 1) / n * result["grad_bytes_per_step"] / wire / 1e9 if wire > 0 else None
    hint = f" (about --bus-bandwidth {fitted:.3g} would reproduce it)" if fitted else ""
    return [
        f"The run measured {m['exposed_comm_s'] * 1e3:.1f} ms of exposed all-reduce at {n} ranks where the model "
        f"gives {row['exposed_comm_s'] * 1e3:.1f} ms: its link, or what its all-reduce waits on, is slower than "
        f"the table's{hint}."
    ]


def _accumulation_key(s: dict) -> str:
    """k× the micro-batches per step as the user types it: the global batch when optim.global_batch_size is set (the
    trainer derives the accumulation from it), else the accumulation."""
    key, current = (
        ("optim.global_batch_size", s["global_batch_size"])
        if s.get("global_batch_size")
        else ("optim.grad_accum_steps", s.get("grad_accum_steps") or 1)
    )
    return f"{key}=k" if current == 1 else f"{key}=k×{current}"


def _explain(result: dict, s: dict) -> list[str]:
    """The answer to "N GPUs give only k× — why?", in words (``s``: the run's summary)."""
    t, n = result["target"], result["nproc_per_node"]
    lines = [
        f"At {n} ranks each step still computes {result['compute_per_step_s']:.3f} s per rank (data, compute, "
        "optimizer and other: every rank keeps its micro-batches).",
        f"Each rank all-reduces {result['grad_bytes_per_step'] / MIB:.1f} MiB: the ring sends 2·{n - 1}/{n} of it over "
        f"{t['bus_gb_s']:g} GB/s plus 2·{n - 1} hops of {result['latency_us']:g} µs = {t['allreduce_s'] * 1e3:.1f} ms.",
        f"All but the last of {result['buckets']} bucket(s) can hide behind backward (≈ 2/3 of compute = "
        f"{result['backward_s']:.3f} s): {t['exposed_comm_s'] * 1e3:.1f} ms stays exposed, "
        f"{t['exposed_comm_s'] / t['step_time_s']:.0%} of the {t['step_time_s']:.3f} s step.",
        f"So {n} ranks give {t['speedup']:.2f}× one rank ({t['efficiency']:.0%} efficiency).",
    ]
    lines += _calibration(result)
    if t["efficiency"] < 0.9:
        lines.append(
            f"What changes it: {_accumulation_key(s)} divides the exposed all-reduce per sample by k; "
            "parallel.comm_hook=fp16_compress/bf16_compress halves the bytes; a faster link shrinks the bandwidth term."
        )
    else:
        lines.append(
            "The all-reduce hides well at this scale: a measured speedup well below this comes from what the model "
            "leaves out (unbalanced ranks, a slow rank, data loading, a shared PCIe switch): see the run's report."
        )
    return lines
