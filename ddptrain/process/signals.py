"""Stopping a run by signal: SIGTERM, SIGUSR2 or Ctrl-C saves a checkpoint and stops; a second Ctrl-C aborts.

Two sides:

- Every worker runs its training loop inside ``stop_on_signals()``. SIGTERM (pre-emption), SIGUSR2 or a
  first SIGINT (Ctrl-C) only sets a flag; the trainer all-reduces it with the step's token count,
  so every rank stops after the same step, saves one checkpoint and returns normally. The worker
  exits 0: under ``torchrun --max-restarts N`` a non-zero exit would restart the group.
- The self-launcher (``python -m ddptrain``) runs elastic's agent inside ``forward_to_workers()``.
  Left to itself, the agent turns SIGTERM/SIGINT into ``SignalException``, stops reading its
  workers' return values, and SIGKILLs them 30 s later: a worker that has returned waits for the
  launcher to read its value before it exits. Instead the launcher passes the signal on, the agent
  keeps collecting results, and ``__main__`` prints one line and exits with ``STOPPED_EXIT_CODE``.

A terminal's Ctrl-C reaches the whole foreground process group: the self-launcher and its workers
get it directly, and the workers get it again from the launcher. The self-launcher sees each Ctrl-C
exactly once, so it alone decides that one is the second: it then sends its workers ABORT_SIGNAL, and
they take every other repeat for the same request, however late a forwarded copy arrives. Workers
of torchrun (or of a single-process run) decide themselves: a SIGINT within ``REPEAT_WINDOW_S`` of
the first signal is the same request; a later one aborts at once, without saving (the previous
checkpoint stays intact: checkpoints are written atomically). So does a later SIGTERM after a
Ctrl-C: torchrun passes a second Ctrl-C on to its workers as SIGTERM. After a SIGTERM, only Ctrl-C
aborts: a scheduler may send SIGTERM more than once.

SIGUSR2 is what Slurm sends ahead of a job's time limit when submitit asks for it (``--signal=USR2@<delay>``), to
every process of the job. It stops the run like SIGTERM. Inside a submitit job, submitit's own handler for it
(checkpoint the job and requeue it) is handed the signal once the run has saved and the job's record says
``stopped`` (``launch.hydra_job``, ``scheduler_handler``), so the requeued job resumes from that checkpoint.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Slurm's warning ahead of the time limit (submitit's default, SUBMITIT_PREEMPT_SIGNAL).
PREEMPT_SIGNAL = signal.SIGUSR2
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, PREEMPT_SIGNAL)
# A repeat of Ctrl-C within this many seconds of the first signal is the same request (the
# terminal's copy and the launcher's forwarded copy); a later one aborts.
REPEAT_WINDOW_S = 1.0
# On a second Ctrl-C the self-launcher gives its workers this long to exit, then SIGKILLs them (a
# worker blocked in a collective runs no Python code, so it cannot act on the signal).
ABORT_GRACE_S = 2.0
# sysexits.h EX_TEMPFAIL, "try again later": the self-launcher stopped cleanly after saving a
# checkpoint, and the same command with trainer.resume=<run dir> continues. Requeue scripts can tell
# it from 0 (finished), 1 (failed) and 130 (aborted, or killed by SIGINT).
STOPPED_EXIT_CODE = 75
ABORTED_EXIT_CODE = 130
DIVERGED_EXIT_CODE = 65
"""A run that diverged (trainer.on_nonfinite, ``observe.nonfinite``): not 1 (a crash), not 75 (a stop that resumes)."""
# Set in the self-launcher once a stop is requested: workers it starts afterwards (a restart after
# a failure) begin with the request already made.
STOP_ENV = "DDPTRAIN_STOP_SIGNAL"
# Set for the workers of the self-launcher. There the launcher alone decides when a Ctrl-C is the
# second one (it gets each Ctrl-C exactly once) and sends ABORT_SIGNAL; a worker treats every other
# repeat as the same request, so a forwarded copy that arrives late can never abort the run.
SELF_LAUNCHED_ENV = "DDPTRAIN_SELF_LAUNCHED"
# A signal nobody else sends: not SIGUSR2 (Slurm's warning before the time limit must stop a run with a checkpoint,
# not abort it) nor SIGUSR1 (``kill -USR1`` prints a rank's stacks, see ``hangs``). Where there are no real-time
# signals (macOS), the virtual-time alarm, which nothing here sets.
ABORT_SIGNAL = getattr(signal, "SIGRTMIN", signal.SIGVTALRM)
# Keys ``Trainer.fit`` adds to its result when it stopped on a signal.
STOPPED_BY = "stopped_by"
STOPPED_AT_STEP = "stopped_at_step"


class Aborted(KeyboardInterrupt):
    """A second Ctrl-C in the self-launcher: the workers have ended, nothing more is saved.

    A KeyboardInterrupt, so that elastic's ``except Exception`` clauses let it through.
    """


# The first stop signal this process took (in a worker, the self-launcher, or ``preemption_deferred``): see
# ``hand_on_preemption``.
_first_stop: dict[str, signal.Signals] = {}


def scheduler_handler() -> Any:
    """The handler a scheduler's job wrapper installed for PREEMPT_SIGNAL (submitit: checkpoint the job and requeue
    it), or None. Read it before ddptrain installs its own: ``hand_on_preemption`` calls it once the run has saved."""
    handler = signal.getsignal(PREEMPT_SIGNAL)
    return handler if callable(handler) else None


@contextlib.contextmanager
def preemption_deferred(handler: Any) -> Iterator[None]:
    """While a scheduler's job runs (``handler``: submitit's, from ``scheduler_handler``), PREEMPT_SIGNAL never
    reaches submitit directly: submitit would requeue the job and exit at once, in the middle of a save, of the
    report, or of a run that had finished. Whenever no training loop listens (start-up, the end), it is only noted:
    a run that has not begun training starts with the stop already requested (STOP_ENV) and ends before its first
    step, and ``hand_on_preemption`` hands the signal to submitit once the job's record says stopped. A run that
    finished keeps its result. Nothing happens without a handler (outside a submitit job)."""
    if handler is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def note(signum: int, frame: Any) -> None:
        _first_stop.setdefault("signal", PREEMPT_SIGNAL)
        os.environ.setdefault(STOP_ENV, PREEMPT_SIGNAL.name)
        log.warning(
            "%s outside training: noted (a run not yet training ends before its first step and is requeued; "
            "a finished one keeps its result)",
            PREEMPT_SIGNAL.name,
        )

    previous = signal.signal(PREEMPT_SIGNAL, note)
    try:
        yield
    finally:
        signal.signal(PREEMPT_SIGNAL, previous)


def hand_on_preemption(handler: Any, exit_code: Any) -> None:
    """After a run stopped on PREEMPT_SIGNAL and exits with STOPPED_EXIT_CODE (saved, its record written): give the
    signal to the scheduler's handler, which requeues the job (submitit does on global rank 0, then exits). Not
    after an abort or a failure, not for any other signal."""
    stopped = exit_code == STOPPED_EXIT_CODE and _first_stop.get("signal") == PREEMPT_SIGNAL
    if handler is not None and stopped:
        log.info("%s: the run has saved; handing the signal on to the job's scheduler", PREEMPT_SIGNAL.name)
        handler(PREEMPT_SIGNAL, None)


class StopRequest:
    """The first stop signal this process received; the training loop reads ``requested`` at each step."""

    def __init__(self, signum: signal.Signals | None = None, launcher_aborts: bool = False) -> None:
        self.signal = signum
        self.at = time.monotonic()
        self.aborting = False
        # A worker of the self-launcher: only the launcher's ABORT_SIGNAL aborts (see SELF_LAUNCHED_ENV).
        self.launcher_aborts = launcher_aborts

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def note(self, signum: int) -> str:
        """Record a signal.

        Returns:
            ``"stop"`` for the first; ``"abort"`` for a SIGINT, or any signal after a first SIGINT,
            more than REPEAT_WINDOW_S after the first; ``"repeat"`` for anything else (the same
            request again).
        """
        now = time.monotonic()
        if signum == ABORT_SIGNAL:
            self.aborting = True
            return "abort"
        if self.signal is None:
            self.signal, self.at = signal.Signals(signum), now
            _first_stop.setdefault("signal", self.signal)
            return "stop"
        if self.launcher_aborts:
            return "repeat"
        after_ctrl_c = signal.SIGINT in (signum, self.signal)
        if after_ctrl_c and now - self.at > REPEAT_WINDOW_S and not self.aborting:
            self.aborting = True
            return "abort"
        return "repeat"

    def report(self, step: int) -> dict[str, Any]:
        """What ``fit`` adds to its result: which signal (this rank may not have received one), and the step."""
        by = self.signal.name if self.signal is not None else "a signal to another rank"
        return {STOPPED_BY: by, STOPPED_AT_STEP: step}


@contextlib.contextmanager
def stop_on_signals(stop: StopRequest | None = None) -> Iterator[StopRequest]:
    """In a worker: turn SIGTERM, SIGUSR2 and a first Ctrl-C into a request to checkpoint and stop; a second Ctrl-C
    aborts.

    Args:
        stop: the request of an enclosing use (so the saving after the loop still counts repeats
            from the first signal); default a new one, already made when the launcher set STOP_ENV.

    Yields:
        The request. On exit the previous handlers come back, or, once a stop is under way, both
        signals are ignored (see ``_restore``). Outside the main thread (where Python cannot set
        handlers) nothing is installed.
    """
    if stop is None:
        from_launcher = os.environ.get(STOP_ENV)
        first = signal.Signals[from_launcher] if from_launcher in signal.Signals.__members__ else None
        stop = StopRequest(first, launcher_aborts=os.environ.get(SELF_LAUNCHED_ENV) == "1")
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    owner = os.getpid()

    def handle(signum: int, frame: Any) -> None:
        if os.getpid() != owner:  # a forked child (a DataLoader worker) inherited the handler: not its business
            return
        what = stop.note(signum)
        if what == "stop":
            log.warning(
                "%s: finishing this step, saving a checkpoint, then stopping (Ctrl-C again to abort)",
                signal.Signals(signum).name,
            )
        elif what == "abort":
            how = f"{signal.Signals(signum).name} after Ctrl-C"
            if signum == ABORT_SIGNAL:
                how = "a second Ctrl-C to the launcher"
            log.warning("%s: aborting without saving", how)
            # SystemExit, not KeyboardInterrupt: the process exits normally, without a traceback,
            # and multiprocessing releases its semaphores (no resource_tracker warning).
            raise SystemExit(ABORTED_EXIT_CODE)

    previous = {s: signal.signal(s, handle) for s in (*STOP_SIGNALS, ABORT_SIGNAL)}
    try:
        yield stop
    finally:
        _restore(previous, stop)


@contextlib.contextmanager
def forward_to_workers() -> Iterator[StopRequest]:
    """In the self-launcher: pass SIGTERM / a first Ctrl-C on to the workers; a second Ctrl-C ends them.

    The workers are this process's multiprocessing children (elastic's agent starts them with
    ``spawn``, or through the forkserver). Elastic must be told to leave SIGTERM and SIGINT alone
    (``LaunchConfig.signals_to_handle``), or it replaces these handlers. On a second Ctrl-C the
    workers get ABORT_SIGNAL and exit; those still running after ABORT_GRACE_S are killed.

    Yields:
        The request (``requested`` once a signal came).

    Raises:
        Aborted: a second Ctrl-C, once the workers have ended.
    """
    stop = StopRequest()

    def handle(signum: int, frame: Any) -> None:
        what = stop.note(signum)
        workers = _started_children()
        if what == "stop":
            os.environ[STOP_ENV] = signal.Signals(signum).name
            for worker in workers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.pid, signum)
        elif what == "abort":
            for worker in workers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.pid, ABORT_SIGNAL)
            deadline = time.monotonic() + ABORT_GRACE_S
            for worker in workers:
                worker.join(timeout=max(0.0, deadline - time.monotonic()))
                if worker.is_alive():
                    worker.kill()
                    worker.join(timeout=10)
            raise Aborted

    previous = {s: signal.signal(s, handle) for s in STOP_SIGNALS}
    try:
        yield stop
    finally:
        _restore(previous, stop)
        os.environ.pop(STOP_ENV, None)


def _started_children() -> list[Any]:
    """This process's multiprocessing children, without polling them as ``active_children()`` does.

    A forkserver child's exit code comes through a pipe: a poll from a signal handler can take the code that the main
    thread, interrupted between its wait and its read, was about to read, and the main thread then records 255.
    """
    children = getattr(multiprocessing.process, "_children", None)
    return list(children) if children is not None else multiprocessing.active_children()


def start_resource_tracker_deaf_to_preemption() -> None:
    """Start multiprocessing's resource tracker now, with PREEMPT_SIGNAL ignored: a disposition it keeps across exec.

    The tracker is a process of its own in the job's process group. It ignores SIGINT and SIGTERM by itself, but
    SIGUSR2, which Slurm sends to every process of the job, would kill it; the one started in its place then knows
    none of the workers' semaphores and prints a KeyError traceback for each. Does nothing once it runs, or off the
    main thread (only the main thread may set handlers).
    """
    from multiprocessing import resource_tracker

    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.signal(PREEMPT_SIGNAL, signal.SIG_IGN)
    try:
        resource_tracker.ensure_running()
    finally:
        signal.signal(PREEMPT_SIGNAL, previous)


def init_loader_worker(rank_pid: int, worker_id: int) -> None:
    """``worker_init_fn`` of the DataLoader (bound to the rank's pid): ignore the stop signals, die with the rank."""
    ignore_stop_signals(worker_id)
    die_with(rank_pid)


# prctl(2): the signal a process gets when the thread that forked it exits.
_PR_SET_PDEATHSIG = 1


def die_with(parent_pid: int) -> None:
    """Linux: the kernel SIGKILLs this forked process the moment ``parent_pid`` (its parent) dies; strictly, when
    the thread that forked it ends, which for the loader's workers is the rank's training thread.

    A rank killed outright (a SIGKILL, the OOM killer) leaves its forked loader workers behind. They hold the pipe by
    which a self-launch's agent learns that the rank exited, and notice the loss only at their own check, every 5 s:
    the agent saw the death, and restarted the group, 5 s late. Elsewhere nothing changes.
    """
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        log.debug("prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(ctypes.get_errno()))
        return
    if os.getppid() != parent_pid:  # the rank died before the call above: nothing will signal this process
        os._exit(1)


def ignore_stop_signals(worker_id: int) -> None:
    """``worker_init_fn`` of the DataLoader: its workers ignore STOP_SIGNALS (SIGTERM, Ctrl-C, SIGUSR2).

    A terminal's Ctrl-C, or a scheduler signalling every process of the job, also reaches the
    loader's workers; they must not die mid-epoch while the training process finishes its step and
    saves. The training process ends them when it stops.
    """
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def _restore(previous: dict[signal.Signals, Any], stop: StopRequest) -> None:
    """The handlers from before; but once a stop is under way, the process is about to exit, and a late
    signal (the launcher's copy of a Ctrl-C, another Ctrl-C) must not interrupt that with a
    KeyboardInterrupt traceback or kill it: ignore them."""
    for signum, handler in previous.items():
        signal.signal(signum, signal.SIG_IGN if stop.requested else handler)


def stopped_line(how: str, run_dir: Path, step: int | None) -> str:
    """The one line that says how a run ended early, where its checkpoint is and how to resume.

    Args:
        how: e.g. ``"stopped by SIGTERM"``.
        run_dir: the run directory.
        step: the step the run stopped after; None when it stopped before training began.
    """
    where = f" at step {step}" if step is not None else ""
    latest = run_dir / "checkpoints" / "latest"
    if not latest.is_file():
        return f"ddptrain: {how}{where}; no checkpoint yet: start the run again from the beginning"
    checkpoint = run_dir / "checkpoints" / latest.read_text().strip()
    return f"ddptrain: {how}{where}; checkpoint {checkpoint}; resume with trainer.resume={run_dir}"
