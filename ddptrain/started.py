"""How this process was started, read from the environment before any process group exists.

torchrun exports RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE to every worker it starts, with
TORCHELASTIC_RESTART_COUNT and TORCHELASTIC_RUN_ID; so does the elastic agent that ``launch.launch``
runs for its own workers. Without them this process is alone: rank 0 of a world of one.

The one place that reads these variables. It imports no torch (``python -m ddptrain`` consults it
before the config is validated) and nothing else from ddptrain, so that both ``launch.py`` (what the
entry point does about it) and ``parallel.py`` (the group it forms) can use it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

AGENT_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


@dataclass(frozen=True)
class Start:
    """This process's place in the job as its launcher set it."""

    elastic: bool
    """Started by torchrun, or as a worker of ``launch.launch``: the four AGENT_VARS are set."""
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    restart_count: int = 0
    """How many times ``--max-restarts`` (or ``parallel.max_restarts``) restarted the group: 0 at first."""
    run_id: str = "none"
    """The rendezvous id (``torchrun --rdzv-id``), the same for every rank and every restart."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> Start:
        """Read the launcher's variables (see the module docstring)."""
        restart_count = int(environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        run_id = environ.get("TORCHELASTIC_RUN_ID", "none")
        if not all(name in environ for name in AGENT_VARS):
            return cls(False, restart_count=restart_count, run_id=run_id)
        rank, local_rank, world_size, local_world_size = (int(environ[name]) for name in AGENT_VARS)
        return cls(True, rank, local_rank, world_size, local_world_size, restart_count, run_id)

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0

    @property
    def makes_run_folder(self) -> bool:
        """Whether Hydra may create the run folder here: alone, or rank 0 of torchrun's first attempt.

        The other ranks are given rank 0's folder once the group forms, and a restarted group goes
        back to the first attempt's folder (``launch``'s restart marker).
        """
        return not self.elastic or (self.is_rank_zero and self.restart_count == 0)
