"""The command line, ``ddptrain diagnose RUN_DIR [--what-if parallel.nproc_per_node=8 link=nvlink]``: write
the report into the run folder, print its short version and, when asked, the what-if. Its ``--help`` is the
verb's (``ddptrain.cli``), the same under ``python -m ddptrain.diagnose``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ddptrain.cli import verb_parser
from ddptrain.diagnose.render import console_summary, format_what_if, write_files, write_report
from ddptrain.diagnose.runs import MIB, DiagnoseError
from ddptrain.diagnose.scaling import LINKS, resolve_link, what_if

# ----------------------------------------------------------------------------- CLI


def _parse_what_if(tokens: list[str]) -> tuple[int, str]:
    """``parallel.nproc_per_node=8 link=nvlink`` -> (8, "nvlink")."""
    values = {}
    for token in tokens:
        key, sep, value = token.partition("=")
        key = key.removeprefix("parallel.")
        if not sep or key not in ("nproc_per_node", "link"):
            raise ValueError(f"--what-if {token}: expected parallel.nproc_per_node=N and link={'|'.join(LINKS)}.")
        values[key] = value
    if "nproc_per_node" not in values or not values["nproc_per_node"].isdigit():
        raise ValueError(
            "--what-if needs parallel.nproc_per_node=N, e.g. --what-if parallel.nproc_per_node=8 link=nvlink."
        )
    return int(values["nproc_per_node"]), values.get("link", "pcie")


def _what_if_request(args: argparse.Namespace) -> dict | None:
    """The what-if's arguments for ``what_if``, checked before anything is written (None when none was asked).

    Raises:
        ValueError: a malformed --what-if, an unknown link, a non-positive --grad-mb or --bus-bandwidth, a negative
            --latency-us, or one of these three without --what-if. All problems at once.
    """
    options = {"--bus-bandwidth": args.bus_bandwidth, "--latency-us": args.latency_us, "--grad-mb": args.grad_mb}
    given = [name for name, value in options.items() if value is not None]
    if not args.what_if:
        if given:
            raise ValueError(
                f"{', '.join(given)} only apply to the what-if: add --what-if parallel.nproc_per_node=N "
                f"link={'|'.join(LINKS)}, or drop {'them' if len(given) > 1 else 'it'}."
            )
        return None
    problems = [
        f"{name} {value:g} must be positive."
        for name, value in (("--grad-mb", args.grad_mb), ("--bus-bandwidth", args.bus_bandwidth))
        if value is not None and value <= 0
    ]
    if args.latency_us is not None and args.latency_us < 0:
        problems.append(f"--latency-us {args.latency_us:g} must be 0 or more.")
    try:
        nproc, link = _parse_what_if(args.what_if)
        if nproc < 1:
            problems.append(f"--what-if parallel.nproc_per_node={nproc} must be 1 or more.")
        resolve_link(link, args.bus_bandwidth, args.latency_us)
    except ValueError as err:
        problems.append(str(err))
    if problems:
        raise ValueError(" ".join(problems))
    grad_bytes = args.grad_mb * MIB if args.grad_mb is not None else None
    return {
        "nproc_per_node": nproc,
        "link": link,
        "bus_bandwidth_gb_s": args.bus_bandwidth,
        "latency_us": args.latency_us,
        "grad_bytes": grad_bytes,
    }


def _parser() -> argparse.ArgumentParser:
    parser = verb_parser("diagnose")
    parser.add_argument("run_dir", type=Path, help="a run folder (holds metrics.jsonl and config.yaml)")
    parser.add_argument(
        "--what-if", nargs="+", metavar="KEY=VALUE", help="parallel.nproc_per_node=N link=pcie|nvlink|ib|ethernet"
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--bus-bandwidth", type=float, metavar="GB_S", help="what-if: all-reduce bus bandwidth in GB/s")
    parser.add_argument("--latency-us", type=float, help="what-if: latency per ring hop in microseconds")
    parser.add_argument("--grad-mb", type=float, help="what-if: gradient MiB per rank and step, if the run logged none")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``ddptrain diagnose RUN_DIR [--what-if parallel.nproc_per_node=8 link=nvlink] [--no-plots]``.

    Checks the command first (a malformed one writes nothing), then writes the report into RUN_DIR and prints its
    short version (and the what-if).

    Args:
        argv: the arguments (default: the command line's).

    Returns:
        0, or 2 when the command is malformed, there is nothing to diagnose, or the what-if cannot run (the reason
        goes to stderr).
    """
    args = _parser().parse_args(argv)
    try:
        request = _what_if_request(args)
        report = write_report(args.run_dir, plots=not args.no_plots)
        print(console_summary(report))
        if request:
            result = what_if(report, **request)
            report["what_if"] = result
            write_files(args.run_dir, report)
            print(format_what_if(result))
    except (DiagnoseError, ValueError) as err:
        print(f"ddptrain.diagnose: {err}", file=sys.stderr)
        return 2
    return 0
