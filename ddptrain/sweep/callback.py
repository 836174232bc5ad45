"""The Hydra callback that keeps a multirun's sweep report current (``conf/train.yaml``: ``hydra.callbacks``).

After every job it rewrites the report from the job folders (so it exists while the sweep runs and after it was
interrupted), and at the end of the multirun prints where it is and the best jobs. Hydra does not call
``on_multirun_end`` when a job failed (its sweeper raises that job's error first), which is why every job's end
writes the whole report, plots included. Outside a multirun it does nothing.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from ddptrain.process.started import Start

log = logging.getLogger(__name__)


class SweepReport(Callback):
    """Writes ``report.md``, ``report.csv`` and the plots into the sweep folder as jobs end."""

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        # A job whose tasks are its ranks (hydra/launcher=slurm_multinode) ends in every task: rank 0 writes.
        if config.hydra.mode == RunMode.MULTIRUN and Start.from_environ().is_rank_zero:
            refresh(Path(str(config.hydra.sweep.dir)))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        rows = refresh(Path(str(config.hydra.sweep.dir)))
        if rows:
            from ddptrain.sweep.report import console_lines

            print(console_lines(Path(str(config.hydra.sweep.dir)), rows), file=sys.stderr)


def refresh(sweep_dir: Path) -> list[dict[str, Any]]:
    """Rewrite the sweep report; a report that fails must not fail the job it follows (it says how to retry)."""
    from ddptrain.sweep.report import write_sweep_report

    try:
        return write_sweep_report(sweep_dir)
    except Exception as err:
        log.warning("no sweep report (%s); retry with: ddptrain report %s", err, sweep_dir)
        return []
