"""parallel.strategy=fsdp2 on 2 gloo ranks against DDP on the same batches: the same training (LoRA and a full
fine-tune, with accumulation), its collectives counted where they run, half the memory held per rank, sharded
checkpoints that resume bit for bit, and weights that load in plain peft.

Runs of the bundled model, 10 steps each, fp32, shared by the tests below: with optim.grad_accum_steps=2, LoRA and a
full fine-tune under each strategy from the same pretrained folder (the bundled model with an odd vocabulary and MLP
width, which FSDP2 splits unevenly; its random weights saved by transformers: FSDP2 builds the model on the meta
device and each rank reads its rows of them, DDP loads them through from_pretrained), and the fsdp2 LoRA run resumed
from its step-5 checkpoint into a new folder; and full fine-tunes of random weights (each rank draws the whole
model) checkpointed at step 5 on one number of processes and resumed on another.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ddptrain.launch import launch
from tests.conftest import REPO, compose_config, read_metrics
from tests.distributed.workers_fsdp import start_and_report, train_and_report
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
EVERY_STEP = ["optim.grad_accum_steps=2", "trainer.log_every_n_steps=1"]
RUNS = {
    "lora-ddp": ["parallel=ddp2", *EVERY_STEP, *NO_SAVES],
    "lora-fsdp2": ["parallel=fsdp2_2", *EVERY_STEP, *SAVES],
    "full-ddp": ["parallel=ddp2", "model.lora=false", *EVERY_STEP, *NO_SAVES],
    "full-fsdp2": ["parallel=fsdp2_2", "model.lora=false", *EVERY_STEP, *NO_SAVES],
    # A bf16 model's full fine-tune, which DDP refuses: fp32 masters, gathered in bf16, saved in bf16.
    "full-fsdp2-bf16": ["parallel=fsdp2_2", "model.lora=false", "model.dtype=bf16", *EVERY_STEP, *SAVES],
}
# Full fine-tunes (a tied head; AdamW's states resharded under fsdp2) of 2 micro-batches per step, checkpointed at
# step 5 with a log window open (logged every 4 steps): on 2 processes x 1 micro-step, then resumed on 1 x 2 (fsdp2),
# and the other way round (ddp). Where one side has 1 rank or 1 micro-step, both add the step's two micro-batches'
# gradients in the same order (an all-reduce of two, or two backwards into one .grad): bit for bit.
ON_2 = ["parallel.nproc_per_node=2", "optim.grad_accum_steps=1"]
ON_1 = ["parallel.nproc_per_node=1", "optim.grad_accum_steps=2"]
ACROSS = ["model.lora=false", "trainer.log_every_n_steps=4", "trainer.save_every_n_steps=5", *NO_SAVES]
RESUMED_ELSEWHERE = {  # uninterrupted run, then the run resumed from its step-5 checkpoint
    "fsdp2": (["parallel=fsdp2_2", *ACROSS, *ON_2], ["parallel=fsdp2_2", *ACROSS, *ON_1]),
    "ddp": (["parallel=ddp2", *ACROSS, *ON_1], ["parallel=ddp2", *ACROSS, *ON_2]),
}


def run(out: Path, name: str, overrides: list[str]) -> Path:
    run_dir = out / name
    run_dir.mkdir(parents=True)
    cfg = compose_config([f"trainer.output_dir={out}", *COMMON, *overrides])
    launch(cfg, run_dir, entrypoint=train_and_report)
    return run_dir


def architecture(folder: Path, **sizes: int) -> Path:
    """The bundled model's config.json with ``sizes`` changed, written into ``folder``."""
    config = json.loads((REPO / "ddptrain" / "assets" / "tiny_qwen2" / "config.json").read_text())
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config | sizes))
    return folder


def uneven_config(folder: Path) -> Path:
    """The bundled model with an odd vocabulary and MLP width: the embedding, the MLP's gate and up projections and
    their LoRA B split unevenly over 2 ranks (rank 0 holds one row more), as most real vocabularies do."""
    return architecture(folder, vocab_size=4353, intermediate_size=383)


def save_pretrained(folder: Path, overrides: list[str], seed: int = 0) -> list[str]:
    """The model the overrides compose, with random weights from ``seed``, saved by transformers with its tokenizer
    into ``folder``; returns the overrides that train it as a pretrained model."""
    from ddptrain.model import build_base_model, build_tokenizer

    cfg = compose_config(overrides)
    build_base_model(cfg.model, seed).save_pretrained(folder)
    build_tokenizer(cfg.model).save_pretrained(folder)
    return ["model.init=pretrained", f"model.name_or_path={folder}", f"model.tokenizer={folder}"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("fsdp2")
    pretrained = save_pretrained(out / "pretrained", [f"model.name_or_path={uneven_config(out / 'uneven')}"])
    done = {name: run(out, name, [*pretrained, *overrides]) for name, overrides in RUNS.items()}
    resume = f"trainer.resume={done['lora-fsdp2']}/checkpoints/step-00000005"
    done["lora-fsdp2-resumed"] = run(out, "lora-fsdp2-resumed", [*pretrained, *RUNS["lora-fsdp2"], resume])
    for strategy, (first, then) in RESUMED_ELSEWHERE.items():
        done[f"across-{strategy}"] = run(out, f"across-{strategy}", first)
        resume = f"trainer.resume={done[f'across-{strategy}']}/checkpoints/step-00000005"
        done[f"across-{strategy}-resumed"] = run(out, f"across-{strategy}-resumed", [*then, resume])
    return done


def params(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "params.pt")


def ranks(run_dir: Path) -> list[dict]:
    return [json.loads((run_dir / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_fsdp2_trains_what_ddp_trains_on_the_same_batches(runs, mode) -> None:
    """Every trainable parameter after 10 steps of 2 micro-steps equals DDP's, bit for bit (fp32, no clipping). Both
    start from the same pretrained folder, FSDP2 by reading each rank's rows of it into a model built on the meta
    device (its LoRA adapters from trainer.seed as DDP's), DDP through from_pretrained. On 2 ranks both add the same
    two ranks' gradients (an all-reduce; a reduce-scatter, which gloo runs as an all-reduce and slices) and halve
    them, and AdamW steps each element alike, whole or in shards. The gradient norm each step logs (its square a sum
    over every gradient element, in shards against whole tensors) agrees within the rounding of that sum in another
    order: a gradient scaled wrongly is off by the factor."""
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


def layer_and_root_bytes(mode: str, tmp_path: Path) -> tuple[int, int, int, int]:
    """From the model's own parameters, built here as a run builds it: (one decoder layer's bytes, the root's
    bytes, i.e. the rest, the trainable bytes per layer, the root's trainable bytes), each tensor's first dimension
    padded to a multiple of the 2 ranks as FSDP2 pads it."""
    from ddptrain.model import build_model

    shapes = [f"model.name_or_path={uneven_config(tmp_path / 'uneven')}"]
    cfg = compose_config([*shapes, *(["model.lora=false"] if mode == "full" else [])])
    model = build_model(cfg.model, seed=0, device=torch.device("cpu"))
    padded = lambda p: (-(-p.shape[0] // 2) * 2) * (p.numel() // max(p.shape[0], 1)) * p.element_size()  # noqa: E731
    layers = model.decoder.layers
    in_layers = {id(p) for p in layers.parameters()}
    layer = [p for p in layers[0].parameters()]
    root = [p for p in model.parameters() if id(p) not in in_layers]
    trained = lambda ps: sum(padded(p) for p in ps if p.requires_grad)  # noqa: E731
    return sum(padded(p) for p in layer), sum(padded(p) for p in root), trained(layer), trained(root)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_the_collectives_are_counted_where_they_run(runs, mode, tmp_path) -> None:
    """Per optimizer step, as FSDP2 called them: one reduce-scatter per unit that trains, at the last micro-step
    only (2 micro-steps, not twice as many), the gradients' bytes; all-gathers of every unit's weights, each layer's
    twice per micro-step (forward, and backward: resharded after forward), the root's once (kept to the backward).
    The expected figures are worked out from the model's parameter shapes here, not from the product's counts."""
    layer, root, layer_trained, root_trained = layer_and_root_bytes(mode, tmp_path)
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


@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_a_checkpoint_resumes_on_another_number_of_processes_bit_identical(runs, strategy) -> None:
    """fsdp2: a sharded checkpoint of 2 processes resumed on 1 (with optim.grad_accum_steps=2, the same 2
    micro-batches per step); ddp: 1 process resumed on 2. Each ends with the uninterrupted run's parameters, bit for
    bit, so every step trained on the same micro-batches with the same weights and optimizer state; and the log
    window open at the checkpoint is shared out over the new ranks: the first record after the resume counts the
    uninterrupted run's tokens exactly, and its loss within the rounding of adding a step's two micro-batches' losses
    in fp32 on one rank (in float64 across two)."""
    whole, resumed = params(runs[f"across-{strategy}"]), params(runs[f"across-{strategy}-resumed"])
    assert whole.keys() == resumed.keys() and whole
    differ = [k for k in whole if not torch.equal(whole[k], resumed[k])]
    assert not differ, f"{len(differ)} of {len(whole)} differ: {differ[:3]}"
    records = [
        {r["step"]: r for r in read_metrics(runs[name]) if "loss" in r and r["step"] > 5}
        for name in (f"across-{strategy}", f"across-{strategy}-resumed")
    ]
    assert sorted(records[0]) == sorted(records[1]) == [8, 10]
    for step in (8, 10):
        ours, theirs = records[0][step], records[1][step]
        assert (ours["tokens"], ours["target_tokens"]) == (theirs["tokens"], theirs["target_tokens"]), step
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=reordered_sum_tolerance(2)), step


def test_no_rank_holds_the_whole_pretrained_model_while_an_fsdp2_run_starts(tmp_path) -> None:
    """A 52M-parameter model (209 MB in fp32) in a pretrained folder, started under fsdp2 on 2 ranks
    (model.init=pretrained: built on the meta device, each rank reading its rows from the files): how far each
    rank's peak resident memory rises while the Trainer is built (VmHWM, reset just before), less what the same
    start costs with the bundled 1M-parameter model (the data, the libraries), is about its half of the model and
    well under the whole. The same model drawn at random (model.init=random: every rank builds it whole on its host,
    then shards it) costs more than the whole model on each rank: the measurement sees a whole copy where there is
    one. Both hold half the model's parameter bytes once it is sharded."""
    sizes = {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 12}
    wide = [f"model.name_or_path={architecture(tmp_path / 'wide', **sizes)}"]
    starts = {"bundled": [], "meta": save_pretrained(tmp_path / "pretrained", wide), "host": wide}
    common = ["parallel=fsdp2_2", "model.lora=false", "data.max_rows=64", *NO_SAVES, "plan.at_start=false"]
    report = {}
    for name, overrides in starts.items():
        run_dir = tmp_path / name
        run_dir.mkdir()
        cfg = compose_config([f"trainer.output_dir={tmp_path}", *COMMON, *common, *overrides])
        launch(cfg, run_dir, entrypoint=start_and_report)
        report[name] = [json.loads((run_dir / f"start{r}.json").read_text()) for r in (0, 1)]
    whole = report["meta"][0]["model_bytes"]
    assert whole > 200e6, whole
    for bundled, meta, host in zip(report["bundled"], report["meta"], report["host"], strict=True):
        assert meta["held_bytes"] == host["held_bytes"] and 0.45 <= meta["held_bytes"] / whole <= 0.55, meta
        model_growth = {name: r["peak_growth"] - bundled["peak_growth"] for name, r in (("meta", meta), ("host", host))}
        assert model_growth["meta"] < 0.75 * whole and model_growth["host"] > whole, (model_growth, whole)
