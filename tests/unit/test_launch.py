"""How a process was started, read before Hydra runs: torchrun's variables, the restart count, the argv Hydra gets."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddptrain import launch
from ddptrain.process.started import Start

TORCHRUN_RANK1 = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
ARGV = ["ddptrain", "trainer.max_steps=1"]
QUIET = ["hydra.output_subdir=null", "hydra.run.dir=."]


def test_alone_without_the_launchers_variables() -> None:
    assert Start.from_environ({}) == Start(elastic=False)
    # Three of the four variables are not a launcher's: still alone.
    assert not Start.from_environ({k: v for k, v in TORCHRUN_RANK1.items() if k != "LOCAL_RANK"}).elastic


def test_torchrun_variables_and_restart_count_are_read() -> None:
    start = Start.from_environ({**TORCHRUN_RANK1, "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_RUN_ID": "job7"})
    assert start == Start(True, rank=1, local_rank=1, world_size=4, local_world_size=2, restart_count=2, run_id="job7")
    assert not start.is_rank_zero


@pytest.mark.parametrize(
    ("environ", "makes_folder"),
    [
        ({}, True),
        ({**TORCHRUN_RANK1, "RANK": "0"}, True),
        (TORCHRUN_RANK1, False),
        ({**TORCHRUN_RANK1, "RANK": "0", "TORCHELASTIC_RESTART_COUNT": "1"}, False),
    ],
    ids=["alone", "torchrun-rank0", "torchrun-rank1", "torchrun-rank0-restarted"],
)
def test_only_one_process_lets_hydra_make_the_run_folder(environ: dict[str, str], makes_folder: bool) -> None:
    start = Start.from_environ(environ)
    assert start.makes_run_folder is makes_folder
    assert launch.hydra_argv(ARGV, start) == (ARGV if makes_folder else [*ARGV, *QUIET])


def test_a_sweep_under_torchrun_is_refused_naming_the_command_to_run() -> None:
    with pytest.raises(SystemExit, match=r"run `ddptrain train -m \.\.\.`"):
        launch.hydra_argv([*ARGV, "-m"], Start.from_environ(TORCHRUN_RANK1))
    assert launch.hydra_argv([*ARGV, "-m"], Start.from_environ({})) == [*ARGV, "-m"]


def test_a_restarted_torchrun_group_goes_back_to_the_first_attempts_run_folder(tmp_path) -> None:
    from ddptrain.observe.run_files import build_run_files

    out = tmp_path / "outputs"
    first, second = tmp_path / "first", tmp_path / "second"
    rank1 = Start(True, rank=1, local_rank=1, world_size=2, local_world_size=2, run_id="job7")
    assert launch._torchrun_run_dir(first, out, rank1, build_run_files(rank1.is_rank_zero)) == first
    assert not (out / ".torchrun" / "job7").exists(), "only rank 0 leaves the marker"
    rank0 = Start(True, world_size=2, local_world_size=2, run_id="job7")
    assert launch._torchrun_run_dir(first, out, rank0, build_run_files(rank0.is_rank_zero)) == first
    restarted = Start(True, world_size=2, local_world_size=2, restart_count=1, run_id="job7")
    assert launch._torchrun_run_dir(second, out, restarted, build_run_files(True)) == first
    other_job = Start(True, world_size=2, local_world_size=2, restart_count=1, run_id="job8")
    assert launch._torchrun_run_dir(second, out, other_job, build_run_files(True)) == second


@pytest.mark.parametrize("elastic", [False, True], ids=["self-launched", "torchrun"])
def test_a_stopped_run_says_where_its_checkpoint_is_and_exits_75_unless_under_torchrun(
    tmp_path, capsys, elastic
) -> None:
    from ddptrain.observe.console import build_console
    from ddptrain.process import signals

    start = Start(elastic)
    launch._exit_if_stopped_or_diverged({"loss": 1.0}, tmp_path, start, build_console(True))
    assert capsys.readouterr().err == "", "a finished run says nothing here"
    stopped = {signals.STOPPED_BY: "SIGTERM", signals.STOPPED_AT_STEP: 3}
    if elastic:  # exit 0: a non-zero exit would make torchrun --max-restarts restart the group
        launch._exit_if_stopped_or_diverged(stopped, tmp_path, start, build_console(True))
    else:
        with pytest.raises(SystemExit) as exited:
            launch._exit_if_stopped_or_diverged(stopped, tmp_path, start, build_console(True))
        assert exited.value.code == signals.STOPPED_EXIT_CODE == 75
    assert "ddptrain: stopped by SIGTERM at step 3" in capsys.readouterr().err
    launch._exit_if_stopped_or_diverged(stopped, tmp_path, Start(True, rank=1), build_console(False))
    assert capsys.readouterr().err == "", "ranks other than 0 say nothing"


def test_only_an_unused_hydra_folder_is_removed_never_the_working_directory(tmp_path, monkeypatch) -> None:
    unused, used, cwd = tmp_path / "unused", tmp_path / "used", tmp_path / "cwd"
    for folder in (unused, used, cwd):
        (folder / ".hydra").mkdir(parents=True)
    (used / "metrics.jsonl").write_text("{}\n")
    monkeypatch.chdir(cwd)
    for folder in (unused, used, cwd, Path(".")):
        launch._remove_unused_hydra_folder(folder)
    assert not unused.exists()
    assert (used / "metrics.jsonl").is_file() and (used / ".hydra").is_dir()
    assert (cwd / ".hydra").is_dir(), "the working directory is never removed"


def test_restarts_across_nodes_without_the_agents_store_are_refused_before_training() -> None:
    """With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 each node counts its own restarts, so after a restart the ranks of
    two nodes would meet under different attempts and time out (seen in CI, where the variable had leaked into the
    test session): such a job stops at start, naming the fixes. One node, or no restarts, still runs."""
    two_nodes = Start(True, rank=1, local_rank=0, world_size=2, local_world_size=1)
    one_node = Start(True, rank=1, local_rank=1, world_size=2, local_world_size=2)
    with pytest.raises(SystemExit) as refused:
        launch._refuse_restarts_across_nodes_without_a_shared_store(two_nodes, {"TORCHELASTIC_MAX_RESTARTS": "1"})
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in str(refused.value)
    assert "--max-restarts 0" in str(refused.value)
    launch._refuse_restarts_across_nodes_without_a_shared_store(two_nodes, {"TORCHELASTIC_MAX_RESTARTS": "0"})
    launch._refuse_restarts_across_nodes_without_a_shared_store(one_node, {"TORCHELASTIC_MAX_RESTARTS": "3"})
