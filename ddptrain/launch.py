"""How this process was started and what it does about it: train here, or self-launch the workers.

``python -m ddptrain`` passes its command line through ``hydra_argv`` before Hydra composes the
config, then hands the validated config to ``run``, which dispatches on how the process was
started (``process.started.Start``):

- torchrun: this process is one rank. ``run`` checks that torchrun started
  ``parallel.nproc_per_node`` processes, finds the run folder (rank 0's Hydra folder, or after a
  ``--max-restarts`` restart the first attempt's, from the restart marker) and runs ``worker``.
- one process (``parallel.nproc_per_node`` 1 or null): ``worker`` runs here.
- otherwise ``launch``: it binds a TCPStore to a free port on 127.0.0.1 (race-free: the socket
  stays bound from the moment the port is chosen), runs the elastic rendezvous over a file store
  (so nothing else listens), and starts ``nproc_per_node`` copies of ``worker``.

Stopping by signal (``ddptrain/process/signals.py``): the launcher passes SIGTERM and Ctrl-C on to its
workers and keeps collecting their results; each worker saves a checkpoint and returns, and
``run`` prints where the checkpoint is and exits with the code for it.

Nothing here imports torch at module level: a bad config fails before torch loads.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddptrain.config import (
    ConfigError,
    RunConfig,
    StartMethod,
    resolve_global_batch_size,
    to_run_config,
    to_yaml,
)
from ddptrain.process import forkserver, hangs, signals
from ddptrain.process.cpus import compact_ranges, visible_cpus
from ddptrain.process.self_launch import (
    ELASTIC_SIGNALS_ENV,
    bind_store_socket,
    killed_by,
    launch_config,
    scoped_environ,
    worker_environment,
)
from ddptrain.process.started import Start

if TYPE_CHECKING:
    from ddptrain.observe.console import Console, NullConsole
    from ddptrain.observe.run_files import NullRunFiles, RunFiles
    from ddptrain.parallel import DistEnv

log = logging.getLogger(__name__)


def hydra_argv(argv: list[str], start: Start | None = None) -> list[str]:
    """The command line Hydra should read: no sweep under torchrun, one process makes the run folder.

    Under torchrun every rank composes the config; the ranks that ``Start.makes_run_folder`` rules
    out run Hydra with ``hydra.output_subdir=null hydra.run.dir=.``, so they create no folder.

    Args:
        argv: ``sys.argv``.
        start: how this process was started; None reads it from the environment.

    Raises:
        SystemExit: ``-m``/``--multirun`` under torchrun, naming the command to run instead.
    """
    start = start or Start.from_environ()
    if start.elastic and any(a in ("-m", "--multirun") for a in argv[1:]):
        sys.exit(
            "ddptrain: sweeps (-m) start a fresh process group per job, which torchrun cannot do: "
            "run `ddptrain train -m ...` (it launches each job's workers itself)."
        )
    if start.makes_run_folder:
        return argv
    return [*argv, "hydra.output_subdir=null", "hydra.run.dir=."]


def hydra_job(dict_cfg: Any) -> float | None:
    """The function Hydra runs for ``python -m ddptrain``: one run, or one job of a multirun.

    A module-level function (not ``__main__``'s), so a parallel sweep can hand it to the process that runs a job.
    In a multirun each job goes through ``sweep.jobs.run_sweep_job``: a job finished by an earlier run of the same
    sweep is skipped, a failed one (an invalid config included) lets the sweep go on, and ``job.json`` records it.

    Returns:
        The run's ``objective``: the final eval loss, else the final training loss (what Hydra's sweepers
        optimise); None when there is none.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return run(_validated(dict_cfg), run_dir)
    from ddptrain.sweep.jobs import run_sweep_job

    overrides = list(hydra_cfg.overrides.task)
    requeue = signals.scheduler_handler()  # submitit's, in a submitit job: see signals.preemption_deferred
    with signals.preemption_deferred(requeue):
        try:
            return run_sweep_job(lambda: run(_validated(dict_cfg), run_dir), run_dir, overrides, int(hydra_cfg.job.num))
        except SystemExit as stop:
            signals.hand_on_preemption(requeue, stop.code)  # stopped by Slurm's time-limit warning, saved: requeue
            raise


def _validated(dict_cfg: Any) -> RunConfig:
    try:
        return to_run_config(dict_cfg)
    except ConfigError as err:
        sys.exit(f"ddptrain: invalid configuration:\n{err}")


def run(cfg: RunConfig, hydra_dir: Path) -> float | None:
    """Train as this process was started (see the module docstring), then exit as the run ended.

    Exit codes of ``python -m ddptrain``: 0 finished; 75 stopped by SIGTERM, SIGUSR2 or Ctrl-C after saving a
    checkpoint (``signals.STOPPED_EXIT_CODE``: the same command with ``trainer.resume=<run dir>``
    continues); 65 diverged (a step's loss or gradient norm was not finite: trainer.on_nonfinite); 130 aborted by a
    second Ctrl-C; 1 failed. Under torchrun a rank stopped by a
    signal exits 0: a non-zero exit would make ``torchrun --max-restarts`` restart the group. So do the
    ranks other than 0 of a scheduler's job whose tasks are its ranks (rank 0 exits 75).

    Args:
        cfg: validated run config.
        hydra_dir: the folder Hydra made for this run (the working directory on torchrun's ranks
            that make none, see ``hydra_argv``).

    Returns:
        The run's ``objective`` (for Hydra's sweepers), None when the worker returned nothing.

    Raises:
        SystemExit: parallel.nproc_per_node disagrees with torchrun's count, the self-launched
            workers failed or were aborted, or the run stopped on a signal (codes above).
    """
    start = Start.from_environ()
    if start.elastic:  # before torch loads: a wrong process count fails at once
        _check_torchrun_size(cfg.parallel.nproc_per_node, start)
    if start.scheduler:
        _meet_at(start)
    signals.start_resource_tracker_deaf_to_preemption()
    cfg = _with_global_batch_size(cfg, start.world_size if start.elastic else cfg.parallel.nproc_per_node or 1)
    from ddptrain.observe.console import FORMAT, build_console
    from ddptrain.observe.nonfinite import refuse_to_replay_a_divergence
    from ddptrain.observe.run_files import build_run_files

    # This process's log until the worker sets up its own (the launcher's lines, start-up warnings).
    logging.basicConfig(level=logging.INFO, format=FORMAT)
    console = build_console(start.is_rank_zero)
    if cfg.optim.global_batch_size is not None:
        console.say(
            f"ddptrain: optim.global_batch_size={cfg.optim.global_batch_size} gives "
            f"optim.grad_accum_steps={cfg.optim.grad_accum_steps}"
        )
    run_dir = hydra_dir
    if start.scheduler:  # every task of the job runs in the one folder the sweep gave the job
        result = worker(cfg, str(run_dir), None, start)
    elif start.elastic:
        start, run_dir = _torchrun_round(cfg, hydra_dir, start, build_run_files(start.is_rank_zero))
        refuse_to_replay_a_divergence(start.restart_count, run_dir, console)  # torchrun restarts on exit 65
        result = worker(cfg, str(run_dir), None, start)
    elif (cfg.parallel.nproc_per_node or 1) == 1:
        result = worker(cfg, str(run_dir), None, start)
    else:
        result = _self_launch(cfg, run_dir, console)
    _exit_if_stopped_or_diverged(result, run_dir, start, console)
    return objective(result)


def objective(result: dict[str, Any] | None) -> float | None:
    """What a run returns to Hydra (a sweeper such as Optuna minimises it): the best value of trainer.best_metric
    (eval_loss by default; set the sweeper's direction for eval_accuracy) when the run evaluates (an eval split),
    else the last logged training loss."""
    if not result:
        return None
    return result.get("best_value", result.get("eval_loss", result.get("loss")))


def _with_global_batch_size(cfg: RunConfig, world_size: int) -> RunConfig:
    """optim.grad_accum_steps from optim.global_batch_size, once the number of processes is known."""
    try:
        return resolve_global_batch_size(cfg, world_size)
    except ConfigError as err:
        sys.exit(f"ddptrain: invalid configuration:\n{err}")


def _check_torchrun_size(nproc_per_node: int | None, start: Start) -> None:
    started = start.local_world_size
    if nproc_per_node is None or nproc_per_node == started:
        return
    if start.scheduler:
        sys.exit(
            f"ddptrain: parallel.nproc_per_node={nproc_per_node} but this {start.scheduler} job runs {started} tasks "
            "per node, each one rank: keep hydra.launcher.tasks_per_node=${parallel.nproc_per_node} (as "
            "hydra/launcher=slurm_multinode does), or pick the parallel= option with that many processes."
        )
    sys.exit(
        f"ddptrain: parallel.nproc_per_node={nproc_per_node} but torchrun started {started} processes per node: "
        f"launch with --nproc_per_node {nproc_per_node}, or pick the matching parallel= option "
        "(parallel=auto adopts torchrun's count)."
    )


def _torchrun_round(
    cfg: RunConfig, hydra_dir: Path, start: Start, files: RunFiles | NullRunFiles
) -> tuple[Start, Path]:
    """This rank's start with the job's round as its attempt, and the run folder, both kept across
    ``--max-restarts`` restarts on every node (``parallel.torchrun_round``; ``_torchrun_run_dir`` where
    torchrun's agents keep no store for the job)."""
    from ddptrain import parallel

    timeout = timedelta(seconds=cfg.parallel.timeout_s)
    found = parallel.torchrun_round(start.rank, start.world_size, hydra_dir, timeout)
    if found is None:
        _refuse_restarts_across_nodes_without_a_shared_store(start, os.environ)
        return start, _torchrun_run_dir(hydra_dir, Path(cfg.trainer.output_dir), start, files)
    round_, run_dir = found
    if run_dir != hydra_dir and start.makes_run_folder:
        _remove_unused_hydra_folder(hydra_dir)
    return replace(start, restart_count=round_), run_dir


def _refuse_restarts_across_nodes_without_a_shared_store(start: Start, environ: Mapping[str, str]) -> None:
    """With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 the agents keep no store across restarts, and the only count of
    restarts a worker gets is its own node's (an agent whose workers were healthy restarts them without counting):
    after a restart the nodes' ranks would look for each other under different attempts and for different run
    folders, and time out. On one node all ranks share their agent's count, so that still works.

    Raises:
        SystemExit: several nodes, restarts allowed, and no shared store; naming both fixes.
    """
    several_nodes = start.world_size > start.local_world_size
    if several_nodes and int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        sys.exit(
            "ddptrain: torchrun --max-restarts across several nodes needs the agents' shared store "
            "(TORCHELASTIC_USE_AGENT_STORE=True, the default of the c10d and static rendezvous), which this job lacks "
            "(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, or a rendezvous backend that keeps none): unset it, or run with "
            "--max-restarts 0 and restart the job yourself with trainer.resume=<run folder>."
        )


def _meet_at(start: Start) -> None:
    """Where the tasks of a scheduler's job form their group (``Start.master_addr``, ``master_port``): rank 0 hosts
    the store. On one machine (``submitit_local``) the tasks share its cores: one thread each unless told otherwise.

    Raises:
        SystemExit: no address to meet at (a Slurm job without SLURM_JOB_NODELIST), naming the fix.
    """
    if not start.master_addr:
        sys.exit(
            "ddptrain: this Slurm job's tasks have no node to meet on (SLURM_JOB_NODELIST is empty): export "
            "MASTER_ADDR=<the first node> in hydra.launcher.setup."
        )
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = start.master_addr, str(start.master_port)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as for self-launched workers: loader workers fork
    if start.scheduler == "local":
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(visible_cpus()) // start.local_world_size)))
    if start.is_rank_zero:
        print(
            f"ddptrain: {start.world_size} tasks of {start.scheduler} job {start.run_id} meet at "
            f"{start.master_addr}:{start.master_port} (rank 0 hosts the store; MASTER_ADDR / MASTER_PORT choose them)",
            file=sys.stderr,
        )


def _remove_unused_hydra_folder(hydra_dir: Path) -> None:
    """Rank 0 on a node whose own workers were healthy: its agent restarted them for a new round without counting a
    restart, so Hydra made a new folder (holding only ``.hydra/``) while the run goes on in round 0's. Never the
    working directory, never a folder with anything else in it."""
    if hydra_dir.resolve() == Path.cwd().resolve() or not hydra_dir.is_dir():
        return
    if set(os.listdir(hydra_dir)) <= {".hydra"}:
        shutil.rmtree(hydra_dir / ".hydra", ignore_errors=True)
        with contextlib.suppress(OSError):
            hydra_dir.rmdir()
        log.info("removed %s: this restart continues in the first round's run folder", hydra_dir)


def _torchrun_run_dir(hydra_dir: Path, output_dir: Path, start: Start, files: RunFiles | NullRunFiles) -> Path:
    """The run directory under torchrun, kept across ``--max-restarts`` restarts.

    A restarted group must find its own checkpoints (trainer.resume=auto), but Hydra would
    pick a new timestamped folder. Where torchrun's agents keep a store for the job (the default), the
    first round's rank 0 leaves its folder there (``parallel.torchrun_round``). Otherwise
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) rank 0 of the first attempt leaves its folder's name in
    ``<trainer.output_dir>/.torchrun/<rendezvous id>`` for the restarts to read: give every such job
    its own ``--rdzv-id``.
    """
    marker = output_dir / ".torchrun" / start.run_id
    if start.restart_count > 0 and marker.is_file():
        return Path(marker.read_text().strip())
    files.write_file(marker, f"{hydra_dir}\n")  # rank 0 writes it
    return hydra_dir


def _self_launch(cfg: RunConfig, run_dir: Path, console: Console | NullConsole) -> dict[str, Any] | None:
    """``launch`` with its failures turned into one line and an exit code."""
    try:
        return launch(cfg, run_dir)
    except RuntimeError as err:
        sys.exit(f"ddptrain: {err}")
    except signals.Aborted:
        console.say(signals.stopped_line("aborted by a second Ctrl-C", run_dir, None))
        sys.exit(signals.ABORTED_EXIT_CODE)


def _exit_if_stopped_or_diverged(
    result: dict[str, Any] | None, run_dir: Path, start: Start, console: Console | NullConsole
) -> None:
    """After SIGTERM or Ctrl-C: one line saying where the checkpoint is, and the exit code for it. After a divergence
    (trainer.on_nonfinite): the step and what to change, and exit 65 on every rank, under torchrun too."""
    from ddptrain.observe.nonfinite import DIVERGED, divergence_message

    if result and DIVERGED in result:
        console.say(f"ddptrain: {divergence_message(result[DIVERGED])}")
        sys.exit(signals.DIVERGED_EXIT_CODE)
    if not result or signals.STOPPED_BY not in result:
        return
    how = f"stopped by {result[signals.STOPPED_BY]}"
    console.say(signals.stopped_line(how, run_dir, result[signals.STOPPED_AT_STEP]))
    # Under torchrun a rank returns and exits 0 (see ``run``); so do the ranks other than 0 of a scheduler's job:
    # rank 0 records the stop and hands the signal on, and an srun with --kill-on-bad-exit must not end it first.
    if not start.elastic or (start.scheduler and start.is_rank_zero):
        sys.exit(signals.STOPPED_EXIT_CODE)


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
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    nproc = cfg.parallel.nproc_per_node or 1
    sock = bind_store_socket(int(os.environ.get("MASTER_PORT", 0)))
    port = sock.getsockname()[1]
    # The store owns the listening socket from here on and closes it when it goes: the socket object lets go of
    # it (closed by both, the number could already belong to another file when the store closes it again).
    store = dist.TCPStore(  # the workers' rendezvous point, until the launch ends
        "127.0.0.1",
        port,
        is_master=True,
        master_listen_fd=sock.detach(),
        wait_for_workers=False,
        timeout=timedelta(seconds=cfg.parallel.timeout_s),
    )
    # For the workers only, restored when the launch ends. elastic_launch itself leaves its signals in
    # ELASTIC_SIGNALS_ENV (a later torchrun would then leave SIGTERM and SIGINT alone): restored too.
    added = {**worker_environment(nproc), signals.SELF_LAUNCHED_ENV: "1"}  # the last: Ctrl-C is this launcher's
    with scoped_environ(added, also_restore=(ELASTIC_SIGNALS_ENV,)):
        rdzv_dir = Path(tempfile.mkdtemp(prefix="ddptrain-rdzv-"))
        config = launch_config(cfg.parallel, nproc, rdzv_dir)
        target, args = entrypoint or worker, (cfg, str(run_dir), port)
        log.info("starting %d workers (store on 127.0.0.1:%d), run directory %s", nproc, port, run_dir)
        try:
            if cfg.parallel.start_method == StartMethod.forkserver:
                forkserver.start()
                target, args = forkserver.run_forked, (forkserver.LauncherState(), target, *args)
            with signals.forward_to_workers() as stop:
                try:
                    results = elastic_launch(config, target)(*args)
                except ChildFailedError as exc:
                    if killed_by(exc, stop.signal):  # during start-up, before the workers handle signals
                        return {signals.STOPPED_BY: stop.signal.name, signals.STOPPED_AT_STEP: None}
                    raise RuntimeError(hangs.failure_summary(exc.failures, run_dir / hangs.HANG_DIR, nproc)) from None
        finally:
            shutil.rmtree(rdzv_dir, ignore_errors=True)
            del store  # the port is free now, also when a failure's traceback keeps this frame alive
    return results[0]


def worker(cfg: RunConfig, run_dir: str, store_port: int | None, start: Start | None = None) -> dict[str, Any] | None:
    """The body of every rank: join the group, agree on the run directory, train, leave.

    Runs under elastic's ``record``: a failure reaches the launcher with its message, not just
    an exit code.

    Args:
        cfg: validated run config.
        run_dir: this process's run directory: the launcher's, the single process's Hydra folder,
            or under torchrun each rank's own (see ``run``). Rank 0's is broadcast: every rank
            uses that one.
        store_port: the launcher's store port (self-launch), or None (torchrun, one process).
        start: how this process was started; None (``launch``'s workers) reads it from the environment.

    Returns:
        ``Trainer.fit``'s result (with ``signals.STOPPED_BY`` after a stop by signal), or None
        when the body exited with ``sys.exit(0)``.
    """
    from torch.distributed.elastic.multiprocessing.errors import record

    from ddptrain import parallel

    result = record(_train_on_this_rank)(cfg, run_dir, store_port, start)
    parallel.release_left_groups()  # the trainer, and the DDP model that held the group, went with the call's frame
    return result


def _train_on_this_rank(cfg: RunConfig, run_dir: str, store_port: int | None, start: Start | None) -> dict[str, Any]:
    import torch

    from ddptrain import parallel
    from ddptrain.model.precision import settle_precision
    from ddptrain.observe.console import build_console, done_line, setup_logging
    from ddptrain.observe.nonfinite import DIVERGED
    from ddptrain.observe.run_files import build_run_files
    from ddptrain.trainer import Trainer

    start = start or Start.from_environ()
    # Before the group forms: NCCL reads its flight recorder's switches when it makes the process group.
    os.environ.update(hangs.flight_recorder_environment(os.environ, torch.__version__))
    env = parallel.init_distributed(cfg.parallel, cfg.trainer.device, store_port, start)
    trainer, status = None, "failed"
    try:
        agreed = Path(parallel.broadcast_object(run_dir))
        hang_dir = agreed / hangs.HANG_DIR
        os.environ.update(hangs.flight_recorder_environment(os.environ, torch.__version__, hang_dir))  # read at a dump
        setup_logging(env.rank, agreed)
        cfg = replace(cfg, trainer=settle_precision(cfg.trainer, env.device))  # trainer.precision=auto: the choice
        console = build_console(env.is_rank_zero)
        build_run_files(env.is_rank_zero).write_file(agreed / "config.yaml", to_yaml(cfg))
        log.info(
            "rank %d of %d on %s (%s), %d thread(s) on cores %s",
            *(env.rank, env.world_size, env.device, env.backend, torch.get_num_threads(), _cores()),
        )
        hangs.board.enter("build_model")
        with _watching_for_hangs(cfg, env, hang_dir, start.restart_count):
            trainer = Trainer(cfg, env, agreed)
            result = trainer.fit()
        status = "stopped" if signals.STOPPED_BY in result else DIVERGED if DIVERGED in result else "finished"
        return result
    finally:
        parallel.teardown()
        if trainer is not None:  # after the group is gone: no rank waits while rank 0 writes the report
            trainer.close(status)
        if status == "finished":
            console.say(done_line(result, agreed))
        # A failed rank is a process on its way out, unless it is a scheduler's task (Hydra and submitit still
        # record the job): nothing may keep it from exiting.
        if status == "failed" and env.world_size > 1 and not start.scheduler:
            parallel.exit_soon()
        # The process exits next: skip the garbage collections of interpreter shutdown, seconds
        # with torch and transformers loaded (measured 2.9 s -> 0.4 s), which delay a stop by signal.
        gc.freeze()


def _cores() -> str:
    """The cores this process may run on, as ``0-3,8`` (a parallel sweep gives each job its own)."""
    return compact_ranges(visible_cpus())


def _watching_for_hangs(
    cfg: RunConfig, env: DistEnv, hang_dir: Path, attempt: int
) -> contextlib.AbstractContextManager[None]:
    """``hangs.watch`` with this run's timeouts: ``tokenize`` may last data.prepare_timeout_s, as long as the
    other ranks wait for local rank 0 to tokenize (``parallel.local_rank_zero_first``); ``save`` may last
    trainer.save_timeout_s, as long as they wait for rank 0 to write (``parallel.after_rank_zero``)."""
    limits = {"tokenize": cfg.data.prepare_timeout_s, "save": cfg.trainer.save_timeout_s}
    return hangs.watch(hang_dir, env.rank, env.world_size, cfg.parallel.timeout_s, attempt=attempt, limits=limits)
