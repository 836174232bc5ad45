"""Saves on 2 gloo ranks that take as long as they take: rank 0's checkpoint write held past parallel.timeout_s
does not fail the run (the other rank waits through the store, up to trainer.save_timeout_s), the run resumes from
that checkpoint exactly, and a write that fails on rank 0 still ends both ranks at once, each with rank 0's error;
a write stuck past trainer.save_timeout_s ends both ranks, naming the key."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import socket
import time
from pathlib import Path

import pytest

from ddptrain.launch import launch
from tests.conftest import compose_config, read_metrics
from tests.distributed.workers_saves import (
    HOLD_S,
    STUCK_S,
    train_with_rank0_save_failing,
    train_with_rank0_save_held,
    train_with_rank0_save_stuck,
)

pytestmark = pytest.mark.dist

TIMEOUT_S = 5  # parallel.timeout_s: shorter than the held write (HOLD_S), long enough for the ranks' start-up
ENDS_WITHIN_S = 15  # from rank 0's failed write to both ranks gone
ARGS = [
    "parallel=ddp2",
    "data.max_rows=160",
    "data.eval_fraction=0",
    "trainer.max_steps=4",
    "trainer.save_every_n_steps=2",
    "trainer.log_every_n_steps=1",
    "trainer.progress_bar=false",
    f"parallel.timeout_s={TIMEOUT_S}",
]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


@pytest.mark.timeout(180)
def test_a_save_longer_than_the_collective_timeout_finishes_resumes_and_a_failed_one_ends_both_ranks(
    tmp_path, monkeypatch
) -> None:
    assert HOLD_S > TIMEOUT_S + 1, "the write must be held past parallel.timeout_s"
    held_dir = tmp_path / "held"
    held_dir.mkdir()
    launch(compose_config([*ARGS, f"trainer.output_dir={tmp_path}"]), held_dir, entrypoint=train_with_rank0_save_held)
    held = json.loads((held_dir / "held.json").read_text())
    assert held["step"] == 2 and held["held_s"] > TIMEOUT_S + 1, held
    step2 = held_dir / "checkpoints" / "step-00000002"
    assert (step2 / "manifest.json").is_file() and (held_dir / "checkpoints" / "step-00000004").is_dir()
    assert sorted(losses(held_dir)) == [1, 2, 3, 4]

    # Resumed from the held checkpoint, the run trains steps 3 and 4 exactly as the held run did; then rank 0's
    # last checkpoint write fails, and both ranks end soon after, the other one with rank 0's error.
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    cfg = compose_config([*ARGS, f"trainer.resume={step2}", f"trainer.output_dir={tmp_path}"])
    store_port = free_port()
    monkeypatch.setenv("MASTER_PORT", str(store_port))  # the launcher binds its store there
    with pytest.raises(RuntimeError, match="training failed") as failed:
        launch(cfg, resumed_dir, entrypoint=train_with_rank0_save_failing)
    # The traceback (in ``failed``) keeps launch's frame alive, yet its store is gone: nothing listens on its port.
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the connections' TIME_WAIT, not a LISTEN
        probe.bind(("127.0.0.1", store_port))
    ended_s = time.time() - float((resumed_dir / "failed_at").read_text())
    assert ended_s < ENDS_WITHIN_S, f"both ranks ended {ended_s:.1f} s after rank 0's write failed"
    assert losses(resumed_dir) == {s: loss for s, loss in losses(held_dir).items() if s > 2}
    assert "No space left on device" in (resumed_dir / "error0.txt").read_text()
    rank1 = (resumed_dir / "error1.txt").read_text()
    assert "rank 0 could not save the checkpoint of step 4: OSError: [Errno 28] No space left" in rank1, rank1
    assert f"trainer.resume={resumed_dir}" in rank1, "the error says how to resume"
    print(f"held {held['held_s']:.1f} s past parallel.timeout_s={TIMEOUT_S}; failed run ended in {ended_s:.1f} s")
    print(str(failed.value))

    # The failure's traceback (in ``failed``) kept launch's frame alive. Files opened now take the lowest free
    # numbers, as a process's next files do; when that frame goes, nothing of the launch may close one of them
    # (its store once closed its listening socket's number a second time: pytest's own output was lost).
    files = [open(os.devnull) for _ in range(32)]  # noqa: SIM115  (closed below)
    del failed
    gc.collect()
    closed = [f.fileno() for f in files if not is_open(f.fileno())]
    for f in files:
        with contextlib.suppress(OSError):
            f.close()
    assert not closed, f"the failed launch closed file descriptors it did not own: {closed}"


SAVE_TIMEOUT_S = 2  # trainer.save_timeout_s: rank 1 gives up on rank 0's write after this long


@pytest.mark.timeout(120)  # a wait without a limit would end only with the stuck write, STUCK_S later: not a hang
def test_a_save_stuck_past_save_timeout_s_ends_both_ranks_naming_the_key(tmp_path) -> None:
    """Rank 0's write of step 1 is stuck for STUCK_S; rank 1 waits for it trainer.save_timeout_s=2 s, then fails
    naming the key and its value, and both ranks are gone long before the write would have ended."""
    assert STUCK_S > 2 * (SAVE_TIMEOUT_S + ENDS_WITHIN_S), "the stuck write must outlast the bound by far"
    run_dir = tmp_path / "stuck"
    run_dir.mkdir()
    short = [a for a in ARGS if not a.startswith(("trainer.max_steps=", "trainer.save_every_n_steps="))]
    overrides = [
        *short,
        "trainer.max_steps=1",
        "trainer.save_every_n_steps=1",
        f"trainer.save_timeout_s={SAVE_TIMEOUT_S}",
    ]
    with pytest.raises(RuntimeError, match="training failed") as failed:
        launch(
            compose_config([*overrides, f"trainer.output_dir={tmp_path}"]),
            run_dir,
            entrypoint=train_with_rank0_save_stuck,
        )
    ended_s = time.time() - float((run_dir / "stuck_at").read_text())
    named = f"rank 0 did not save the checkpoint of step 1 within trainer.save_timeout_s={SAVE_TIMEOUT_S} s"
    assert named in (run_dir / "error1.txt").read_text()
    assert named in str(failed.value), str(failed.value)
    assert "Free space" not in (run_dir / "error1.txt").read_text(), "a slow save is not a full disk"
    assert ended_s < SAVE_TIMEOUT_S + ENDS_WITHIN_S, f"both ranks ended {ended_s:.1f} s after rank 0's write began"
