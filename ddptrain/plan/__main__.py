"""``ddptrain plan [--world-size N] [overrides]``: will the run fit? Every rank's predicted peak memory.

One process, no workers, no weights: the run's config is composed from the same overrides as ``python -m ddptrain``
(and checked the same way), its data tokenized through the same cache a run uses and batched by the same plan, and
its model simulated on fake tensors from its architecture config (``ddptrain.plan.simulate``). Exit status: 0 when
the run fits (or no device size is known), 3 when it does not, 2 for a configuration error, 1 for unreadable data.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ddptrain.cli import verb_parser
from ddptrain.preview import refuse_unknown_options, run_config_or_none, tokenized

DOES_NOT_FIT = 3


def _parser() -> argparse.ArgumentParser:
    parser = verb_parser(
        "plan",
        "One process, no weights: the model is simulated on fake tensors. Any other argument is a Hydra override, as "
        "for ddptrain train. Exit status: 0 fits, 3 does not fit, 2 configuration error, 1 unreadable data.",
    )
    parser.add_argument("--world-size", type=int, help="ranks to plan for, all nodes (default parallel.nproc_per_node)")
    parser.add_argument("--no-levers", action="store_true", help="skip the largest batch and the levers (faster)")
    parser.add_argument("--config-dir", type=Path, help="a recipe folder, as for ddptrain train")
    parser.add_argument("--config-name", default="train", help="the config in --config-dir (default train)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, overrides = parser.parse_known_args(argv)
    refuse_unknown_options(parser, overrides)
    started = time.monotonic()
    configured = run_config_or_none("ddptrain.plan", overrides, args)
    if configured is None:
        return 2
    cfg, world_size = configured
    from ddptrain.plan.planner import make_plan  # torch, transformers: after the config check
    from ddptrain.plan.render import render_plan

    try:
        _, data = tokenized(cfg)
        plan = make_plan(cfg, data, world_size, with_levers=not args.no_levers)
    except (OSError, ValueError) as err:  # unreadable data, config or tokenizer; data too small for a micro-step
        print(f"ddptrain.plan: {err}", file=sys.stderr)
        return 1
    title = (
        f"memory plan: model.name_or_path={cfg.model.name_or_path}, {world_size} rank(s) on {plan.device}, "
        f"data.batching={cfg.data.batching.value} (planned in {time.monotonic() - started:.0f} s, no weights loaded)"
    )
    print(render_plan(plan, title))
    return DOES_NOT_FIT if plan.fits is False else 0


if __name__ == "__main__":
    sys.exit(main())
