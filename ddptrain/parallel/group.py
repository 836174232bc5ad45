"""The process group: how this rank joins it (rendezvous store, device, backend), the facts it learns (``DistEnv``),
and how it leaves (``teardown``, ``exit_soon``)."""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import logging
import os
import socket
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddptrain.config import Backend, Device, ParallelConfig
from ddptrain.parallel.collectives import bind as bind_collectives
from ddptrain.process.started import Start

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistEnv:
    """Facts about this process's place in the job, fixed once the group forms."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0

    @property
    def is_local_rank_zero(self) -> bool:
        return self.local_rank == 0


def init_distributed(
    cfg: ParallelConfig, device: Device, store_port: int | None = None, start: Start | None = None
) -> DistEnv:
    """Join (or, alone, create) the process group and pin this process to its device.

    Args:
        cfg: the ``parallel`` config group.
        device: ``trainer.device``.
        store_port: port of the launcher's TCPStore on 127.0.0.1 (self-launch); None under
            torchrun, where the group forms from torchrun's MASTER_ADDR/MASTER_PORT.
        start: this process's rank, world size and restart count as its launcher set them;
            None reads them from the environment (``Start.from_environ``).

    Returns:
        The DistEnv of this process.

    Raises:
        RuntimeError: CUDA asked for but missing, nccl asked for without CUDA, or two ranks on one GPU (but for
            ``parallel.backend=gloo``, which may share one: ``cuda_index``).
    """
    start = start or Start.from_environ()
    torch_device = _pick_device(device, start.local_rank, share=cfg.backend == Backend.gloo)
    backend = _pick_backend(cfg.backend, torch_device)
    timeout = timedelta(seconds=cfg.timeout_s)
    if start.world_size == 1 and store_port is None:
        store: dist.Store = dist.HashStore()
    else:
        store = _rendezvous_store(start.rank, store_port, timeout, start.restart_count)
    group_timeout = timedelta(seconds=cfg.timeout_s + timeout_grace_s(backend, cfg.timeout_s))
    dist.init_process_group(backend, store=store, rank=start.rank, world_size=start.world_size, timeout=group_timeout)
    bind_collectives(store, torch_device if backend == "nccl" else torch.device("cpu"), cfg.timeout_s)
    env = DistEnv(start.rank, start.local_rank, start.world_size, start.local_world_size, torch_device, backend)
    check_one_rank_per_gpu(env, store)
    return env


def timeout_grace_s(backend: str, timeout_s: float) -> float:
    """How much longer than ``parallel.timeout_s`` the process group itself waits.

    On NCCL the host runs ahead of the GPU and learns of a hung collective only where it waits for the device
    (``LateRead``). NCCL's own watchdog ends the process (SIGABRT) once a collective passes the group's timeout,
    before Python can write the failure record or the hang report; ddptrain's wait gives up at ``timeout_s``
    counted from when the step was queued, so the group gets a grace on top that covers the time the host takes to
    queue one step. gloo raises in the waiting thread itself: no grace.
    """
    return max(NCCL_GRACE_MIN_S, NCCL_GRACE_SHARE * timeout_s) if backend == "nccl" else 0.0


NCCL_GRACE_MIN_S = 30.0
NCCL_GRACE_SHARE = 0.1


# Keys of torchrun's agent store that ddptrain keeps for a job across its restarts (see torchrun_round).
_ARRIVALS_KEY, _RUN_DIR_KEY = "ddptrain/arrivals", "ddptrain/run_dir"


def torchrun_round(rank: int, world_size: int, run_dir: Path, timeout: timedelta) -> tuple[int, Path] | None:
    """Under torchrun: which round of the job this is, and the first round's run folder.

    A job restarts (``--max-restarts``) as a new rendezvous round, and every round forms its process group over the
    same agent store, so the group's keys need a per-round prefix. torchrun's restart count cannot give it on
    several nodes: an agent whose own workers were healthy restarts them for the new round without counting a
    restart, so its workers would look for last round's keys while the failed node's look for this round's (the
    group never forms). Instead every worker counts itself in on the agent store as it starts, and the round is its
    arrival number divided by the world size: the same on every rank of a round. Rank 0 of round 0 leaves its run
    folder in the same store, where a later round's rank 0 (on whichever node) finds it.

    Args:
        rank: this worker's global rank.
        world_size: all workers of the job, every node.
        run_dir: this process's run folder (rank 0's Hydra folder).
        timeout: for the store.

    Returns:
        (round, the run folder rank 0 uses: round 0's); None when torchrun's agents keep no store for the job
        (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: every round gets a new store).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timeout,
        wait_for_workers=False,
    )
    round_ = (store.add(_ARRIVALS_KEY, 1) - 1) // world_size
    _check_round(store, round_, rank, world_size, timeout)
    if rank != 0:
        return round_, run_dir
    if round_ == 0:
        store.set(_RUN_DIR_KEY, str(run_dir))
        return round_, run_dir
    if not store.check([_RUN_DIR_KEY]):
        raise RuntimeError(
            f"round {round_} of this torchrun job found no run folder from its first round in torchrun's store: "
            "start the job again with trainer.resume=<run folder> to continue from its last checkpoint."
        )
    return round_, Path(store.get(_RUN_DIR_KEY).decode())


def _check_round(store: dist.Store, round_: int, rank: int, world_size: int, timeout: timedelta) -> None:
    """Every rank of the round counted itself in: the arrival count only holds while each round's workers all start
    (one that died before it counted itself in leaves the next rounds out of step) and the world size stays fixed.

    Raises:
        RuntimeError: not every rank arrived in this round within ``parallel.timeout_s``, naming why.
    """
    store.set(f"ddptrain/round{round_}/rank{rank}", "1")
    try:
        store.wait([f"ddptrain/round{round_}/rank{r}" for r in range(world_size)], timeout)
    except (RuntimeError, dist.DistStoreError):
        raise RuntimeError(
            f"rank {rank} is in round {round_} of this torchrun job, but not every rank of that round arrived within "
            "parallel.timeout_s: a worker died before it joined a round, or the number of processes changed "
            "(ddptrain needs the same --nnodes and --nproc_per_node on every restart). Start the job again "
            "(trainer.resume=<run folder> continues from its last checkpoint)."
        ) from None


def _rendezvous_store(rank: int, store_port: int | None, timeout: timedelta, attempt: int) -> dist.Store:
    """The store the group forms over, namespaced by restart attempt.

    Self-launch: the launcher's store on 127.0.0.1. torchrun: MASTER_ADDR:MASTER_PORT, which the
    elastic agent hosts and keeps across ``--max-restarts``; without the per-attempt prefix a
    restarted group reads the dead group's addresses and gloo fails with "Connection refused".
    ``attempt`` is the restart count (self-launch) or the job's round (torchrun: ``torchrun_round``).
    """
    if store_port is not None:
        store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timeout)
    else:
        agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=rank == 0 and not agent_hosts_it,
            timeout=timeout,
            wait_for_workers=False,
        )
    return dist.PrefixStore(f"attempt{attempt}", store)


def _pick_device(device: Device, local_rank: int, share: bool = False) -> torch.device:
    want_cuda = device == Device.cuda or (device == Device.auto and torch.cuda.is_available())
    if not want_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but this torch build sees no CUDA device: use trainer.device=cpu.")
    index = cuda_index(local_rank, torch.cuda.device_count(), share=share)
    # Before anything touches CUDA, or every rank allocates a context on GPU 0.
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


SHARE_A_GPU = (
    "To share GPUs between ranks for a test or debugging (not for speed: gloo all-reduces CUDA tensors through the "
    "host), set parallel.backend=gloo."
)


def cuda_index(local_rank: int, visible: int, share: bool = False) -> int:
    """The CUDA device this rank uses, of the ``visible`` ones it sees.

    A scheduler that binds one GPU to each task (Slurm's ``--gpus-per-task``, ``CUDA_VISIBLE_DEVICES`` set per
    rank) shows each rank a single device, ``cuda:0``, whatever its local rank; otherwise every rank of the node
    sees all of them and takes the one at its local rank. Two ranks that end up on one GPU are refused once the
    group forms (``check_one_rank_per_gpu``), unless the group is gloo's.

    Args:
        local_rank: this rank's place on its node.
        visible: the CUDA devices this process sees.
        share: ranks may share a GPU (``parallel.backend=gloo``: gloo all-reduces CUDA tensors through the host,
            NCCL refuses two ranks on one device). With more local ranks than GPUs, rank r takes GPU r % visible:
            ``make gpu-check`` runs 2 ranks on one GPU this way.

    Raises:
        RuntimeError: several GPUs visible, but fewer than the local ranks, and ``share`` not set.
    """
    if visible == 1 or local_rank < visible:
        return 0 if visible == 1 else local_rank
    if share:
        return local_rank % visible
    raise RuntimeError(
        f"local rank {local_rank} has no GPU: only {visible} visible. "
        f"Lower parallel.nproc_per_node (or torchrun --nproc_per_node) to the number of GPUs. {SHARE_A_GPU}"
    )


def check_one_rank_per_gpu(env: DistEnv, store: dist.Store) -> None:
    """No two ranks drive one GPU (a scheduler that shows several ranks the same single GPU would put them there).
    Exchanged over the group's store, not NCCL, whose first collective would fail first with its own "Duplicate GPU
    detected". A gloo group may share a GPU (tests, debugging): rank 0 warns instead. Every rank calls it.

    Raises:
        RuntimeError: on NCCL (or any backend but gloo), naming the ranks that share a GPU and the fix.
    """
    if env.device.type != "cuda" or env.world_size == 1:
        return
    mine = f"{socket.gethostname()} {torch.cuda.get_device_properties(env.device).uuid}"
    store.set(f"ddptrain/device/rank{env.rank}", mine)
    devices = [store.get(f"ddptrain/device/rank{rank}").decode() for rank in range(env.world_size)]  # waits for all
    shared = ranks_sharing_a_device(devices)
    if shared and env.backend == "gloo":
        if env.is_rank_zero:
            log.warning(
                "ranks %s share one GPU (%s) over gloo: right for tests and debugging, not for speed (each rank's "
                "all-reduce goes through the host and the ranks take turns on the device).",
                ", ".join(map(str, shared[0])),
                devices[shared[0][0]],
            )
        return
    if shared:
        raise RuntimeError(
            f"ranks {', '.join(map(str, shared[0]))} all run on one GPU ({devices[shared[0][0]]}): each rank needs its "
            "own. Give every task its own GPU (Slurm --gpus-per-task=1, or CUDA_VISIBLE_DEVICES per rank), or show "
            f"every rank all GPUs of the node, or start fewer processes per node. {SHARE_A_GPU}"
        )


def ranks_sharing_a_device(devices: list[str]) -> list[list[int]]:
    """Groups of ranks (by index into ``devices``: each rank's host and device id) that share a device."""
    by_device: dict[str, list[int]] = {}
    for rank, device in enumerate(devices):
        by_device.setdefault(device, []).append(rank)
    return [ranks for ranks in by_device.values() if len(ranks) > 1]


def _pick_backend(backend: Backend, device: torch.device) -> str:
    if backend == Backend.auto:
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == Backend.nccl and device.type != "cuda":
        raise RuntimeError("parallel.backend=nccl needs CUDA devices: use parallel.backend=gloo (or auto) on CPU.")
    return backend.value


# How long a failed rank may take to leave the group, and then to exit (see ``exit_soon``); normally under a second.
FAILED_EXIT_GRACE_S = 30.0


def teardown() -> None:
    """Leave the process group (safe to call twice).

    On a normal exit the ranks first meet at a barrier, so that they destroy the group together:
    one that tears its connections down while another still works can leave that one hanging
    inside ``destroy_process_group`` (seen once in CI on gloo). Called while an exception
    propagates (from a ``finally``), there is no barrier: the other ranks may be gone, and leaving the
    group may not hang either (``exit_soon`` watches it). The group object itself stays alive until
    ``release_left_groups`` (see ``_left_groups``).
    """
    if not dist.is_initialized():
        return
    several = dist.get_world_size() > 1
    if sys.exc_info()[0] is None and several:
        dist.barrier()
    elif several:
        exit_soon()
    if several:
        _left_groups.append(dist.group.WORLD)
        _drop_reducers()
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


# The process groups ``teardown`` left, kept until ``release_left_groups``. DDP's Reducer holds its group from C++,
# and dropped there (the model freed with the GIL held) a gloo group joins its worker threads still holding the GIL,
# while one of them may be waiting for it to free the tensors of a finished collective: the process hangs. Seen in
# the tests (a finished run whose rank 1 never exited, 2 of 54 tries of one test). Dropped from Python, a group is
# destroyed with the GIL released, so the last reference must be this list's: ``teardown`` frees the Reducers while
# the list holds the group, whenever the model itself goes (a traceback, a cache or a cycle may keep it).
_left_groups: list[dist.ProcessGroup] = []
wrapped: weakref.WeakSet[DDP] = weakref.WeakSet()


def _drop_reducers() -> None:
    """Free the C++ objects through which each DDP model made here holds its group: its Reducer, and the Logger
    that holds the Reducer (DDP's own attribute names). The model is of no use once the group is left."""
    for ddp in list(wrapped):
        ddp.__dict__.pop("logger", None)
        ddp.__dict__.pop("reducer", None)


def release_left_groups() -> None:
    """Destroy the process groups ``teardown`` left: call it once the model that used them is gone (``launch.worker``
    does, after the run; ``atexit`` does for any other way out). Safe to call twice."""
    _left_groups.clear()


atexit.register(release_left_groups)


def exit_soon() -> None:
    """For a rank that failed, on its way out: should it still be here after FAILED_EXIT_GRACE_S,
    ``faulthandler`` prints every thread's stack and ends the process with exit code 1, so
    its launcher sees the failure. A 2-rank CI run whose ranks both failed at once hung 300 s somewhere past the
    error; a non-daemon thread that never ends keeps a process alive the same way. ``teardown`` arms it while it
    leaves the group; ``launch.worker`` once the rank's run has closed. A later call replaces an earlier one."""
    faulthandler.dump_traceback_later(FAILED_EXIT_GRACE_S, exit=True)


@contextlib.contextmanager
def local_rank_zero_first(env: DistEnv, timeout_s: int, what: str) -> Iterator[None]:
    """Run the block on local rank 0 first, then on the other ranks (which then hit its cache).

    The waiting ranks block on a barrier of a separate gloo group whose timeout is
    ``timeout_s`` (data.prepare_timeout_s), not the short collective timeout, so slow
    preprocessing never trips ``parallel.timeout_s``.
    """
    if env.world_size == 1:
        yield
        return
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    if not env.is_local_rank_zero:
        log.info("waiting for local rank 0 to finish %s (up to %d s)", what, timeout_s)
        dist.barrier(group=group)
    yield
    if env.is_local_rank_zero:
        dist.barrier(group=group)
    dist.destroy_process_group(group)
