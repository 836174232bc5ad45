"""parallel.start_method=forkserver: the ranks are forks of one server that imported the libraries once, yet each
starts with what the launcher has at that launch, as a spawned rank would (the server itself is older)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from multiprocessing import resource_tracker
from pathlib import Path

import pytest

from ddptrain.launch import launch
from ddptrain.process import forkserver
from tests.conftest import REPO, compose_config
from tests.distributed.workers import report_how_this_rank_started

pytestmark = pytest.mark.dist


@contextlib.contextmanager
def output_to_devnull() -> Iterator[None]:
    """File descriptors 1 and 2 of this process point at /dev/null for the duration."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    saved = [os.dup(1), os.dup(2)]
    try:
        for fd in (1, 2):
            os.dup2(devnull, fd)
        yield
    finally:
        for fd, original in zip((1, 2), saved, strict=True):
            os.dup2(original, fd)
            os.close(original)
        os.close(devnull)


def test_a_forked_rank_starts_with_the_launchers_environment_output_cores_and_threads(
    tmp_path, monkeypatch, capfd
) -> None:
    cfg = compose_config(["parallel=ddp2", "parallel.start_method=forkserver", f"trainer.output_dir={tmp_path}"])
    forkserver.stop()  # the first launch below starts the server,
    resource_tracker._resource_tracker._stop()  # and multiprocessing's resource tracker, as in a new process
    monkeypatch.setenv("DDPTRAIN_TEST_REMOVED", "set before the first launch")
    with output_to_devnull():  # what a server started now inherits: the second launch's ranks must not write there
        first = launch(cfg, tmp_path, entrypoint=report_how_this_rank_started)  # the server runs from here on
    assert "forkserver" in first["parent"] and first["parent_pid"] != os.getpid(), first["parent"]
    assert blocked_signals(first["parent_pid"]) >= {signal.SIGINT, signal.SIGTERM, signal.SIGUSR2}

    value = uuid.uuid4().hex
    monkeypatch.setenv("DDPTRAIN_TEST_VALUE", value)
    monkeypatch.delenv("DDPTRAIN_TEST_REMOVED")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cores[:1])
    try:
        second = launch(cfg, tmp_path, entrypoint=report_how_this_rank_started)
    finally:
        os.sched_setaffinity(0, cores)
    out, err = capfd.readouterr()

    assert second["parent_pid"] == first["parent_pid"], "the second launch forked from the same server"
    assert second["value"] == value and second["removed"] is None, "the environment of the launch, not the server's"
    if len(cores) > 1:  # a one-core machine cannot tell the launcher's cores from the server's
        assert second["cores"] == cores[:1]
    assert second["threads"] == 3, "OMP_NUM_THREADS of the launch"
    assert second["signals_as_spawned"], "the server blocks the stop signals; a rank handles them as any process"
    for rank in (0, 1):
        assert f"rank {rank} says hello on stdout" in out, out[-2000:]
        assert f"rank {rank} says hello on stderr" in err, err[-2000:]


def blocked_signals(pid: int) -> set[int]:
    """The signals process ``pid`` blocks, from /proc (SigBlk: a hexadecimal mask, bit N-1 for signal N)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:")), 16)
    return {n for n in range(1, 65) if mask >> (n - 1) & 1}


def test_a_changed_import_time_variable_gets_a_new_server(tmp_path, monkeypatch) -> None:
    """A library may read HF_* (and the like) while it is imported, which the server did: a change starts a new one."""
    cfg = compose_config(["parallel=ddp2", "parallel.start_method=forkserver", f"trainer.output_dir={tmp_path}"])
    first = launch(cfg, tmp_path, entrypoint=report_how_this_rank_started)
    again = launch(cfg, tmp_path, entrypoint=report_how_this_rank_started)
    monkeypatch.setenv("HF_DDPTRAIN_TEST", uuid.uuid4().hex)
    changed = launch(cfg, tmp_path, entrypoint=report_how_this_rank_started)
    assert again["parent_pid"] == first["parent_pid"] != changed["parent_pid"]


def test_a_launch_leaves_the_launchers_environment_as_it_found_it(tmp_path, monkeypatch) -> None:
    """The workers' variables (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, loopback sockets, ...) are theirs only: they
    once stayed in the launching process, and a torchrun started from it later (in CI, the test session) lost
    torchrun's shared store, so its two-node restart timed out."""
    for name in ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    before = dict(os.environ)
    cfg = compose_config(["parallel=ddp2", f"trainer.output_dir={tmp_path}"])
    launch(cfg, tmp_path, entrypoint=report_how_this_rank_started)
    assert dict(os.environ) == before


LAUNCH_AND_WAIT = """
import sys
from pathlib import Path
from ddptrain.launch import launch
from tests.conftest import REPO, compose_config
from tests.distributed.workers import wait_to_be_interrupted
run_dir = Path(sys.argv[1])
cfg = compose_config(["parallel=ddp2", "parallel.start_method=forkserver", f"trainer.output_dir={run_dir}"])
launch(cfg, run_dir, entrypoint=wait_to_be_interrupted)
"""


def test_forked_ranks_are_interrupted_when_the_launcher_is_killed(tmp_path) -> None:
    """A spawned rank gets SIGINT when its launcher dies (torch asks the kernel); a forked one's parent is the server,
    which outlives the launcher: the ranks must still get their SIGINT, not train on alone."""
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCH_AND_WAIT, str(tmp_path)], cwd=REPO)
    pids = [tmp_path / f"rank{r}.pid" for r in (0, 1)]
    try:
        deadline = time.monotonic() + 120
        while not all(p.exists() for p in pids) and time.monotonic() < deadline and launcher.poll() is None:
            time.sleep(0.1)
        assert all(p.exists() for p in pids), "the ranks did not start"
        launcher.kill()
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 15
        while not all((tmp_path / f"rank{r}.interrupted").exists() for r in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [(tmp_path / f"rank{r}.interrupted").exists() for r in (0, 1)] == [True, True]
        assert all("forkserver" in (tmp_path / f"rank{r}.parent").read_text() for r in (0, 1)), "forked ranks"
    finally:
        launcher.kill()
        for pid_file in pids:
            with contextlib.suppress(FileNotFoundError, ProcessLookupError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
