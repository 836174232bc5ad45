"""GPU checks (skipped without CUDA): the risky paths of the real entrypoint on one GPU, one process.

On a GPU machine: ``make gpu-check`` (tier "one GPU" of scripts/gpu_check.py), or ``python -m pytest
tests/gpu/test_gpu.py -q`` alone. Each run is the bundled tiny model for 30 steps on ``parallel=single`` (one
process, no DDP wrapper: 2 ranks on this GPU over gloo are test_gpu_shared.py, over NCCL test_gpu_ddp.py); every run
must finish with finite losses that fall, plus what is specific to its path. Packed rows under sdpa and flash
attention compute each sample as if alone.
"""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ddptrain.config import DType
from ddptrain.observe.flops import lookup_peak_tflops
from tests.conftest import REPO, read_metrics, run_ddptrain, run_dirs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

STEPS = 30
SINGLE_GPU = [
    "parallel=single",
    "trainer.device=cuda",
    f"trainer.max_steps={STEPS}",
    "trainer.log_every_n_steps=5",
    "trainer.progress_bar=false",
    "trainer.save_final=false",
    "data.max_rows=1000",
    "data.micro_batch_size=16",
    "data.eval_fraction=0",
    "trainer.precision=fp32",  # the reference: tests name the precision they check (the default is auto)
]
BF16 = ["model.dtype=bf16", "trainer.precision=bf16"]
Train = Callable[..., list[dict]]


def has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


@pytest.fixture(scope="module")
def train(tmp_path_factory) -> Train:
    """``train(*overrides)``: the logged training records of a finished single-GPU run (each run once per
    module, so a reference run is shared by the tests that compare against it)."""
    done: dict[tuple[str, ...], list[dict]] = {}

    def run(*overrides: str) -> list[dict]:
        if overrides not in done:
            out = tmp_path_factory.mktemp("run")
            result = run_ddptrain([*SINGLE_GPU, *overrides, f"trainer.output_dir={out}"], timeout=280)
            assert result.returncode == 0, result.stderr[-3000:]
            (run_dir,) = run_dirs(out)
            done[overrides] = [r for r in read_metrics(run_dir) if "loss" in r]
        return done[overrides]

    return run


def assert_trains(records: list[dict]) -> list[float]:
    """Every logged window ran, every loss is finite, and the last two windows sit well below the first."""
    assert [r["step"] for r in records] == list(range(5, STEPS + 1, 5))
    losses = [r["loss"] for r in records]
    assert all(math.isfinite(x) for x in losses), losses
    assert (losses[-1] + losses[-2]) / 2 < losses[0] - 0.5, losses
    return losses


def assert_close(losses: list[float], reference: list[float], rel: float) -> None:
    assert losses == pytest.approx(reference, rel=rel), f"{losses} vs reference {reference}"


def test_fp32_reference_trains(train: Train) -> None:
    records = train()
    assert_trains(records)
    assert sum(r["skipped_steps"] for r in records) == 0


def test_fp16_base_with_lora_and_grad_scaler(train: Train) -> None:
    records = train("model.dtype=fp16", "trainer.precision=fp16")
    assert_trains(records)
    skipped = sum(r["skipped_steps"] for r in records)
    assert skipped < STEPS // 2, f"GradScaler skipped {skipped} of {STEPS} steps (overflow every step?)"


def test_bf16_base_trains_without_a_scaler(train: Train) -> None:
    records = train(*BF16)
    assert_trains(records)
    assert sum(r["skipped_steps"] for r in records) == 0, "bf16 needs no GradScaler, so no step is skipped"


def test_the_default_precision_is_bf16_autocast_on_a_bf16_gpu(tmp_path) -> None:
    """trainer.precision=auto: bf16 where the GPU has it, and the run's config.yaml and log say so."""
    if torch.cuda.get_device_capability(0)[0] < 8:
        pytest.skip("this GPU has no native bf16: auto stays fp32 (tests/unit/test_precision.py)")
    args = [*SINGLE_GPU, "trainer.precision=auto", "trainer.max_steps=5", f"trainer.output_dir={tmp_path}"]
    result = run_ddptrain(args, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = run_dirs(tmp_path)
    assert "\n  precision: bf16\n" in (run_dir / "config.yaml").read_text()
    assert "trainer.precision=auto on " in (run_dir / "train.log").read_text()
    records = [r for r in read_metrics(run_dir) if "loss" in r]
    bf16_peak = lookup_peak_tflops(torch.cuda.get_device_name(0), DType.bf16)  # the dtype the matmuls ran in
    assert records and all(r["peak_tflops"] == bf16_peak for r in records), records
    assert all(r["mfu"] is None or 0 < r["mfu"] < 1 for r in records), records


def test_bf16_autocast_over_fp32_base(train: Train) -> None:
    assert_trains(train("trainer.precision=bf16"))


@pytest.mark.skipif(not has_module("flash_attn"), reason="flash_attn is not installed (pip install flash-attn)")
def test_flash_attention_with_packed_batches_matches_sdpa(train: Train) -> None:
    """Packed rows carry several samples with no attention mask; position_ids alone keep them apart. flash's
    losses track sdpa's on the same packed batches (bf16 noise only)."""
    packed = ["data.batching=packed", "data.max_tokens_per_batch=4096", *BF16]
    flash = assert_trains(train(*packed, "model.attn_implementation=flash_attention_2"))
    assert_close(flash, assert_trains(train(*packed, "model.attn_implementation=sdpa")), rel=0.05)


@pytest.mark.skipif(
    not has_module("liger_kernel"), reason="liger_kernel is not installed (pip install 'ddptrain[liger]')"
)
def test_liger_kernel_trains_like_the_plain_model(train: Train) -> None:
    liger = assert_trains(train(*BF16, "model.liger_kernel=true"))
    assert_close(liger, assert_trains(train(*BF16)), rel=0.05)


def test_compile_trains_like_eager(train: Train) -> None:
    """Fused kernels round differently, so not bit-equal; a 10% change of optim.lr moves these losses ~1%."""
    compiled = assert_trains(train("trainer.compile=true"))
    assert_close(compiled, assert_trains(train()), rel=0.01)


def test_gradient_checkpointing_recomputes_the_same_training(train: Train) -> None:
    """Non-reentrant recomputation in fp32 gives the same gradients: the losses match the plain run's."""
    checkpointed = assert_trains(train("model.gradient_checkpointing=true"))
    assert_close(checkpointed, assert_trains(train()), rel=1e-3)


def test_cuda_timing_adds_up_and_reports_mfu(train: Train) -> None:
    """On CUDA the step clock reads events once per window: the columns still add up, and the GPU's
    name gives the peak (an H100/H200/A100... from the table) so mfu is a fraction, not null."""
    records = train(*BF16)
    for record in records[1:]:
        columns = sum(record[f"time_{c}_s"] for c in ("data", "compute", "comm", "optimizer", "other"))
        assert abs(columns - record["step_time_s"]) <= 0.05 * record["step_time_s"], record
        assert record["mem_peak_gb"] > 0 and record["mem_total_gb"] > record["mem_peak_gb"]
        assert record["tflops"] > 0
    if records[-1]["peak_tflops"] is not None:
        assert 0 < records[-1]["mfu"] < 1


def test_ranks_forked_from_the_forkserver_can_use_cuda(tmp_path) -> None:
    """parallel.start_method=forkserver: the server imported torch, transformers and peft; a rank it forks must still
    be able to initialise CUDA (it cannot once the parent had)."""
    from ddptrain.launch import launch
    from tests.conftest import compose_config
    from tests.distributed.workers import compute_on_cuda

    cfg = compose_config(["parallel=ddp2", "parallel.start_method=forkserver", "trainer.device=cuda"])
    result = launch(cfg, tmp_path, entrypoint=compute_on_cuda)
    assert "forkserver" in result["parent"] and result["sum"] == 6.0, result


# ----------------------------------------------------------------------------- packed rows

# Qwen2.5-7B's attention (hidden 3584, 28 query heads and 4 key/value heads of 128) at 2 layers and a 32k
# vocabulary: the shapes the kernels see in the headline run, small enough to build in seconds.
SEVEN_B_ATTENTION = {
    "num_hidden_layers": 2,
    "vocab_size": 32768,
    "intermediate_size": 4096,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
SAMPLE_LENGTHS = [37, 300, 128, 511]
# The same sample alone and packed goes through kernels tiled differently, so bf16 rounding differs by a few units
# in the last place of logits that reach ~8 (0.03 each). On the CPU in fp32 the two agree within 6e-6, and a row
# whose samples attend to each other (position_ids dropped) differs by 8.5: the bound sits far from both.
PACKED_BF16_MAX_ABS = 0.25


def packed_vs_alone(attn: str, tmp_path: Path, device: torch.device | None = None, dtype: str = "bf16") -> float:
    """Max abs difference between the logits of samples packed into one row (the product's collator and model)
    and the same samples run one at a time."""
    from ddptrain.config import Attention, DType, ModelConfig, ModelInit
    from ddptrain.data import Collator
    from ddptrain.model import build_model

    seven_b = json.loads((REPO / "ddptrain" / "assets" / "model_configs" / "qwen2.5-7b" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**seven_b, **SEVEN_B_ATTENTION}))
    cfg = ModelConfig(
        name_or_path=str(tmp_path), init=ModelInit.random, dtype=DType(dtype), attn_implementation=Attention(attn)
    )
    device = device or torch.device("cuda", 0)
    loss_module = build_model(cfg, seed=0, device=device).eval()
    generator = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, 32768, (n,), generator=generator).tolist() for n in SAMPLE_LENGTHS]
    rows = [[{"input_ids": s, "labels": s} for s in samples]]
    packed = Collator(0, packed=True, flash_varlen=attn == "flash_attention_2")(rows)
    packed.pop("labels"), packed.pop("target_index")

    def logits(batch: dict) -> torch.Tensor:
        on_device = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
        hidden = loss_module.decoder(**on_device, use_cache=False).last_hidden_state
        return loss_module.lm_head(hidden).float()[0]

    with torch.no_grad():
        together = logits(packed)
        alone = torch.cat([logits({"input_ids": torch.tensor([s])}) for s in samples])
    return float((together - alone).abs().max())


@pytest.mark.parametrize(
    "attn",
    [
        "sdpa",
        pytest.param(
            "flash_attention_2",
            marks=pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="pip install flash-attn"),
        ),
    ],
)
def test_a_packed_row_computes_each_sample_as_if_alone(attn, tmp_path) -> None:
    difference = packed_vs_alone(attn, tmp_path)
    assert difference <= PACKED_BF16_MAX_ABS, f"{attn}: packed logits differ from the samples alone by {difference}"
