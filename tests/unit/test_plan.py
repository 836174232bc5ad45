"""The memory plan (issue 24): predicted activations against what a real step keeps, the costliest micro-batch
against what the sampler hands each rank, and the command's verdict."""

from __future__ import annotations

import dataclasses
import json
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
from ddptrain.plan import budget, simulate
from ddptrain.plan.__main__ import DOES_NOT_FIT, main
from ddptrain.plan.at_start import RunDoesNotFit, plan_at_start
from ddptrain.plan.budget import MemoryPlan
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


PACKED_WIDTH = 8192  # tokens in one packed row (issue 38): its square is 64 M elements, 256 MiB of fp32 scores


def test_a_packed_row_under_flash_attention_2_is_planned_without_a_term_in_the_square_of_its_width(monkeypatch):
    """A packed row of 8,192 tokens under model.attn_implementation=flash_attention_2, checkpointing off: no tensor
    the simulated step allocates (every op's output, forward and backward, as the simulation counts it) is as large
    as width x width, and planned at 4,096 and at 8,192 tokens the step's bytes kept and its peak grow linearly:
    twice the tokens take at most twice the bytes (a term in the square of the width would take four times its
    share). The same row under SDPA does allocate a (width x width) mask, so the check can tell the two apart.
    And flash keeps for backward what flash-attn's autograd function keeps, seen on the tensors the simulated
    forward hands autograd to keep: in every layer its output (like the query: rows x width x heads x head dim, in
    bf16) beside the query, the key and the value, and the log-sum-exp of each query row (rows x heads x width,
    fp32). A simulation that allocated or kept nothing would pass the checks above and fail this one."""
    allocated: list[torch.Size] = []
    track = simulate.LiveBytes._track

    def recording(live, t):
        allocated.append(t.shape)
        return track(live, t)

    kept: dict[int, set[tuple[tuple[int, ...], torch.dtype]]] = {}  # storage -> the tensors kept on it
    hooks = torch.autograd.graph.saved_tensors_hooks

    def recording_hooks(pack, unpack):  # around the simulation's own counting (simulate._saved_bytes)
        def recording_pack(t):
            kept.setdefault(t.untyped_storage()._cdata, set()).add((tuple(t.shape), t.dtype))
            return pack(t)

        return hooks(recording_pack, unpack)

    monkeypatch.setattr(simulate.LiveBytes, "_track", recording)
    monkeypatch.setattr(torch.autograd.graph, "saved_tensors_hooks", recording_hooks)
    steps = {}
    config = AutoConfig.from_pretrained(TINY_QWEN2)
    for attention in ("flash_attention_2", "sdpa"):
        cfg = ModelConfig(name_or_path=TINY_QWEN2, init="random", dtype="bf16", attn_implementation=attention)
        model = FakeModel(AutoConfig.from_pretrained(TINY_QWEN2), cfg, DType.bf16)
        for width in (PACKED_WIDTH // 2, PACKED_WIDTH):
            allocated.clear()
            kept.clear()
            steps[attention, width] = model.step(BatchShape(1, width, width // 2, padded=False, packed=True))
        squares = [shape for shape in allocated if shape.numel() >= PACKED_WIDTH**2]
        assert bool(squares) == (attention == "sdpa"), f"{attention}: tensors of width x width or more: {squares}"
        if attention == "flash_attention_2":  # the step at PACKED_WIDTH: what it kept, storage by storage
            heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
            head_dim = config.hidden_size // heads
            layers = config.num_hidden_layers  # the tiny model has 2: simulated whole, each layer once

            def storages(shape, dtype) -> int:
                return sum((shape, dtype) in tensors for tensors in kept.values())

            width = PACKED_WIDTH
            assert storages((1, heads, width), torch.float32) == layers, "a log-sum-exp per layer, fp32"
            assert storages((1, width, heads, head_dim), torch.bfloat16) >= 2 * layers, "output and query per layer"
            assert storages((1, width, kv_heads, head_dim), torch.bfloat16) >= 2 * layers, "key and value per layer"
    half, whole = steps["flash_attention_2", PACKED_WIDTH // 2], steps["flash_attention_2", PACKED_WIDTH]
    assert whole.saved <= 2 * half.saved and whole.peak <= 2 * half.peak, (half, whole)
    sdpa_half, sdpa_whole = steps["sdpa", PACKED_WIDTH // 2], steps["sdpa", PACKED_WIDTH]
    assert sdpa_whole.saved > 2 * sdpa_half.saved, "SDPA's mask grows with the square of the width"


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
    # The tensors alone (no resident set at start), on a device as small as they are.
    common = [f"data.cache_dir={datasets_cache}", "data.max_rows=400", "plan.resident_baseline_gb=0"]
    assert main([*common, "plan.device_memory_gb=0.04"]) == DOES_NOT_FIT
    out = capsys.readouterr().out
    assert "DOES NOT FIT: predicted peak" in out
    levers = out.split("levers (the fullest rank's peak")[1].splitlines()[1:]
    assert {line.split()[0] for line in levers} >= {"model.gradient_checkpointing=true", "data.max_length=256"}
    # Two largest micro-batches, each with its label: for any data (every row at data.max_length, every position
    # trained) and for these rows (their longest together). Each fits the same device, planned again on these rows
    # through the run's sampler. That the worst case's one row more does not fit, and that it does, is measured on
    # such rows in test_the_largest_micro_batch_the_plan_names_measures_within_15_percent_and_one_row_more_does_not_fit,
    # where the rows are shorter than data.max_length and that test's figure is the one for its data.
    worst = re.search(
        r"largest that fits any data \(every row at data.max_length, every token trained\): "
        r"data.micro_batch_size=(\d+) at data.max_length=512\n",
        out,
    )
    on_data = re.search(
        r"largest that fits this data \(rows as wide as its longest, as many tokens trained as its most-trained "
        r"rows\): data.micro_batch_size=(\d+)\n",
        out,
    )
    assert worst and on_data, out
    largest = {int(worst.group(1)), int(on_data.group(1))}
    assert int(on_data.group(1)) >= int(worst.group(1)), "the data's rows are no longer than data.max_length"
    for size in largest:
        assert main([*common, "plan.device_memory_gb=0.04", f"data.micro_batch_size={size}", "--no-levers"]) == 0
        assert "fits: predicted peak" in capsys.readouterr().out
    assert main([*common, "plan.device_memory_gb=8", "--no-levers"]) == 0
    assert "fits: predicted peak" in capsys.readouterr().out
    assert main([*common, "plan.device_memory_gb=-1"]) == 2
    assert "plan.device_memory_gb=-1.0 must be positive" in capsys.readouterr().err


def test_the_largest_that_fits_this_data_stops_where_one_micro_batch_holds_all_of_it(datasets_cache) -> None:
    """token_budget and packed: the bundled data's first 30 rows at data.max_length=256 (28 with something to train
    on), on a device that holds them all in one micro-batch with room (0.3 GiB, the tensors alone; the worst case
    fits over 1.5 times their tokens). The largest data.max_tokens_per_batch that fits this data is the least that
    puts every training row in one micro-batch, and says so, not a size the search doubled to once the micro-batch
    stopped growing: a multiple of data.max_length (the search's step) whose budget the run's own batch plan
    (``data.plan.plan_epoch``) fills with every row in one micro-batch, where one data.max_length less takes two.
    (random and length_grouped stop at every row as they did, data.micro_batch_size=28, labelled the same way.)"""
    from ddptrain.data.plan import plan_epoch
    from ddptrain.plan.planner import ALL_ROWS

    for batching in ("token_budget", "packed"):
        cfg = compose_config(
            [
                "parallel=single",
                "data.max_rows=30",
                "data.max_length=256",
                "data.eval_fraction=0",
                f"data.batching={batching}",
                "plan.device_memory_gb=0.3",
                "plan.resident_baseline_gb=0",
                f"data.cache_dir={datasets_cache}",
            ]
        )
        data = build_datasets(cfg.data, build_tokenizer(cfg.model), cfg.trainer.seed)
        rows, lengths = len(data.train), data.train["length"]
        plan = make_plan(cfg, data, world_size=1)
        label = re.escape(f" ({ALL_ROWS.format(rows=rows)})")
        named = re.fullmatch(rf"data\.max_tokens_per_batch=(\d+){label}", plan.largest_on_data or "")
        assert named, f"{batching}: {plan.largest_on_data}"
        budget = int(named.group(1))
        assert budget % cfg.data.max_length == 0, budget
        for tokens, micro_steps in ((budget, 1), (budget - cfg.data.max_length, 2)):
            d = dataclasses.replace(cfg.data, max_tokens_per_batch=tokens)
            steps = plan_epoch(lengths, build_batching_spec(d, 1, 1, cfg.trainer.seed), 0)
            assert len(steps) == micro_steps, f"{batching} at {tokens} tokens: {len(steps)} micro-steps"
            if micro_steps == 1:
                assert sorted(i for row in steps[0][0] for i in row) == list(range(rows))


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
    # The tensors alone (plan.resident_baseline_gb=0), on devices as small as they are; this process's allocator as
    # it is (plan.cpu_returns_freed_memory=false: the tests after this one run in it).
    here = {"resident_baseline_gb": 0, "cpu_returns_freed_memory": False}
    roomy = dataclasses.replace(cfg, plan=PlanConfig(device_memory_gb=8.0, **here))
    with caplog.at_level(logging.INFO, logger="ddptrain.plan"):
        prediction = plan_at_start(roomy, data, rank=0, world_size=1)
    assert "memory plan: predicted peak per rank" in caplog.text and "of 8.00 GiB per device" in caplog.text
    assert len(prediction.train_gb) == 1 and 0.05 < prediction.train_gb[0] < 1.0
    anyway = dataclasses.replace(cfg, plan=PlanConfig(device_memory_gb=0.05, stop_if_no_fit=False, **here))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ddptrain.plan"):
        assert plan_at_start(anyway, data, rank=0, world_size=1).train_gb == prediction.train_gb
    assert "DOES NOT FIT" in caplog.text and "starting anyway: plan.stop_if_no_fit=false" in caplog.text
    # Stopping, it names settings that fit: each of them, planned again on the same device, fits.
    stopping = dataclasses.replace(cfg, plan=PlanConfig(device_memory_gb=0.065, **here))
    with pytest.raises(RunDoesNotFit, match="predicted to fit with") as refused:
        plan_at_start(stopping, data, rank=0, world_size=1)
    named = str(refused.value).split("predicted to fit with ")[1].split(". Nothing was loaded")[0].split("; or ")
    assert len(named) >= 2, str(refused.value)
    common = ["parallel=single", "data.max_rows=400", f"data.cache_dir={datasets_cache}", "plan.resident_baseline_gb=0"]
    for fix in named:
        # "data.max_length=256 (0.06 GiB)", "data.micro_batch_size=3 (the largest that fits this data)"
        overrides = fix.rsplit(" (", 1)[0].replace(" at ", " ").split()
        assert main([*common, *overrides, "plan.device_memory_gb=0.065", "--no-levers"]) == 0, fix


LARGEST_LENGTH = 2048  # data.max_length: every row of the largest micro-batch at it
TOLERANCE = 0.15  # the plan's, as the 2-rank peak test holds it to (tests/distributed/test_evaluation.py)
# plan.device_memory_gb: 208 MiB, room for 2 such rows (planned 176 MiB), not 3 (253 MiB). For the fit and the
# overflow to be told apart by measurement on any machine the plan holds to TOLERANCE, the device sits at least
# TOLERANCE above the named size's plan and below the next one's: 208 / 176 = 1.18, 208 / 253 = 0.82. (With 3 rows
# named, the next size is only 4/3 of it, less than (1 + TOLERANCE) / (1 - TOLERANCE) = 1.35: no such device.)
DEVICE_GB = 208 / 1024


def test_the_largest_micro_batch_the_plan_names_measures_within_15_percent_and_one_row_more_does_not_fit(
    tmp_path, datasets_cache
) -> None:
    """For a declared device of 208 MiB the plan names the largest data.micro_batch_size at data.max_length=2048.
    A real step (the run's model and optimizer, in a process of its own) on that many rows at data.max_length (one
    row a few tokens short: padded, as the plan takes the widest micro-batch to be) adds, measured by the peak
    resident set (``workers_evaluation.measure_the_steps_of_saved_batches``), within 15% of what the plan predicts
    for that setting, and fits the device; with one row more it needs more than the device has, measured the same
    way (the weights and the optimizer's states alive before each step counted on the real tensors)."""
    from ddptrain.data.collate import Collator
    from ddptrain.launch import launch
    from tests.distributed.workers_evaluation import measure_the_steps_of_saved_batches

    # Each "red" is one token: the first row ends a few tokens short of data.max_length, the others are cut there.
    words = [LARGEST_LENGTH - 8, *[LARGEST_LENGTH + 50] * 4]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(["red"] * n)}) + "\n" for n in words))
    common = [
        "parallel=single",
        f"data.path={path}",
        "data.template=text",
        f"data.max_length={LARGEST_LENGTH}",
        "data.batching=random",
        "data.eval_fraction=0",
        "trainer.save_check=off",  # rank 0's save check is a peak of its own: the batch alone decides here
        f"plan.device_memory_gb={DEVICE_GB}",
        "plan.resident_baseline_gb=0",  # the tensors alone, as measured below
        f"data.cache_dir={datasets_cache}",
    ]
    tokenizer = build_tokenizer(compose_config(common).model)

    def planned(rows: int, largest: bool = False) -> tuple[MemoryPlan, list[dict]]:
        """The plan of data.micro_batch_size=rows over the first ``rows`` rows (one micro-batch), and the rows."""
        cfg = compose_config([*common, f"data.micro_batch_size={rows}", f"data.max_rows={rows}"])
        data = build_datasets(cfg.data, tokenizer, cfg.trainer.seed)
        plan = make_plan(cfg, data, world_size=1, with_levers=largest)
        return plan, data.train.with_format(None, columns=["input_ids", "labels"])

    stated = planned(1, largest=True)[0].largest
    named = re.fullmatch(rf"data\.micro_batch_size=(\d+) at data\.max_length={LARGEST_LENGTH}", stated or "")
    assert named, stated
    largest = int(named.group(1))
    assert largest >= 2, "one row more must be a large enough part of the batch to tell apart"
    # The same rows (n words make n + 1 tokens) under data.max_length=4096: the worst case now has rows twice as long
    # and names fewer, while the largest for this data, its longest rows together, is the size measured below.
    same_rows = tmp_path / "same-rows.jsonl"
    same_rows.write_text(
        "".join(json.dumps({"text": " ".join(["red"] * min(n, LARGEST_LENGTH - 1))}) + "\n" for n in words)
    )
    longer = compose_config(
        [
            *common,
            f"data.path={same_rows}",
            "data.max_length=4096",
            f"data.max_rows={len(words)}",
            "data.micro_batch_size=1",
        ]
    )
    longer_plan = make_plan(longer, build_datasets(longer.data, tokenizer, longer.trainer.seed), world_size=1)
    assert longer_plan.largest_on_data == f"data.micro_batch_size={largest}", longer_plan.largest_on_data
    worst = re.fullmatch(r"data\.micro_batch_size=(\d+) at data\.max_length=4096", longer_plan.largest or "")
    assert longer_plan.largest.startswith("nothing fits") or int(worst.group(1)) < largest, longer_plan.largest
    collate = Collator(pad_id=0, pad_to_multiple_of=1)
    plans, batches = [], []
    for rows in (largest, largest + 1):
        plan, train = planned(rows)
        shape = plan.fullest.candidate.shape
        assert (shape.rows, shape.width, shape.padded) == (rows, LARGEST_LENGTH, True), shape
        batches.append(collate([[train[i]] for i in plan.fullest.candidate.samples]))
        plans.append(plan)
    # A first step on a short row: the CPU runtime's one-time allocations (17 MiB here: the autograd engine, oneDNN's
    # first kernels) are not a micro-batch's, and the optimizer's states exist from then on, as in a run's later steps.
    warm_up = collate([[{key: values[:64] for key, values in train[0].items()}]])
    torch.save([warm_up, *batches], tmp_path / "batches.pt")
    cfg = compose_config([*common, f"trainer.output_dir={tmp_path}"])
    launch(cfg, tmp_path, entrypoint=measure_the_steps_of_saved_batches)
    measured = json.loads((tmp_path / "steps.json").read_text())
    _, fits, one_more = measured["steps"]
    # What the plan predicts beyond what was alive before the step: the weights and the optimizer's states.
    predicted = plans[0].peak(plans[0].fullest) - measured["weights"] - fits["alive_before"]
    error = abs(predicted - fits["increase"]) / fits["increase"]
    mib = 2**20
    assert error <= TOLERANCE, (
        f"{largest} rows: predicted {predicted / mib:.1f} MiB, measured {fits['increase'] / mib:.1f}"
    )
    device = DEVICE_GB * 2**30
    used, needed = (measured["weights"] + m["alive_before"] + m["increase"] for m in (fits, one_more))
    assert used <= device, f"{largest} rows, named as fitting, took {used / mib:.1f} MiB of {device / mib:.1f}"
    assert needed > device, f"{largest + 1} rows needed only {needed / mib:.1f} MiB of the device's {device / mib:.1f}"
    print(
        f"{largest} rows: predicted {predicted / mib:.1f} MiB, measured {fits['increase'] / mib:.1f}, "
        f"{used / mib:.1f} in all; {largest + 1} rows: {needed / mib:.1f} MiB in all; device {device / mib:.1f}"
    )


@pytest.fixture(scope="module")
def bundled_data(datasets_cache):
    """The bundled instructions, 200 rows, tokenized once for the tests below."""
    cfg = compose_config(["data.max_rows=200", f"data.cache_dir={datasets_cache}"])
    return build_datasets(cfg.data, build_tokenizer(cfg.model), cfg.trainer.seed)


def test_a_cuda_plan_adds_each_fixed_cost_as_its_plan_key_sets_it_and_names_the_key(bundled_data) -> None:
    """Planned for trainer.device=cuda (fake tensors: no GPU needed), each rank's peak is the same run's CPU plan
    (same precision: the same tensors; plan.resident_baseline_gb=0: no resident set at start) plus
    plan.cuda_context_gb, plan.nccl_gb on more than one rank, and plan.allocator_slack of what the allocator holds,
    each at a value other than its default; the printed plan names each key on its row; the save check adds nothing
    to the device (a GPU run loads the base on the host)."""
    from ddptrain.plan.render import render_plan

    common = ["data.max_rows=200", "trainer.precision=bf16", "plan.device_memory_gb=8", "plan.resident_baseline_gb=0"]
    keys = ["plan.cuda_context_gb=0.75", "plan.nccl_gb=1.5", "plan.allocator_slack=0.1"]
    for parallel, world_size, fixed in (("ddp2", 2, 0.75 + 1.5), ("single", 1, 0.75)):
        plans = {
            device: make_plan(
                compose_config([*common, *keys, f"parallel={parallel}", f"trainer.device={device}"]),
                bundled_data,
                world_size,
                with_levers=False,
            )
            for device in ("cuda", "cpu")
        }
        assert plans["cpu"].fixed == {} and plans["cpu"].save_check > 0, "the CPU plan adds nothing of a GPU's"
        assert plans["cuda"].save_check == 0
        for cuda, cpu in zip(plans["cuda"].ranks, plans["cpu"].ranks, strict=True):
            allocated = plans["cpu"].peak(cpu)
            assert plans["cuda"].allocated(cuda) == allocated, "the same tensors on both devices"
            expected = allocated + int(fixed * budget.GIB) + int(0.1 * allocated)
            assert abs(plans["cuda"].peak(cuda) - expected) <= 1, (parallel, plans["cuda"].fixed)  # int() of each
        text = render_plan(plans["cuda"], "plan")
        named = ["CUDA context (plan.cuda_context_gb)", "allocator slack (plan.allocator_slack: 10%)"]
        named += ["NCCL buffers (plan.nccl_gb)"] if world_size > 1 else []
        assert all(name in text for name in named), text
        assert ("NCCL" in text) == (world_size > 1)


def test_the_save_check_term_of_a_cpu_plan_is_the_copy_of_the_weights_the_check_loads(bundled_data) -> None:
    """On a CPU run rank 0's save check loads the saved model's weights again, beside the training model: with LoRA
    the base (``AutoModelForCausalLM.from_pretrained`` in model.dtype) and three fp32 logits of its probe (the
    training model's, the loaded adapter's, the merged model's); a full fine-tune the whole model. The plan's term
    is that, the weights measured here on a model built from the config (a tied LM head is one tensor)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ddptrain.evaluation.save_check import Probe
    from ddptrain.model.precision import TORCH_DTYPES

    common = ["data.max_rows=200", "parallel=single"]
    cfg = compose_config(common)
    config = AutoConfig.from_pretrained(cfg.model.name_or_path)
    with torch.device("meta"):  # shapes and dtypes, no memory
        base = AutoModelForCausalLM.from_config(config, dtype=TORCH_DTYPES[cfg.model.dtype])
    weights = sum(p.numel() * p.element_size() for p in base.parameters())  # each shared tensor once
    probe = Probe.from_rows(bundled_data.train[:2]["input_ids"], pad_id=0)  # the run's first two rows, as the check
    logits = probe.input_ids.numel() * config.vocab_size * torch.finfo(torch.float32).bits // 8
    lora = make_plan(cfg, bundled_data, world_size=1, with_levers=False)
    assert lora.save_check == weights + 3 * logits, (lora.save_check, weights, logits)
    assert lora.check_peak == lora.held + lora.save_check
    full = make_plan(compose_config([*common, "model.lora=false"]), bundled_data, world_size=1, with_levers=False)
    assert full.save_check == weights, (full.save_check, weights)
    off = make_plan(compose_config([*common, "trainer.save_check=off"]), bundled_data, world_size=1, with_levers=False)
    assert off.save_check == 0 and off.check_peak == 0
