"""A rank blocked past parallel.timeout_s, through the real entrypoint: the run fails within a minute, the
console says where every rank was, and every rank's stacks are in the run folder.

The block is injected from here, not switched on in the product: a ``sitecustomize`` module on PYTHONPATH
(Python imports it in every process it starts, the spawned and torchrun's workers included) wraps
``hangs.PhaseBoard.enter`` so that rank 1 sleeps as it enters the forward of step 3.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, RUN_TAG, processes_mentioning, run_dirs

pytestmark = pytest.mark.e2e

TORCHRUN = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", "2"]
# parallel.timeout_s: short, so the test is short; not much shorter, for every collective of the run waits at most
# this long, the start-up's included (the two ranks meet there after importing everything, side by side).
TIMEOUT_S = 8
FAIL_WITHIN_S = 60  # from the moment rank 1 blocks to the end of the run
# Sooner in fact: the blocked rank leaves as soon as rank 0 has failed, instead of sitting out the 30 s that the
# launcher's agent gives a rank between its SIGTERM and its SIGKILL (that took TIMEOUT_S + 30 s or more). 25 s over
# the timeout fails that and leaves a busy 2-core machine room to start the failure's reports.
LEAVES_WITHIN_S = TIMEOUT_S + 25
STALL_STEP = 3
STALLED_AT_ENV = "DDPTRAIN_TEST_STALLED_AT"

# Rank 1 blocks in a function whose name the test then looks for in its stack dump.
STALL_SHIM = textwrap.dedent(
    f'''
    """Test shim: rank 1 blocks as it enters the forward of step {STALL_STEP} (see tests/e2e/test_hangs.py)."""
    import os
    import time

    from ddptrain.process import hangs

    _enter = hangs.PhaseBoard.enter


    def stall_rank1_in_forward(self, name, step=None, micro_step=None):
        _enter(self, name, step, micro_step)
        if name == "forward" and step == {STALL_STEP} and not micro_step and os.environ.get("RANK") == "1":
            with open(os.environ["{STALLED_AT_ENV}"], "w") as stamp:
                stamp.write(repr(time.time()))
            time.sleep(600)


    hangs.PhaseBoard.enter = stall_rank1_in_forward
    '''
)

ARGS = [
    "data.max_rows=400",
    "data.eval_fraction=0",
    "trainer.max_steps=20",
    "trainer.progress_bar=false",
    "trainer.save_final=false",
    f"parallel.timeout_s={TIMEOUT_S}",
    "trainer.device=cpu",
]
# A rank's line in the report: "rank 1: forward at step 3 micro-step 0 for 12 s, in stall_rank1_in_forward (...)".
# Rank 1 blocks after the step's first collective, the token-count all-reduce (phase "sync"), which rank 0 then
# passes too; rank 0's forward has no collective (parallel.broadcast_buffers=false: no buffer broadcast), so
# rank 0 waits in the next one, the gradient all-reduce of its backward (one micro-step: micro-step 0).
WAITING = rf"backward at step {STALL_STEP} micro-step 0 for \d+ s"
RANK0_WAITING = re.compile(rf"rank 0: {WAITING}, in [^\n]* \(its collective timed out\)")
RANK1_STUCK = re.compile(rf"rank 1: forward at step {STALL_STEP} micro-step 0 for \d+ s, in stall_rank1_in_forward \(")
HEADLINE = re.compile(rf"on rank 0 in {WAITING}; rank 1 stuck in forward at step {STALL_STEP} micro-step 0 for")


def run_with_rank1_blocked(tmp_path: Path, launcher: list[str]) -> tuple[subprocess.CompletedProcess, float, float]:
    """The run, rank 1 blocked; returns it, its wall time, and the seconds from the block to the end."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(STALL_SHIM)
    stamp = tmp_path / "stalled_at"
    command = [*launcher, "-m", "ddptrain", *ARGS, f"trainer.output_dir={tmp_path / 'out'}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", RUN_TAG: " ".join(command), STALLED_AT_ENV: str(stamp)}
    env["PYTHONPATH"] = os.pathsep.join([str(shim), str(REPO)])  # this checkout's ddptrain, for the shim too
    env.pop("MASTER_PORT", None)
    started = time.time()
    result = subprocess.run(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300
    )
    ended = time.time()
    assert stamp.exists(), f"rank 1 never reached the forward of step {STALL_STEP}:\n{result.stdout[-5000:]}"
    return result, ended - started, ended - float(stamp.read_text())


def no_process_left(marker: str) -> None:
    """Every process of the run has ended, a few seconds after the launcher (the blocked rank included)."""
    deadline = time.monotonic() + 5
    while (left := processes_mentioning(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes left behind: {left}"


@pytest.mark.parametrize("launcher", ["self-launch", "torchrun"])
def test_a_blocked_rank_fails_the_run_within_a_minute_naming_every_ranks_phase(tmp_path, launcher) -> None:
    command = TORCHRUN if launcher == "torchrun" else [sys.executable]
    result, wall_s, after_block_s = run_with_rank1_blocked(tmp_path, command)
    no_process_left(str(tmp_path))
    output = result.stdout
    print(f"{launcher}: exit {result.returncode}, {after_block_s:.1f} s after the block, {wall_s:.1f} s in all")
    assert result.returncode != 0, output[-5000:]
    assert after_block_s < FAIL_WITHIN_S, f"ended {after_block_s:.0f} s after rank 1 blocked:\n{output[-5000:]}"
    assert after_block_s < LEAVES_WITHIN_S, f"rank 1 was left to the agent's SIGKILL:\n{output[-5000:]}"

    # Every rank's phase, on the console: the stuck one and the one whose collective timed out.
    assert RANK1_STUCK.search(output), output[-5000:]
    assert RANK0_WAITING.search(output), output[-5000:]
    assert HEADLINE.search(output), output[-5000:]
    if launcher == "self-launch":  # the launcher's summary, the last thing on the console, repeats them
        summary = output[output.rindex("training failed:") :]
        assert RANK1_STUCK.search(summary) and RANK0_WAITING.search(summary), summary

    # The stack dumps: rank 1 blocked inside the shim, called from its training step; rank 0 waiting in its own.
    (run_dir,) = run_dirs(tmp_path / "out")
    hang = run_dir / "hang"
    rank1_stacks = (hang / "rank1.stacks.txt").read_text()
    assert f"rank 1 (pid {read_pid(hang, 1)}): forward at step {STALL_STEP} micro-step 0" in rank1_stacks
    assert "stall_rank1_in_forward" in rank1_stacks and "train_step" in rank1_stacks, rank1_stacks
    rank0_stacks = (hang / "rank0.stacks.txt").read_text()
    assert f"rank 0 (pid {read_pid(hang, 0)}): " in rank0_stacks and "train_step" in rank0_stacks, rank0_stacks
    assert "stall_rank1_in_forward" not in rank0_stacks
    assert str(hang / "rank1.stacks.txt") in output, "the console names the dump files"

    # The files the launcher's summary reads, left before the processes ended: rank 0's failure record (its
    # collective timed out) and each rank's last phase, the one it really was in. Rank 1 left by itself on seeing
    # rank 0's record (no error of its own).
    failed = json.loads((hang / "rank0.failed").read_text())
    assert failed["timed_out"] is True and "Timed out waiting" in failed["error"], failed
    assert not (hang / "rank1.failed").exists()
    rank0, rank1 = (json.loads((hang / f"rank{rank}.json").read_text()) for rank in (0, 1))
    assert (rank0["name"], rank0["step"], rank0["micro_step"]) == ("backward", STALL_STEP, 0), rank0
    assert (rank1["name"], rank1["step"], rank1["micro_step"]) == ("forward", STALL_STEP, 0), rank1
    assert rank1["frame"].startswith("stall_rank1_in_forward ("), rank1


def read_pid(hang: Path, rank: int) -> int:
    return json.loads((hang / f"rank{rank}.json").read_text())["pid"]
