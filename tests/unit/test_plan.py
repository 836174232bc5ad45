"""The memory plan (issue 24): predicted activations against what a real step keeps, the costliest micro-batch
against what the sampler hands each rank, and the command's verdict."""

from __future__ import annotations

import dataclasses
import logging
import re

import pytest
import torch
import torch.distributed as dist
from transformers import AutoConfig, LlamaConfig

from ddptrain.config import DType, ModelConfig, PlanConfig
from ddptrain.data import build_datasets
from ddptrain.data.collate import Collator
from ddptrain.data.loader import build_batching_spec
from ddptrain.data.sampler import DistributedBatchSampler
from ddptrain.model import build_model, build_tokenizer
from ddptrain.plan.__main__ import DOES_NOT_FIT, main
from ddptrain.plan.at_start import RunDoesNotFit, plan_at_start
from ddptrain.plan.planner import make_plan
from ddptrain.plan.simulate import BatchShape, FakeModel
from tests.conftest import compose_config

TINY_QWEN2 = compose_config([]).model.name_or_path


def tiny_llama(folder) -> str:
    """A 5-layer Llama (more layers than the planner simulates: the rest is carried on from 2 and 3)."""
    config = LlamaConfig(
        vocab_size=4352,
        hidden_size=96,
        intermediate_size=256,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    config.save_pretrained(folder)
    return str(folder)


def real_batch(shape: BatchShape) -> dict[str, torch.Tensor]:
    """Tensors as the collator builds them: padded rows (every row after the first half as long), rows all as long
    as the width (``padded=False``: the mask is all ones), or one packed row of four samples; ``shape.targets``
    positions trained."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4000, (shape.rows, shape.width), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if shape.packed:
        quarter = shape.width // 4
        batch["position_ids"] = torch.arange(shape.width).remainder(quarter)[None]
    else:
        mask = torch.ones(shape.rows, shape.width, dtype=torch.long)
        if shape.padded:
            mask[1:, shape.width // 2 :] = 0
        batch["attention_mask"] = mask
    batch["target_index"] = torch.randperm(shape.rows * (shape.width - 1), generator=g)[: shape.targets].sort().values
    return batch


def bytes_saved_for_backward(model: torch.nn.Module, batch: dict, precision: DType) -> int:
    """What a real step keeps for backward: every tensor autograd saves, each storage once, parameters aside."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameters:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == DType.bf16)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        model(**batch)
    return sum(kept.values())


SHAPES = [
    BatchShape(rows=8, width=64, targets=200),
    BatchShape(rows=2, width=384, targets=300),
    BatchShape(rows=1, width=512, targets=400, padded=False, packed=True),
    # No padding: SDPA applies causality itself and no (rows x width x width) mask exists in any layer.
    BatchShape(rows=4, width=256, targets=300, padded=False),
]


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
def test_predicted_activations_are_within_10_percent_of_what_a_real_step_keeps(architecture, tmp_path):
    torch.manual_seed(0)
    path = TINY_QWEN2 if architecture == "qwen2" else tiny_llama(tmp_path / "llama")
    for checkpointing in (False, True):
        cfg = ModelConfig(name_or_path=path, init="random", dtype="fp32", gradient_checkpointing=checkpointing)
        cfg = dataclasses.replace(cfg, lora_dropout=0.05)
        model = build_model(cfg, seed=0, device=torch.device("cpu")).train()
        cases = [(DType.fp32, shape) for shape in SHAPES]
        if architecture == "qwen2" and not checkpointing:
            cases.append((DType.bf16, SHAPES[0]))  # autocast: the adapters' fp32 copies of bf16 inputs
        for precision in sorted({p for p, _ in cases}):
            predicted = FakeModel(AutoConfig.from_pretrained(path), cfg, precision)
            for shape in [s for p, s in cases if p == precision]:
                measured = bytes_saved_for_backward(model, real_batch(shape), precision)
                case = f"{architecture}, checkpointing={checkpointing}, {precision.value}, {shape}"
                assert predicted.step(shape).saved == pytest.approx(measured, rel=0.10), case
        unpadded = SHAPES[-1]  # no (rows x width x width) mask in any layer, which the padded shape keeps
        assert predicted.step(unpadded).peak < predicted.step(dataclasses.replace(unpadded, padded=True)).peak


def padded_width(batch: list[list[int]], lengths: list[int], batching: str) -> int:
    """A micro-batch's width as the collator builds it: a packed row is its samples end to end, other batches are as
    wide as their longest row."""
    if batching == "packed":
        return sum(lengths[i] for i in batch[0])
    return max(lengths[i] for row in batch for i in row)


@pytest.mark.parametrize("batching", ["random", "token_budget", "packed"])
def test_each_ranks_costliest_micro_batch_is_the_one_its_sampler_hands_it_in_any_epoch(datasets_cache, batching):
    """Each rank's planned micro-batch is, of all its sampler hands it over 3 epochs, the one with the most padded
    tokens, or the widest of all ranks' where that one is this rank's (a mask grows with the width: the simulation
    decides between the two), as the collator builds it."""
    settings = [f"data.batching={batching}", "data.max_length=2048", "trainer.epochs=3", "trainer.seed=0"]
    cfg = compose_config([*settings, f"data.cache_dir={datasets_cache}"])
    data = build_datasets(cfg.data, build_tokenizer(cfg.model), cfg.trainer.seed)
    plan = make_plan(cfg, data, world_size=2, with_levers=False)
    spec = build_batching_spec(cfg.data, 2, cfg.optim.grad_accum_steps, cfg.trainer.seed)
    collate = Collator(pad_id=0, pad_to_multiple_of=cfg.data.pad_to_multiple_of, packed=batching == "packed")
    rows = data.train.with_format(None, columns=["input_ids", "labels"])
    lengths = data.train["length"]
    assert [s.candidate.rank for s in plan.ranks] == [0, 1]
    handed = []  # (rank, padded tokens, width, epoch, the rows): what the collator would build, from the lengths
    for rank in (0, 1):
        sampler = DistributedBatchSampler(lengths, spec, rank, data.epoch_rows)
        for epoch in range(cfg.trainer.epochs):
            sampler.set_epoch(epoch)
            for batch in sampler:
                width = padded_width(batch, lengths, batching)
                handed.append((rank, len(batch) * width, width, epoch, batch))
    widest = max((b[2], b[1]) for b in handed)
    later_epochs_cost_more = False
    for rank, planned in enumerate(plan.ranks):
        own = [b for b in handed if b[0] == rank]
        most = max(b[1:3] for b in own)
        later_epochs_cost_more |= most > max(b[1:3] for b in own if b[3] == 0)
        # The batches as built for real: the most padded tokens (and any tied), the widest if it is this rank's.
        built = [
            collate([[rows[i] for i in row] for row in b[4]]) for b in own if most == b[1:3] or widest == (b[2], b[1])
        ]
        costliest = {(*c["input_ids"].shape, c["target_index"].numel()) for c in built}
        shape = planned.candidate.shape
        assert (shape.rows, shape.width, shape.targets) in costliest, (
            f"rank {rank}: {shape} not in {sorted(costliest)[:5]}"
        )
    if batching == "random":
        assert later_epochs_cost_more, "the data no longer tells a search of epoch 0 alone from a search of every epoch"


def test_the_command_says_whether_the_run_fits_and_what_would_make_it(capsys, datasets_cache):
    common = [f"data.cache_dir={datasets_cache}", "data.max_rows=400"]
    assert main([*common, "plan.device_memory_gb=0.04"]) == DOES_NOT_FIT
    out = capsys.readouterr().out
    assert "DOES NOT FIT: predicted peak" in out
    levers = out.split("levers (")[1].splitlines()[1:]
    assert {line.split()[0] for line in levers} >= {"model.gradient_checkpointing=true", "data.max_length=256"}
    # The largest micro-batch it names fits the same device, and one row more does not (the real batches of these
    # rows are padded to data.max_length: the longest row of any batch reaches it).
    largest = int(re.search(r"largest that fits: data.micro_batch_size=(\d+) at data.max_length=512", out).group(1))
    assert main([*common, "plan.device_memory_gb=0.04", f"data.micro_batch_size={largest}", "--no-levers"]) == 0
    assert "fits: predicted peak" in capsys.readouterr().out
    assert (
        main([*common, "plan.device_memory_gb=0.04", f"data.micro_batch_size={largest + 1}", "--no-levers"])
        == DOES_NOT_FIT
    )
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert main([*common, "plan.device_memory_gb=8", "--no-levers"]) == 0
    assert "fits: predicted peak" in capsys.readouterr().out
    assert main([*common, "plan.device_memory_gb=-1"]) == 2
    assert "plan.device_memory_gb=-1.0 must be positive" in capsys.readouterr().err


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_starting_run_logs_its_plan_and_starts_where_it_does_not_fit_when_told(
    one_rank_group, datasets_cache, caplog
):
    cfg = compose_config(["parallel=single", "data.max_rows=400", f"data.cache_dir={datasets_cache}"])
    data = build_datasets(cfg.data, build_tokenizer(cfg.model), cfg.trainer.seed)
    assert plan_at_start(cfg, data, rank=0, world_size=1).train_gb == [], "CPU and no device size: no plan at start"
    roomy = dataclasses.replace(cfg, plan=PlanConfig(device_memory_gb=8.0))
    with caplog.at_level(logging.INFO, logger="ddptrain.plan"):
        prediction = plan_at_start(roomy, data, rank=0, world_size=1)
    assert "memory plan: predicted peak per rank" in caplog.text and "of 8.00 GiB per device" in caplog.text
    assert len(prediction.train_gb) == 1 and 0.05 < prediction.train_gb[0] < 1.0
    anyway = dataclasses.replace(cfg, plan=PlanConfig(device_memory_gb=0.05, stop_if_no_fit=False))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ddptrain.plan"):
        assert plan_at_start(anyway, data, rank=0, world_size=1).train_gb == prediction.train_gb
    assert "DOES NOT FIT" in caplog.text and "starting anyway: plan.stop_if_no_fit=false" in caplog.text
    # Stopping, it names settings that fit: each of them, planned again on the same device, fits.
    stopping = dataclasses.replace(cfg, plan=PlanConfig(device_memory_gb=0.065))
    with pytest.raises(RunDoesNotFit, match="predicted to fit with") as refused:
        plan_at_start(stopping, data, rank=0, world_size=1)
    named = str(refused.value).split("predicted to fit with ")[1].split(". Nothing was loaded")[0].split("; or ")
    assert len(named) >= 2, str(refused.value)
    common = ["parallel=single", "data.max_rows=400", f"data.cache_dir={datasets_cache}"]
    for fix in named:
        # "data.max_length=256 (0.06 GiB)", "data.micro_batch_size=3 at data.max_length=512 (the largest that fits)"
        overrides = fix.rsplit(" (", 1)[0].replace(" at ", " ").split()
        assert main([*common, *overrides, "plan.device_memory_gb=0.065", "--no-levers"]) == 0, fix
