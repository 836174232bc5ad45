"""DPO on 2 gloo ranks (issue 40): the first step's loss and rewards, the pairs' loss the same whatever the split
into ranks and micro-steps, the rewards in every log record, and a model of the bundled size that learns the
bundled preference set (an answer preferred to a refusal: scripts/make_assets.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from ddptrain.launch import launch
from tests.conftest import compose_config, read_metrics, train_in_process
from tests.distributed.test_train_step import relative_diff
from tests.distributed.workers import train_fixed_layout

pytestmark = pytest.mark.dist

DPO = ["objective=dpo", "data=tiny_preference", "trainer.progress_bar=false", "parallel.timeout_s=60"]
REWARDS = ("rewards_chosen", "rewards_rejected", "rewards_accuracy", "rewards_margin", "logps_chosen", "logps_rejected")


LEARNS = [*DPO, "trainer.log_every_n_steps=1", "trainer.max_steps=12", "trainer.eval_every_n_steps=6"]


@pytest.fixture(scope="module")
def adapter_off_run(tmp_path_factory) -> Path:
    """12 steps of 16 pairs, evaluated at 6 and 12, the reference being the adapter switched off (the default)."""
    run = tmp_path_factory.mktemp("dpo") / "adapter-off"
    return train_in_process(run, [*LEARNS, "trainer.best_metric=eval_rewards_accuracy"])


def test_a_dpo_run_starts_at_ln2_logs_its_rewards_and_learns_the_held_out_pairs(adapter_off_run: Path) -> None:
    """From a fresh adapter (lora_B = 0) the policy is its reference: the first step's loss is ln 2 and every reward
    0. After 12 steps (of 16 pairs) the held-out pairs' chosen reply gets the higher reward in at least 90% of them,
    the run report shows the rewards, and the best adapter kept is the one evaluated best by that share."""
    run = adapter_off_run
    records = read_metrics(run)
    steps = [r for r in records if "rewards_chosen" in r]
    assert [r["step"] for r in steps] == list(range(1, 13))
    first = steps[0]
    assert abs(first["loss"] - math.log(2)) <= 1e-6, first["loss"]
    assert first["rewards_chosen"] == first["rewards_rejected"] == first["rewards_margin"] == 0.0
    assert first["rewards_accuracy"] == 0.0, "tied rewards: no pair counted as won"
    assert first["pairs"] == 16 and first["logps_chosen"] < 0 and first["logps_rejected"] < 0
    assert first["target_tokens"] > 2 * first["pairs"], "both replies' tokens, not the pairs"
    evals = [r for r in records if "eval_rewards_accuracy" in r]
    assert [r["step"] for r in evals] == [6, 12] and evals[0]["eval_pairs"] == 60
    assert evals[-1]["eval_rewards_accuracy"] >= 0.9, evals
    assert steps[-1]["rewards_margin"] > 0 and steps[-1]["loss"] < math.log(2)
    # The run report (report.md) shows the pairs won and the margin, first window to last, and the held-out share.
    report = (run / "report.md").read_text()
    won = f"pairs won {first['rewards_accuracy']:.1%} → {steps[-1]['rewards_accuracy']:.1%}"
    margin = f"margin {first['rewards_margin']:.3f} → {steps[-1]['rewards_margin']:.3f}"
    assert won in report and margin in report, report
    assert f"held-out pairs won {evals[-1]['eval_rewards_accuracy']:.1%}" in report
    best = json.loads((run / "best" / "best.json").read_text())
    assert best["metric"] == "eval_rewards_accuracy"
    assert best["eval_rewards_accuracy"] == max(r["eval_rewards_accuracy"] for r in evals)


def _first_step(run: Path) -> dict:
    return next(r for r in read_metrics(run) if "rewards_chosen" in r)


def test_a_precomputed_reference_gives_the_adapter_off_losses_and_is_read_back_from_its_cache(
    adapter_off_run: Path, tmp_path: Path
) -> None:
    """objective.reference=precomputed, the same run otherwise: the first step at ln 2 with every reward 0, and every
    step's loss and evaluation loss within 1e-6 of the adapter-off run's, its rewards within 1e-5. Its table is
    cached: a run of the same data and model reads it (a table edited on disk, the chosen replies' reference lowered
    by 1, shows in the first step's chosen reward: β x 1), and a run whose base computes other numbers (another
    attention kernel) computes its own."""
    cache = [f"data.cache_dir={tmp_path / 'cache'}"]
    precomputed = [*LEARNS, "objective.reference=precomputed", *cache]
    run = train_in_process(tmp_path / "precomputed", [*precomputed, "trainer.best_metric=eval_rewards_accuracy"])
    first = _first_step(run)
    assert abs(first["loss"] - math.log(2)) <= 1e-6, first["loss"]
    # The table's batches are not the step's: 0 to the rounding of other matmul shapes, not bit for bit.
    assert all(abs(first[k]) <= 1e-6 for k in ("rewards_chosen", "rewards_rejected", "rewards_margin")), first
    # Not the shares of pairs won: a pair near a tie may fall either way on another CPU.
    compared = ("loss", "rewards_chosen", "rewards_rejected", "rewards_margin", "eval_loss")
    ours, theirs = ([r for r in read_metrics(x) if {"loss", "eval_loss"} & set(r)] for x in (run, adapter_off_run))
    pairs = list(zip(ours, theirs))
    assert len(ours) == len(theirs) == 14 and all(a["step"] == b["step"] for a, b in pairs)
    for a, b in pairs:
        for key in compared:
            if key in b:
                close = 1e-6 if "loss" in key else 1e-5  # the rewards: means of β x log-ratios of up to ~10
                assert abs(a[key] - b[key]) <= close, f"step {b['step']} {key}: {a[key]} against {b[key]}"
    tables = sorted((tmp_path / "cache").rglob("reference-logps-*.pt"))
    assert len(tables) == 2, "the train and the eval set's"
    train_table = max(tables, key=lambda p: torch.load(p).shape[0])
    table = torch.load(train_table)
    assert table.shape == (538, 2) and (table < 0).all()
    table[:, 0] -= 1.0
    torch.save(table, train_table)
    one_step = [*DPO, "objective.reference=precomputed", *cache, "trainer.max_steps=1", "trainer.eval_every_n_steps=0"]
    edited = _first_step(train_in_process(tmp_path / "cached", [*one_step, "trainer.save_final=false"]))
    assert edited["rewards_chosen"] == pytest.approx(0.1, abs=1e-6) and abs(edited["rewards_rejected"]) <= 1e-6
    other = [*one_step, "trainer.save_final=false", "model.attn_implementation=eager"]
    assert abs(_first_step(train_in_process(tmp_path / "eager", other))["rewards_chosen"]) <= 1e-6, "its own table"
    assert len(list((tmp_path / "cache").rglob("reference-logps-*.pt"))) == 4


def test_a_full_fine_tune_trains_against_its_precomputed_reference_which_a_resume_computes_from_the_base(
    tmp_path: Path,
) -> None:
    """model.lora=false with objective.reference=precomputed: the first step at ln 2; after 4 steps the held-out
    pairs are scored against the base (most won, the pair loss under ln 2: an eval batch without its table would
    set the model against itself, every reward 0). Resumed from step 2's checkpoint with an empty cache, the run
    computes the table again from the weights before the checkpoint loads, the base's: steps 3 and 4 log the
    uninterrupted run's losses."""
    full = [*DPO, "model.lora=false", "objective.reference=precomputed", "optim.lr=1e-4", "data.max_rows=160"]
    full += ["trainer.max_steps=4", "trainer.log_every_n_steps=1", "trainer.save_every_n_steps=2"]
    run = train_in_process(tmp_path / "full", [*full, f"data.cache_dir={tmp_path / 'cache-a'}"])
    records = read_metrics(run)
    losses = {r["step"]: r["loss"] for r in records if "rewards_chosen" in r}
    assert abs(losses[1] - math.log(2)) <= 1e-6, losses
    (evaluated,) = [r for r in records if "eval_rewards_accuracy" in r]
    assert evaluated["eval_rewards_accuracy"] > 0.5 and evaluated["eval_loss"] < math.log(2) - 0.01, evaluated
    resume = f"trainer.resume={run}/checkpoints/step-00000002"
    resumed = train_in_process(tmp_path / "resumed", [*full, f"data.cache_dir={tmp_path / 'cache-b'}", resume])
    again = {r["step"]: r["loss"] for r in read_metrics(resumed) if "rewards_chosen" in r}
    assert sorted(again) == [3, 4] and all(abs(again[k] - losses[k]) <= 1e-6 for k in again), (again, losses)
    assert "computed and cached" in (resumed / "train.log").read_text(), "the resumed run computed its table"


def test_dpo_after_sft_trains_a_new_adapter_on_the_sft_model_which_is_its_reference(tmp_path: Path) -> None:
    """An SFT run's adapter as model.base_adapter: the DPO run's base (written to <run>/base, which its adapter names)
    is the SFT run's base with that adapter merged, as peft merges it, and differs from the SFT run's base; the
    policy starts as its reference, that SFT model (loss ln 2, rewards 0), although the SFT adapter moved the
    replies' log-probabilities; and the run's saves pass their load check onto that base."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    common = ["trainer.progress_bar=false", "parallel.timeout_s=60", "trainer.log_every_n_steps=1"]
    sft = train_in_process(tmp_path / "sft", [*common, "trainer.max_steps=4", "data.max_rows=64", "optim.lr=2e-2"])
    base = ["model.init=pretrained", f"model.name_or_path={sft / 'base'}"]
    short = [*DPO, *common, *base, "trainer.max_steps=1", "data.max_rows=32", "trainer.save_check=final"]
    plain = _first_step(train_in_process(tmp_path / "plain", short))
    dpo = train_in_process(tmp_path / "dpo", [*short, f"model.base_adapter={sft / 'adapter'}"])
    first = _first_step(dpo)
    assert abs(first["loss"] - math.log(2)) <= 1e-6 and first["rewards_margin"] == 0.0, first
    assert abs(first["logps_chosen"] - plain["logps_chosen"]) > 1.0, "the SFT adapter moved the replies"
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(sft / "base"), sft / "adapter")
    expected = merged.merge_and_unload().state_dict()
    written = load_file(dpo / "base" / "model.safetensors")
    original = load_file(sft / "base" / "model.safetensors")
    assert any(not torch.equal(original[k], written[k]) for k in written), "the base is the SFT run's, merged"
    for key, value in written.items():
        assert torch.equal(value, expected[key]), key
    adapter_config = json.loads((dpo / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str((dpo / "base").resolve())


def test_a_weighted_mixture_of_preference_sources_trains_each_pair_against_its_own_reference(tmp_path: Path) -> None:
    """Two preference sources weighted 3:1 (each epoch draws rows of their concatenation, not in order) against a
    precomputed reference: the first step's loss is ln 2 and every reward 0, which holds only if every drawn pair
    carries its own row's reference values."""
    from tests.unit.test_preference import preference_mixture

    overrides = [*preference_mixture(tmp_path), "objective.reference=precomputed", "trainer.max_steps=2"]
    overrides.append(f"data.cache_dir={tmp_path / 'cache'}")  # the reference computed here, not read
    run = train_in_process(tmp_path / "mixture", [*DPO[2:], *overrides, "trainer.log_every_n_steps=1"])
    first = _first_step(run)
    assert abs(first["loss"] - math.log(2)) <= 1e-6
    assert abs(first["rewards_chosen"]) <= 1e-6 and abs(first["rewards_rejected"]) <= 1e-6, first
    assert first["pairs"] == 16


LAYOUTS = {  # name: ranks, micro-steps, this rank's micro-batches (pairs), overrides
    "ddp, 2 ranks": (2, 1, [4], []),
    "ddp, 1 rank x 2 micro-steps": (1, 2, [3, 5], []),
    "fsdp2, 2 ranks": (2, 1, [4], ["parallel.strategy=fsdp2"]),
    "fsdp2, 2 ranks, precomputed": (2, 1, [4], ["parallel.strategy=fsdp2", "objective.reference=precomputed"]),
}


def test_the_pairs_loss_is_the_same_on_2_ranks_as_on_1_rank_with_accumulation_and_sharded(tmp_path: Path) -> None:
    """2 ranks x 1 micro-step of 4 pairs, 1 rank x 2 micro-steps of 3 and 5 pairs, and 2 ranks of a sharded model
    (parallel.strategy=fsdp2, with either reference) over the same 5 global batches of 8 pairs: every trainable
    parameter within 1e-5 (fp32). A loss averaged per micro-batch would weigh the 3 pairs' more than the 5 pairs' and
    differ. The 72 pairs make 9 batches of the precomputed reference's pass, 5 on one rank and 4 on the other: a
    sharded model's forwards must still pair up across the ranks (each all-gathers every layer)."""
    params = {}
    for name, (world, accum, sizes, overrides) in LAYOUTS.items():
        run_dir = tmp_path / name.replace(" ", "").replace(",", "-")
        run_dir.mkdir()
        (run_dir / "layout.json").write_text(json.dumps({"accum": accum, "steps": 5, "sizes": sizes}))
        extra = ["data.eval_fraction=0", "data.max_rows=72", "optim.max_grad_norm=null", "optim.eps=1e-6"]
        extra.append(f"data.cache_dir={tmp_path / 'cache'}")  # the reference computed here, not read
        common = [f"parallel.nproc_per_node={world}", f"trainer.output_dir={tmp_path}", *DPO, *extra]
        launch(compose_config([*common, *overrides]), run_dir, entrypoint=train_fixed_layout)
        params[name] = torch.load(run_dir / "params.pt")["params"]
    expected = params.pop("ddp, 2 ranks")
    assert any(v.abs().sum() > 0 for k, v in expected.items() if "lora_B" in k), "the adapter trained"
    for name, got in params.items():
        for key, value in expected.items():
            assert relative_diff(got[key], value) <= 1e-5, f"{key} differs: {name}"


@pytest.mark.parametrize(("loss_type", "steps"), [("sigmoid", 10), ("ipo", 3), ("hinge", 3)])
def test_ddptrain_and_trls_dpo_trainer_give_the_same_losses(loss_type: str, steps: int, tmp_path: Path) -> None:
    """TRL's DPOTrainer (a development dependency) and ddptrain, from the same LoRA model and fed the same token ids
    in the same batches of 8 pairs (β 0.1, AdamW at a constant learning rate without warmup, clipping at 1, no
    dropout, fp32): the loss of each step within 1e-4, 10 steps of DPO's sigmoid loss, 3 of IPO's and hinge's."""
    pytest.importorskip("trl")
    from ddptrain.bench.dpo_parity import trl_steps  # the benchmark's TRL side, at the tiny size

    per_step = 8
    optim = ["optim.scheduler=constant", "optim.warmup_steps=0", "optim.lr=1e-3", "optim.weight_decay=0"]
    extra = ["data.eval_fraction=0", f"data.max_rows={steps * per_step + 20}", "parallel.nproc_per_node=1", *optim]
    cfg = compose_config([f"trainer.output_dir={tmp_path}", *DPO, *extra, f"objective.loss_type={loss_type}"])
    run_dir = tmp_path / "ddptrain"
    run_dir.mkdir()
    (run_dir / "layout.json").write_text(json.dumps({"accum": 1, "steps": steps, "sizes": [per_step]}))
    launch(cfg, run_dir, entrypoint=train_fixed_layout)
    ours = torch.load(run_dir / "params.pt")["losses"]

    theirs = trl_steps(cfg, steps, per_step, tmp_path)["losses"]  # the same pairs and LoRA start, in TRL
    assert len(theirs) == len(ours) == steps
    for step, (a, b) in enumerate(zip(ours, theirs), start=1):
        assert abs(a - b) <= 1e-4, f"step {step}: ddptrain {a:.6f}, TRL {b:.6f}"
