"""A real GPU run is right by default: what trainer.precision=auto becomes, the MFU peak of the dtype the matmuls
really run in, TF32, the precision refusals, one visible GPU per rank, and attention that fits the batching.

No GPU is needed: each decision is a function of the device's facts, given here."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from ddptrain import config, parallel
from ddptrain.config import ConfigError, DType, Precision, TrainerConfig, resolve_precision
from ddptrain.model.attention import attention_cost_warning, dense_attention_overhead, warn_about_attention_cost
from ddptrain.model.precision import settle_precision
from ddptrain.observe import flops
from tests.conftest import compose_config

H100 = "NVIDIA H100 80GB HBM3"  # datasheet: bf16 989.5 dense, TF32 494.5, FP32 67
CUDA = torch.device("cuda", 0)


# ----------------------------------------------------------------------------- trainer.precision=auto


def test_the_default_precision_is_auto() -> None:
    assert compose_config([]).trainer.precision == Precision.auto


@pytest.mark.parametrize(
    ("device_type", "bf16_supported", "expected"),
    [("cuda", True, DType.bf16), ("cuda", False, DType.fp32), ("cpu", True, DType.fp32), ("cpu", False, DType.fp32)],
)
def test_auto_is_bf16_on_a_bf16_gpu_and_fp32_elsewhere(device_type, bf16_supported, expected) -> None:
    assert resolve_precision(Precision.auto, device_type, bf16_supported) == expected


@pytest.mark.parametrize("explicit", [Precision.fp32, Precision.bf16, Precision.fp16])
def test_an_explicit_precision_is_honoured_on_any_device(explicit) -> None:
    for device_type, bf16 in (("cuda", True), ("cuda", False), ("cpu", False)):
        assert resolve_precision(explicit, device_type, bf16) == DType(explicit.value)


@pytest.fixture
def cuda_matmul_mode():
    """Restores CUDA's fp32 matmul mode (the flags exist without a GPU), set and read through the legacy flags, as
    the product sets them."""
    matmul, conv = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, conv


def gpu(monkeypatch, capability: tuple[int, int], name: str = H100) -> None:
    """This process sees a GPU of ``capability`` (the facts settle_precision and peak_tflops ask torch for)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def test_on_an_ampere_gpu_auto_becomes_bf16_and_fp32_matmuls_use_tf32(monkeypatch, cuda_matmul_mode, caplog) -> None:
    gpu(monkeypatch, (9, 0))
    torch.backends.cuda.matmul.allow_tf32 = False
    with caplog.at_level(logging.INFO, logger="ddptrain.model.precision"):
        settled = settle_precision(TrainerConfig(), CUDA)
    assert settled.precision == Precision.bf16
    assert torch.backends.cuda.matmul.allow_tf32 and flops.tf32_matmuls()
    # What inductor's autotuning and other libraries read: it must still answer (torch raises on mixed APIs).
    assert torch.get_float32_matmul_precision() == "high"
    assert f"trainer.precision=auto on {H100}: bf16 autocast" in caplog.text
    settle_precision(TrainerConfig(tf32=False), CUDA)  # the key turns it off
    assert not torch.backends.cuda.matmul.allow_tf32 and not flops.tf32_matmuls()
    assert torch.get_float32_matmul_precision() == "highest"


def test_on_a_gpu_without_bf16_auto_stays_fp32_and_tf32_is_left_alone(monkeypatch, cuda_matmul_mode) -> None:
    gpu(monkeypatch, (7, 0), "Tesla V100-SXM2-16GB")  # Volta: no bf16, no TF32
    torch.backends.cuda.matmul.allow_tf32 = False
    assert settle_precision(TrainerConfig(), CUDA).precision == Precision.fp32
    assert not torch.backends.cuda.matmul.allow_tf32


def test_on_the_cpu_auto_is_fp32_and_the_cpu_matmuls_are_not_touched(cuda_matmul_mode) -> None:
    before = (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32)
    assert settle_precision(TrainerConfig(), torch.device("cpu")).precision == Precision.fp32
    assert (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32) == before


# ----------------------------------------------------------------------------- autocast applied


def test_under_bf16_every_linear_of_the_trainers_model_multiplies_in_bf16_in_training_and_evaluation(
    tmp_path, datasets_cache
) -> None:
    """trainer.precision=bf16 on the CPU: the Trainer's own model (fp32 weights, LoRA on every linear layer) trains
    a step and evaluates, and a forward hook on every ``nn.Linear`` it runs sees a bf16 output from fp32 weights:
    the matmul ran in autocast's dtype, in the training forward and in evaluation alike."""
    from ddptrain.trainer import Trainer

    overrides = ["parallel=single", "trainer.precision=bf16", "data.max_rows=40", "data.max_length=128"]
    cfg = compose_config(
        [
            *overrides,
            "data.eval_fraction=0.2",
            "data.micro_batch_size=4",
            "trainer.max_steps=1",
            "trainer.eval_every_n_steps=1",
            "trainer.save_final=false",
            "trainer.save_check=off",  # the check of a saved checkpoint compares logits without autocast, by design
            "trainer.progress_bar=false",
            f"data.cache_dir={datasets_cache}",
            f"trainer.output_dir={tmp_path}",
        ]
    )
    env = parallel.init_distributed(cfg.parallel, cfg.trainer.device)
    try:
        trainer = Trainer(cfg, env, tmp_path)
        linears = {name: m for name, m in trainer.loss_module.named_modules() if isinstance(m, torch.nn.Linear)}
        seen: dict[tuple[str, bool], set[torch.dtype]] = {}  # (module, training?) -> output dtypes

        def record(name: str):
            def hook(module, args, output) -> None:
                seen.setdefault((name, torch.is_grad_enabled()), set()).add(output.dtype)

            return hook

        handles = [m.register_forward_hook(record(name)) for name, m in linears.items()]
        try:
            trainer.fit()
        finally:
            for handle in handles:
                handle.remove()
    finally:
        parallel.teardown()
    assert {m.weight.dtype for m in linears.values()} == {torch.float32}, "fp32 weights: bf16 comes from autocast"
    trained = {name for name, grad in seen if grad}
    # 2 layers x 7 projections and their 2 LoRA factors each (the LM head's loss is a chunked GEMM on its weight).
    assert sum("base_layer" in n for n in trained) == 14 and sum("lora_" in n for n in trained) == 28, sorted(trained)
    evaluated = {name for name, grad in seen if not grad}
    assert trained <= evaluated, f"evaluation did not run {sorted(trained - evaluated)}"
    assert all(dtypes == {torch.bfloat16} for dtypes in seen.values()), {
        k: v for k, v in seen.items() if v != {torch.bfloat16}
    }


# ----------------------------------------------------------------------------- the MFU peak


def test_bf16_weights_without_autocast_are_measured_against_the_bf16_peak(monkeypatch, cuda_matmul_mode) -> None:
    """model.dtype=bf16 with trainer.precision=fp32: no autocast, but every matmul takes bf16 weights."""
    gpu(monkeypatch, (9, 0))
    torch.backends.cuda.matmul.allow_tf32 = False
    assert flops.peak_tflops(CUDA, flops.matmul_dtype(DType.fp32, DType.bf16), None) == 989.5
    assert flops.peak_tflops(CUDA, flops.matmul_dtype(DType.bf16, DType.fp32), None) == 989.5
    assert flops.peak_tflops(CUDA, flops.matmul_dtype(DType.fp32, DType.fp32), None) == 67.0
    torch.backends.cuda.matmul.allow_tf32 = True
    assert flops.peak_tflops(CUDA, flops.matmul_dtype(DType.fp32, DType.fp32), None) == 494.5


# ----------------------------------------------------------------------------- refusals


def problems(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        compose_config(overrides)
    return info.value.problems


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_full_finetune_of_low_precision_weights_is_refused_with_the_fix(dtype) -> None:
    (problem,) = problems([f"model.dtype={dtype}", "model.lora=false", "trainer.precision=bf16"])
    assert problem.startswith(f"model.dtype={dtype} with model.lora=false makes the optimizer update {dtype} weights")
    assert "model.dtype=fp32 trainer.precision=bf16" in problem and "model.lora=true" in problem
    assert compose_config(["model.dtype=fp32", "model.lora=false", "trainer.precision=bf16"]).model.lora is False


@pytest.mark.parametrize("precision", ["auto", "fp32", "bf16"])
def test_fp16_weights_without_fp16_autocast_are_refused_with_the_fix(precision) -> None:
    (problem,) = problems(["model.dtype=fp16", f"trainer.precision={precision}"])
    assert problem == (
        f"model.dtype=fp16 needs trainer.precision=fp16 (autocast with a GradScaler), but trainer.precision="
        f"{precision}: set trainer.precision=fp16, or use model.dtype=bf16 on a GPU that has bf16."
    )
    assert compose_config(["model.dtype=fp16", "trainer.precision=fp16"]).model.dtype == DType.fp16


COMPILED_CHECKPOINTING = ["trainer.compile=true", "model.gradient_checkpointing=true", "parallel=ddp2"]


def test_compile_with_checkpointing_under_ddp_is_refused_on_torch_before_2_6(monkeypatch) -> None:
    monkeypatch.setattr(config.checks, "installed_torch_version", lambda: (2, 5))
    (problem,) = problems(COMPILED_CHECKPOINTING)
    assert problem.startswith(
        "trainer.compile=true with model.gradient_checkpointing=true under DDP crashes on torch 2.5"
    )
    assert "upgrade torch to 2.6 or newer, or set trainer.compile=false" in problem
    assert compose_config([*COMPILED_CHECKPOINTING, "parallel=single"]).trainer.compile  # no DDP, no DDPOptimizer
    monkeypatch.setattr(config.checks, "installed_torch_version", lambda: (2, 6))
    assert compose_config(COMPILED_CHECKPOINTING).trainer.compile


def test_the_installed_torch_version_is_read_without_importing_torch() -> None:
    assert config.installed_torch_version() == tuple(int(x) for x in torch.__version__.split(".")[:2])


# ----------------------------------------------------------------------------- one GPU per rank


@pytest.mark.parametrize("local_rank", [0, 1, 3, 7])
def test_one_visible_gpu_is_cuda_0_for_every_local_rank(local_rank) -> None:
    assert parallel.cuda_index(local_rank, visible=1) == 0


def test_with_every_gpu_visible_each_local_rank_takes_its_own() -> None:
    assert [parallel.cuda_index(r, visible=4) for r in range(4)] == [0, 1, 2, 3]
    with pytest.raises(RuntimeError, match=r"local rank 2 has no GPU: only 2 visible\. Lower parallel\.nproc_per_node"):
        parallel.cuda_index(2, visible=2)


def test_ranks_on_one_device_are_found() -> None:
    devices = ["node1 GPU-a", "node1 GPU-b", "node2 GPU-a", "node1 GPU-a"]
    assert parallel.ranks_sharing_a_device(devices) == [[0, 3]]
    assert parallel.ranks_sharing_a_device(devices[:3]) == []


# ----------------------------------------------------------------------------- attention and batching


def test_dense_attention_over_packed_rows_counts_every_cross_sample_block() -> None:
    # Two samples of 100 in a 200-token row: 200^2 scores computed, 2 x 100^2 needed.
    assert dense_attention_overhead([[100, 100]]) == 2.0
    # Rows of one sample each need what they compute.
    assert dense_attention_overhead([[300], [20]]) == 1.0
    assert dense_attention_overhead([[100, 100], [300]]) == 130000 / 110000


def test_sdpa_with_packing_on_a_gpu_warns_with_its_measured_cost() -> None:
    advice = attention_cost_warning(config.Attention.sdpa, CUDA, [[100, 100], [50, 50, 50, 50]])
    # 200^2 + 200^2 computed / (2 x 100^2 + 4 x 50^2) needed = 80000 / 30000
    assert "computes every cross-sample block: 2.7x the attention scores" in advice
    assert "model.attn_implementation=flash_attention_2" in advice
    assert attention_cost_warning(config.Attention.flash_attention_2, CUDA, [[100, 100]]) is None
    assert attention_cost_warning(config.Attention.sdpa, torch.device("cpu"), [[100, 100]]) is None  # no choice


def test_flash_attention_with_padded_batches_warns_and_names_packing() -> None:
    advice = attention_cost_warning(config.Attention.flash_attention_2, CUDA, [[100], [90]])
    assert "unpads and re-pads every batch in every layer" in advice and "data.batching=packed" in advice
    assert attention_cost_warning(config.Attention.sdpa, CUDA, [[100], [90]]) is None


def test_the_sampler_reports_the_samples_each_packed_row_holds() -> None:
    """What the attention warning is computed from: the real plan's rows, checked against the plan itself."""
    from ddptrain.data.plan import BatchingSpec
    from ddptrain.data.sampler import DistributedBatchSampler

    lengths = [30, 50, 20, 70, 10, 40, 60, 25]
    spec = BatchingSpec(mode=config.Batching.packed, world_size=2, micro_batch_size=1, max_tokens_per_batch=100, seed=0)
    sampler = DistributedBatchSampler(lengths, spec, rank=1)
    rows = [row for batch in sampler for row in batch]
    assert sampler.row_lengths() == [[lengths[i] for i in row] for row in rows]
    assert any(len(row) > 1 for row in rows) and all(sum(row) <= 100 for row in sampler.row_lengths())


def test_the_settled_config_keeps_every_other_trainer_key() -> None:
    cfg = dataclasses.replace(TrainerConfig(), seed=7, max_steps=3)
    settled = settle_precision(cfg, torch.device("cpu"))
    assert dataclasses.replace(settled, precision=Precision.auto) == cfg


def test_two_ranks_on_one_gpu_are_refused_before_nccl_would_fail(monkeypatch) -> None:
    """The exchange runs over the group's store (NCCL's first collective would fail first, with its own message):
    rank 1 already said it is on this host's GPU-a, and rank 0 finds itself there too."""
    import socket
    import types

    import torch.distributed as dist

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(uuid="GPU-a"))
    store = dist.HashStore()
    env = parallel.DistEnv(rank=0, local_rank=0, world_size=2, local_world_size=2, device=CUDA, backend="nccl")
    store.set("ddptrain/device/rank1", f"{socket.gethostname()} GPU-a")
    with pytest.raises(RuntimeError, match=r"ranks 0, 1 all run on one GPU .*GPU-a.*--gpus-per-task=1"):
        parallel.check_one_rank_per_gpu(env, store)
    store.set("ddptrain/device/rank1", f"{socket.gethostname()} GPU-b")
    parallel.check_one_rank_per_gpu(env, store)  # each its own GPU


def test_the_attention_advice_walks_the_plan_only_on_a_gpu(caplog) -> None:
    """The trainer hands over the sampler's row_lengths; on the CPU there is nothing to advise, so the epoch's
    plan is not walked at start-up."""
    walked: list[str] = []

    def rows() -> list[list[int]]:
        walked.append("plan")
        return [[100, 100]]

    warn_about_attention_cost(config.Attention.sdpa, torch.device("cpu"), rows)
    assert walked == []
    with caplog.at_level(logging.WARNING, logger="ddptrain.model.attention"):
        warn_about_attention_cost(config.Attention.sdpa, CUDA, rows)
    assert walked == ["plan"] and "2.0x the attention scores" in caplog.text
