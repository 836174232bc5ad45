"""A diverged step, injected by design (rank 1's loss times NaN at named steps), on 2 gloo ranks through the product's
worker: trainer.on_nonfinite=stop ends both ranks at that step with the record, the levers, the report's verdict and
nothing non-finite saved; skip drops exactly the poisoned updates and trains on until trainer.max_skipped_steps in a
row. Neither adds a host read to a step. A single-process run through ``launch.run`` exits with the code for it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ddptrain import launch as launch_module
from ddptrain.launch import launch
from ddptrain.observe.console import build_console
from ddptrain.observe.nonfinite import refuse_to_replay_a_divergence
from ddptrain.process import signals
from tests.conftest import compose_config, read_metrics
from tests.distributed.workers_nonfinite import train_with_nan_loss

pytestmark = pytest.mark.dist

EVERY = 4  # log and save every 4 steps: steps 2, 3, 5, 6, 7 neither log nor save
ARGS = [
    "parallel=ddp2",
    "data.max_rows=240",
    "data.eval_fraction=0",
    f"trainer.log_every_n_steps={EVERY}",
    f"trainer.save_every_n_steps={EVERY}",
    "trainer.keep_last_n=5",
    "trainer.progress_bar=false",
    "optim.max_grad_norm=null",  # clipping off: the record must offer it
    "parallel.timeout_s=60",
]


def diverge(tmp_path: Path, name: str, steps: list[int], extra: list[str]) -> tuple[Path, list[dict]]:
    run_dir = tmp_path / name
    run_dir.mkdir()
    (run_dir / "inject.json").write_text(json.dumps({"rank": 1, "steps": steps}))
    cfg = compose_config([*ARGS, *extra, f"trainer.output_dir={tmp_path}"])
    launch(cfg, run_dir, entrypoint=train_with_nan_loss)
    return run_dir, [json.loads((run_dir / f"rank{r}.json").read_text()) for r in (0, 1)]


def assert_one_late_read_per_plain_step(rank: dict, steps: list[int]) -> None:
    """On each of ``steps`` (1-based; they neither log nor save), from its start to the next step's, the host reads
    one device value: the verdict (stop votes, finiteness) of the step before, queued a step earlier, so that on a
    GPU the host never waits for the step in flight. As many reads as before the check, and none of them early."""
    reads = [rank["reads_per_step"][step - 1] for step in steps]
    assert reads == [1] * len(steps), rank["reads_per_step"]
    assert [rank["verdicts_read"][str(step)] for step in steps] == [[step - 1] for step in steps]


def saved_steps(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-"))


def finite_everywhere(folder: Path) -> bool:
    tensors = [t for f in folder.rglob("*.safetensors") for t in load_file(str(f)).values()]
    state = torch.load(folder / "trainer_state.pt", map_location="cpu", weights_only=True)
    stack, found = [state], []
    while stack:  # every tensor in the nested trainer state (optimizer moments, scaler, RNG states are integers)
        item = stack.pop()
        if isinstance(item, dict):
            stack += list(item.values())
        elif isinstance(item, (list, tuple)):
            stack += list(item)
        elif isinstance(item, torch.Tensor) and item.is_floating_point():
            found.append(item)
    return bool(tensors) and all(torch.isfinite(t).all() for t in [*tensors, *found])


def test_a_nan_loss_on_one_rank_stops_both_at_that_step_saving_nothing_after_it(tmp_path) -> None:
    run_dir, ranks = diverge(tmp_path, "stop", steps=[7], extra=["trainer.max_steps=12"])
    # Both ranks stop at step 7, having started step 8 at most (the verdict is read a step late, without a wait).
    for rank in ranks:
        record = rank["result"]["diverged"]
        assert (record["step"], record["first_nonfinite"], record["nonfinite_loss_ranks"]) == (7, "loss", [1])
        assert rank["trained"] == list(range(1, 9))
        # Step 7's update was dropped: the weights after it are step 6's, bit for bit.
        assert rank["after_steps"][6]["digest"] == rank["after_steps"][5]["digest"]
    assert ranks[0]["after_steps"] == ranks[1]["after_steps"], "the replicas parted"

    # metrics.jsonl: its last record names the step, what turned first and the levers; every loss is a number.
    records = read_metrics(run_dir)
    last = records[-1]
    assert last["diverged"] and last["step"] == 7 and last["last_good_checkpoint"].endswith("step-00000004")
    levers = [lever["set"] for lever in last["levers"]]
    assert levers == ["optim.lr=0.0025", "optim.warmup_steps=100", "optim.max_grad_norm=1.0"]
    assert all(isinstance(r["loss"], float) and math.isfinite(r["loss"]) for r in records if "loss" in r)
    # The last good checkpoint stays; nothing of step 7 or later, and no final weights, were saved.
    assert saved_steps(run_dir) == ["step-00000004"]
    assert finite_everywhere(run_dir / "checkpoints" / "step-00000004")
    assert not (run_dir / "adapter").exists()
    report = json.loads((run_dir / "report.json").read_text())
    assert report["verdict"] == "diverged" and "step 7 on rank(s) 1" in report["headline"]
    for rank in ranks:
        assert_one_late_read_per_plain_step(rank, [2, 3, 5, 6])


def test_skip_drops_each_poisoned_update_trains_on_and_stops_after_max_skipped_steps_in_a_row(tmp_path) -> None:
    extra = ["trainer.on_nonfinite=skip", "trainer.max_skipped_steps=3", "trainer.max_steps=16"]
    run_dir, ranks = diverge(tmp_path, "skip", steps=[3, 9, 10, 11], extra=extra)
    for rank in ranks:
        after = rank["after_steps"]
        digests = [a["digest"] for a in after]
        # Step 3 dropped (the weights stay step 2's), steps 4-8 trained on; 9, 10, 11 dropped, and the third stops.
        assert digests[2] == digests[1] and len(set(digests[3:8])) == 5 and digests[3] != digests[2]
        assert digests[8] == digests[9] == digests[10] == digests[7]
        # AdamW's step count (its bias correction) counts the updates made, not the steps tried.
        assert [a["optimizer_steps"] for a in after[:5]] == [[1], [2], [2], [3], [4]]
        record = rank["result"]["diverged"]
        assert (record["step"], record["dropped_in_a_row"], record["on_nonfinite"]) == (11, 3, "skip")
    records = {r["step"]: r for r in read_metrics(run_dir) if "loss" in r}
    # The window of steps 1-4 counts the dropped step and averages the finite losses only.
    assert records[4]["skipped_steps"] == 1 and records[4]["loss"] > 0 and records[8]["skipped_steps"] == 0
    assert saved_steps(run_dir) == ["step-00000004", "step-00000008"] and finite_everywhere(
        run_dir / "checkpoints" / "step-00000008"
    )
    for rank in ranks:
        assert_one_late_read_per_plain_step(rank, [2, 3, 5, 6, 7])


def test_a_skipped_dpo_step_leaves_its_rewards_out_of_the_log_window(tmp_path) -> None:
    """objective=dpo, rank 1's policy log-probabilities NaN at step 3, trainer.on_nonfinite=skip: the window of steps
    1-4 averages the loss and the rewards of the pairs that stayed finite, every other pair: 4 steps x 16 pairs less
    rank 1's 8 at step 3. Counted as it was, one NaN pair made every reward of the window NaN."""
    extra = ["objective=dpo", "data=tiny_preference", "trainer.on_nonfinite=skip", "trainer.max_steps=4"]
    run_dir, _ = diverge(tmp_path, "dpo", steps=[3], extra=extra)
    (record,) = [r for r in read_metrics(run_dir) if "loss" in r]
    assert record["skipped_steps"] == 1 and record["pairs"] == 4 * 16 - 8, record
    rewards = ("rewards_chosen", "rewards_rejected", "rewards_accuracy", "rewards_margin", "logps_chosen")
    assert all(isinstance(record[k], float) and math.isfinite(record[k]) for k in ("loss", *rewards)), record


def test_a_diverged_run_exits_with_its_own_code_naming_the_step_and_the_levers(tmp_path, monkeypatch, capsys) -> None:
    """``launch.run`` in this process, one rank: the first step's loss is NaN; the run exits 65 (not 0, not 1)."""
    from ddptrain.model import CausalLMLoss

    forward = CausalLMLoss.forward

    def nan_loss(self: CausalLMLoss, *args, **kwargs):
        loss_sum, n_tokens = forward(self, *args, **kwargs)
        return loss_sum * math.nan if self.training else loss_sum, n_tokens

    monkeypatch.setattr(CausalLMLoss, "forward", nan_loss)
    single = ["parallel=single", "data.max_rows=64", "data.eval_fraction=0", "trainer.max_steps=3"]
    cfg = compose_config([*single, "trainer.progress_bar=false", f"trainer.output_dir={tmp_path}"])
    with pytest.raises(SystemExit) as exited:
        launch_module.run(cfg, tmp_path)
    assert exited.value.code == signals.DIVERGED_EXIT_CODE == 65
    said = capsys.readouterr()
    assert "ddptrain: training diverged at step 1: the loss was NaN or infinite on rank(s) 0" in said.out + said.err
    assert "optim.lr=" in said.out + said.err
    # It diverged before its first log line: the steps up to it are logged (a window without a finite loss: null),
    # so the report has its numbers and its verdict.
    window, record = read_metrics(tmp_path)[-2:]
    assert (window["step"], window["loss"], window["grad_norm"], record["diverged"]) == (1, None, None, True)
    assert json.loads((tmp_path / "report.json").read_text())["verdict"] == "diverged"

    # A torchrun restart round (its ranks exited 65) would replay the same steps into the same divergence: it ends at
    # once with the same code; a new launch (round 0) trains as asked.
    refuse_to_replay_a_divergence(0, tmp_path, build_console(True))
    with pytest.raises(SystemExit) as refused:
        refuse_to_replay_a_divergence(1, tmp_path, build_console(True))
    assert (
        refused.value.code == 65 and "ddptrain: not restarting: training diverged at step 1" in capsys.readouterr().err
    )
    with (tmp_path / "metrics.jsonl").open("a") as metrics:  # trained on past it (resumed with other settings)
        metrics.write(json.dumps({**window, "step": 2, "loss": 3.5}) + "\n")
    refuse_to_replay_a_divergence(1, tmp_path, build_console(True))
