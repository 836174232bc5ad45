"""ModelFlops against what torch's FlopCounterMode counts on real collated batches; the peak table.

The oracle is torch.utils.flop_counter.FlopCounterMode around the loss module's forward and
backward (fp32, CPU): it counts every matmul the run dispatches. It also counts the work that
model FLOPs leave out (padding, attention across a packed row, checkpointing's recomputation),
so each test builds the oracle to compare like with like: every sample run alone, unpadded.
The attention runs eagerly (two matmuls the counter sees, over the full L×L, the convention
flops.py counts): CPU SDPA's fused kernel has no FLOP formula in the counter, which would count
no attention at all. Measured agreement is exact; the tolerance only leaves room for a counter
that one day counts a stray small matmul (rotary angles, say).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.utils.checkpoint
from torch.utils.flop_counter import FlopCounterMode

from ddptrain.config import Attention, Batching, DataConfig, DType, ModelConfig, Objective, Reference
from ddptrain.data import RowEncoder, build_collator
from ddptrain.model import CausalLMLoss, build_model, build_tokenizer
from ddptrain.observe.flops import ModelFlops, lookup_peak_tflops, peak_tflops
from tests.conftest import compose_config
from tests.unit.test_model import CPU, TINY_INSTRUCT, one_thread  # noqa: F401  (one_thread: autouse fixture)

TOLERANCE = 1e-4  # relative; measured: 0 in every case


@pytest.fixture(scope="module")
def tiny() -> ModelConfig:
    return replace(compose_config([]).model, attn_implementation=Attention.eager)


@pytest.fixture(scope="module")
def pad_id(tiny) -> int:
    return build_tokenizer(tiny).pad_token_id


@pytest.fixture(scope="module")
def samples(tiny) -> list[dict[str, list[int]]]:
    """Five real rows of the bundled data, tokenized with their prompts masked, of different lengths."""
    tokenizer = build_tokenizer(tiny)
    encoder = RowEncoder(DataConfig(path=str(TINY_INSTRUCT)), tokenizer)
    with open(TINY_INSTRUCT) as f:
        rows = [json.loads(next(f)) for _ in range(5)]
    encoded = [
        {"input_ids": ids, "labels": labels}
        for ids, labels, _ in encoder.encode_turns([encoder.turns(row) for row in rows])
    ]
    assert len({len(s["input_ids"]) for s in encoded}) > 2, "uneven lengths, so padding is exercised"
    return encoded


def collate(samples, pad_id: int, *, packed: bool = False, pad_to_multiple_of: int = 1, flash_varlen=False):
    """The product's training collator: one padded row per sample, or all samples packed in one row."""
    batching = Batching.packed if packed else Batching.random
    data = DataConfig(path=str(TINY_INSTRUCT), batching=batching, pad_to_multiple_of=pad_to_multiple_of)
    collator = build_collator(data, pad_id, flash_varlen=flash_varlen)
    return collator([samples] if packed else [[s] for s in samples])


def inplace_addmm_flops(self_shape, mat1_shape, mat2_shape, *_, out_shape=None, **__) -> int:
    """FlopCounterMode knows addmm but not in-place addmm_, which the chunked head's fp32 weight gradient uses."""
    rows, inner = mat1_shape
    return 2 * rows * inner * mat2_shape[1]


def counter() -> FlopCounterMode:
    return FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: inplace_addmm_flops})


def counted(model: CausalLMLoss, batch: dict) -> tuple[int, int]:
    """(forward, backward) FLOPs that FlopCounterMode sees in the loss module's forward, then its backward."""
    model.zero_grad(set_to_none=True)
    with counter() as forward:
        loss_sum, _ = model(**batch)
    with counter() as backward:
        loss_sum.backward()
    return forward.get_total_flops(), backward.get_total_flops()


def counted_alone(model: CausalLMLoss, samples, pad_id: int) -> int:
    """The counter's forward + backward summed over each sample run alone, unpadded: real tokens only."""
    return sum(sum(counted(model, collate([s], pad_id))) for s in samples)


def assert_close(got: int, expected: int) -> None:
    assert expected > 0
    assert abs(got - expected) <= TOLERANCE * expected, f"{got:,} vs {expected:,} ({got / expected - 1:+.2%})"


# ----------------------------------------------------------------------------- what trains


# Each variant sends gradients down a different path: which inputs need gradients, which
# attention products backward computes in layer 0 (frozen embedding below it), which weights train.
VARIANTS = {
    "lora-all-linear": {},
    "lora-q-v": {"lora_target_modules": "q_proj,v_proj"},  # layer 0: no dK, and k_proj's input needs none
    "lora-v": {"lora_target_modules": "v_proj"},  # layer 0 attention backward: dV only
    "lora-down": {"lora_target_modules": "down_proj"},  # layer 0: no input gradient before down_proj
    "full-fine-tune": {"lora": False},  # weight gradients everywhere, the head's too
    "full-fine-tune-plain-head": {"lora": False, "loss_chunk_tokens": 0},
    "plain-head": {"loss_chunk_tokens": 0},  # F.cross_entropy instead of the chunked head
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_one_unpadded_row_matches_the_counter(tiny, samples, pad_id, variant):
    model = build_model(replace(tiny, **VARIANTS[variant]), 0, CPU).train()
    flops = ModelFlops.from_model(model)
    for sample in samples[:2]:
        batch = collate([sample], pad_id)
        assert_close(flops.batch_flops(batch), sum(counted(model, batch)))


def test_forward_and_backward_each_match_the_counter(tiny, samples, pad_id):
    # The chunked head forms its gradient inside forward: compare the split with the plain head.
    model = build_model(replace(tiny, loss_chunk_tokens=0), 0, CPU).train()
    batch = collate(samples[:1], pad_id)
    forward, backward = ModelFlops.from_model(model).forward_backward_flops(batch)
    counted_forward, counted_backward = counted(model, batch)
    assert_close(forward, counted_forward)
    assert_close(backward, counted_backward)


@pytest.mark.parametrize("reference", ["adapter_off", "precomputed"])
def test_a_batch_of_pairs_counts_the_reference_forward_where_it_runs(tiny, samples, pad_id, reference):
    """objective=dpo: the counter around DPO's loss module, forward and backward, on an unpadded pair (a sample as
    both replies): the policy's forward and backward, and the reference's forward (the base, adapters off) only
    where the batch does not carry its log-probabilities."""
    from ddptrain.config import ObjectiveConfig

    objective = ObjectiveConfig(name=Objective.dpo, reference=Reference(reference))
    model = build_model(replace(tiny, loss_chunk_tokens=0), 0, CPU, objective=objective).train()
    pair = {**samples[0], "rejected_input_ids": samples[0]["input_ids"], "rejected_labels": samples[0]["labels"]}
    batch = collate([pair], pad_id)
    assert int(batch["pairs"]) == 1 and bool(batch["attention_mask"].all())
    if reference == "precomputed":
        batch["reference_logps"] = torch.zeros(2)
    assert_close(ModelFlops.from_model(model).batch_flops(batch), sum(counted(model, batch)))


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning")  # peft, on the tied head
def test_lora_on_the_lm_head_is_refused(tiny):
    model = build_model(replace(tiny, lora_target_modules="q_proj,lm_head"), 0, CPU)
    with pytest.raises(ValueError, match=r"LoRA adapters on .*lm_head are not counted"):
        ModelFlops.from_model(model)


# ----------------------------------------------------------------------------- batch shapes


@pytest.fixture(scope="module")
def model(tiny) -> CausalLMLoss:
    return build_model(tiny, 0, CPU).train()


def test_padded_batch_counts_real_tokens_only(model, samples, pad_id):
    batch = collate(samples, pad_id, pad_to_multiple_of=8)
    assert batch["attention_mask"].eq(0).sum() > 20, "rows of different lengths, padded"
    expected = counted_alone(model, samples, pad_id)
    assert_close(ModelFlops.from_model(model).batch_flops(batch), expected)
    assert sum(counted(model, batch)) > 1.1 * expected, "the counter sees the padding: hardware work"


@pytest.mark.parametrize("flash_varlen", [False, True], ids=["position-ids", "with-cu-seq-lens"])
def test_packed_batch_counts_each_sample_at_its_own_length(model, samples, pad_id, flash_varlen):
    batch = collate(samples, pad_id, packed=True, flash_varlen=flash_varlen)
    assert batch["input_ids"].shape[0] == 1 and len(samples) > 2
    expected = counted_alone(model, samples, pad_id)
    assert_close(ModelFlops.from_model(model).batch_flops(batch), expected)
    if not flash_varlen:  # (eager attention ignores cu_seq_lens; that batch only checks the count's input)
        assert sum(counted(model, batch)) > expected, "eager attention runs the whole row's L×L"


# ----------------------------------------------------------------------------- gradient checkpointing


def test_gradient_checkpointing_changes_hardware_work_not_model_flops(tiny, samples, pad_id):
    batch = collate(samples[:1], pad_id)
    plain = build_model(tiny, 0, CPU).train()
    checkpointed = build_model(replace(tiny, gradient_checkpointing=True), 0, CPU).train()
    model_flops = ModelFlops.from_model(checkpointed).batch_flops(batch)
    assert model_flops == ModelFlops.from_model(plain).batch_flops(batch)
    plain_count = sum(counted(plain, batch))
    assert_close(model_flops, plain_count)

    # What the counter sees on top is checkpointing's: the layers' forward, run again in backward,
    # and the input gradients below layer 0 that enable_input_require_grads makes autograd compute.
    with counter() as layers_forward, torch.no_grad():
        plain.decoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    plain.model.enable_input_require_grads()
    input_grads = sum(counted(plain, batch)) - plain_count
    assert input_grads > 0
    # Early stop would end each layer's recomputation once backward has its saved tensors, skipping
    # the last product (down_proj's LoRA B): recompute whole layers, so the two sides are comparable.
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        overhead = sum(counted(checkpointed, batch)) - plain_count
    assert_close(overhead, layers_forward.get_total_flops() + input_grads)


# ----------------------------------------------------------------------------- peak


def test_the_override_wins_everywhere():
    assert peak_tflops(CPU, DType.bf16, 123.0) == 123.0
    assert peak_tflops(torch.device("cuda"), DType.fp16, 50.0) == 50.0  # never asks CUDA


@pytest.mark.parametrize("precision", list(DType))
def test_cpu_has_no_peak(precision):
    assert peak_tflops(CPU, precision, None) is None


@pytest.mark.parametrize(
    ("name", "precision", "expected"),
    [
        ("NVIDIA A100-SXM4-80GB", DType.bf16, 312.0),
        ("NVIDIA A100-PCIE-40GB", DType.fp16, 312.0),
        ("NVIDIA A100 80GB PCIe", DType.fp32, 19.5),
        ("NVIDIA H100 80GB HBM3", DType.bf16, 989.5),
        ("NVIDIA H100 PCIe", DType.bf16, 756.5),
        ("NVIDIA H100 NVL", DType.bf16, 835.5),
        ("NVIDIA H200", DType.bf16, 989.5),
        ("NVIDIA H200 NVL", DType.bf16, 835.5),
        ("NVIDIA L40S", DType.bf16, 362.05),
        ("NVIDIA L4", DType.bf16, 121.0),  # not L40S's
        ("NVIDIA A10G", DType.bf16, 125.0),
        ("NVIDIA A10", DType.fp16, 125.0),
        ("NVIDIA GeForce RTX 4090", DType.bf16, 165.2),
        ("NVIDIA GeForce RTX 3090", DType.fp16, 71.0),
        ("Tesla V100-SXM2-16GB", DType.fp16, 125.0),
        ("Tesla V100-PCIE-32GB", DType.fp16, 112.0),
        ("Tesla V100-SXM2-32GB", DType.bf16, None),  # no bf16 tensor cores
        ("Tesla T4", DType.fp16, 65.0),
        ("NVIDIA GeForce RTX 3090 Ti", DType.bf16, None),  # not the 3090's figure
        ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", DType.bf16, None),  # a slice has a fraction of the peak
        ("Some Future GPU", DType.bf16, None),
    ],
)
def test_known_gpu_names_map_to_their_datasheet_peak(name, precision, expected):
    assert lookup_peak_tflops(name, precision) == expected


def test_fp32_uses_the_tf32_peak_when_torch_allows_tf32(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    cuda = torch.device("cuda")
    saved = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert peak_tflops(cuda, DType.fp32, None) == 19.5
        torch.set_float32_matmul_precision("high")
        assert peak_tflops(cuda, DType.fp32, None) == 156.0
        assert peak_tflops(cuda, DType.bf16, None) == 312.0
    finally:
        torch.set_float32_matmul_precision(saved)
