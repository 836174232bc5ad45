"""Everything that touches ``torch.distributed``: process group, rank facts, DDP, collectives.

The trainer never imports ``torch.distributed``; it calls the names below. Every
rank calls every collective here; none of them may sit behind ``if rank == 0``.
A world of one process still gets a (local, in-memory) process group, so the same
collectives work in a single-process run and cost nothing there.

``group`` forms and leaves the process group, ``ddp`` wraps the model and counts what its all-reduce sends,
``fsdp`` shards it instead (``parallel.strategy=fsdp2``) and counts its all-gathers and reduce-scatters, ``wrap``
picks between them, ``collectives`` holds the collectives and the checks built on them.
"""

# ruff: noqa: F401  (the package re-exports its modules' names: callers write parallel.<name>)
from ddptrain.parallel.collectives import (
    AFTER_RANK_ZERO_POLL_S,
    DEVICE_POLL_S,
    LateRead,
    after_rank_zero,
    all_gather_object,
    all_gather_tensor,
    all_reduce_sum,
    barrier,
    broadcast_object,
    check_every_trainable_param_has_a_gradient,
    check_replicas_agree,
    check_same_on_all_ranks,
    check_trainable_params_agree,
    trainable_checksum,
    wait_for_device,
    weights_checksum,
)
from ddptrain.parallel.ddp import CommCounter
from ddptrain.parallel.fsdp import gathered, is_sharded, load_shards, materialize, save_shards, whole_trainable
from ddptrain.parallel.group import (
    FAILED_EXIT_GRACE_S,
    NCCL_GRACE_MIN_S,
    NCCL_GRACE_SHARE,
    DistEnv,
    check_one_rank_per_gpu,
    cuda_index,
    exit_soon,
    init_distributed,
    local_rank_zero_first,
    ranks_sharing_a_device,
    release_left_groups,
    teardown,
    timeout_grace_s,
    torchrun_round,
)
from ddptrain.parallel.wrap import grad_sync, load_device, wrap_model
