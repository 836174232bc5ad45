"""parallel.start_method=forkserver: the ranks are forks of one server that imported the libraries once, yet each
starts with what the launcher has at that launch, as a spawned rank would (the server itself is older)."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator

import pytest

from ddptrain.launch import launch
from tests.conftest import compose_config
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
    monkeypatch.setenv("DDPTRAIN_TEST_REMOVED", "set before the first launch")
    with output_to_devnull():  # what a server started now inherits: the second launch's ranks must not write there
        first = launch(cfg, tmp_path, entrypoint=report_how_this_rank_started)  # the server runs from here on
    assert "forkserver" in first["parent"] and first["parent_pid"] != os.getpid(), first["parent"]

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
    assert second["cores"] == cores[:1]
    assert second["threads"] == 3, "OMP_NUM_THREADS of the launch"
    assert second["sigterm_default"], "the server ignores SIGTERM; a rank must not"
    for rank in (0, 1):
        assert f"rank {rank} says hello on stdout" in out, out[-2000:]
        assert f"rank {rank} says hello on stderr" in err, err[-2000:]
