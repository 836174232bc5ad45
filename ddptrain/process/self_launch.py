"""What a self-launch (``launch.launch``) sets up around torch elastic's agent: the store's listening socket, the
variables the workers inherit (set for the launch and restored after it by one context manager, ``scoped_environ``),
and elastic's launch config with its signal settings. torch is imported inside ``launch_config`` only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddptrain.config import ParallelConfig

# elastic_launch leaves the signals its agent handles in this variable (a later torchrun started from this process
# would then leave SIGTERM and SIGINT alone): a launch restores it.
ELASTIC_SIGNALS_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"


def bind_store_socket(port: int) -> socket.socket:
    """A listening socket on 127.0.0.1:port (0 = any free port), held until the store owns it.

    Raises:
        RuntimeError: the port is taken, naming the fix.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", port))
    except OSError as exc:
        sock.close()
        if exc.errno != errno.EADDRINUSE:
            raise
        raise RuntimeError(
            f"MASTER_PORT={port} is already in use on 127.0.0.1 (another job?). Unset MASTER_PORT and "
            "ddptrain picks a free port itself, or export MASTER_PORT=<a free port>."
        ) from None
    sock.listen(128)
    return sock


def worker_environment(nproc: int) -> dict[str, str]:
    """Variables the workers inherit; user settings win."""
    env = {
        # Share the rendezvous' store with nobody: workers use the launcher's loopback store.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        # Keep gloo's and NCCL's own bootstrap sockets on loopback for a single-node job.
        "GLOO_SOCKET_IFNAME": "lo",
        "NCCL_SOCKET_IFNAME": "lo",
        # Like torchrun: one thread per rank unless told otherwise, or N ranks fight over cores.
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc)),
        "TOKENIZERS_PARALLELISM": "false",
    }
    return {k: v for k, v in env.items() if k not in os.environ}


@contextlib.contextmanager
def scoped_environ(added: dict[str, str], also_restore: tuple[str, ...] = ()) -> Iterator[None]:
    """Set ``added`` in ``os.environ`` for the block, then put back what was there before, also for the variables
    of ``also_restore`` that something inside the block sets (each removed again when it was unset).

    The process may go on to launch other jobs (a sweep in one process, a test session), and torchrun started from
    it must not inherit what a launch set for its workers.
    """
    restored = {name: os.environ.get(name) for name in (*added, *also_restore)}
    os.environ.update(added)
    try:
        yield
    finally:
        for name, value in restored.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def launch_config(p: ParallelConfig, nproc: int, rdzv_dir: Path) -> Any:
    """elastic's LaunchConfig for one node: a rendezvous over a file store in ``rdzv_dir`` (nothing else listens),
    the workers' logs there too, parallel.max_restarts and parallel.start_method."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint=str(rdzv_dir / "store"),
        rdzv_configs={"store_type": "file"},
        max_restarts=p.max_restarts,
        monitor_interval=0.2,
        start_method=p.start_method.value,
        logs_specs=DefaultLogsSpecs(log_dir=str(rdzv_dir / "logs")),  # removed with rdzv_dir
        **leave_stop_signals_to_us(LaunchConfig),
    )


def leave_stop_signals_to_us(launch_config: type) -> dict[str, str]:
    """Keep elastic's agent off SIGTERM and SIGINT: signals.forward_to_workers handles them.

    The agent would raise SignalException, stop collecting the workers' results and SIGKILL them
    30 s later. Torch releases before ``LaunchConfig.signals_to_handle`` always take them over.
    """
    if "signals_to_handle" not in getattr(launch_config, "__dataclass_fields__", {}):
        return {}
    return {"signals_to_handle": "SIGHUP,SIGQUIT"}


def killed_by(exc: Any, signum: int | None) -> bool:
    """Whether every failed worker died of the signal the launcher forwarded."""
    return signum is not None and all(f.exitcode == -signum for f in exc.failures.values())
