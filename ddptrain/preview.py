"""``ddptrain preview [--n N | --rows 3,17,40] [--html FILE] [overrides]``: see what a run trains on.

One process, no workers. The run's config is composed from the same overrides as ``python -m ddptrain`` (and checked
the same way), its data tokenized through the same cache a run uses. For each chosen sample of the training set
(after the eval split) it prints the text as the model sees it with the trained tokens marked (green on a terminal,
``[[...]]`` otherwise), its token and trained counts, whether it reaches ``data.max_length`` and, in a mixture, its
source; then the batch plan of epoch 0: micro-batches, padding and the rank imbalance. ``--html FILE`` writes the
samples as a page (trained tokens highlighted, each token's id and text on hover).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from ddptrain.cli import verb_parser
from ddptrain.config import ConfigError, RunConfig, register_configs, to_run_config
from ddptrain.config.hydra import CONF_DIR
from ddptrain.config.run import resolve_global_batch_size

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ddptrain.data.tokenized import TokenizedData


def _parser() -> argparse.ArgumentParser:
    parser = verb_parser(
        "preview",
        "One process, no workers; trained text is green on a terminal, [[...]] otherwise. Any other argument is a "
        "Hydra override, as for ddptrain train.",
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--n", type=int, default=3, help="show the first N samples of the training set (default 3)")
    which.add_argument("--rows", help="show these samples of the training set, e.g. 3,17,40")
    parser.add_argument("--html", type=Path, help="also write the samples as an HTML page to this file")
    parser.add_argument("--plain", action="store_true", help="mark trained text with [[ ]] even on a terminal")
    parser.add_argument(
        "--world-size", type=int, help="ranks to plan batches for, all nodes (default parallel.nproc_per_node)"
    )
    parser.add_argument("--config-dir", type=Path, help="a recipe folder, as for ddptrain train")
    parser.add_argument("--config-name", default="train", help="the config in --config-dir (default train)")
    return parser


def compose_run_config(overrides: list[str], config_dir: Path | None, config_name: str) -> RunConfig:
    """The run config ``python -m ddptrain [--config-dir DIR --config-name NAME] *overrides`` would train with.

    Raises:
        ConfigError: the overrides do not make a valid run.
    """
    from hydra import compose, initialize_config_dir

    register_configs()
    primary = CONF_DIR
    if config_dir is not None:  # like --config-dir: the recipe is primary, conf/ stays on the search path
        primary = config_dir.resolve()
        overrides = [*overrides, f"hydra.searchpath=[file://{CONF_DIR}]"]
    with initialize_config_dir(str(primary), version_base="1.3"):
        return to_run_config(compose(config_name, overrides=overrides))


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, overrides = parser.parse_known_args(argv)
    refuse_unknown_options(parser, overrides)
    try:
        wanted = parse_rows(args.rows, args.n)
    except ValueError as err:
        parser.error(str(err))
    configured = run_config_or_none("ddptrain.preview", overrides, args)
    if configured is None:
        return 2
    cfg, world_size = configured
    try:
        tokenizer, data = tokenized(cfg)
        rows = in_training_set(wanted, len(data.train))
    except (OSError, ValueError) as err:  # unreadable data or tokenizer, a malformed row, a row not in the set
        print(f"ddptrain.preview: {err}", file=sys.stderr)
        return 1
    colour = not args.plain and sys.stdout.isatty() and "NO_COLOR" not in os.environ
    samples = show_samples(cfg, tokenizer, data, rows, colour)
    if args.html is not None:
        args.html.write_text(_page(cfg, tokenizer, samples))
    try:
        print(plan_summary(cfg, data, world_size))
    except ValueError as err:  # the data cannot fill one micro-step on every rank: what a run would stop on
        print(f"ddptrain.preview: no batch plan: {err}", file=sys.stderr)
        return 1
    finally:
        if args.html is not None:
            print(f"\nwrote {args.html}")
    return 0


def refuse_unknown_options(parser: argparse.ArgumentParser, overrides: list[str]) -> None:
    """What argparse left over is Hydra overrides; anything that looks like an option is a typo (exits 2)."""
    flags = [o for o in overrides if o.startswith("-")]
    if flags:
        parser.error(f"unknown option {flags[0]}: options are listed by --help, the rest are Hydra overrides")


def run_config_or_none(prog: str, overrides: list[str], args: argparse.Namespace) -> tuple[RunConfig, int] | None:
    """The run config and the ranks to plan for (``--config-dir``, ``--config-name``, ``--world-size``), or None
    after printing why the overrides make no valid run (the command then exits 2)."""
    try:
        cfg = compose_run_config(overrides, args.config_dir, args.config_name)
        world_size = planned_world_size(cfg, args.world_size)
        return resolve_global_batch_size(cfg, world_size), world_size
    except (ConfigError, HydraException, OmegaConfBaseException) as err:
        print(f"{prog}: invalid configuration:\n{err}", file=sys.stderr)
        return None


def tokenized(cfg: RunConfig) -> tuple[PreTrainedTokenizerBase, TokenizedData]:
    """The run's tokenizer and data, tokenized through the cache a run uses, the data side's lines on stderr.

    Raises:
        OSError, ValueError: an unreadable tokenizer or data file, a malformed row.
    """
    from ddptrain.data.mixture import build_datasets  # torch, transformers, datasets: after the config check
    from ddptrain.model import build_tokenizer

    with _data_side_logged():
        tokenizer = build_tokenizer(cfg.model)
        return tokenizer, build_datasets(cfg.data, tokenizer, cfg.trainer.seed)


def parse_rows(rows: str | None, n: int) -> list[int] | int:
    """``--rows`` as indices, or ``--n`` as a count (checked before anything is tokenized).

    Raises:
        ValueError: not row numbers, or not at least one row.
    """
    if rows is None:
        if n < 1:
            raise ValueError(f"--n {n}: show at least one sample (--n 1 or more)")
        return n
    try:
        chosen = [int(r) for r in rows.split(",") if r.strip()]
    except ValueError:
        chosen = []
    if not chosen or min(chosen) < 0:
        raise ValueError(f"--rows {rows}: give row numbers from 0, separated by commas, e.g. --rows 3,17,40")
    return chosen


def in_training_set(wanted: list[int] | int, size: int) -> list[int]:
    """The indices to show: the first ``wanted`` rows, or ``wanted`` itself when each is in the training set.

    Raises:
        ValueError: a row past the end of the training set.
    """
    if isinstance(wanted, int):
        return list(range(min(wanted, size)))
    outside = [r for r in wanted if r >= size]
    if outside:
        raise ValueError(f"--rows: the training set has rows 0 to {size - 1}; {outside[0]} is not one")
    return wanted


def planned_world_size(cfg: RunConfig, given: int | None) -> int:
    """The ranks to plan for: ``--world-size``, else parallel.nproc_per_node (said when that is a guess)."""
    if given is not None:
        return given
    if cfg.parallel.nproc_per_node is None:
        print(
            "ddptrain.preview: parallel.nproc_per_node=null (torchrun decides): planning for 1 rank; "
            "give --world-size N for the job's number of processes",
            file=sys.stderr,
        )
    return cfg.parallel.nproc_per_node or 1


def show_samples(cfg: RunConfig, tokenizer, data: TokenizedData, rows: list[int], colour: bool) -> list[tuple]:
    """Print each chosen sample; return ``(heading, input_ids, labels)`` for the HTML page."""
    from ddptrain.data.show import describe, marked_text

    sources = [s.path for s in cfg.data.sources] if cfg.data.sources else None
    samples = []
    for i in rows:
        row = data.train[i]
        pair = "rejected_input_ids" in row  # a preference pair: both sequences, each trained on its reply
        for name, prefix in (("chosen", ""), ("rejected", "rejected_")) if pair else (("", ""),):
            sequence = {**row, "input_ids": row[f"{prefix}input_ids"], "labels": row[f"{prefix}labels"]}
            heading = (
                f"training row {i}{f', {name}' if name else ''} · {describe(sequence, cfg.data.max_length, sources)}"
            )
            print(f"── {heading}\n{marked_text(tokenizer, sequence['input_ids'], sequence['labels'], colour)}\n")
            samples.append((heading, sequence["input_ids"], sequence["labels"]))
    return samples


def plan_summary(cfg: RunConfig, data: TokenizedData, world_size: int) -> str:
    """Epoch 0's batch plan as the sampler makes it on each rank: micro-batches, samples, tokens, padding, the
    costliest micro-batch, and how unevenly the ranks are loaded."""
    from ddptrain.data.loader import build_batching_spec
    from ddptrain.data.plan import micro_batch_cost
    from ddptrain.data.sampler import DistributedBatchSampler

    lengths = data.train["length"]
    spec = build_batching_spec(cfg.data, world_size, cfg.optim.grad_accum_steps, cfg.trainer.seed)
    lines = [
        f"batch plan, epoch 0: data.batching={cfg.data.batching.value}, {world_size} rank(s), "
        f"{cfg.optim.grad_accum_steps} micro-batch(es) per optimizer step",
        f"{'rank':>6} {'micro-batches':>14} {'samples':>8} {'tokens':>9} {'padded':>9} {'padding':>8} "
        f"{'costliest':>10}",
    ]
    padded_per_rank, dropped = [], 0
    for rank in range(world_size):
        sampler = DistributedBatchSampler(lengths, spec, rank, data.epoch_rows)
        costs = [micro_batch_cost(batch, lengths, spec) for batch in sampler]
        samples = sum(len(row) for batch in sampler for row in batch)
        real, padded = sum(c[0] for c in costs), sum(c[1] for c in costs)
        padding = 1 - real / padded if padded else 0.0
        costliest = max(c[1] for c in costs)
        lines.append(f"{rank:>6} {len(costs):>14} {samples:>8} {real:>9} {padded:>9} {padding:>8.1%} {costliest:>10}")
        padded_per_rank.append(padded)
        dropped = sampler.dropped
    imbalance = max(padded_per_rank) / (sum(padded_per_rank) / world_size)
    lines.append(
        f"rank imbalance {imbalance:.3f} (the busiest rank's padded tokens over the mean); "
        f"{dropped} sample(s) left out of this epoch; 'costliest' is a rank's largest micro-batch in padded tokens"
    )
    return "\n".join(lines)


def _page(cfg: RunConfig, tokenizer, samples: list[tuple]) -> str:
    from ddptrain.data.show import html_page

    source = cfg.data.path if not cfg.data.sources else f"{len(cfg.data.sources)} sources"
    return html_page(f"ddptrain preview: {source} (data.template={cfg.data.template.value})", samples, tokenizer)


@contextlib.contextmanager
def _data_side_logged() -> Iterator[None]:
    """The data side's own lines (rows read, truncation, how conversations are rendered and trained) on stderr, while
    the preview runs (a caller's logging is left as it was)."""
    logger = logging.getLogger("ddptrain")
    handler, level = logging.StreamHandler(sys.stderr), logger.level
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


if __name__ == "__main__":
    sys.exit(main())
