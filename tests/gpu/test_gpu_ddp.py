"""GPU checks over 2 ranks on NCCL, one GPU each (the module skips with fewer than 2 GPUs).

The paths a multi-GPU node takes and the CPU suite and the one-GPU tiers cannot: NCCL collectives, accumulation with
one all-reduce per step, gradient checkpointing and torch.compile under DDP, eval and save and a bit-identical resume,
torchrun, bf16 gradient compression (NCCL only), and each rank's process on its own GPU. One 2-rank run is shared by
the tests that read it. Run by ``make gpu-check`` on 2 or more GPUs (scripts/gpu_check.py, tier "nccl").
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from ddptrain.config import DType
from ddptrain.observe.flops import lookup_peak_tflops
from tests.conftest import read_metrics, run_ddptrain, run_dirs
from tests.gpu.runs import assert_trains as assert_trains_for
from tests.gpu.runs import eval_losses_at, resumed_from_step_10, train_watching_gpus

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (DDP over 2 ranks, nccl)"),
]

STEPS = 20
DDP2 = [
    "parallel=ddp2",
    "trainer.device=cuda",
    f"trainer.max_steps={STEPS}",
    "trainer.log_every_n_steps=5",
    "trainer.progress_bar=false",
    "data.max_rows=1000",
    "data.micro_batch_size=8",
]
# The shared run: accumulation, checkpointing, eval and saves on the way (precision: the default, auto). Eager
# attention: sdpa's fused backward kernels add into the query gradient with atomics, so two runs of the same steps
# may differ in the last bits, and the resume below must be bit-identical (the frozen embedding has no gradient to
# scatter; matmuls and a 2-rank NCCL sum are deterministic). sdpa and flash run in the other tests.
SHARED = [
    *DDP2,
    "model.attn_implementation=eager",
    "optim.grad_accum_steps=2",
    "model.gradient_checkpointing=true",
    "data.eval_fraction=0.05",
    "trainer.eval_every_n_steps=10",
    "trainer.save_every_n_steps=10",
]


def assert_trains(records: list[dict]) -> None:
    assert_trains_for(records, STEPS)


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory) -> tuple[Path, list[dict], dict]:
    out = tmp_path_factory.mktemp("ddp2")
    return train_watching_gpus([*SHARED, f"trainer.output_dir={out}"])


def test_accumulation_over_nccl_syncs_once_per_optimizer_step(shared_run) -> None:
    run_dir, records, _ = shared_run
    assert_trains(records)
    train = [r for r in records if "loss" in r]
    assert all(r["allreduce_syncs_per_step"] == 1.0 for r in train), [r["allreduce_syncs_per_step"] for r in train]
    config = (run_dir / "config.yaml").read_text()
    assert "\n  precision: bf16\n" in config, "trainer.precision=auto on a bf16 GPU trains under bf16 autocast"
    # The peak MFU is measured against is the bf16 one (the matmuls run in bf16), not fp32's (15x lower on Hopper).
    bf16_peak = lookup_peak_tflops(torch.cuda.get_device_name(0), DType.bf16)
    assert all(r["peak_tflops"] == bf16_peak for r in train), [r["peak_tflops"] for r in train]
    assert all(r["mfu"] is None or 0 < r["mfu"] < 1 for r in train), [r["mfu"] for r in train]


def test_eval_runs_on_both_ranks_and_every_save_is_written(shared_run) -> None:
    run_dir, records, _ = shared_run
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [10, 20] and all(math.isfinite(r["eval_loss"]) for r in evals), evals
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert saved == ["step-00000010", "step-00000020"], saved
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()


def test_each_rank_process_holds_memory_on_exactly_one_gpu(shared_run) -> None:
    _, _, ranks = shared_run
    if not ranks:
        pytest.skip("nvidia-smi lists no process of this run (a container without the host's process ids)")
    assert len(ranks) >= 2, f"nvidia-smi saw {ranks}"
    assert all(len(gpus) == 1 for gpus in ranks.values()), ranks
    assert len(set().union(*ranks.values())) == len(ranks), f"two ranks on one GPU: {ranks}"


def test_resume_from_the_middle_is_bit_identical(shared_run, tmp_path) -> None:
    run_dir, records, _ = shared_run
    _, resumed = resumed_from_step_10(SHARED, run_dir, records, tmp_path)
    final_eval = eval_losses_at(STEPS, resumed, records)
    assert final_eval[0] == final_eval[1], final_eval


def test_compile_and_checkpointing_under_ddp(tmp_path) -> None:
    _, records, _ = train_watching_gpus([*DDP2, "trainer.compile=true", "model.gradient_checkpointing=true",
                                         "data.eval_fraction=0", "trainer.save_final=false",
                                         f"trainer.output_dir={tmp_path}"])  # fmt: skip
    assert_trains(records)


def test_torchrun_on_two_gpus(tmp_path) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    _, records, _ = train_watching_gpus(
        [*DDP2, "data.eval_fraction=0", "trainer.save_final=false", f"trainer.output_dir={tmp_path}"], torchrun
    )
    assert_trains(records)


def test_two_gpus_nccl_with_bf16_compression(tmp_path) -> None:
    result = run_ddptrain(
        ["parallel=ddp2", "parallel.comm_hook=bf16_compress", "trainer.device=cuda", "trainer.precision=bf16",
         f"trainer.max_steps={STEPS}", "trainer.log_every_n_steps=5", "trainer.progress_bar=false",
         "trainer.save_final=false", "data.max_rows=1000", "data.eval_fraction=0", f"trainer.output_dir={tmp_path}"],
        timeout=280,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = run_dirs(tmp_path)
    records = [r for r in read_metrics(run) if "loss" in r]
    assert_trains(records)
    assert all(r["allreduce_syncs_per_step"] == 1.0 for r in records)
    # 2 bytes per LoRA gradient element (4 uncompressed): the tiny model's 77,824 trainable parameters.
    assert all(r["allreduce_bytes_per_step"] == 155_648 for r in records)


# FSDP2 on NCCL in bf16 (trainer.precision=bf16: the units gather their weights in bf16, the masters stay fp32),
# accumulation, evaluation and sharded checkpoints, then a resume from the middle: the CPU suite proves the same on
# gloo in fp32 (tests/distributed/test_fsdp2.py).
FSDP2 = [*SHARED, "parallel=fsdp2_2", "trainer.precision=bf16", "model.lora=false", "model.dtype=bf16"]


def test_fsdp2_in_bf16_trains_saves_shards_and_resumes_bit_identical(tmp_path) -> None:
    run_dir, records, _ = train_watching_gpus([*FSDP2, f"trainer.output_dir={tmp_path / 'run'}"])
    assert_trains(records)
    train = [r for r in records if "loss" in r]
    assert all(r["reducescatter_syncs_per_step"] == 1.0 for r in train), train
    assert (run_dir / "checkpoints" / "step-00000010" / "sharded" / ".metadata").is_file()
    assert (run_dir / "adapter" / "config.json").is_file(), "the full fine-tune's weights, gathered"
    resumed_from_step_10(FSDP2, run_dir, records, tmp_path / "resumed")
