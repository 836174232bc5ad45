"""The hang report's parts, in one process: the watchdog's files and decisions, the report, the flight recorder's
variables. The whole path (a rank really blocked, two real ranks) is tests/e2e/test_hangs.py."""

from __future__ import annotations

import functools
import gc
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddptrain.process import hangs
from ddptrain.process.hangs import Phase

GLOO_TIMEOUT = "[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 10000ms for recv operation to complete"
# NCCL needs a GPU: its watchdog's text as torch's ProcessGroupNCCL.cpp writes it (checkTimeout).
NCCL_TIMEOUT = (
    "[PG ID 0 PG GUID 0(default_pg) Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, "
    "OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=10000) ran for 10012 milliseconds before timing out."
)


@pytest.fixture(autouse=True)
def fresh_board():
    """Each test sets the process's phase itself; the board is put back afterwards."""
    before = hangs.board.current
    yield
    hangs.board.current = before


def enter_since(name: str, seconds_ago: float, step: int | None = 3, micro_step: int | None = 0) -> Phase:
    hangs.board.current = Phase(name, step, micro_step, time.time() - seconds_ago)
    return hangs.board.current


class Left(Exception):
    """What the test watchdog does instead of ending the process."""


def leave(code: int) -> None:
    raise Left(code)


def watchdog(tmp_path: Path, rank: int = 1, timeout_s: float = 10, attempt: int = 0, **limits: float):
    stacks = (tmp_path / f"rank{rank}.stacks.txt").open("a")
    return hangs.Watchdog(tmp_path, rank, timeout_s, limits, attempt, stacks, leave=leave)


@pytest.fixture
def leaving_recorded(monkeypatch) -> list[int]:
    """``watch``'s watchdog records the exit of a rank stuck after another rank failed instead of ending the
    process: a test that sets up both (a phase as old as its timeout, another rank's failure record) would
    otherwise have the pytest process ended by ``os._exit`` whenever the watchdog polls before ``watch`` ends."""
    left: list[int] = []
    monkeypatch.setattr(hangs, "Watchdog", functools.partial(hangs.Watchdog, leave=left.append))
    return left


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def failure(tmp_path: Path, rank: int, attempt: int = 0, timed_out: bool = True, at: float | None = None) -> None:
    """Rank ``rank``'s failure record, failed ``at`` (default: now, once a dead pid is found; that can take a
    fraction of a second on a loaded machine)."""
    record = {"rank": rank, "pid": dead_pid(), "host": socket.gethostname(), "attempt": attempt}
    record.update(error="Timed out waiting 10000ms", timed_out=timed_out, at=time.time() if at is None else at)
    (tmp_path / f"rank{rank}.failed").write_text(json.dumps(record))


# ----------------------------------------------------------------------------- the watchdog


def test_the_phase_file_follows_the_board_and_is_written_only_when_the_phase_changes(tmp_path) -> None:
    dog = watchdog(tmp_path)
    phase = enter_since("forward", 0.5)
    dog.poll(time.time())
    record = json.loads((tmp_path / "rank1.json").read_text())
    assert (record["rank"], record["pid"], record["name"], record["step"], record["micro_step"]) == (
        1,
        os.getpid(),
        "forward",
        3,
        0,
    )
    assert record["since"] == phase.since and record["frame"] is None
    (tmp_path / "rank1.json").unlink()
    dog.poll(time.time())
    assert not (tmp_path / "rank1.json").exists(), "the same phase again: nothing to write"
    enter_since("backward", 0.1)
    dog.poll(time.time())
    assert json.loads((tmp_path / "rank1.json").read_text())["name"] == "backward"


def blocked_here(seconds: float) -> None:
    time.sleep(seconds)


def test_stacks_are_dumped_once_a_phase_lasts_most_of_its_timeout_and_once_only(tmp_path) -> None:
    dog = watchdog(tmp_path, timeout_s=10)
    enter_since("forward", 7.5)  # under DUMP_AT x 10 s
    dog.start()  # the real thread: it reads the main thread's frame from outside, as in a run
    try:
        enter_since("forward", 8.2)
        blocked_here(hangs.POLL_S * 2.5)  # the watchdog polls twice meanwhile
    finally:
        dog.stop()
    stacks = (tmp_path / "rank1.stacks.txt").read_text()
    assert stacks.count("=== ") == 1, stacks
    assert re.search(rf"rank 1 \(pid {os.getpid()}\): forward at step 3 micro-step 0 for \d+ s, timeout 10 s", stacks)
    # faulthandler's dump of every thread, the blocked main thread among them.
    assert "in blocked_here" in stacks and "test_stacks_are_dumped_once" in stacks, stacks
    frame = json.loads((tmp_path / "rank1.json").read_text())["frame"]
    assert frame.startswith("blocked_here (unit/test_hangs.py:"), frame


def test_tokenize_is_given_its_own_longer_timeout(tmp_path) -> None:
    dog = watchdog(tmp_path, timeout_s=10, tokenize=3600)
    enter_since("tokenize", 60, step=None, micro_step=None)
    dog.poll(time.time())
    assert (tmp_path / "rank1.stacks.txt").read_text() == ""
    enter_since("tokenize", 0.8 * 3600 + 1, step=None, micro_step=None)
    dog.poll(time.time())
    assert "tokenize for 2881 s, timeout 3600 s" in (tmp_path / "rank1.stacks.txt").read_text()


def test_a_stuck_rank_leaves_once_another_rank_of_its_attempt_failed(tmp_path) -> None:
    dog = watchdog(tmp_path, timeout_s=10)
    enter_since("forward", 3)
    failure(tmp_path, rank=0)
    dog.poll(time.time())  # another rank failed, but this one is not stuck: it fails by itself soon enough
    failure(tmp_path, rank=0, attempt=1)
    enter_since("forward", 9)
    dog.poll(time.time())  # stuck, and the failure is of another attempt (a --max-restarts restart)
    failure(tmp_path, rank=0, attempt=0)
    with pytest.raises(Left):
        dog.poll(time.time())


def test_a_rank_that_moved_on_from_its_dumped_phase_does_not_leave(tmp_path) -> None:
    dog = watchdog(tmp_path, timeout_s=10)
    enter_since("eval", 9)  # a long phase, not a hang: it ends
    dog.poll(time.time())
    enter_since("save", 0.1)
    failure(tmp_path, rank=0)
    dog.poll(time.time())


def test_watch_dumps_stacks_on_sigusr1(tmp_path) -> None:
    with hangs.watch(tmp_path, rank=0, world_size=1, timeout_s=600):
        os.kill(os.getpid(), signal.SIGUSR1)
        # faulthandler writes from its C signal handler, delivered before os.kill returns: the dump is there at
        # once. Looked for up to 10 s all the same, so that a loaded machine cannot fail it; a handler that never
        # writes still fails it.
        deadline = time.monotonic() + 10
        while not (stacks := (tmp_path / "rank0.stacks.txt").read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert "test_watch_dumps_stacks_on_sigusr1" in stacks, stacks
    assert (tmp_path / "rank0.stacks.txt").read_text() == stacks, "a file with a dump is kept"


def test_a_run_that_never_dumped_leaves_no_stacks_file(tmp_path) -> None:
    stacks = tmp_path / "rank0.stacks.txt"
    with hangs.watch(tmp_path, rank=0, world_size=2, timeout_s=600):
        assert stacks.exists()  # from the start: faulthandler is handed the file a kill -USR1 dump goes to
    assert not stacks.exists()
    with pytest.raises(ValueError), hangs.watch(tmp_path, rank=0, world_size=2, timeout_s=600):
        raise ValueError("bad row")
    assert not stacks.exists(), "nor does a run that failed without a dump"
    assert (tmp_path / "rank0.failed").exists()


# ----------------------------------------------------------------------------- on failure


def store_timeout() -> RuntimeError:
    """The c10d TCPStore's own error for a key no rank set in time."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(milliseconds=200))
    with pytest.raises(RuntimeError) as raised:
        store.get("never_set")
    return raised.value


def test_collective_timeouts_are_told_from_other_errors() -> None:
    assert hangs.is_collective_timeout(RuntimeError(GLOO_TIMEOUT))
    assert hangs.is_collective_timeout(RuntimeError("Application timeout caused pair closure"))
    assert hangs.is_collective_timeout(RuntimeError(NCCL_TIMEOUT))
    assert hangs.is_collective_timeout(store_timeout()), str(store_timeout())
    try:
        try:
            raise RuntimeError(GLOO_TIMEOUT)
        except RuntimeError as gloo:
            raise ValueError("wrapped") from gloo
    except ValueError as wrapped:
        assert hangs.is_collective_timeout(wrapped)
    assert not hangs.is_collective_timeout(RuntimeError("CUDA out of memory"))
    assert not hangs.is_collective_timeout(ValueError("data.max_length=timeout"))
    assert not hangs.is_collective_timeout(RuntimeError("DataLoader timed out after 60 seconds"))
    assert not hangs.is_collective_timeout(RuntimeError("Timeout while downloading the tokenizer"))


class SlowRows:
    """A map-style dataset whose rows take half a second each: a DataLoader with a shorter ``timeout`` gives up."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        time.sleep(0.5)
        return index


def test_a_data_loader_timeout_passes_through_unchanged(tmp_path) -> None:
    """A DataLoader that timed out waited for its own worker, not for another rank: its error is not a hang's."""
    from torch.utils.data import DataLoader

    loader = DataLoader(SlowRows(), num_workers=1, timeout=0.2, multiprocessing_context="fork")
    with pytest.raises(RuntimeError) as raised, hangs.watch(tmp_path, rank=0, world_size=2, timeout_s=10):
        next(iter(loader))
    assert str(raised.value) == "DataLoader timed out after 0.2 seconds"  # torch's own error, as it was raised
    assert type(raised.value) is RuntimeError
    assert json.loads((tmp_path / "rank0.failed").read_text())["timed_out"] is False
    # The loader's worker ends now (its iterator is held by the error's traceback), not in a garbage collection
    # during a later test, whose timings it would stretch by up to half a second.
    del raised
    gc.collect()


def test_the_report_names_every_ranks_phase_as_of_the_first_failure(tmp_path) -> None:
    now = time.time()
    for rank, (name, ago) in enumerate([("backward", 10.2), ("forward", 12.4)]):
        record = {"rank": rank, "name": name, "step": 3, "micro_step": 0, "since": now - ago, "frame": None}
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(record))
    (tmp_path / "rank1.stacks.txt").write_text("Thread ...")
    (tmp_path / "rank0.stacks.txt").write_text("")  # opened, never written: not listed
    failure(tmp_path, rank=0, at=now)  # the phases' ages are counted to the failure (CI once saw 12.4 s as 13)
    lines = hangs.where_ranks_were(tmp_path, world_size=3)
    assert lines[0] == "rank 0: backward at step 3 micro-step 0 for 10 s (its collective timed out)"
    assert lines[1] == "rank 1: forward at step 3 micro-step 0 for 12 s"
    assert lines[2].startswith("rank 2: no phase recorded")
    assert lines[3] == f"stacks of all threads: {tmp_path / 'rank1.stacks.txt'}"
    assert hangs.where_ranks_were(tmp_path / "absent", world_size=2) == []


def test_a_timed_out_collective_is_reraised_naming_the_stuck_rank(tmp_path) -> None:
    now = time.time()
    stuck = {"rank": 1, "name": "forward", "step": 3, "micro_step": 0, "since": now - 12, "frame": "sleep (x.py:1)"}
    (tmp_path / "rank1.json").write_text(json.dumps(stuck))
    with pytest.raises(hangs.CollectiveTimeout) as raised, hangs.watch(tmp_path, rank=0, world_size=2, timeout_s=10):
        enter_since("backward", 10)
        raise RuntimeError(GLOO_TIMEOUT)
    message = str(raised.value)
    assert message.startswith("collective timed out after parallel.timeout_s=10 s on rank 0 in backward at step 3")
    assert "; rank 1 stuck in forward at step 3 micro-step 0 for 12 s, in sleep (x.py:1) " in message
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert json.loads((tmp_path / "rank0.failed").read_text())["timed_out"] is True


def test_of_several_ranks_the_stuck_one_is_not_one_whose_own_collective_timed_out(tmp_path, leaving_recorded) -> None:
    now = time.time()
    # Rank 2 waited for rank 1 too, and entered its phase earlier: it timed out, so it is not the cause.
    for rank, (name, ago) in {1: ("data", 11), 2: ("backward", 13)}.items():
        record = {"rank": rank, "name": name, "step": 3, "micro_step": None, "since": now - ago, "frame": None}
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(record))
    failure(tmp_path, rank=2, timed_out=True)
    started = time.monotonic()
    stuck = "; rank 1 stuck in data at step 3 for 11 s "
    with pytest.raises(hangs.CollectiveTimeout, match=stuck), hangs.watch(tmp_path, rank=0, world_size=3, timeout_s=10):
        enter_since("backward", 10)
        raise RuntimeError(GLOO_TIMEOUT)
    # Where a rank's record is missing, the report waits 2 x hangs.POLL_S (2 s) for the other ranks to write theirs;
    # with every record there it must not. Without the wait it takes milliseconds of file reads and writes: three
    # quarters of the wait leaves a loaded machine 1.5 s for them, and a report that waited anyway takes 2 s or more.
    waited = time.monotonic() - started
    assert waited < 1.5 * hangs.POLL_S, f"took {waited:.2f} s: every waiting rank had recorded its timeout already"


def test_other_errors_pass_through_unchanged_and_leave_a_failure_record(tmp_path) -> None:
    with pytest.raises(ValueError, match="bad row"), hangs.watch(tmp_path, rank=0, world_size=2, timeout_s=10):
        raise ValueError("bad row")
    record = json.loads((tmp_path / "rank0.failed").read_text())
    assert (record["error"], record["timed_out"], record["pid"]) == ("bad row", False, os.getpid())


# ----------------------------------------------------------------------------- NCCL's flight recorder


def test_the_flight_recorder_is_switched_on_under_the_name_this_torch_reads(tmp_path) -> None:
    assert hangs.flight_recorder_environment({}, "2.13.0+cpu") == {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }
    # Before 2.8 only the old name exists.
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" in hangs.flight_recorder_environment({}, "2.4.1")
    assert hangs.flight_recorder_environment({}, "2.13.0", tmp_path)["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(
        tmp_path / "nccl_trace_rank_"
    )


def test_the_users_flight_recorder_settings_win() -> None:
    user = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
    assert hangs.flight_recorder_environment(user, "2.13.0") == {}, "either buffer name set: the user has chosen"
    user = {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/scratch/fr_"}
    assert "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in hangs.flight_recorder_environment(user, "2.13.0", Path("/run"))


# ----------------------------------------------------------------------------- the self-launcher's summary


class Failure:
    """What elastic's ChildFailedError holds per failed rank (ProcessFailure): a message and an exit code."""

    def __init__(self, exitcode: int, message: str) -> None:
        self.exitcode, self.message = exitcode, {"message": message}


def summary(tmp_path: Path, **failures: Failure) -> str:
    return hangs.failure_summary({int(rank[-1]): f for rank, f in failures.items()}, tmp_path, nproc=2)


def test_the_launchers_summary_adds_every_ranks_phase_after_a_timeout_or_a_kill(tmp_path) -> None:
    now = time.time()
    for rank in (0, 1):
        record = {"rank": rank, "name": "forward", "step": 3, "micro_step": 0, "since": now - 11, "frame": None}
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(record))
    failure(tmp_path, rank=0, timed_out=False)
    plain = summary(tmp_path, rank0=Failure(1, "ValueError: bad row"))
    assert "ValueError: bad row" in plain and "where each rank was" not in plain
    killed = summary(tmp_path, rank1=Failure(-6, "Signal 6 (SIGABRT) received by PID 7"))
    assert "where each rank was" in killed and "    rank 1: forward at step 3 micro-step 0 for 11 s" in killed
    failure(tmp_path, rank=0, timed_out=True)
    timed_out = summary(tmp_path, rank0=Failure(1, "CollectiveTimeout: collective timed out ..."))
    assert "    rank 0: forward at step 3 micro-step 0 for 11 s (its collective timed out)" in timed_out


def test_the_launchers_summary_names_the_error_of_a_rank_elastic_did_not_report(tmp_path) -> None:
    """Rank 1 failed (its record names trainer.save_timeout_s) and rank 0, ended because of it, exited first: elastic
    reports rank 0 alone, with no message of its own. The summary still carries rank 1's error."""
    failure(tmp_path, rank=1, timed_out=False)
    record = json.loads((tmp_path / "rank1.failed").read_text())
    error = "rank 0 did not save the checkpoint of step 1 within trainer.save_timeout_s=2 s"
    (tmp_path / "rank1.failed").write_text(json.dumps({**record, "error": error}))
    told = summary(tmp_path, rank0=Failure(1, "To enable traceback see: https://pytorch.org/docs/stable/elastic/"))
    assert f"  rank 1: {error}" in told
    assert told.count("rank 1") == 1 == summary(tmp_path, rank1=Failure(1, error)).count(error), "listed once"


# ----------------------------------------------------------------------------- a GPU's host waiting for its device


class DeviceNeverDone:
    """Stands in for the CUDA event after a step's work whose collective another rank never joined: it never
    completes. It notes the phase the hang report shows each time the host looks."""

    def __init__(self) -> None:
        self.seen: list[Phase] = []

    def query(self) -> bool:
        self.seen.append(hangs.board.current)
        return False


def test_a_host_waiting_for_its_device_reports_that_step_and_times_out_with_a_failure_record(
    tmp_path, monkeypatch
) -> None:
    """On NCCL the host queues step 4 before it reads step 3's stop votes, and only there waits for the device.
    The report must show the step the host waits for (3, not 4), and the wait must end with a collective timeout
    that leaves the failure record and the report while Python still runs (NCCL's watchdog would SIGABRT later)."""
    import torch

    from ddptrain import parallel

    # The watchdog writes the phase file at each hangs.POLL_S (1 s) poll: a 3 s wait gives it two polls to spare
    # before the wait ends, should a loaded machine hold its thread back.
    timeout_s = 3.0
    monkeypatch.setattr(parallel.collectives, "_timeout_s", timeout_s)
    started = time.monotonic()
    late = parallel.LateRead(torch.tensor(0.0), step=3)  # the step's work is queued now: the wait counts from here
    late.copied = DeviceNeverDone()
    with pytest.raises(hangs.CollectiveTimeout) as raised, hangs.watch(tmp_path, rank=0, world_size=2, timeout_s=3):
        hangs.board.enter("other", 4)  # the host has queued step 4 meanwhile
        late.value()
    waited = time.monotonic() - started
    # The host looks every 0.5 ms and gives up at the deadline: it cannot end sooner than parallel.timeout_s after
    # the step was queued (less the clock's resolution), and beyond it only by the time a loaded machine takes to
    # schedule the thread and raise. Half the timeout allows that; a wait that started its clock again (at the
    # first look, or at each phase change) would take twice the timeout.
    assert timeout_s - 0.01 < waited < 1.5 * timeout_s, f"gave up after {waited:.2f} s, not parallel.timeout_s"
    _first_look, *waiting = late.copied.seen  # the first look is quick: a finished step changes no phase
    assert waiting and {(p.name, p.step) for p in waiting} == {("device_wait", 3)}
    assert str(raised.value).startswith(
        "collective timed out after parallel.timeout_s=3 s on rank 0 in device_wait at step 3"
    )
    record = json.loads((tmp_path / "rank0.failed").read_text())
    assert record["timed_out"] is True and "for the device to finish step 3" in record["error"]
    phase = json.loads((tmp_path / "rank0.json").read_text())
    assert (phase["name"], phase["step"]) == ("device_wait", 3)
    assert parallel.timeout_grace_s("nccl", 600) >= parallel.NCCL_GRACE_MIN_S, "NCCL's watchdog must come after"
    assert parallel.timeout_grace_s("gloo", 600) == 0, "gloo raises in the waiting thread: its timeout is the key's"
