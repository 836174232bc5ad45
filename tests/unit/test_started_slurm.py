"""A submitit job whose tasks are its ranks (hydra/launcher=slurm_multinode): each task's place from Slurm's variables,
as srun sets them, and where the group meets."""

from __future__ import annotations

import pytest

from ddptrain.process.started import PORT_BASE, PORT_SPAN, Start, first_host

# Rank 5 of a 2-node job with 4 tasks per node, as srun sets it for a submitit job (SUBMITIT_EXECUTOR from its script).
SLURM_RANK5 = {
    "SUBMITIT_EXECUTOR": "slurm",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "8",
    "SLURM_NNODES": "2",
    "SLURM_NODEID": "1",
    "SLURM_JOB_ID": "4711",
    "SLURM_JOB_NODELIST": "gpu[007-008]",
}


def test_a_task_of_a_slurm_job_is_the_rank_srun_gave_it() -> None:
    start = Start.from_environ(SLURM_RANK5)
    assert (start.elastic, start.scheduler) == (True, "slurm")
    assert (start.rank, start.local_rank, start.world_size, start.local_world_size) == (5, 1, 8, 4)
    assert (start.master_addr, start.run_id) == ("gpu007", "4711")


def test_every_task_derives_the_same_port_and_two_jobs_get_different_ones() -> None:
    ports = {Start.from_environ({**SLURM_RANK5, "SLURM_PROCID": str(r)}).master_port for r in range(8)}
    assert len(ports) == 1
    other = Start.from_environ({**SLURM_RANK5, "SLURM_JOB_ID": "4712"}).master_port
    # Below Linux's ephemeral ports (32768 on), where an outgoing connection could hold the port already.
    assert other not in ports and all(PORT_BASE <= p < PORT_BASE + PORT_SPAN < 32768 for p in (*ports, other))


def test_master_addr_and_port_from_the_environment_win() -> None:
    start = Start.from_environ({**SLURM_RANK5, "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29555"})
    assert (start.master_addr, start.master_port) == ("10.0.0.7", 29555)


@pytest.mark.parametrize(
    "environ",
    [
        {k: v for k, v in SLURM_RANK5.items() if k != "SUBMITIT_EXECUTOR"},  # a plain sbatch script's python
        {**SLURM_RANK5, "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_NNODES": "1"},  # the one-node preset
    ],
    ids=["not-submitit", "one-task"],
)
def test_not_a_rank_outside_a_submitit_job_of_several_tasks(environ: dict[str, str]) -> None:
    assert Start.from_environ(environ) == Start(elastic=False)


def test_torchrun_inside_a_slurm_job_keeps_torchruns_ranks() -> None:
    torchrun = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    start = Start.from_environ({**SLURM_RANK5, **torchrun})
    assert (start.rank, start.world_size, start.scheduler) == (3, 4, "")


def test_a_local_submitit_job_meets_on_loopback() -> None:
    local = {"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_GLOBALID": "1", "SUBMITIT_LOCAL_LOCALID": "1"}
    local |= {"SUBMITIT_LOCAL_NTASKS": "2", "SUBMITIT_LOCAL_JOB_NUM_NODES": "1", "SUBMITIT_LOCAL_JOB_ID": "8945"}
    start = Start.from_environ(local)
    assert (start.rank, start.world_size, start.local_world_size, start.master_addr) == (1, 2, 2, "127.0.0.1")


@pytest.mark.parametrize(
    "nodelist",
    ["gpu[007-009,012],cpu1", "node1", "node3,node1", "n[10-11]-ib,m2", "a[099]", "rack[1-2]-node[01-02],x[3-4]"],
)
def test_the_first_host_is_the_one_submitit_and_slurm_list_first(nodelist: str) -> None:
    from submitit.slurm.slurm import _parse_node_list

    assert first_host(nodelist) == _parse_node_list(nodelist)[0]


def test_a_slurm_job_without_a_node_list_is_refused_naming_the_fix() -> None:
    from ddptrain import launch

    start = Start.from_environ({k: v for k, v in SLURM_RANK5.items() if k != "SLURM_JOB_NODELIST"})
    with pytest.raises(SystemExit, match="export MASTER_ADDR=<the first node>"):
        launch._meet_at(start)
