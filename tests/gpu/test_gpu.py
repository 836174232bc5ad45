"""GPU checks (skipped without CUDA): the same entrypoint on cuda with nccl and bf16.

On a GPU machine: ``python -m pytest tests/gpu -q``; the throughput benchmark's GPU mode is
``python -m ddptrain.bench.throughput --gpu ...`` (see bench/README.md).
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import read_metrics, run_ddptrain, run_dirs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_bf16_single_gpu_trains(tmp_path) -> None:
    result = run_ddptrain(
        ["parallel=single", "trainer.precision=bf16", "trainer.max_steps=30", "trainer.log_every_n_steps=10",
         "trainer.progress_bar=false", f"trainer.output_dir={tmp_path}"]
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = run_dirs(tmp_path)
    losses = [r["loss"] for r in read_metrics(run) if "loss" in r]
    assert losses[-1] < losses[0]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_nccl_with_bf16_compression(tmp_path) -> None:
    result = run_ddptrain(
        ["parallel=ddp2", "parallel.comm_hook=bf16_compress", "trainer.precision=bf16", "trainer.max_steps=10",
         "trainer.log_every_n_steps=5", "trainer.progress_bar=false", f"trainer.output_dir={tmp_path}"]
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = run_dirs(tmp_path)
    records = [r for r in read_metrics(run) if "loss" in r]
    assert records[-1]["allreduce_syncs_per_step"] == 1.0
