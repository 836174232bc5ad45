"""The files rank 0 leaves in the run folder besides the log and metrics.jsonl: ``config.yaml`` and the torchrun
restart marker (written by the launcher), and the run report (``report.md``, ``report.json``: the diagnosis, written
when the metrics logger closes). Other ranks hold ``NullRunFiles``: the same calls, nothing written, so no caller
asks which rank it is on.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any


class RunFiles:
    """Global rank 0's writer of the run folder's small files."""

    def write_file(self, path: Path, text: str) -> None:
        """Write ``text`` to ``path``, creating its folder (``config.yaml``, the torchrun restart marker)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def write_report(self, run_dir: Path) -> dict[str, Any] | None:
        """report.md and report.json in ``run_dir`` (read from its metrics.jsonl), and the short version on the console.

        Returns:
            The report, or None when it could not be made (a warning says how to retry).
        """
        from ddptrain import diagnose

        try:
            report = diagnose.write_report(run_dir, plots=False)
        except Exception as err:  # the training is done: a report that fails must not fail the run
            logging.getLogger(__name__).warning("no run report (%s); retry with: ddptrain diagnose %s", err, run_dir)
            return None
        print(diagnose.console_summary(report), file=sys.stderr)
        return report


class NullRunFiles:
    """What ranks other than 0 hold: rank 0 writes the run folder's files for the job."""

    def write_file(self, path: Path, text: str) -> None:
        """Nothing to write: rank 0 writes it."""

    def write_report(self, run_dir: Path) -> dict[str, Any] | None:
        """Nothing to write: rank 0 writes the report."""
        return None


def build_run_files(is_rank_zero: bool) -> RunFiles | NullRunFiles:
    return RunFiles() if is_rank_zero else NullRunFiles()
