"""The memory plan under parallel.strategy=fsdp2 (issue 39): what a rank holds, checked against what
``fully_shard`` really leaves on a rank, and the lever that names FSDP2 where DDP does not fit.

The oracle is FSDP2 itself, in this one process: a fake process group of N ranks (``torch.testing``'s "fake"
backend: collectives that return at once) lets ``fully_shard`` cut the real model as rank 0 of N would hold it, and
a micro-step run without gradient sync leaves the unsharded gradients FSDP2 keeps between micro-steps. Nothing is
read from the planner's own formulas.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddptrain.config import ModelConfig
from ddptrain.data import build_datasets
from ddptrain.model import build_model, build_tokenizer
from ddptrain.plan.__main__ import DOES_NOT_FIT, main
from ddptrain.plan.at_start import _one_line
from ddptrain.plan.budget import GIB
from ddptrain.plan.planner import make_plan
from ddptrain.plan.render import render_plan
from tests.conftest import compose_config
from tests.unit.test_plan import TINY_QWEN2, tiny_llama

RANKS = 3  # odd: the tiny models' first dimensions (128, 384, 4352) do not all divide by it, so padding shows
COMMON = ["data.max_rows=200", "plan.resident_baseline_gb=0", "trainer.save_check=off", "plan.max_epochs=1"]


@pytest.fixture(scope="module")
def data(datasets_cache):
    """The bundled instructions, 200 rows, tokenized once for the tests below."""
    cfg = compose_config(["data.max_rows=200", f"data.cache_dir={datasets_cache}"])
    return build_datasets(cfg.data, build_tokenizer(cfg.model), cfg.trainer.seed)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return tiny_llama(tmp_path_factory.mktemp("llama"))


@contextlib.contextmanager
def fake_ranks(n: int) -> Iterator[None]:
    """This process as rank 0 of ``n``, over collectives that do nothing (shapes, not values, are what count)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=n, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded(model: ModelConfig, mp_policy=None) -> tuple[nn.Module, list]:
    """The real model, cut by ``fully_shard`` as the runtime cuts it (one unit per decoder layer, then the root)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    module = build_model(model, seed=0, device=torch.device("cpu"))
    lists = [m for m in module.modules() if isinstance(m, nn.ModuleList)]
    layers = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    policy = mp_policy or MixedPrecisionPolicy()
    units = [fully_shard(layer, mp_policy=policy) for layer in layers]
    return module, [*units, fully_shard(module, mp_policy=policy)]


def local_bytes(module: nn.Module) -> tuple[dict[str, int], int]:
    """Rank 0's shards as FSDP2 holds them: bytes by dtype, and elements of the trainable ones (rank 0's shard is
    the padded size every rank's storage has: the first ceil(rows / N) rows)."""
    by_dtype: dict[str, int] = {}
    trainable = 0
    for p in module.parameters():
        local = p.to_local()
        name = str(local.dtype).removeprefix("torch.")
        by_dtype[name] = by_dtype.get(name, 0) + local.numel() * local.element_size()
        trainable += local.numel() if p.requires_grad else 0
    return by_dtype, trainable


@pytest.mark.parametrize(
    "case",
    [("qwen2", "fp32", "false"), ("qwen2", "bf16", "true"), ("llama", "fp32", "true")],
    ids=["qwen2-full-fp32", "qwen2-lora-bf16", "llama5-lora-fp32"],
)
def test_fsdp2_holds_what_fully_shard_leaves_on_a_rank_ddp_s_bytes_divided_by_the_ranks(case, data, llama) -> None:
    """Per rank, the plan's weights (by dtype), gradients and AdamW states under fsdp2 are rank 0's shards of the
    real model cut by fully_shard over 3 ranks (gradients and both AdamW states fp32, shaped like the trainable
    shards), and DDP's figures for the same run divided by 3, up to less than one row of padding per parameter.
    The 5-layer Llama is planned from 2 and 3 layers carried on to 5."""
    architecture, dtype, lora = case
    path = TINY_QWEN2 if architecture == "qwen2" else llama
    run = [*COMMON, f"model.name_or_path={path}", f"model.dtype={dtype}", f"model.lora={lora}"]
    fsdp2 = make_plan(compose_config([*run, "parallel=fsdp2_2"]), data, RANKS, with_levers=False)
    ddp = make_plan(compose_config([*run, "parallel=ddp2"]), data, RANKS, with_levers=False)

    model_cfg = compose_config(run).model
    built = build_model(model_cfg, 0, "cpu")
    rows = {n: p.numel() // p.shape[0] * p.element_size() for n, p in built.named_parameters()}
    with fake_ranks(RANKS):
        module, _ = sharded(model_cfg)
        weights, trainable = local_bytes(module)
    fp32 = torch.finfo(torch.float32).bits // 8
    assert fsdp2.weights == weights, (fsdp2.weights, weights)
    assert fsdp2.gradients == trainable * fp32 and fsdp2.optimizer == 2 * trainable * fp32
    padding = sum(rows.values())  # at most one row of each parameter on a rank beyond its 1/N
    for name, size in ddp.weights.items():
        assert size / RANKS <= fsdp2.weights[name] < size / RANKS + padding, name
    for held in ("gradients", "optimizer"):
        assert getattr(ddp, held) / RANKS <= getattr(fsdp2, held) < getattr(ddp, held) / RANKS + 2 * padding, held


def test_accumulation_adds_the_unsharded_gradients_fsdp2_keeps_between_micro_steps(data) -> None:
    """With optim.grad_accum_steps=2 the plan holds, beside the shards, what FSDP2 itself keeps after a micro-step
    without gradient sync (``set_requires_gradient_sync(False)``): every unit's unsharded gradients, measured on
    the real model; one micro-step per optimizer step holds none, and DDP, which accumulates in its buckets,
    neither."""
    run = [*COMMON, "model.lora=false", "parallel=fsdp2_2"]
    once = make_plan(compose_config(run), data, RANKS, with_levers=False)
    twice = make_plan(compose_config([*run, "optim.grad_accum_steps=2"]), data, RANKS, with_levers=False)
    ddp = make_plan(compose_config([*run, "parallel=ddp2", "optim.grad_accum_steps=2"]), data, RANKS, False)

    with fake_ranks(RANKS):
        module, units = sharded(compose_config(run).model)
        module.set_requires_gradient_sync(False)
        ids = torch.randint(0, 4000, (2, 16))
        loss, _ = module(input_ids=ids, labels=ids, attention_mask=torch.ones_like(ids), target_index=torch.arange(8))
        loss.backward()
        kept = 0
        for unit in units:
            for param in unit._get_fsdp_state()._fsdp_param_group.fsdp_params:
                grad = param.unsharded_accumulated_grad
                grad = param._unsharded_param.grad if grad is None else grad
                kept += 0 if grad is None else grad.numel() * grad.element_size()
    assert kept > 0, "FSDP2 kept no unsharded gradient: the oracle measured nothing"
    rows = {name: size for name, size in twice.sharding.items() if name.startswith("no-sync gradients")}
    assert rows == {"no-sync gradients (optim.grad_accum_steps=2)": kept}, (rows, kept)
    assert not any(name.startswith("no-sync") for name in once.sharding) and not ddp.sharding
    assert twice.held - once.held == kept


def test_cpu_offload_takes_the_shards_off_the_gpu_and_changes_nothing_on_a_cpu(data) -> None:
    """parallel.cpu_offload=true on a GPU (planned on fake tensors): each rank's peak as the allocator counts it
    falls by exactly its shards, their gradients and AdamW's states, which the plan says are in host memory; the
    gathered layers, buffers and activations stay. On a CPU run the host is the device: nothing moves."""
    gpu = [*COMMON, "parallel=fsdp2_2", "trainer.device=cuda", "trainer.precision=bf16", "plan.device_memory_gb=8"]
    on = make_plan(compose_config(gpu), data, RANKS, with_levers=False)
    off = make_plan(compose_config([*gpu, "parallel.cpu_offload=true"]), data, RANKS, with_levers=False)
    shards = sum(on.weights.values()) + on.gradients + on.optimizer
    assert shards > 0 and off.host == shards
    assert off.sharding == on.sharding
    for a, b in zip(on.ranks, off.ranks, strict=True):
        assert on.allocated(a) - off.allocated(b) == shards
    assert "in host memory (parallel.cpu_offload=true)" in render_plan(off, "plan")
    cpu = [*COMMON, "parallel=fsdp2_2"]
    here = make_plan(compose_config(cpu), data, RANKS, with_levers=False)
    offloaded = make_plan(compose_config([*cpu, "parallel.cpu_offload=true"]), data, RANKS, with_levers=False)
    assert offloaded.host == 0 and [here.peak(s) for s in here.ranks] == [offloaded.peak(s) for s in offloaded.ranks]


def test_reshard_after_forward_false_keeps_every_layer_gathered_and_its_lever_is_the_plan_with_true(
    data, llama
) -> None:
    """The 5-layer Llama, full fine-tune: with parallel.reshard_after_forward=false the gathered row holds 3 more
    decoder layers than with true (two in flight), each a layer's parameters padded to 3 ranks' rows as the
    all-gather returns them, in fp32 (no bf16 on a CPU run); its lever parallel.reshard_after_forward=true
    predicts the peak of the plan made with it (one checkpointed row a micro-batch: the weights weigh most)."""
    run = [*COMMON, f"model.name_or_path={llama}", "model.lora=false", "parallel=fsdp2_2", "data.micro_batch_size=1"]
    run.append("model.gradient_checkpointing=true")
    kept = make_plan(compose_config([*run, "parallel.reshard_after_forward=false"]), data, RANKS)
    freed = make_plan(compose_config(run), data, RANKS, with_levers=False)
    layer = build_model(compose_config(run).model, 0, "cpu").model.model.layers[0]
    gathered = sum(p.chunk(RANKS)[0].numel() * RANKS * p.element_size() for p in layer.parameters())

    def row(plan) -> int:
        (size,) = [size for name, size in plan.sharding.items() if name.startswith("gathered")]
        return size

    assert row(kept) - row(freed) == 3 * gathered
    levers = {lever.overrides: lever.peak for lever in kept.levers}
    assert levers["parallel.reshard_after_forward=true"] == freed.peak(freed.fullest), levers


def test_a_ddp_run_that_does_not_fit_names_fsdp2_with_the_peak_it_predicts(data, datasets_cache, capsys) -> None:
    """A full fine-tune of the tiny model on 8 ranks, one checkpointed row a micro-batch (the weights, gradients and
    AdamW states weigh most, as in a 7B full fine-tune), on a device between FSDP2's peak and DDP's (both planned
    here first): the DDP plan does not fit, names parallel.strategy=fsdp2 with FSDP2's own peak, and so does the one
    line a starting run that stops would print; the same run with parallel.strategy=fsdp2 fits that device. The
    printed plan says the strategy."""
    run = [*COMMON, f"data.cache_dir={datasets_cache}", "model.lora=false", "parallel=ddp8", "data.micro_batch_size=1"]
    run.append("model.gradient_checkpointing=true")
    ddp = make_plan(compose_config(run), data, 8, with_levers=False)
    fsdp2 = make_plan(compose_config([*run, "parallel.strategy=fsdp2"]), data, 8, with_levers=False)
    assert fsdp2.worst < ddp.worst, "on 8 ranks the shards outweigh what FSDP2 gathers"
    limit = (ddp.worst + fsdp2.worst) / 2 / GIB

    assert main([*run, f"plan.device_memory_gb={limit}"]) == DOES_NOT_FIT
    out = capsys.readouterr().out
    assert "parallel.strategy=ddp: every rank holds the whole model" in out
    predicted = f"{fsdp2.peak(fsdp2.fullest) / GIB:.2f}"
    assert re.search(rf"^  parallel\.strategy=fsdp2 +{predicted} GiB", out, re.MULTILINE), out
    refused = make_plan(compose_config([*run, f"plan.device_memory_gb={limit}"]), data, 8)
    assert refused.fits is False and f"parallel.strategy=fsdp2 ({predicted} GiB)" in _one_line(refused)

    fitting = dataclasses.replace(fsdp2, device_bytes=int(limit * GIB))
    assert fitting.fits and "parallel.strategy=fsdp2: every rank holds 1/8" in render_plan(fitting, "plan")
