"""Everything that touches ``torch.distributed``: process group, rank facts, DDP, collectives.

The trainer never imports ``torch.distributed``; it calls the names below. Every
rank calls every collective here; none of them may sit behind ``if rank == 0``.
A world of one process still gets a (local, in-memory) process group, so the same
collectives work in a single-process run and cost nothing there.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import inspect
import itertools
import logging
import os
import socket
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from ddptrain import hangs
from ddptrain.config import Backend, CommHook, Device, ParallelConfig
from ddptrain.started import Start

log = logging.getLogger(__name__)
T = TypeVar("T")
# Where collective tensors must live: NCCL reduces CUDA tensors only, gloo CPU ones.
_collective_device = torch.device("cpu")
# The store the group formed over (``after_rank_zero`` waits there, past parallel.timeout_s), and that timeout.
_store: dist.Store | None = None
_timeout_s = 600.0


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
        RuntimeError: CUDA asked for but missing, nccl asked for without CUDA, or two ranks on one GPU.
    """
    start = start or Start.from_environ()
    torch_device = _pick_device(device, start.local_rank)
    backend = _pick_backend(cfg.backend, torch_device)
    timeout = timedelta(seconds=cfg.timeout_s)
    if start.world_size == 1 and store_port is None:
        store: dist.Store = dist.HashStore()
    else:
        store = _rendezvous_store(start.rank, store_port, timeout, start.restart_count)
    group_timeout = timedelta(seconds=cfg.timeout_s + timeout_grace_s(backend, cfg.timeout_s))
    dist.init_process_group(backend, store=store, rank=start.rank, world_size=start.world_size, timeout=group_timeout)
    global _collective_device, _store, _timeout_s
    _collective_device = torch_device if backend == "nccl" else torch.device("cpu")
    _store, _timeout_s = store, float(cfg.timeout_s)
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


def _pick_device(device: Device, local_rank: int) -> torch.device:
    want_cuda = device == Device.cuda or (device == Device.auto and torch.cuda.is_available())
    if not want_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but this torch build sees no CUDA device: use trainer.device=cpu.")
    index = cuda_index(local_rank, torch.cuda.device_count())
    # Before anything touches CUDA, or every rank allocates a context on GPU 0.
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def cuda_index(local_rank: int, visible: int) -> int:
    """The CUDA device this rank uses, of the ``visible`` ones it sees.

    A scheduler that binds one GPU to each task (Slurm's ``--gpus-per-task``, ``CUDA_VISIBLE_DEVICES`` set per
    rank) shows each rank a single device, ``cuda:0``, whatever its local rank; otherwise every rank of the node
    sees all of them and takes the one at its local rank. Two ranks that end up on one GPU are refused once the
    group forms (``check_one_rank_per_gpu``).

    Raises:
        RuntimeError: several GPUs visible, but fewer than the local ranks.
    """
    if visible == 1 or local_rank < visible:
        return 0 if visible == 1 else local_rank
    raise RuntimeError(
        f"local rank {local_rank} has no GPU: only {visible} visible. "
        "Lower parallel.nproc_per_node (or torchrun --nproc_per_node) to the number of GPUs."
    )


def check_one_rank_per_gpu(env: DistEnv, store: dist.Store) -> None:
    """No two ranks drive one GPU (a scheduler that shows several ranks the same single GPU would put them there).
    Exchanged over the group's store, not NCCL, whose first collective would fail first with its own "Duplicate GPU
    detected". Every rank calls it.

    Raises:
        RuntimeError: naming the ranks that share a GPU and the fix.
    """
    if env.device.type != "cuda" or env.world_size == 1:
        return
    mine = f"{socket.gethostname()} {torch.cuda.get_device_properties(env.device).uuid}"
    store.set(f"ddptrain/device/rank{env.rank}", mine)
    devices = [store.get(f"ddptrain/device/rank{rank}").decode() for rank in range(env.world_size)]  # waits for all
    shared = ranks_sharing_a_device(devices)
    if shared:
        raise RuntimeError(
            f"ranks {', '.join(map(str, shared[0]))} all run on one GPU ({devices[shared[0][0]]}): each rank needs its "
            "own. Give every task its own GPU (Slurm --gpus-per-task=1, or CUDA_VISIBLE_DEVICES per rank), or show "
            "every rank all GPUs of the node, or start fewer processes per node."
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
_wrapped: weakref.WeakSet[DDP] = weakref.WeakSet()


def _drop_reducers() -> None:
    """Free the C++ objects through which each DDP model made here holds its group: its Reducer, and the Logger
    that holds the Reducer (DDP's own attribute names). The model is of no use once the group is left."""
    for ddp in list(_wrapped):
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


# ----------------------------------------------------------------------------- DDP


@dataclass
class CommCounter:
    """What DDP's communication hook actually sent (calls and bytes per rank), and when it ran.

    The times let ``timing.StepClock`` tell the communication that backward hid from the part it
    waited for: on the CPU, ``hook_intervals`` are the host times spent inside the hook (the autograd
    thread launches the all-reduce there and cannot compute meanwhile); on CUDA, ``last_launch`` is an
    event recorded on the compute stream when the last bucket is handed over, which is when the
    gradients are all computed and only communication is left.
    """

    calls: int = 0
    syncs: int = 0
    bytes: int = 0
    timed: bool = False
    """Set before ``wrap_model``: time the hook (trainer.timing)."""
    counting: bool = True
    """False when DDP's built-in all-reduce runs (no hook): nothing was counted."""
    hook_intervals: list[tuple[float, float]] = field(default_factory=list)
    last_launch: Any = None

    def take(self) -> tuple[int, int, int]:
        """(calls, syncs, bytes) since the last take."""
        counts = (self.calls, self.syncs, self.bytes)
        self.calls = self.syncs = self.bytes = 0
        return counts

    def take_times(self) -> tuple[list[tuple[float, float]], Any]:
        """The hook's host intervals and the last launch event since the last call (then forgotten)."""
        times = (self.hook_intervals, self.last_launch)
        self.hook_intervals, self.last_launch = [], None
        return times


def wrap_model(model: nn.Module, cfg: ParallelConfig, env: DistEnv, counter: CommCounter | None = None) -> nn.Module:
    """Wrap in DDP when there is more than one rank; a single process gets the model back.

    The communication hook (plain all-reduce unless parallel.comm_hook says otherwise) is
    registered here and counts into ``counter`` every bucket it handles and the bytes of
    every tensor it hands to the all-reduce. Skipped micro-steps (``grad_sync(enabled=False)``)
    run no hook at all.
    """
    if env.world_size == 1:
        return model
    # Every rank built or loaded the same weights (same seed, same files). DDP would broadcast all of
    # them from rank 0, the frozen base included (15 GB per rank for a 7B in bf16); a checksum
    # compared once proves the same for a few bytes of communication.
    check_replicas_agree(model)
    ddp = DDP(
        model,
        device_ids=[env.device.index] if env.device.type == "cuda" else None,
        bucket_cap_mb=cfg.bucket_cap_mb,
        find_unused_parameters=cfg.find_unused_parameters,
        static_graph=cfg.static_graph,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,
        **_buffer_sync(cfg.broadcast_buffers),
        **_NO_INIT_SYNC,
    )
    _wrapped.add(ddp)
    counter = counter or CommCounter()
    if cfg.comm_hook == CommHook.none and not counter.timed:
        # DDP's built-in all-reduce (in C++): no Python call per bucket when nothing is counted or timed.
        counter.counting = False
        return ddp
    state, hook = _comm_hook(cfg, env, counter)
    ddp.register_comm_hook(state, _timed_hook(hook, counter) if counter.timed else hook)
    return ddp


# DDP's start-up broadcast can be switched off from torch 2.6; older releases still broadcast.
_DDP_PARAMETERS = inspect.signature(DDP.__init__).parameters
_NO_INIT_SYNC = {"init_sync": False} if "init_sync" in _DDP_PARAMETERS else {}
# Not re-sending the buffers before each step's forward: ``forward_sync_buffers=False`` from the torch release
# that deprecated ``broadcast_buffers`` (which then warns on every run); ``broadcast_buffers=True`` keeps
# DDP's long-standing behaviour when asked for.
_NO_FORWARD_SYNC = "forward_sync_buffers" if "forward_sync_buffers" in _DDP_PARAMETERS else "broadcast_buffers"


def _buffer_sync(broadcast_buffers: bool) -> dict[str, bool]:
    return {"broadcast_buffers": True} if broadcast_buffers else {_NO_FORWARD_SYNC: False}


def _comm_hook(cfg: ParallelConfig, env: DistEnv, counter: CommCounter) -> tuple[Any, Any]:
    """(state, hook) for ``DDP.register_comm_hook``; the hook counts what it sends into ``counter``."""
    if cfg.comm_hook == CommHook.none:
        return None, _allreduce_hook(counter)
    if cfg.comm_hook == CommHook.fp16_compress:
        return None, _compress_hook(torch.float16, counter)
    if cfg.comm_hook == CommHook.bf16_compress:
        if env.backend != "nccl":
            raise RuntimeError(
                "parallel.comm_hook=bf16_compress needs the nccl backend (PyTorch's hook refuses gloo): "
                "use parallel.comm_hook=fp16_compress on CPU."
            )
        return None, _compress_hook(torch.bfloat16, counter)
    state = powerSGD_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=cfg.powersgd_rank, start_powerSGD_iter=2
    )
    return state, _powersgd_hook(counter)


# The hooks carry no annotations: DDP rejects a hook whose ``bucket`` annotation is not the
# GradBucket class itself, and ``from __future__ import annotations`` would turn it into a string.
# They mirror torch's default_hooks (allreduce_hook, fp16/bf16_compress_hook), counting on the way.


def _timed_hook(hook: Any, counter: CommCounter) -> Any:
    """``hook``, recording when it runs (see ``CommCounter``): two clock reads per bucket, no device sync."""

    def timed(state, bucket):
        if bucket.is_last() and bucket.buffer().is_cuda:
            counter.last_launch = torch.cuda.Event(enable_timing=True)
            counter.last_launch.record()
        entered = time.perf_counter()
        future = hook(state, bucket)
        counter.hook_intervals.append((entered, time.perf_counter()))
        return future

    return timed


def _count_bucket(counter: CommCounter, bucket: Any) -> None:
    counter.calls += 1
    counter.syncs += int(bucket.is_last())


def _average_async(tensor: torch.Tensor, counter: CommCounter) -> torch.futures.Future:
    """Start averaging ``tensor`` in place over ranks; count the bytes handed to the all-reduce."""
    counter.bytes += tensor.numel() * tensor.element_size()
    # Divide first: a sum of fp16 gradients over many ranks can overflow where their mean does not.
    tensor.div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future()


def _allreduce_hook(counter: CommCounter) -> Any:
    """DDP's own behaviour: average the bucket as it is (fp32 gradients send 4 bytes each)."""

    def allreduce(state, bucket):
        _count_bucket(counter, bucket)
        return _average_async(bucket.buffer(), counter).then(lambda fut: fut.value()[0])

    return allreduce


def _compress_hook(dtype: torch.dtype, counter: CommCounter) -> Any:
    """Average a copy of the bucket cast to ``dtype``, then write the result back into the bucket."""

    def compressed_allreduce(state, bucket):
        _count_bucket(counter, bucket)
        buffer = bucket.buffer()

        def decompress(fut):
            # In place: the bucket's own memory (gradient views) holds the result, no second fp32 copy.
            return buffer.copy_(fut.value()[0])

        return _average_async(buffer.to(dtype), counter).then(decompress)

    return compressed_allreduce


def _powersgd_hook(counter: CommCounter) -> Any:
    """torch's PowerSGD hook, counting the bytes it all-reduces.

    Before ``start_powerSGD_iter`` it averages the bucket as it is. After, it all-reduces the
    tensors it does not compress, then the P factors, then the Q factors (the last two from
    callbacks, after the hook returns); their element counts are exactly what it adds to
    ``state.compression_stats()``'s "after compression" total while it splits the bucket.
    """

    def powersgd(state, bucket):
        _count_bucket(counter, bucket)
        buffer = bucket.buffer()
        full_bucket = state.iter < state.start_powerSGD_iter
        elements_before = state.compression_stats()[2]
        future = powerSGD_hook.powerSGD_hook(state, bucket)
        elements = buffer.numel() if full_bucket else state.compression_stats()[2] - elements_before
        counter.bytes += elements * buffer.element_size()
        return future

    return powersgd


@contextlib.contextmanager
def grad_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Within this block, backward all-reduces gradients only if ``enabled``.

    Accumulation micro-steps run with enabled=False (DDP's ``no_sync``); the last
    micro-step of an optimizer step syncs the accumulated gradients once. ``model`` may be
    torch.compile's wrapper around DDP: its forward still runs DDP's, which reads the flag.
    """
    ddp = _find_ddp(model)
    if enabled or ddp is None:
        yield
        return
    with ddp.no_sync():
        yield


def _find_ddp(model: nn.Module) -> DDP | None:
    """The DDP module ``model`` is or wraps (through torch.compile's ``_orig_mod``), or None."""
    while not isinstance(model, DDP):
        if not hasattr(model, "_orig_mod"):
            return None
        model = model._orig_mod
    return model


# ----------------------------------------------------------------------------- collectives


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks; returns a new tensor on the input's device (the input is untouched)."""
    out = values.detach().to(_collective_device, copy=True)
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out.to(values.device)


def all_gather_object(obj: T) -> list[T]:
    """Every rank's ``obj``, in rank order (small picklable values only)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


class LateRead:
    """A device value copied to the host without waiting; ``value()`` waits for that copy only.

    The training loop reads the stop votes of step k after queueing step k+1: on a GPU the host
    then never waits for the step in flight (CPU tensors are simply read). When it does wait, the device has not
    finished step k: another rank has not joined one of its collectives. The hang report then shows this rank in
    ``device_wait`` at step k (not in step k+1, where the host is), and the wait gives up after
    ``parallel.timeout_s`` with an error the hang report knows, before NCCL's watchdog would end the process
    (``timeout_grace_s``).

    Args:
        tensor: the value, on the device; the copy is queued after everything queued so far.
        step: the optimizer step whose work the copy follows (1-based, as the hang report counts).
    """

    def __init__(self, tensor: torch.Tensor, step: int):
        self.host = tensor.detach().to("cpu", non_blocking=True)
        self.copied = torch.cuda.Event() if tensor.is_cuda else None
        if self.copied is not None:
            self.copied.record()
        self.waits_in = hangs.Phase("device_wait", step, None, time.time())

    def value(self) -> float:
        """The value; waits for the device up to ``parallel.timeout_s`` after the step was queued.

        Raises:
            RuntimeError: the device did not get there in time ("Timed out waiting ...ms for the device").
        """
        if self.copied is not None and not self.copied.query():
            with hangs.board.showing(self.waits_in):
                wait_for_device(self.copied, self.waits_in.since + _timeout_s, self.waits_in.step)
        return float(self.host)


DEVICE_POLL_S = 0.0005
"""How often a host that waits for the device looks: ``event.synchronize()`` could not give up at a deadline."""


def wait_for_device(event: Any, deadline: float, step: int | None) -> None:
    """Until ``event`` (a CUDA event, or anything with ``query()``) completes, or ``deadline`` (``time.time()``).

    Raises:
        RuntimeError: the deadline passed; its text is what ``hangs.is_collective_timeout`` looks for.
    """
    while not event.query():
        if time.time() >= deadline:
            raise RuntimeError(
                f"Timed out waiting {_timeout_s * 1000:.0f}ms for the device to finish step {step} "
                f"(parallel.timeout_s={_timeout_s:g}): another rank has not joined one of its collectives"
            )
        time.sleep(DEVICE_POLL_S)


def all_gather_tensor(values: torch.Tensor) -> torch.Tensor:
    """Every rank's ``values`` stacked in rank order: ``[world_size, *values.shape]`` on the input's device.

    Every rank must pass the same shape and dtype.
    """
    local = values.detach().to(_collective_device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return torch.stack(gathered).to(values.device)


def broadcast_object(obj: T, src: int = 0) -> T:
    """Rank ``src``'s value of ``obj`` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    dist.barrier()


def after_rank_zero(work: Callable[[], T], what: str, timeout_s: float, timeout_key: str) -> T | None:
    """``work()`` on every rank (elsewhere than rank 0 a null object's no-op), then the other ranks wait for rank 0's
    to end, up to ``timeout_s``: through a key in the group's store, not a collective, so rank 0 may take longer
    than ``parallel.timeout_s`` (a checkpoint of tens of GB on network storage). Rank 0 leaves its outcome under
    the key, so a failure there ends every rank at once, each with rank 0's error. Every rank calls it, in the
    same order, like a collective.

    Args:
        work: what rank 0 does (a checkpoint writer's ``save``).
        what: for the errors: "save the checkpoint of step 20".
        timeout_s: how long the other ranks wait.
        timeout_key: the config key that sets ``timeout_s``, named in the error.

    Returns:
        ``work()``'s result (on rank 0; None elsewhere).

    Raises:
        RuntimeError: rank 0 failed (its error), or did not finish within ``timeout_s``.
    """
    key = f"ddptrain/after_rank_zero/{next(_rank_zero_works)}"
    if dist.get_world_size() == 1:
        return work()
    assert _store is not None, "init_distributed first"
    if dist.get_rank() == 0:
        try:
            result = work()
        except BaseException as err:
            _store.set(key, f"failed: {type(err).__name__}: {err}"[:2000])
            raise
        _store.set(key, "ok")
        return result
    work()
    outcome = _wait_for_key(key, time.monotonic() + timeout_s)
    if outcome is None:
        raise RuntimeError(
            f"rank 0 did not {what} within {timeout_key}={timeout_s:g} s: raise {timeout_key} if the storage is "
            "this slow, or look for a rank 0 that hung (its stacks: <run>/hang/)."
        )
    if outcome != "ok":
        raise RuntimeError(f"rank 0 could not {what}: {outcome.removeprefix('failed: ')}")
    return None


_rank_zero_works = itertools.count()
AFTER_RANK_ZERO_POLL_S = (0.01, 1.0)
"""The first and the longest pause between two looks at the store (doubling): a short save is seen at once,
a long one costs the store one request a second per waiting rank."""


def _wait_for_key(key: str, deadline: float) -> str | None:
    """The key's value once rank 0 set it, or None at ``deadline`` (``time.monotonic()``). Short looks, not one long
    ``store.wait``: between two, Python's signal handlers run (a second Ctrl-C aborts a save)."""
    assert _store is not None, "init_distributed first"
    pause, longest = AFTER_RANK_ZERO_POLL_S
    while not _store.check([key]):
        if time.monotonic() >= deadline:
            return None
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(2 * pause, longest)
    return _store.get(key).decode()


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


def check_same_on_all_ranks(value: Any, what: str, fix: str) -> None:
    """Raise on every rank if ``value`` differs between ranks (e.g. micro-batches per epoch).

    Raises:
        RuntimeError: naming each rank's value and the fix.
    """
    values = all_gather_object(value)
    if any(v != values[0] for v in values):
        per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
        raise RuntimeError(f"{what} differs between ranks ({per_rank}). {fix}")


def weights_checksum(model: nn.Module, trainable_only: bool = False) -> tuple[int, int]:
    """A checksum of the parameters' bits (and the buffers', unless ``trainable_only``): equal on all ranks
    iff the replicas agree, exactly. The buffers count because DDP does not re-send them every step
    (parallel.broadcast_buffers=false): they must agree from the start.

    Integer sums of the raw bit patterns, plain and weighted by position (so swapped elements or
    swapped tensors show too), wrapping modulo 2**64: the result does not depend on the order of
    the reduction (thread count, GPU model), where a float sum would. Slices of at most
    ``_CHECKSUM_SLICE`` elements bound the int64 copies; one host read at the end.
    """
    with torch.no_grad():
        parts, offset = [], 0
        tensors = [*model.parameters(), *model.buffers()]
        if trainable_only:
            tensors = [p for p in model.parameters() if p.requires_grad]
        for p in tensors:
            for piece in p.detach().reshape(-1).split(_CHECKSUM_SLICE):
                bits = piece.view(_SAME_SIZE_INT[piece.element_size()]).long()
                position = torch.arange(offset + 1, offset + 1 + bits.numel(), device=bits.device)
                parts.append(torch.stack([bits.sum(), (bits * position).sum()]))
                offset += bits.numel()
        if not parts:
            return 0, 0
        plain, weighted = torch.stack(parts).sum(dim=0).tolist()
        return plain, weighted


_CHECKSUM_SLICE = 1 << 22
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def trainable_checksum(model: nn.Module) -> tuple[int, int]:
    """``weights_checksum`` of the trainable parameters (after step 1: were the gradients synced?)."""
    return weights_checksum(model, trainable_only=True)


def check_replicas_agree(model: nn.Module) -> None:
    """Raise on every rank unless every rank holds the same weights, frozen ones included.

    Raises:
        RuntimeError: naming each rank's checksum and the likely causes.
    """
    check_same_on_all_ranks(
        weights_checksum(model),
        "the model's weights",
        "Every rank must build the same model: point model.name_or_path at the same files on every node, "
        "and keep model.init=random runs on the same seed (trainer.seed) and transformers version.",
    )


def check_every_trainable_param_has_a_gradient(model: nn.Module, cfg: ParallelConfig) -> None:
    """After a step's backward and before the next ``zero_grad``: name trainable parameters that got no
    gradient on any rank (their ``.grad`` is still None).

    Under DDP such a parameter stalls its gradient bucket and the next step fails with
    "Expected to have finished reduction in the prior iteration"; say which ones and why.

    Raises:
        RuntimeError: some did, with several ranks and ``parallel.find_unused_parameters=false``.
    """
    missing = sorted(n for n, p in model.named_parameters() if p.requires_grad and p.grad is None)
    unused = sorted(set().union(*all_gather_object(missing)))
    if not unused:
        return
    names = ", ".join(unused[:10]) + (f" and {len(unused) - 10} more" if len(unused) > 10 else "")
    if dist.get_world_size() > 1 and not cfg.find_unused_parameters:
        raise RuntimeError(
            f"{len(unused)} trainable parameters received no gradient in step 1: {names}. Freeze them "
            "(e.g. narrow model.lora_target_modules), or set parallel.find_unused_parameters=true."
        )
    log.warning("%d trainable parameters received no gradient in step 1: %s", len(unused), names)


def check_trainable_params_agree(model: nn.Module) -> None:
    """After step 1: every rank holds the same trainable weights, so the gradients were synchronised.

    Raises:
        RuntimeError: naming each rank's checksum; the loss was computed outside the DDP-wrapped module.
    """
    checksums = all_gather_object(trainable_checksum(model))
    if any(c != checksums[0] for c in checksums):
        raise RuntimeError(
            f"trainable parameters differ between ranks after step 1 (checksums {checksums}): gradients "
            "were not synchronised. The loss must be computed inside the DDP-wrapped module."
        )
