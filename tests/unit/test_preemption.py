"""Slurm's warning ahead of the time limit (SIGUSR2) inside a submitit job: submitit's own handler (checkpoint the
job, requeue it, exit) gets the signal only once the run has saved and stopped, never in the middle of a start-up,
a save or a finished run's report."""

from __future__ import annotations

import os
import signal
import time

import pytest

from ddptrain.process import signals


@pytest.fixture
def submitit_like_handler(monkeypatch):
    """A handler in the place submitit's own takes in its jobs (it records what it is given), and a fresh process."""
    monkeypatch.setattr(signals, "_first_stop", {})
    monkeypatch.delenv(signals.STOP_ENV, raising=False)
    calls: list[int] = []

    def requeue(signum: int, frame: object) -> None:
        calls.append(signum)

    # A stop leaves SIGTERM and SIGINT ignored (the process is about to exit): pytest's own come back after.
    previous = {s: signal.getsignal(s) for s in signals.STOP_SIGNALS}
    signal.signal(signals.PREEMPT_SIGNAL, requeue)
    yield requeue, calls
    for signum, handler in previous.items():
        signal.signal(signum, handler)
    os.environ.pop(signals.STOP_ENV, None)


def _deliver(signum: int) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(0.05)  # Python runs the handler in the main thread, between bytecodes


def test_a_warning_before_training_is_noted_and_the_run_starts_stopped(submitit_like_handler) -> None:
    requeue, calls = submitit_like_handler
    assert signals.scheduler_handler() is requeue
    with signals.preemption_deferred(requeue):
        _deliver(signals.PREEMPT_SIGNAL)
        assert calls == [], "submitit must not requeue and exit before the run saved"
        with signals.stop_on_signals() as stop:  # the training loop, starting now
            assert stop.requested and stop.signal == signals.PREEMPT_SIGNAL
    assert signal.getsignal(signals.PREEMPT_SIGNAL) is requeue, "submitit's handler is back after the job"


@pytest.mark.parametrize(
    ("code", "handed_on"),
    [(signals.STOPPED_EXIT_CODE, True), (signals.ABORTED_EXIT_CODE, False), (1, False)],
    ids=["stopped", "aborted", "failed"],
)
def test_submitit_gets_the_signal_once_the_run_stopped_after_saving(submitit_like_handler, code, handed_on) -> None:
    requeue, calls = submitit_like_handler
    with signals.preemption_deferred(requeue):
        with signals.stop_on_signals():
            _deliver(signals.PREEMPT_SIGNAL)  # while training: a stop request like SIGTERM
        assert calls == []
        signals.hand_on_preemption(requeue, code)
    assert calls == ([signals.PREEMPT_SIGNAL] if handed_on else [])


def test_a_stop_by_sigterm_is_not_handed_to_submitit(submitit_like_handler) -> None:
    """Pre-emption or scancel: Slurm's own requeue (--requeue) or the sweep run again resumes the job."""
    requeue, calls = submitit_like_handler
    with signals.preemption_deferred(requeue):
        with signals.stop_on_signals():
            _deliver(signal.SIGTERM)
        signals.hand_on_preemption(requeue, signals.STOPPED_EXIT_CODE)
    assert calls == []
