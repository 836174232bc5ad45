"""``parallel.start_method=forkserver``: the self-launcher's ranks are forks of one server process that imported
torch, transformers and peft once (multiprocessing's forkserver), yet each starts with what a spawned rank gets from
the launcher at that moment.

The server is as old as this process's first forkserver launch (under pytest, another test's). What a forked rank
would take from it, and what is done about each:

- the environment: the launcher's is pickled with the rank's arguments at each start (restarts included) and
  adopted when the rank unpickles them, before elastic sets the rank's own variables, as with spawn. What a library
  reads while it is imported (``HF_HUB_OFFLINE``, ``HF_DATASETS_CACHE``, ``MKL_*``...) the server read: when a
  variable of that kind (``IMPORT_TIME_PREFIXES``) differs from the server's, a new server is started;
- standard output and error, and the cores: passed along and put in place the same way;
- OpenMP's thread count, read when the server imported torch: set from ``OMP_NUM_THREADS``;
- signals: the server must outlive a signal sent to the whole process group (a terminal's Ctrl-C, Slurm's
  SIGUSR2), for its ranks' exit codes reach the launcher through it. It runs with the stop signals blocked; a rank
  inherits the mask and unblocks it once its handling is as in a new process, so a signal sent earlier is
  delivered then (as in a spawned rank that has not installed ddptrain's handlers yet: SIGTERM ends it, SIGINT
  raises KeyboardInterrupt);
- the launcher's death: a spawned rank gets SIGINT when its parent dies (torch asks the kernel for it); a forked
  rank's parent is the server, which lives as long as its ranks, so a thread watches the launcher instead.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Mapping
from multiprocessing import forkserver as mp_forkserver
from multiprocessing import resource_tracker
from typing import Any

from ddptrain.process import signals

log = logging.getLogger(__name__)

# What a rank imports before it trains (the bundled and Qwen2.5 models are Qwen2).
PRELOAD = ["ddptrain.launch", "ddptrain.trainer", "peft", "transformers.models.qwen2.modeling_qwen2"]
BLOCKED = (signal.SIGINT, signal.SIGTERM, signals.PREEMPT_SIGNAL)
# Should an import ask torch.cuda.is_available(), NVML answers: a CUDA driver initialised in the server could not be
# used by the ranks it forks.
NVML_CHECK_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"
# Variables that libraries may read while they are imported. OMP_NUM_THREADS is applied in each rank.
IMPORT_TIME_PREFIXES = (
    *("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "DATASETS_", "PEFT_", "TOKENIZERS_", "TORCH_", "PYTORCH_"),
    *("CUDA_", "NCCL_", "OMP_", "KMP_", "MKL_", "OPENBLAS_", "PYTHON", "LD_"),
)

_server: tuple[int, dict[str, str]] | None = None  # (pid, import-time variables) of the server this process started
_let_go: list[int] = []  # servers stop() let go of, reaped once they have ended


def start() -> None:
    """Make sure a server runs with the libraries preloaded and this environment's import-time variables."""
    global _server
    server = mp_forkserver._forkserver  # multiprocessing's one server per process (no public handle)
    _reap_let_go()
    wanted = import_time_variables(os.environ)
    if _server is None and server._forkserver_pid is not None:
        stop()  # started elsewhere: without the preload and the blocked signals
    elif _server is not None and _server[1] != wanted:
        changed = sorted(k for k in {*wanted, *_server[1]} if wanted.get(k) != _server[1].get(k))
        log.info("forkserver: %s changed since the server started: starting a new one", ", ".join(changed))
        stop()
    multiprocessing.set_forkserver_preload(PRELOAD)
    # The server's start would start the resource tracker too, and that unblocks SIGINT and SIGTERM when done.
    signals.start_resource_tracker_deaf_to_preemption()
    resource_tracker.ensure_running()  # off the main thread the line above does nothing
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, BLOCKED)  # a mask survives fork and exec
    nvml_check = os.environ.get(NVML_CHECK_ENV)
    os.environ[NVML_CHECK_ENV] = "1"
    try:
        server.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        if nvml_check is None:
            os.environ.pop(NVML_CHECK_ENV)
        else:
            os.environ[NVML_CHECK_ENV] = nvml_check
    if _server is None or _server[0] != server._forkserver_pid:
        _server = (server._forkserver_pid, wanted)


def stop() -> None:
    """Let this process's server go: the next ``start`` starts a new one. The old one ends once every process it
    forked has (each holds its pipe); nothing waits for that here, as a rank of an earlier launch may linger."""
    global _server
    _server = None
    server = mp_forkserver._forkserver
    with server._lock:
        if server._forkserver_pid is None:
            return
        os.close(server._forkserver_alive_fd)  # the server's signal to end
        _let_go.append(server._forkserver_pid)
        address = server._forkserver_address
        server._forkserver_alive_fd = server._forkserver_pid = server._forkserver_address = None
    if isinstance(address, str) and not address.startswith("\0"):
        with contextlib.suppress(OSError):
            os.unlink(address)


def _reap_let_go() -> None:
    for pid in list(_let_go):
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0] == 0:
                continue  # still running
        _let_go.remove(pid)


def import_time_variables(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k.startswith(IMPORT_TIME_PREFIXES) and k != "OMP_NUM_THREADS"}


class LauncherState:
    """What a spawned rank inherits from the launcher, read when elastic pickles a rank's arguments (each start)."""

    def __reduce__(self) -> tuple[Callable[..., None], tuple[Any, ...]]:
        from multiprocessing.reduction import DupFd

        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        outputs = [DupFd(fd) if _is_open(fd) else None for fd in (1, 2)]
        return _adopt, (dict(os.environ), *outputs, cores)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _adopt(environ: dict[str, str], stdout: Any, stderr: Any, cores: list[int] | None) -> None:
    """In a forked rank, as it unpickles its arguments: take the launcher's state and a new process's signals."""
    import torch

    os.environ.clear()
    os.environ.update(environ)
    for passed, fd in ((stdout, 1), (stderr, 2)):
        received = passed.detach() if passed is not None else os.open(os.devnull, os.O_WRONLY)
        os.dup2(received, fd)
        os.close(received)
    if cores is not None:
        os.sched_setaffinity(0, cores)
    threads = environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit():  # OpenMP read the variable when the server imported torch
        torch.set_num_threads(int(threads))
    for signum in BLOCKED:
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, BLOCKED)  # last: what is pending arrives now


def run_forked(_state: None, target: Callable[..., Any], *args: Any) -> Any:
    """``target(*args)`` in a forked rank (the launcher's state was adopted as the arguments were unpickled)."""
    launcher = multiprocessing.parent_process()
    if launcher is not None and launcher.sentinel is not None:
        watch = threading.Thread(target=_interrupt_when_gone, args=(launcher.sentinel,), daemon=True)
        watch.start()
    return target(*args)


def _interrupt_when_gone(sentinel: int) -> None:
    """SIGINT to this rank once the launcher is gone (its end of the pipe closed), as a spawned rank would get."""
    from multiprocessing.connection import wait

    wait([sentinel])
    os.kill(os.getpid(), signal.SIGINT)
