"""Where each rank is, so that a hang says which rank was where.

``board`` holds this process's current phase (step, micro-step, forward/backward/optimizer/eval/...). The
training loop updates it at every phase change; it is one attribute assignment, cheap enough for every
micro-step.

``watch`` (around a rank's training, see ``launch``) starts a watchdog thread that reads the board once a
second and, under ``<run>/hang/``:

- writes the phase to ``rank{N}.json`` whenever it changed (the main thread never touches a file);
- dumps every thread's Python stack to ``rank{N}.stacks.txt`` once a phase has lasted ``DUMP_AT`` of its
  timeout (``parallel.timeout_s``; ``data.prepare_timeout_s`` for ``tokenize``), so the dumps exist before
  the other ranks' collectives time out; ``kill -USR1 <pid>`` appends one on demand (``faulthandler``); the
  file is removed at the end if no dump was written;
- ends this process when it is stuck that long and another rank has failed: the group is broken, and the
  elastic agent would otherwise wait 30 s after its SIGTERM before it SIGKILLs a rank that cannot act on it.

When this rank fails, ``watch`` leaves ``rank{N}.failed``; when the failure is a collective timeout it also
logs every rank's last phase and raises ``CollectiveTimeout``, whose one line names the rank that was stuck.
The self-launcher reads the same files for its failure summary (``where_ranks_were``). See docs/hangs.md.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

log = logging.getLogger(__name__)

HANG_DIR = "hang"
"""The folder under the run folder that holds the phase files, the stack dumps and the NCCL traces."""
DUMP_AT = 0.8
"""Share of a phase's timeout after which its stacks are dumped: before the waiting ranks time out."""
POLL_S = 1.0
"""How often the watchdog reads the board: it bounds how stale a phase file is."""
PEER_EXIT_WAIT_S = 10.0
"""How long a stuck rank waits for a failed rank to end before it ends itself (see ``Watchdog.give_up``)."""
NCCL_TRACE_PREFIX = "nccl_trace_rank_"
"""NCCL's flight recorder appends the global rank to this prefix for its dump file."""
# What a wait for other ranks that ran past its timeout raises, word for word (torch 2.13):
# - gloo: "Timed out waiting 10000ms for recv operation to complete" (or send); "Application timeout caused pair
#   closure" on a pair whose other end gave up first;
# - NCCL's watchdog, or a blocking wait: "Watchdog caught collective operation timeout: WorkNCCL(...) ran for
#   10012 milliseconds before timing out.";
# - the c10d TCPStore (ranks meet there at start-up, and in store-based barriers): "wait timeout after 10000ms,
#   keys: ...", "barrier timeout after 10000ms, key: ...";
# - ddptrain's own wait for the device to finish a step (``parallel.LateRead``, where a GPU's host waits on NCCL):
#   "Timed out waiting 10000ms for the device to finish step 3 ...".
# Not any "timed out": "DataLoader timed out after 60 seconds" is this rank's own data loading, not a wait
# for another rank, and must reach the user as it is.
_COLLECTIVE_TIMEOUT = re.compile(
    r"Timed out waiting \d+ms for (?:send|recv) operation to complete"
    r"|Application timeout caused pair closure"
    r"|Watchdog caught collective operation timeout"
    r"|(?:wait|barrier) timeout after \d+ms"
    r"|Timed out waiting \d+ms for the device to finish step"
)


@dataclass(frozen=True)
class Phase:
    """What this rank is doing, and since when (``time.time()``)."""

    name: str
    step: int | None
    micro_step: int | None
    since: float


class PhaseBoard:
    """This process's current phase; read from the watchdog thread."""

    def __init__(self) -> None:
        self.current = Phase("start", None, None, time.time())

    def enter(self, name: str, step: int | None = None, micro_step: int | None = None) -> None:
        # One tuple-like object swapped in whole: the watchdog thread never sees half an update.
        self.current = Phase(name, step, micro_step, time.time())

    @contextlib.contextmanager
    def showing(self, phase: Phase) -> Iterator[None]:
        """``phase`` for the block (a wait for work of an earlier step: ``parallel.LateRead``), then the phase
        before it. Not put back when the block raises: the error is reported where the host was waiting."""
        before, self.current = self.current, phase
        yield
        self.current = before


board = PhaseBoard()


class CollectiveTimeout(RuntimeError):
    """A collective waited past ``parallel.timeout_s``; the message names the rank that was stuck, and where."""


# ----------------------------------------------------------------------------- files


def phase_file(hang_dir: Path, rank: int) -> Path:
    return hang_dir / f"rank{rank}.json"


def stacks_file(hang_dir: Path, rank: int) -> Path:
    return hang_dir / f"rank{rank}.stacks.txt"


def failed_file(hang_dir: Path, rank: int) -> Path:
    return hang_dir / f"rank{rank}.failed"


def _write_json(path: Path, record: dict[str, Any]) -> None:
    """Whole or not at all: a reader never sees half a file."""
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(json.dumps(record))
    os.replace(partial, path)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def describe(phase: Mapping[str, Any], at: float) -> str:
    """``"forward at step 3 micro-step 0 for 12 s"`` from a phase record, as of time ``at``; the function the
    rank was in, once the watchdog dumped its stacks: ``", in all_reduce (distributed/distributed_c10d.py:2950)"``."""
    where = phase["name"]
    if phase.get("step") is not None:
        where += f" at step {phase['step']}"
    if phase.get("micro_step") is not None:
        where += f" micro-step {phase['micro_step']}"
    where += f" for {max(0.0, at - phase['since']):.0f} s"
    return where + (f", in {phase['frame']}" if phase.get("frame") else "")


# ----------------------------------------------------------------------------- the watchdog


class Watchdog(threading.Thread):
    """Once every ``POLL_S``: the phase to its file, the stacks of a phase near its timeout, and leave when
    stuck after another rank failed. ``poll`` is one round (tests call it directly).

    Args:
        hang_dir: ``<run>/hang``.
        rank: this process's global rank.
        timeout_s: ``parallel.timeout_s``.
        limits: timeouts of phases that wait longer than ``timeout_s`` (``{"tokenize": data.prepare_timeout_s}``).
        attempt: the restart attempt (failures of earlier attempts are not this group's).
        stacks: the open stack-dump file.
        leave: how the process ends when stuck after another rank failed (``os._exit``).
    """

    def __init__(
        self,
        hang_dir: Path,
        rank: int,
        timeout_s: float,
        limits: Mapping[str, float],
        attempt: int,
        stacks: TextIO,
        leave: Callable[[int], Any] = os._exit,
    ) -> None:
        super().__init__(name="ddptrain-hang-watchdog", daemon=True)
        self.hang_dir, self.rank, self.timeout_s, self.limits = hang_dir, rank, timeout_s, dict(limits)
        self.attempt, self.stacks, self.leave = attempt, stacks, leave
        self.written: Phase | None = None
        self.dumped: Phase | None = None
        self.stopped = threading.Event()

    def run(self) -> None:
        while True:
            try:
                self.poll(time.time())
            except OSError as err:  # a full or vanished file system must not end the training, only the watch
                log.warning("rank %d: the hang watchdog stops: %s", self.rank, err)
                return
            if self.stopped.wait(POLL_S):
                return

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=10 * POLL_S)

    def poll(self, now: float) -> None:
        phase = board.current
        if phase is not self.written:
            self.write_phase(phase, now)
        if phase is not self.dumped and now - phase.since >= DUMP_AT * self.limit(phase):
            self.dump_stacks(phase, now)
        if phase is self.dumped and (failed := self.failed_peer()) is not None:
            self.give_up(phase, failed, now)

    def limit(self, phase: Phase) -> float:
        return self.limits.get(phase.name, self.timeout_s)

    def write_phase(self, phase: Phase, now: float, frame: str | None = None) -> None:
        record = {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(), "attempt": self.attempt}
        record.update(asdict(phase), frame=frame, written=now)
        _write_json(phase_file(self.hang_dir, self.rank), record)
        self.written = phase

    def dump_stacks(self, phase: Phase, now: float) -> None:
        """Every thread's stack to the dump file; the main thread's innermost function to the phase file."""
        where = describe(asdict(phase), now)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
        header = f"rank {self.rank} (pid {os.getpid()}): {where}, timeout {self.limit(phase):g} s"
        self.stacks.write(f"\n=== {stamp} {header}\n")
        self.stacks.flush()  # faulthandler writes to the file descriptor, past Python's buffer
        faulthandler.dump_traceback(self.stacks, all_threads=True)
        self.write_phase(phase, now, _main_thread_frame())
        self.dumped = phase
        log.warning("%s; stacks of all threads in %s", header, stacks_file(self.hang_dir, self.rank))

    def failed_peer(self) -> dict[str, Any] | None:
        """The failure record of another rank of this attempt, if one failed."""
        for path in self.hang_dir.glob("rank*.failed"):
            record = _read_json(path)
            if record and record["rank"] != self.rank and record["attempt"] == self.attempt:
                return record
        return None

    def give_up(self, phase: Phase, failed: dict[str, Any], now: float) -> None:
        log.error(
            "rank %d failed (%s) while this rank has been in %s: leaving, the process group is broken",
            failed["rank"],
            failed["error"],
            describe(asdict(phase), now),
        )
        for handler in logging.getLogger().handlers:
            handler.flush()
        # The launcher's agent reports the ranks that have ended when it first sees one end: leaving before
        # the failed rank has ended would put this rank's bare exit code in the summary instead of its error.
        _wait_for_exit(failed, PEER_EXIT_WAIT_S)
        if not self.stopped.is_set():  # meanwhile this rank's own collective failed: it reports that itself
            self.leave(1)


def _main_thread_frame() -> str | None:
    """``"function (folder/file.py:line)"`` of the main thread's innermost Python frame: where it waits."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return None
    where = os.sep.join(Path(frame.f_code.co_filename).parts[-2:])
    return f"{frame.f_code.co_name} ({where}:{frame.f_lineno})"


def _wait_for_exit(failed: dict[str, Any], wait_s: float) -> None:
    """Until the failed rank's process is gone (reaped by its launcher), at most ``wait_s``; on another
    host, where it cannot be seen, ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if failed["host"] == socket.gethostname():
            try:
                os.kill(failed["pid"], 0)
            except ProcessLookupError:
                return
            except PermissionError:
                pass  # alive, someone else's: a reused pid
        time.sleep(0.1)


# ----------------------------------------------------------------------------- on failure


def is_collective_timeout(err: BaseException) -> bool:
    """Whether ``err``, or an error it was raised from, is gloo's, NCCL's or the c10d store's error for a wait on
    other ranks that ran past its timeout (``_COLLECTIVE_TIMEOUT``); other timeouts (a DataLoader's) are not."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, RuntimeError) and _COLLECTIVE_TIMEOUT.search(str(seen)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def record_failure(hang_dir: Path, rank: int, attempt: int, err: BaseException, timed_out: bool) -> None:
    """Leave ``rank{N}.failed``: stuck peers end themselves on seeing it, the launcher's summary reads it."""
    lines = str(err).strip().splitlines() or [type(err).__name__]
    record = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(), "attempt": attempt}
    record.update(error=lines[0][:300], timed_out=timed_out, at=time.time())
    _write_json(failed_file(hang_dir, rank), record)


def read_phases(hang_dir: Path) -> dict[int, dict[str, Any]]:
    """Each rank's last phase record, by rank."""
    records = (_read_json(path) for path in hang_dir.glob("rank*.json"))
    return {r["rank"]: r for r in records if r}


def read_failures(hang_dir: Path) -> dict[int, dict[str, Any]]:
    """Each failed rank's failure record, by rank."""
    records = (_read_json(path) for path in hang_dir.glob("rank*.failed"))
    return {r["rank"]: r for r in records if r}


def failure_summary(failures: dict[int, Any], hang_dir: Path, nproc: int) -> str:
    """The self-launcher's account of a failed run: one line per failed rank elastic reports (``failures``, its
    ``ChildFailedError.failures``); one per rank whose own failure record (``<run>/hang``) elastic did not report (the
    launcher stops the other ranks once one has exited, and the first to exit may be a rank ended because another
    failed: the error that started it is in the record); after a collective timeout, or when a rank was killed by a
    signal (on NCCL the process group's watchdog may end a timed-out rank with SIGABRT), where every rank was."""
    lines = ["training failed:"]
    for rank, failure in sorted(failures.items()):
        message = failure.message if isinstance(failure.message, str) else failure.message.get("message", "")
        last_line = (str(message).strip().splitlines() or [""])[-1]
        lines.append(f"  rank {rank} (exit code {failure.exitcode}): {last_line}")
    recorded = read_failures(hang_dir)
    lines += [f"  rank {rank}: {record['error']}" for rank, record in sorted(recorded.items()) if rank not in failures]
    if any(f.get("timed_out") for f in recorded.values()) or any(f.exitcode < 0 for f in failures.values()):
        lines.append(f"  where each rank was ({hang_dir}):")
        lines += [f"    {line}" for line in where_ranks_were(hang_dir, nproc)]
    lines.append("  The traceback of each failed rank is printed above.")
    return "\n".join(lines)


def where_ranks_were(hang_dir: Path, world_size: int) -> list[str]:
    """One line per rank: its last phase and for how long, as of the first failure; then the stack dumps.

    Args:
        hang_dir: ``<run>/hang``.
        world_size: how many ranks to list (a rank without a phase file says so).

    Returns:
        The lines, or none when no rank left a phase file.
    """
    phases, failures = read_phases(hang_dir), read_failures(hang_dir)
    if not phases:
        return []
    at = min((f["at"] for f in failures.values()), default=time.time())
    lines = []
    for rank in range(world_size):
        phase = phases.get(rank)
        where = describe(phase, at) if phase else "no phase recorded (not started, or another node's folder)"
        note = " (its collective timed out)" if failures.get(rank, {}).get("timed_out") else ""
        lines.append(f"rank {rank}: {where}{note}")
    dumps = sorted(str(p) for p in hang_dir.glob("rank*.stacks.txt") if p.stat().st_size)
    lines.append("stacks of all threads: " + (", ".join(dumps) or "none written"))
    return lines


def _stuck_rank(hang_dir: Path, rank: int, world_size: int, at: float) -> str:
    """The rank that kept the others waiting: of those whose own collective did not time out, the one in its
    phase longest. The other waiting ranks time out about when this one did: give them a moment to say so."""
    deadline = time.monotonic() + 2 * POLL_S
    while len(read_failures(hang_dir)) < world_size - 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    waited = {r for r, f in read_failures(hang_dir).items() if f["timed_out"]} | {rank}
    others = [p for r, p in read_phases(hang_dir).items() if r not in waited]
    if not others:
        return "no other rank recorded its phase"
    oldest = min(others, key=lambda p: p["since"])
    return f"rank {oldest['rank']} stuck in {describe(oldest, at)}"


def timed_out(hang_dir: Path, rank: int, world_size: int, timeout_s: float) -> CollectiveTimeout:
    """Log where every rank was; the error to raise instead of ``err``, one line naming the stuck rank."""
    now = time.time()
    here = describe(asdict(board.current), now)
    stuck = _stuck_rank(hang_dir, rank, world_size, now)
    lines = where_ranks_were(hang_dir, world_size)
    log.error(
        "a collective timed out on rank %d after parallel.timeout_s=%g s. Where each rank was:\n  %s",
        rank,
        timeout_s,
        "\n  ".join(lines),
    )
    return CollectiveTimeout(
        f"collective timed out after parallel.timeout_s={timeout_s:g} s on rank {rank} in {here}; "
        f"{stuck} (every rank's phase and stack dump: {hang_dir})"
    )


@contextlib.contextmanager
def watch(
    hang_dir: Path,
    rank: int,
    world_size: int,
    timeout_s: float,
    *,
    attempt: int = 0,
    limits: Mapping[str, float] | None = None,
) -> Iterator[None]:
    """Run the watchdog (and ``kill -USR1`` stack dumps) around a rank's work; report a collective timeout.

    Args:
        hang_dir: ``<run>/hang``, shared by every rank of the run.
        rank: this process's global rank.
        world_size: the number of ranks.
        timeout_s: ``parallel.timeout_s``.
        attempt: the restart attempt (``Start.restart_count``).
        limits: longer timeouts of some phases, e.g. ``{"tokenize": data.prepare_timeout_s}``.

    Raises:
        CollectiveTimeout: from the error of a collective that timed out in the block.
    """
    hang_dir.mkdir(parents=True, exist_ok=True)
    failed_file(hang_dir, rank).unlink(missing_ok=True)  # an earlier attempt's
    with _dump_file(stacks_file(hang_dir, rank)) as stacks:
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        watchdog = Watchdog(hang_dir, rank, timeout_s, limits or {}, attempt, stacks)
        watchdog.start()
        try:
            yield
        except Exception as err:
            watchdog.stopped.set()  # this rank reports its own error: its watchdog must not end it meanwhile
            timeout = is_collective_timeout(err)
            record_failure(hang_dir, rank, attempt, err, timeout)
            if not timeout:
                raise
            raise timed_out(hang_dir, rank, world_size, timeout_s) from err
        finally:
            watchdog.stop()
            faulthandler.unregister(signal.SIGUSR1)


@contextlib.contextmanager
def _dump_file(path: Path) -> Iterator[TextIO]:
    """``path`` open for appending, removed at the end if it is still empty: a run that never dumped its stacks
    leaves no file. It has to be open from the start: ``faulthandler.register`` takes the file it will write a
    ``kill -USR1`` dump to, from a signal handler that cannot open one. A process killed outright (SIGKILL)
    leaves it behind, empty (``where_ranks_were`` lists only files with a dump)."""
    try:
        with path.open("a") as file:
            yield file
    finally:
        with contextlib.suppress(OSError):  # a vanished folder: nothing to tidy
            if path.stat().st_size == 0:
                path.unlink()


# ----------------------------------------------------------------------------- NCCL's flight recorder


def flight_recorder_environment(
    environ: Mapping[str, str], torch_version: str, hang_dir: Path | None = None
) -> dict[str, str]:
    """The variables that switch on NCCL's flight recorder, less those the user set (their value wins).

    The recorder keeps each rank's last collectives and dumps them when a collective times out. The buffer
    size and ``TORCH_NCCL_DUMP_ON_TIMEOUT`` are read when the NCCL process group is made: call this before
    it forms. ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` (the dump's path prefix; the rank is appended) is read at
    the first dump, so it can follow once the run folder is agreed: pass ``hang_dir`` then. gloo ignores
    them all.

    Args:
        environ: the current environment (``os.environ``).
        torch_version: ``torch.__version__``: from 2.8 the buffer size is ``TORCH_FR_BUFFER_SIZE`` (the old
            ``TORCH_NCCL_TRACE_BUFFER_SIZE`` still works there, with a deprecation warning at start-up).
        hang_dir: ``<run>/hang``; None leaves the dump path alone.

    Returns:
        The variables to add to the environment.
    """
    major, minor = (int(part) for part in re.findall(r"\d+", torch_version)[:2])
    buffer_size = "TORCH_FR_BUFFER_SIZE" if (major, minor) >= (2, 8) else "TORCH_NCCL_TRACE_BUFFER_SIZE"
    wanted = {buffer_size: "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}  # entries (a start or an end), not bytes
    if hang_dir is not None:
        wanted["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = str(hang_dir / NCCL_TRACE_PREFIX)
    chosen = {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"} & environ.keys()
    return {k: v for k, v in wanted.items() if k not in environ and not (k == buffer_size and chosen)}
