"""parallel.strategy=fsdp2 on 2 gloo ranks against DDP on the same batches: the same training (LoRA and a full
fine-tune, with accumulation), its collectives counted where they run, half the memory held per rank, sharded
checkpoints that resume bit for bit, and weights that load in plain peft.

Five runs of the bundled model, 10 steps each, fp32, optim.grad_accum_steps=2, shared by the tests below: LoRA and a
full fine-tune under each strategy, and the fsdp2 LoRA run resumed from its step-5 checkpoint into a new folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ddptrain.launch import launch
from tests.conftest import compose_config, read_metrics
from tests.distributed.workers_fsdp import train_and_report
from tests.numerics import reordered_sum_tolerance

pytestmark = pytest.mark.dist

STEPS = 10
COMMON = [
    "data.max_rows=400",
    "data.eval_fraction=0",
    "trainer.progress_bar=false",
    "parallel.timeout_s=120",
    f"trainer.max_steps={STEPS}",
    "optim.grad_accum_steps=2",
    "trainer.precision=fp32",
    "trainer.log_every_n_steps=1",
    # No clipping: FSDP2's norm adds its shards' squares in another order than DDP's whole tensors (a relative 1e-5
    # here), and that rounding would go into every update through the clip coefficient.
    "optim.max_grad_norm=null",
]
SAVES = ["trainer.save_every_n_steps=5", "trainer.save_final=true"]
NO_SAVES = ["trainer.save_final=false", "trainer.save_check=off"]
RUNS = {
    "lora-ddp": ["parallel=ddp2", *NO_SAVES],
    "lora-fsdp2": ["parallel=fsdp2_2", *SAVES],
    "full-ddp": ["parallel=ddp2", "model.lora=false", *NO_SAVES],
    "full-fsdp2": ["parallel=fsdp2_2", "model.lora=false", *NO_SAVES],
    # A bf16 model's full fine-tune, which DDP refuses: fp32 masters, gathered in bf16, saved in bf16.
    "full-fsdp2-bf16": ["parallel=fsdp2_2", "model.lora=false", "model.dtype=bf16", *SAVES],
}


def run(out: Path, name: str, overrides: list[str]) -> Path:
    run_dir = out / name
    run_dir.mkdir(parents=True)
    cfg = compose_config([f"trainer.output_dir={out}", *COMMON, *overrides])
    launch(cfg, run_dir, entrypoint=train_and_report)
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("fsdp2")
    done = {name: run(out, name, overrides) for name, overrides in RUNS.items()}
    resume = f"trainer.resume={done['lora-fsdp2']}/checkpoints/step-00000005"
    done["lora-fsdp2-resumed"] = run(out, "lora-fsdp2-resumed", [*RUNS["lora-fsdp2"], resume])
    return done


def params(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "params.pt")


def ranks(run_dir: Path) -> list[dict]:
    return [json.loads((run_dir / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_fsdp2_trains_what_ddp_trains_on_the_same_batches(runs, mode) -> None:
    """Every trainable parameter after 10 steps of 2 micro-steps equals DDP's, bit for bit (fp32, no clipping). On 2
    ranks both add the same two ranks' gradients (an all-reduce; a reduce-scatter, which gloo runs as an all-reduce
    and slices) and halve them, and AdamW steps each element alike, whole or in shards. The gradient norm each step
    logs (its square a sum over every gradient element, in shards against whole tensors) agrees within the rounding
    of that sum in another order: a gradient scaled wrongly is off by the factor."""
    ddp, fsdp2 = params(runs[f"{mode}-ddp"]), params(runs[f"{mode}-fsdp2"])
    assert ddp.keys() == fsdp2.keys() and ddp
    differ = [k for k in ddp if not torch.equal(ddp[k], fsdp2[k])]
    assert not differ, (
        f"{len(differ)} of {len(ddp)} differ, {differ[0]} by {(ddp[differ[0]] - fsdp2[differ[0]]).abs().max():.2e}"
    )
    records = [[r for r in read_metrics(runs[f"{mode}-{s}"]) if "loss" in r] for s in ("ddp", "fsdp2")]
    assert [r["loss"] for r in records[0]] == [r["loss"] for r in records[1]] and len(records[0]) == STEPS
    elements = sum(t.numel() for t in ddp.values())
    tolerance = reordered_sum_tolerance(elements)
    for ours, theirs in zip(*records, strict=True):
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=tolerance), (ours["step"], tolerance)


def layer_and_root_bytes(mode: str) -> tuple[int, int, int, int]:
    """From the model's own parameters, built here as a run builds it: (one decoder layer's bytes, the root's
    bytes, i.e. the rest, the trainable bytes per layer, the root's trainable bytes), each tensor's first dimension
    padded to a multiple of the 2 ranks as FSDP2 pads it."""
    from ddptrain.model import build_model

    cfg = compose_config(["model.lora=false"] if mode == "full" else [])
    model = build_model(cfg.model, seed=0, device=torch.device("cpu"))
    padded = lambda p: (-(-p.shape[0] // 2) * 2) * (p.numel() // max(p.shape[0], 1)) * p.element_size()  # noqa: E731
    layers = model.decoder.layers
    in_layers = {id(p) for p in layers.parameters()}
    layer = [p for p in layers[0].parameters()]
    root = [p for p in model.parameters() if id(p) not in in_layers]
    trained = lambda ps: sum(padded(p) for p in ps if p.requires_grad)  # noqa: E731
    return sum(padded(p) for p in layer), sum(padded(p) for p in root), trained(layer), trained(root)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_the_collectives_are_counted_where_they_run(runs, mode) -> None:
    """Per optimizer step, as FSDP2 called them: one reduce-scatter per unit that trains, at the last micro-step
    only (2 micro-steps, not twice as many), the gradients' bytes; all-gathers of every unit's weights, each layer's
    twice per micro-step (forward, and backward: resharded after forward), the root's once (kept to the backward).
    The expected figures are worked out from the model's parameter shapes here, not from the product's counts."""
    layer, root, layer_trained, root_trained = layer_and_root_bytes(mode)
    n_layers = 2
    records = [r for r in read_metrics(runs[f"{mode}-fsdp2"]) if "loss" in r]
    assert records and not any("allreduce_bytes_per_step" in r for r in records)
    for r in records:
        assert r["reducescatter_calls_per_step"] == n_layers + int(root_trained > 0), r
        assert r["reducescatter_syncs_per_step"] == 1.0, r
        assert r["reducescatter_bytes_per_step"] == n_layers * layer_trained + root_trained, r
        assert r["allgather_calls_per_step"] == 2 * (2 * n_layers + 1), r
        assert r["allgather_bytes_per_step"] == 2 * (2 * n_layers * layer + root), r


def test_a_full_fine_tune_holds_about_half_of_ddps_memory_on_each_rank(runs) -> None:
    """The bytes each rank holds for the parameters, their gradients and AdamW's two states (measured from the
    tensors it holds after training): about half of DDP's on 2 ranks (FSDP2 pads each first dimension to a multiple
    of 2, and DDP's gradients may alias its buckets: within 10% of half)."""
    for ddp, fsdp2 in zip(ranks(runs["full-ddp"]), ranks(runs["full-fsdp2"])):
        for part in ("params_bytes", "grads_bytes", "optimizer_bytes"):
            assert 0.45 <= fsdp2[part] / ddp[part] <= 0.55, (part, fsdp2[part], ddp[part])


def test_each_rank_holds_its_own_shard(runs) -> None:
    """Under fsdp2 the two ranks' parts of every trainable parameter differ (each holds its own half); under DDP
    they are the same replica."""
    sharded, replica = ranks(runs["lora-fsdp2"]), ranks(runs["lora-ddp"])
    assert all(sharded[0]["digests"][k] != sharded[1]["digests"][k] for k in sharded[0]["digests"])
    assert replica[0]["digests"] == replica[1]["digests"]


def test_a_sharded_checkpoint_resumes_bit_identical(runs) -> None:
    """The fsdp2 LoRA run resumed from its step-5 checkpoint (sharded/: each rank's shards and the optimizer's)
    into a new folder ends with the uninterrupted run's parameters, bit for bit, and logs the same losses."""
    resumed_pair = ("lora-fsdp2", "lora-fsdp2-resumed")
    whole, resumed = (params(runs[n]) for n in resumed_pair)
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    checkpoint = runs["lora-fsdp2"] / "checkpoints" / "step-00000005" / "sharded"
    assert sorted(p.name for p in checkpoint.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    last = [[r["loss"] for r in read_metrics(runs[n]) if r.get("step") == STEPS and "loss" in r] for n in resumed_pair]
    assert last[0] == last[1] and last[0]


def test_a_bf16_full_fine_tune_trains_fp32_masters_and_saves_them_in_bf16(runs) -> None:
    """model.dtype=bf16 model.lora=false under fsdp2: the trained parameters are fp32 (the masters AdamW steps); the
    weights it saves (adapter/, checked by the save check at every save) are those masters rounded to bf16, and load
    in plain transformers as such."""
    from transformers import AutoModelForCausalLM

    run_dir = runs["full-fsdp2-bf16"]
    masters = params(run_dir)
    assert masters and all(t.dtype == torch.float32 for t in masters.values())
    loaded = AutoModelForCausalLM.from_pretrained(run_dir / "adapter", dtype=torch.bfloat16).state_dict()
    assert all(torch.equal(loaded[k], v.to(torch.bfloat16)) for k, v in masters.items())
    assert [r["step"] for r in read_metrics(run_dir) if "save_check_s" in r] == [5, 10, 10]


def test_the_adapter_is_the_gathered_tensors_and_loads_in_plain_peft(runs) -> None:
    """adapter/ of the fsdp2 run, loaded with transformers and peft alone onto the base it names: every LoRA tensor
    equals the run's trainable parameter gathered whole, bit for bit; and the save check ran on the sharded run."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir = runs["lora-fsdp2"]
    config = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"])
    loaded = dict(PeftModel.from_pretrained(base, str(run_dir / "adapter")).named_parameters())
    trained = params(run_dir)
    lora = {k.removeprefix("model."): v for k, v in trained.items()}
    assert lora and all(torch.equal(loaded[k], v) for k, v in lora.items())
    checks = [r for r in read_metrics(run_dir) if "save_check_s" in r]
    assert [r["step"] for r in checks] == [5, 10, 10] and "save_check_round_trip" in checks[-1]
