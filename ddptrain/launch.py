"""Starting workers: self-launch through torch's elastic launch API, and the worker body.

``python -m ddptrain parallel=ddp2`` (no torchrun) calls ``launch``: it binds a TCPStore
to a free port on 127.0.0.1 (race-free: the socket stays bound from the moment the port
is chosen), runs the elastic rendezvous over a file store (so nothing else listens), and
starts ``nproc_per_node`` copies of ``worker``. Under torchrun, ``worker`` runs directly
on every rank.

Stopping by signal (``ddptrain/signals.py``): the launcher passes SIGTERM and Ctrl-C on to its
workers and keeps collecting their results; each worker saves a checkpoint and returns.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import shutil
import socket
import sys
import tempfile
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import record

from ddptrain import signals
from ddptrain.config import RunConfig, to_yaml

log = logging.getLogger(__name__)


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


def _worker_environment(nproc: int) -> dict[str, str]:
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


def launch(cfg: RunConfig, run_dir: Path, entrypoint: Callable[..., Any] | None = None) -> Any:
    """Run ``entrypoint(cfg, run_dir, store_port)`` on parallel.nproc_per_node local processes.

    Args:
        cfg: validated run config.
        run_dir: the run directory all ranks share.
        entrypoint: a module-level function (spawned processes import it); default ``worker``.

    Returns:
        Rank 0's return value. After SIGTERM or Ctrl-C it holds ``signals.STOPPED_BY`` (and
        ``signals.STOPPED_AT_STEP``, None when the workers were stopped before their first step).

    Raises:
        RuntimeError: MASTER_PORT busy, or a worker failed (after parallel.max_restarts restarts).
        signals.Aborted: a second Ctrl-C; the workers were killed.
    """
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    nproc = cfg.parallel.nproc_per_node or 1
    sock = bind_store_socket(int(os.environ.get("MASTER_PORT", 0)))
    port = sock.getsockname()[1]
    store = dist.TCPStore(  # noqa: F841  (kept alive: the workers' rendezvous point)
        "127.0.0.1",
        port,
        is_master=True,
        master_listen_fd=sock.fileno(),
        wait_for_workers=False,
        timeout=timedelta(seconds=cfg.parallel.timeout_s),
    )
    os.environ.update(_worker_environment(nproc))
    # For the workers only (removed again below): this launcher decides when a Ctrl-C aborts.
    os.environ[signals.SELF_LAUNCHED_ENV] = "1"
    rdzv_dir = Path(tempfile.mkdtemp(prefix="ddptrain-rdzv-"))
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint=str(rdzv_dir / "store"),
        rdzv_configs={"store_type": "file"},
        max_restarts=cfg.parallel.max_restarts,
        monitor_interval=0.2,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(rdzv_dir / "logs")),  # removed with rdzv_dir
        **_leave_stop_signals_to_us(LaunchConfig),
    )
    log.info("starting %d workers (store on 127.0.0.1:%d), run directory %s", nproc, port, run_dir)
    try:
        with signals.forward_to_workers() as stop:
            try:
                results = elastic_launch(config, entrypoint or worker)(cfg, str(run_dir), port)
            except ChildFailedError as exc:
                if _killed_by(exc, stop.signal):  # during start-up, before the workers handle signals
                    return {signals.STOPPED_BY: stop.signal.name, signals.STOPPED_AT_STEP: None}
                raise RuntimeError(_failure_summary(exc)) from None
    finally:
        os.environ.pop(signals.SELF_LAUNCHED_ENV, None)
        shutil.rmtree(rdzv_dir, ignore_errors=True)
        sock.close()
    return results[0]


def _leave_stop_signals_to_us(launch_config: type) -> dict[str, str]:
    """Keep elastic's agent off SIGTERM and SIGINT: signals.forward_to_workers handles them.

    The agent would raise SignalException, stop collecting the workers' results and SIGKILL them
    30 s later. Torch releases before ``LaunchConfig.signals_to_handle`` always take them over.
    """
    if "signals_to_handle" not in getattr(launch_config, "__dataclass_fields__", {}):
        return {}
    return {"signals_to_handle": "SIGHUP,SIGQUIT"}


def _killed_by(exc: Any, signum: int | None) -> bool:
    """Whether every failed worker died of the signal the launcher forwarded."""
    return signum is not None and all(f.exitcode == -signum for f in exc.failures.values())


def _failure_summary(exc: Any) -> str:
    lines = ["training failed:"]
    for rank, failure in sorted(exc.failures.items()):
        message = failure.message if isinstance(failure.message, str) else failure.message.get("message", "")
        last_line = (str(message).strip().splitlines() or [""])[-1]
        lines.append(f"  rank {rank} (exit code {failure.exitcode}): {last_line}")
    lines.append("  The traceback of each failed rank is printed above.")
    return "\n".join(lines)


@record  # failures reach the launcher with their message, not just an exit code
def worker(cfg: RunConfig, run_dir: str | None, store_port: int | None) -> dict[str, Any]:
    """The body of every rank: join the group, agree on the run directory, train, leave.

    Args:
        cfg: validated run config.
        run_dir: the run directory (self-launch), or None under torchrun, where rank 0's
            Hydra folder is broadcast to the others.
        store_port: the launcher's store port (self-launch) or None (torchrun).
    """
    from ddptrain import parallel
    from ddptrain.metrics import setup_logging
    from ddptrain.trainer import Trainer

    env = parallel.init_distributed(cfg.parallel, cfg.trainer.device, store_port)
    try:
        agreed = Path(parallel.broadcast_object(run_dir))
        setup_logging(env.rank, agreed if env.is_rank_zero else None)
        if env.is_rank_zero:
            (agreed / "config.yaml").write_text(to_yaml(cfg))
        log.info("rank %d of %d on %s (%s)", env.rank, env.world_size, env.device, env.backend)
        result = Trainer(cfg, env, agreed).fit()
        if env.is_rank_zero and signals.STOPPED_BY not in result:
            print(f"ddptrain: done. Results in {agreed}", file=sys.stderr)
        return result
    finally:
        parallel.teardown()
        # The process exits next: skip the garbage collections of interpreter shutdown, seconds
        # with torch and transformers loaded (measured 2.9 s -> 0.4 s), which delay a stop by signal.
        gc.freeze()
