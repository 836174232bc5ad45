"""``hydra/launcher=parallel``: several sweep jobs at once, each its own DDP group on its own devices.

Hydra finds launchers only under the ``hydra_plugins`` package, so the class lives here; what it does is in
``ddptrain/sweep/launcher.py`` (and its config in ``conf/hydra/launcher/parallel.yaml``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher


class ParallelLauncher(Launcher):
    """Runs a sweep's jobs ``jobs`` at a time, each in a fresh process with a disjoint device slice.

    Args:
        jobs: how many jobs run at once; None = the visible GPUs (on the CPU the cores) divided by the largest
            job's ``parallel.nproc_per_node``, at least 1.
    """

    def __init__(self, jobs: int | None = None) -> None:
        self.jobs = jobs
        self.config: Any = None
        self.hydra_context: Any = None
        self.task_function: Any = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from ddptrain.sweep.launcher import launch_in_parallel

        return launch_in_parallel(self, job_overrides, initial_job_idx)
