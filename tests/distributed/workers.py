"""Module-level entrypoints for 2-process tests (spawned processes import them by name).

Each runs the real product code on one rank and writes what the test checks to files in
the run directory: results come back through files, not through the launcher.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ddptrain import parallel
from ddptrain.config import RunConfig
from ddptrain.observe.console import setup_logging
from ddptrain.trainer import Trainer

PROBE_TEXT = "### Instruction:\nGive three tips for staying healthy.\n\n### Response:\n1. Eat well."


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def train_and_record(cfg: RunConfig, run_dir: str, store_port: int) -> None:
    """Train with the real Trainer, recording per step which LoRA grads are non-zero and a digest of
    every trainable parameter; record this rank's sample indices for epochs 0 and 1; save probe logits."""
    env = parallel.init_distributed(cfg.parallel, cfg.trainer.device, store_port)
    try:
        setup_logging(env.rank, None)
        trainer = Trainer(cfg, env, Path(run_dir))
        epochs = {}
        for epoch in (0, 1):
            trainer.sampler.set_epoch(epoch)
            epochs[epoch] = [i for batch in trainer.sampler for row in batch for i in row]
        dropped = trainer.sampler.dropped
        trainer.sampler.set_epoch(0)

        trainable = {n: p for n, p in trainer.loss_module.named_parameters() if p.requires_grad}
        nonzero_grads: list[list[str]] = []
        digests: list[dict[str, str]] = []

        def before_step(optimizer, args, kwargs):
            nonzero_grads.append(sorted(n for n, p in trainable.items() if p.grad is not None and p.grad.any()))

        def after_step(optimizer, args, kwargs):
            digests.append({n: _digest(p) for n, p in trainable.items()})

        trainer.optimizer.register_step_pre_hook(before_step)
        trainer.optimizer.register_step_post_hook(after_step)
        last = trainer.fit()

        record = {
            "epochs": epochs,
            "dropped": dropped,
            "dataset_size": len(trainer.data.train),
            "nonzero_grads": nonzero_grads,
            "digests": digests,
            "trainable": sorted(trainable),
            "last": last,
        }
        (Path(run_dir) / f"rank{env.rank}.json").write_text(json.dumps(record))
        if env.is_rank_zero:
            ids = trainer.tokenizer(PROBE_TEXT, return_tensors="pt").input_ids
            trainer.loss_module.eval()
            with torch.no_grad():
                logits = trainer.loss_module.full_logits(ids)
            torch.save({"input_ids": ids, "logits": logits}, Path(run_dir) / "probe.pt")
    finally:
        parallel.teardown()


def whole(tensors) -> list[torch.Tensor]:
    """Copies of ``tensors``, each whole: a sharded one (FSDP2's DTensor) gathered from every rank (a collective)."""
    from torch.distributed.tensor import DTensor

    return [(t.full_tensor() if isinstance(t, DTensor) else t).detach().clone() for t in tensors]


def train_fixed_layout(cfg: RunConfig, run_dir: str, store_port: int | None) -> None:
    """Train 3 optimizer steps (or layout.json's ``steps``) on fixed global batches of 8 samples (preference pairs
    under objective=dpo), split as layout.json says (ranks x micro-steps; ``sizes``: this rank's micro-batches of
    so many samples, uneven), through the real Trainer.train_step; rank 0 saves the trainable params."""
    from ddptrain.data import Collator, RowsDataset

    env = parallel.init_distributed(cfg.parallel, cfg.trainer.device, store_port)
    try:
        setup_logging(env.rank, None)
        layout = json.loads((Path(run_dir) / "layout.json").read_text())
        accum = layout["accum"]
        trainer = Trainer(cfg, env, Path(run_dir))
        rows = RowsDataset(trainer.data.train)
        collate = Collator(trainer.tokenizer.pad_token_id)
        per_micro = 8 // (env.world_size * accum)
        trainable = {n: p for n, p in trainer.loss_module.named_parameters() if p.requires_grad}
        grads: list[list[torch.Tensor]] = []
        losses: list[float] = []
        trainer.optimizer.register_step_pre_hook(lambda *_: grads.append(whole(p.grad for p in trainable.values())))
        for step in range(layout.get("steps", 3)):
            global_batch = list(range(step * 8, step * 8 + 8))
            mine = global_batch[env.rank * accum * per_micro : (env.rank + 1) * accum * per_micro]
            sizes = layout.get("sizes", [per_micro] * (len(mine) // per_micro))  # this rank's micro-batches
            starts = [sum(sizes[:k]) for k in range(len(sizes))]
            micro = [collate([rows[(i,)] for i in mine[a : a + n]]) for a, n in zip(starts, sizes)]
            result = trainer.train_step(micro)
            losses.append(float(result.loss_sum) / float(result.target_tokens))  # this rank's mean loss per unit
            trainer.step += 1
        params = dict(zip(trainable, whole(trainable.values())))  # every rank: FSDP2 gathers each whole
        by_name = [dict(zip(trainable, step_grads)) for step_grads in grads]
        if env.is_rank_zero:
            torch.save({"params": params, "grads": by_name, "losses": losses}, Path(run_dir) / "params.pt")
    finally:
        parallel.teardown()


def train_recording_dropout_masks(cfg: RunConfig, run_dir: str, store_port: int | None) -> None:
    """Every rank trains step 1 on the same 4 rows through the real Trainer.train_step, recording what each
    dropout module with p > 0 got and gave back; writes ``masks-rank{N}.pt``: the trainable weights before the
    step, and per module its input and its mask (the elements it zeroed)."""
    from ddptrain.data import Collator, RowsDataset

    env = parallel.init_distributed(cfg.parallel, cfg.trainer.device, store_port)
    try:
        setup_logging(env.rank, None)
        trainer = Trainer(cfg, env, Path(run_dir))
        weights = {n: p.detach().clone() for n, p in trainer.loss_module.named_parameters() if p.requires_grad}
        seen: dict[str, dict[str, torch.Tensor]] = {}

        def record(name: str):
            def hook(module, inputs, output):
                seen.setdefault(name, {"input": inputs[0].detach().clone(), "mask": (output == 0).detach().clone()})

            return hook

        for name, module in trainer.loss_module.named_modules():
            if isinstance(module, torch.nn.Dropout) and module.p > 0:
                module.register_forward_hook(record(name))
        rows = RowsDataset(trainer.data.train)
        batch = Collator(trainer.tokenizer.pad_token_id)([rows[(i,)] for i in range(4)])
        trainer.train_step([batch])
        torch.save({"weights": weights, "dropout": seen}, Path(run_dir) / f"masks-rank{env.rank}.pt")
    finally:
        parallel.teardown()


def train_with_unused_parameter(cfg: RunConfig, run_dir: str, store_port: int | None) -> None:
    """The real Trainer on a model carrying one trainable parameter the loss never uses
    (as a user's custom model might): the pre-flight must name it."""
    from torch import nn

    from ddptrain import trainer as trainer_module

    real_build_model = trainer_module.build_model

    def build_with_unused(*args, **kwargs):
        module = real_build_model(*args, **kwargs)
        module.register_parameter("unused_scale", nn.Parameter(torch.ones(4)))
        return module

    trainer_module.build_model = build_with_unused
    env = parallel.init_distributed(cfg.parallel, cfg.trainer.device, store_port)
    try:
        setup_logging(env.rank, None)
        try:
            Trainer(cfg, env, Path(run_dir)).fit()
        except RuntimeError as err:
            (Path(run_dir) / f"error{env.rank}.txt").write_text(str(err))
            raise
    finally:
        parallel.teardown()


def report_listening_sockets(cfg: RunConfig, run_dir: str, store_port: int | None) -> None:
    """After the group forms, list the TCP sockets this worker and the launcher (its parent) listen on."""
    import os

    env = parallel.init_distributed(cfg.parallel, cfg.trainer.device, store_port)
    try:
        parallel.barrier()
        listening = _listening_addresses({os.getpid(), os.getppid()})
        (Path(run_dir) / f"listening-rank{env.rank}.json").write_text(json.dumps(listening))
        parallel.barrier()
    finally:
        parallel.teardown()


def _listening_addresses(pids: set[int]) -> list[str]:
    """Local addresses of LISTEN sockets owned by ``pids`` (from /proc: no extra tools needed)."""
    import os
    import socket
    import struct

    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            target = os.readlink(f"/proc/{pid}/fd/{fd}") if os.path.exists(f"/proc/{pid}/fd/{fd}") else ""
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A = LISTEN
                continue
            address_hex = local.split(":")[0]
            raw = bytes.fromhex(address_hex)
            if family == socket.AF_INET:
                raw = struct.pack("<I", struct.unpack(">I", raw)[0])
            else:
                raw = b"".join(struct.pack("<I", struct.unpack(">I", raw[i : i + 4])[0]) for i in range(0, 16, 4))
            found.append(socket.inet_ntop(family, raw))
    return found


def fail_with_a_thread_that_never_ends(cfg: RunConfig, run_dir: str, store_port: int | None) -> None:
    """The product's worker, whose training fails on both ranks at once while a non-daemon thread (a user's logger,
    say) never ends: the interpreter's exit would wait for it forever. The grace is shortened so the test is quick;
    the product's is 30 s."""
    import threading

    from ddptrain import launch, trainer

    def fails(self: Trainer) -> None:
        raise RuntimeError(f"rank {self.env.rank} failed on purpose")

    trainer.Trainer.fit = fails
    parallel.group.FAILED_EXIT_GRACE_S = 3.0
    threading.Thread(target=threading.Event().wait, name="never-ends", daemon=False).start()
    launch.worker(cfg, run_dir, store_port)


def report_how_this_rank_started(cfg: RunConfig, run_dir: str, store_port: int | None) -> dict:
    """What a rank inherited: its parent's command line, an environment variable the test sets, its cores and
    threads; it also prints a line to standard output and one to standard error."""
    import os
    import signal
    import sys

    rank = int(os.environ["RANK"])
    print(f"rank {rank} says hello on stdout", flush=True)
    print(f"rank {rank} says hello on stderr", file=sys.stderr, flush=True)
    parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    return {
        "parent": parent,
        "parent_pid": os.getppid(),
        "value": os.environ.get("DDPTRAIN_TEST_VALUE"),
        "removed": os.environ.get("DDPTRAIN_TEST_REMOVED"),
        "rank": rank,
        "cores": sorted(os.sched_getaffinity(0)),
        "threads": torch.get_num_threads(),
        "signals_as_spawned": signal.getsignal(signal.SIGINT) is signal.default_int_handler
        and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        and signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
        and not signal.pthread_sigmask(signal.SIG_BLOCK, []),
    }


def compute_on_cuda(cfg: RunConfig, run_dir: str, store_port: int | None) -> dict:
    """A forked rank's first CUDA work (the server that forked it must not have initialised CUDA)."""
    import os

    total = torch.arange(4.0, device="cuda").sum().item()
    return {"parent": Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace"), "sum": total}


def wait_to_be_interrupted(cfg: RunConfig, run_dir: str, store_port: int | None) -> None:
    """Leave ``rank<N>.pid`` and ``rank<N>.parent`` (its parent's command line) in the run folder, then wait; on
    Ctrl-C (SIGINT) leave ``rank<N>.interrupted``."""
    import os
    import time

    rank = int(os.environ["RANK"])
    (Path(run_dir) / f"rank{rank}.parent").write_bytes(Path(f"/proc/{os.getppid()}/cmdline").read_bytes())
    (Path(run_dir) / f"rank{rank}.pid").write_text(str(os.getpid()))
    try:
        time.sleep(120)
    except KeyboardInterrupt:
        (Path(run_dir) / f"rank{rank}.interrupted").write_text("")
