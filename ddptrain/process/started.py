"""How this process was started, read from the environment before any process group exists.

torchrun exports RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE to every worker it starts, with
TORCHELASTIC_RESTART_COUNT and TORCHELASTIC_RUN_ID; so does the elastic agent that ``launch.launch``
runs for its own workers. A submitit job with several tasks (``hydra/launcher=slurm_multinode``, or
``submitit_local`` with ``tasks_per_node`` > 1) makes each task one rank: its place comes from Slurm's
variables (SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, SLURM_NNODES), or submitit's own for local jobs;
the group meets at MASTER_ADDR:MASTER_PORT, by default the job's first node and a port derived from its
job id (the same on every task, with nothing exchanged first). Without any of these this process is
alone: rank 0 of a world of one.

The one place that reads these variables. It imports no torch (``python -m ddptrain`` consults it
before the config is validated) and nothing else from ddptrain, so that both ``launch.py`` (what the
entry point does about it) and ``parallel.py`` (the group it forms) can use it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

AGENT_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
# submitit's executor (SUBMITIT_EXECUTOR, set in every job it runs): where it keeps a task's global rank, local rank,
# the job's tasks and nodes, and the job id.
SUBMITIT_TASK_VARS = {
    "slurm": ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NNODES", "SLURM_JOB_ID"),
    "local": (
        "SUBMITIT_LOCAL_GLOBALID",
        "SUBMITIT_LOCAL_LOCALID",
        "SUBMITIT_LOCAL_NTASKS",
        "SUBMITIT_LOCAL_JOB_NUM_NODES",
        "SUBMITIT_LOCAL_JOB_ID",
    ),
}
# The rendezvous port of a job whose tasks are its ranks, unless MASTER_PORT is set: derived from the job id, so
# two jobs whose first node is the same get different ports (unless their ids are PORT_SPAN apart). 15000-28999:
# below Linux's ephemeral ports (32768 on), clear of torchrun's 29400 and 29500.
PORT_BASE, PORT_SPAN = 15000, 14000


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
    """The rendezvous id (``torchrun --rdzv-id``; a scheduler's job id), the same for every rank and every restart."""
    scheduler: str = ""
    """``slurm`` or ``local`` when the ranks are the tasks of a submitit job (``elastic`` is then True too)."""
    master_addr: str = ""
    master_port: int = 0
    """Where the tasks of a scheduler's job meet (rank 0 hosts the store there); unset otherwise."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> Start:
        """Read the launcher's variables (see the module docstring)."""
        restart_count = int(environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        run_id = environ.get("TORCHELASTIC_RUN_ID", "none")
        if not all(name in environ for name in AGENT_VARS):
            return _submitit_task(cls, environ) or cls(False, restart_count=restart_count, run_id=run_id)
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


def _submitit_task(cls: type[Start], environ: Mapping[str, str]) -> Start | None:
    """This process as one task of a submitit job with several tasks; None outside one, or for a job of one task
    (which starts ``parallel.nproc_per_node`` workers itself)."""
    names = SUBMITIT_TASK_VARS.get(environ.get("SUBMITIT_EXECUTOR", ""))
    if names is None or not all(name in environ for name in names):
        return None
    rank, local_rank, tasks, nodes = (int(environ[name]) for name in names[:4])
    if tasks <= 1:
        return None
    job_id = environ[names[4]]
    scheduler = environ["SUBMITIT_EXECUTOR"]
    default_addr = first_host(environ.get("SLURM_JOB_NODELIST", "")) if scheduler == "slurm" else "127.0.0.1"
    port = environ.get("MASTER_PORT") or PORT_BASE + int(re.sub(r"\D", "", job_id) or 0) % PORT_SPAN
    restarts = int(environ.get("SLURM_RESTART_COUNT", "0"))
    return cls(
        True,
        rank,
        local_rank,
        tasks,
        tasks // max(nodes, 1),
        restarts,
        job_id,
        scheduler,
        environ.get("MASTER_ADDR") or default_addr,
        int(port),
    )


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list ("" for an empty one): ``gpu[007-009,012],cpu1`` gives ``gpu007`` (zero
    padding kept), ``rack[1-2]-n[01-02]`` gives ``rack1-n01``."""
    first_group = re.split(r",(?![^\[]*\])", nodelist.strip())[0]  # a comma outside brackets ends a group
    return re.sub(r"\[([^\]]*)\]", lambda ranges: re.split(r"[-,]", ranges.group(1))[0], first_group)
