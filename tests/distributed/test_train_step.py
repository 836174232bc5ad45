"""The training step on 2 gloo ranks: exact accumulation, one sync per optimizer step, compressed
communication, mixed precision, and the pre-flight checks."""

from __future__ import annotations

import inspect
import json
import math
import re
import time
from pathlib import Path

import pytest
import torch

from ddptrain.config.hydra import ASSETS_DIR
from ddptrain.launch import launch
from tests.conftest import compose_config, read_metrics, skip_or_fail
from tests.distributed.workers import train_fixed_layout, train_with_unused_parameter
from tests.distributed.workers_comm import train_recording_gradient_allreduces
from tests.distributed.workers_teardown import free_the_model_while_gloo_needs_the_gil

pytestmark = pytest.mark.dist

TINY = ["data.max_rows=400", "data.eval_fraction=0", "trainer.progress_bar=false", "parallel.timeout_s=60"]


def run_layout(tmp_path: Path, name: str, world: int, accum: int, extra: list[str]) -> dict[str, torch.Tensor]:
    run_dir = tmp_path / name
    run_dir.mkdir()
    (run_dir / "layout.json").write_text(json.dumps({"accum": accum}))
    cfg = compose_config([f"parallel.nproc_per_node={world}", f"trainer.output_dir={tmp_path}", *TINY, *extra])
    launch(cfg, run_dir, entrypoint=train_fixed_layout)
    return torch.load(run_dir / "params.pt")


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "grad-checkpointing"])
def test_same_parameters_whatever_the_split_into_ranks_and_micro_steps(tmp_path, checkpointing) -> None:
    """1 rank x 1 micro-step, 1 x 4, 2 x 2 and 2 x 1 over the same global batches (uneven real tokens per
    micro-batch): the synced gradient of step 1 agrees to float rounding (1e-6 per tensor); after 3 steps the
    trainable parameters agree to 1e-5 as a whole, and every tensor to 1e-4.

    Adam's first updates are sign-like (lr * g / |g|): a gradient element at rounding-noise level can flip
    its update between layouts and differ by 2 * lr. optim.eps=1e-6 keeps such elements in Adam's linear
    regime, so what remains measures the loss normalisation, not Adam's amplification of rounding.
    """
    extra = [f"model.gradient_checkpointing={checkpointing}", "optim.max_grad_norm=null", "optim.eps=1e-6"]
    reference = run_layout(tmp_path, "1x1", world=1, accum=1, extra=extra)
    # With checkpointing, 2 x 2 alone: the layout where recomputation meets both DDP's hooks and accumulation.
    layouts = (("2x2", 2, 2),) if checkpointing else (("1x4", 1, 4), ("2x2", 2, 2), ("2x1", 2, 1))
    for name, world, accum in layouts:
        result = run_layout(tmp_path, name, world, accum, extra)
        for key, expected in reference["grads"][0].items():
            diff = relative_diff(result["grads"][0][key], expected)
            assert diff <= 1e-6, f"{name}: step-1 gradient of {key} differs by {diff:.2e}"
        got, expected = result["params"], reference["params"]
        whole = relative_diff(
            torch.cat([got[k].flatten() for k in expected]), torch.cat([v.flatten() for v in expected.values()])
        )
        assert whole <= 1e-5, f"{name}: the trainable parameters differ after 3 steps by {whole:.2e}"
        worst = max(expected, key=lambda k: relative_diff(got[k], expected[k]))
        assert relative_diff(got[worst], expected[worst]) <= 1e-4, f"{name}: {worst} differs after 3 steps"
        print(f"{name}: whole {whole:.1e}, worst tensor {relative_diff(got[worst], expected[worst]):.1e}")


def relative_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a - b).norm() / b.norm().clamp(min=1e-30)


def run_fit(tmp_path: Path, name: str, extra: list[str]) -> list[dict]:
    run_dir = tmp_path / name
    run_dir.mkdir()
    cfg = compose_config(
        ["parallel=ddp2", "trainer.log_every_n_steps=1", f"trainer.output_dir={tmp_path}", *TINY, *extra]
    )
    launch(cfg, run_dir)
    return [r for r in read_metrics(run_dir) if "loss" in r]


def test_one_all_reduce_per_optimizer_step_whatever_the_accumulation(tmp_path) -> None:
    calls = {}
    for accum in (1, 2, 4):
        records = run_fit(tmp_path, f"accum{accum}", ["trainer.max_steps=3", f"optim.grad_accum_steps={accum}"])
        assert [r["allreduce_syncs_per_step"] for r in records] == [1.0, 1.0, 1.0]
        calls[accum] = {r["allreduce_calls_per_step"] for r in records}
    assert calls[1] == calls[2] == calls[4], calls


def run_recording_allreduces(tmp_path: Path, name: str, extra: list[str]) -> tuple[list[dict], dict]:
    """Train (every step logged) while the test records what DDP handed to torch.distributed.all_reduce.

    Returns:
        The metric records, and rank 0's measurement ``{"bytes": [per step], "calls": [per step]}``
        (after checking rank 1 measured the same).
    """
    run_dir = tmp_path / name
    run_dir.mkdir()
    cfg = compose_config(
        ["parallel=ddp2", "trainer.log_every_n_steps=1", f"trainer.output_dir={tmp_path}", *TINY, *extra]
    )
    launch(cfg, run_dir, entrypoint=train_recording_gradient_allreduces)
    rank0, rank1 = (json.loads((run_dir / f"allreduce-rank{r}.json").read_text()) for r in (0, 1))
    assert rank0 == rank1, f"{name}: the ranks all-reduced different amounts: {rank0} vs {rank1}"
    return [r for r in read_metrics(run_dir) if "loss" in r], rank0


COMM_STEPS = 4  # PowerSGD averages whole buckets for 2 steps (start_powerSGD_iter), then compresses


@pytest.fixture(scope="module")
def plain_allreduce(tmp_path_factory) -> tuple[list[dict], dict]:
    """The default hook (plain all-reduce), measured: the reference the compressed hooks are held to."""
    return run_recording_allreduces(tmp_path_factory.mktemp("comm"), "plain", [f"trainer.max_steps={COMM_STEPS}"])


def assert_logged_bytes_are_the_measured_ones(records: list[dict], sent: dict) -> None:
    assert len(records) == len(sent["bytes"]) == COMM_STEPS, (records, sent)
    assert all(b > 0 for b in sent["bytes"]), f"no gradient all-reduce went through torch.distributed: {sent}"
    assert [r["allreduce_bytes_per_step"] for r in records] == sent["bytes"]


def test_fp16_compression_halves_the_bytes_all_reduced(tmp_path, plain_allreduce) -> None:
    """The test records the bytes of every tensor DDP hands to torch.distributed.all_reduce: the logged
    allreduce_bytes_per_step is what was sent, and fp16_compress sends exactly half of plain all-reduce."""
    plain, plain_sent = plain_allreduce
    fp16, fp16_sent = run_recording_allreduces(
        tmp_path, "fp16", [f"trainer.max_steps={COMM_STEPS}", "parallel.comm_hook=fp16_compress"]
    )
    for records, sent in ((plain, plain_sent), (fp16, fp16_sent)):
        assert_logged_bytes_are_the_measured_ones(records, sent)
        assert [r["allreduce_calls_per_step"] for r in records] == sent["calls"]  # one all-reduce per bucket
    assert [2 * b for b in fp16_sent["bytes"]] == plain_sent["bytes"]
    assert abs(fp16[-1]["loss"] - plain[-1]["loss"]) < 1e-2
    print(f"bytes per step: plain {plain_sent['bytes']}, fp16_compress {fp16_sent['bytes']}")


def test_powersgd_trains_and_sends_fewer_bytes_once_it_compresses(tmp_path, plain_allreduce) -> None:
    """Measured as above: the logged bytes are what was sent; the first start_powerSGD_iter=2 steps send
    whole buckets like plain all-reduce, later steps less (low-rank factors); the loss stays finite."""
    _, plain_sent = plain_allreduce
    records, sent = run_recording_allreduces(
        tmp_path, "powersgd", [f"trainer.max_steps={COMM_STEPS}", "parallel.comm_hook=powersgd"]
    )
    assert_logged_bytes_are_the_measured_ones(records, sent)
    assert sent["bytes"][:2] == plain_sent["bytes"][:2]
    assert all(b < plain_b for b, plain_b in zip(sent["bytes"][2:], plain_sent["bytes"][2:], strict=True)), (
        sent["bytes"],
        plain_sent["bytes"],
    )
    losses = [r["loss"] for r in records]
    assert all(math.isfinite(loss) and loss < 20 for loss in losses), losses
    print(f"bytes per step: plain {plain_sent['bytes']}, powersgd {sent['bytes']}")


def test_compiled_model_computes_the_eager_loss_and_syncs_once_per_step_under_accumulation(tmp_path) -> None:
    """trainer.compile=true on 2 ranks with optim.grad_accum_steps=2. torch.compile wraps the DDP module, and
    the accumulation micro-step must still skip the all-reduce (1 sync per step). Step 1 (the initial weights)
    gives the eager run's loss to 1e-5; the next steps follow the eager run's losses (to 1e-4: compiled kernels
    round differently), so the compiled model's parameters were updated as eager's were; its saves pass the save
    check (no ``_orig_mod.`` key, the training model's logits in plain peft).

    Both runs use one decoder layer of the bundled model with LoRA on q_proj and v_proj: what is compiled is still
    the DDP-wrapped PEFT model, in a third less time than the whole model (55 s and 46 s against 71 s on a cold
    inductor cache, as in CI)."""
    one_layer = json.loads((ASSETS_DIR / "tiny_qwen2" / "config.json").read_text()) | {"num_hidden_layers": 1}
    (tmp_path / "one_layer").mkdir()
    (tmp_path / "one_layer" / "config.json").write_text(json.dumps(one_layer))
    small = [f"model.config_path={tmp_path / 'one_layer'}", "model.lora_target_modules='q_proj,v_proj'"]
    accum = ["trainer.max_steps=3", "optim.grad_accum_steps=2", *small]
    eager = run_fit(tmp_path, "eager-accum2", accum)
    compiled = run_fit(tmp_path, "compiled-accum2", [*accum, "trainer.compile=true"])
    # The compiled run's saves load in plain peft as trained: no _orig_mod. key (every save read back), the training
    # model's logits (the last save's round trip).
    checked = [r for r in read_metrics(tmp_path / "compiled-accum2") if "save_check_s" in r]
    assert checked and all(r.get("save_check_max_abs_diff", 0.0) <= 1e-5 for r in checked)
    assert any("save_check_round_trip" in r for r in checked)
    assert [r["allreduce_syncs_per_step"] for r in compiled] == [1.0, 1.0, 1.0]
    losses = [r["loss"] for r in compiled]
    assert all(math.isfinite(loss) for loss in losses) and len(set(losses)) == len(losses), losses
    diffs = [abs(c["loss"] - e["loss"]) for c, e in zip(compiled, eager, strict=True)]
    assert diffs[0] <= 1e-5, f"step-1 loss: compiled {compiled[0]['loss']} vs eager {eager[0]['loss']}"
    assert max(diffs) <= 1e-4, f"compiled losses {losses} drift from eager {[e['loss'] for e in eager]}"
    print(f"compiled - eager loss per step: {diffs}")


def _cpu_fp16_autocast_works() -> bool:
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            return (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float16
    except RuntimeError:
        return False


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains(tmp_path, precision) -> None:
    if precision == "fp16" and not _cpu_fp16_autocast_works():
        skip_or_fail("this torch build has no fp16 autocast on CPU")
    # 8 steps of rows cut at 128 tokens: the mean loss of the last 3 is 8.1, of the first 3 8.9. Autocast on a CPU
    # is slow: 12 steps of 512-token rows took 16-18 s of steps per precision, these 8 steps about 5 s.
    short = ["trainer.max_steps=8", "data.max_length=128"]
    records = run_fit(tmp_path, precision, [*short, f"trainer.precision={precision}"])
    losses = [r["loss"] for r in records]
    assert all(loss == loss and loss < 20 for loss in losses), losses
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses
    if precision == "fp16":
        assert sum(r["skipped_steps"] for r in records) < len(records), "every fp16 step overflowed"


def test_preflight_names_trainable_parameters_without_gradient(tmp_path) -> None:
    run_dir = tmp_path / "unused"
    run_dir.mkdir()
    cfg = compose_config(["parallel=ddp2", f"trainer.output_dir={tmp_path}", "trainer.max_steps=2", *TINY])
    with pytest.raises(RuntimeError):
        launch(cfg, run_dir, entrypoint=train_with_unused_parameter)
    for rank in (0, 1):
        message = (run_dir / f"error{rank}.txt").read_text()
        assert "unused_scale" in message and "parallel.find_unused_parameters=true" in message


@pytest.mark.timeout(120)
def test_a_failed_rank_exits_even_when_something_keeps_it_alive(tmp_path, capfd) -> None:
    """Once a rank fails, nothing may hold its process (CI once hung 300 s after both ranks failed at once): a
    failed rank still there after parallel.FAILED_EXIT_GRACE_S prints its threads' stacks and exits 1."""
    from tests.distributed.workers import fail_with_a_thread_that_never_ends

    run_dir = tmp_path / "stuck"
    run_dir.mkdir()
    cfg = compose_config(["parallel=ddp2", f"trainer.output_dir={tmp_path}", *TINY])
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="training failed") as failed:
        launch(cfg, run_dir, entrypoint=fail_with_a_thread_that_never_ends)
    assert time.monotonic() - started < 60
    # The launcher names the rank it saw end first, with that rank's own error.
    assert re.search(r"rank (\d) \(exit code 1\): RuntimeError: rank \1 failed on purpose", str(failed.value))
    err = capfd.readouterr().err
    # At least that rank printed its stacks (the launcher ends the other once one has failed).
    assert err.count("Timeout (0:00:03)!") >= 1, err[-3000:]
    assert "_shutdown" in err, "the stacks show where the exit waited (threading._shutdown)"


def test_ranks_with_different_frozen_weights_are_stopped_before_training(tmp_path) -> None:
    """DDP's start-up broadcast is off (every rank loads the same files): a checksum of all weights,
    frozen ones included, must catch a rank whose base model differs."""
    from tests.distributed.workers_replicas import train_with_rank1_frozen_weight_changed

    run_dir = tmp_path / "drift"
    run_dir.mkdir()
    cfg = compose_config(["parallel=ddp2", f"trainer.output_dir={tmp_path}", "trainer.max_steps=2", *TINY])
    with pytest.raises(RuntimeError):
        launch(cfg, run_dir, entrypoint=train_with_rank1_frozen_weight_changed)
    assert not list(run_dir.glob("trained*.txt")), "training went ahead on different replicas"
    for rank in (0, 1):
        message = (run_dir / f"error{rank}.txt").read_text()
        assert "the model's weights differs between ranks" in message and "model.name_or_path" in message


def test_ddp_broadcasts_no_weights_at_start_up(tmp_path) -> None:
    """Every rank built the same weights (the checksum above proves it), so DDP's start-up broadcast of the
    whole model (15 GB per rank for a 7B in bf16) is switched off."""
    import torch.nn.parallel.distributed as ddp_module

    from tests.distributed.workers_replicas import record_startup_broadcast

    if "init_sync" not in inspect.signature(ddp_module.DistributedDataParallel.__init__).parameters:
        skip_or_fail("torch before 2.6 cannot skip DDP's start-up broadcast")
    run_dir = tmp_path / "broadcast"
    run_dir.mkdir()
    cfg = compose_config(["parallel=ddp2", f"trainer.output_dir={tmp_path}", *TINY])
    launch(cfg, run_dir, entrypoint=record_startup_broadcast)
    for rank in (0, 1):
        record = json.loads((run_dir / f"broadcast{rank}.json").read_text())
        assert record["model"] > 0 and record["broadcast"] == [], record


def test_ranks_with_different_buffers_are_stopped_before_training(tmp_path) -> None:
    from tests.distributed.workers_replicas import train_with_rank1_buffer_changed

    run_dir = tmp_path / "buffer-drift"
    run_dir.mkdir()
    cfg = compose_config(["parallel=ddp2", f"trainer.output_dir={tmp_path}", "trainer.max_steps=2", *TINY])
    with pytest.raises(RuntimeError):
        launch(cfg, run_dir, entrypoint=train_with_rank1_buffer_changed)
    assert "the model's weights differs between ranks" in (run_dir / "error0.txt").read_text()


def test_buffers_are_not_broadcast_before_each_step(tmp_path) -> None:
    """DDP's default re-sends the buffers before the forward of each step's synced micro-step (3 here:
    with parallel.broadcast_buffers=true this test counts 3); the constant buffers of a decoder LM need
    none of it."""
    broadcast, expected = "false", 0
    from tests.distributed.workers_replicas import record_buffer_broadcasts

    run_dir = tmp_path / "broadcasts"
    run_dir.mkdir()
    overrides = ["trainer.max_steps=3", "optim.grad_accum_steps=2", f"parallel.broadcast_buffers={broadcast}"]
    cfg = compose_config(
        ["parallel=ddp2", f"trainer.output_dir={tmp_path}", "trainer.save_final=false", *TINY, *overrides]
    )
    launch(cfg, run_dir, entrypoint=record_buffer_broadcasts)
    for rank in (0, 1):
        assert json.loads((run_dir / f"broadcasts{rank}.json").read_text()) == expected


@pytest.mark.timeout(120)  # the bug it guards is a rank that never exits
def test_freeing_the_ddp_model_after_teardown_never_waits_on_gloo_with_the_gil_held(tmp_path) -> None:
    """A finished run's rank could hang for good in DDP's Reducer freeing the process group (gloo joined its
    threads with the GIL held while one of them waited for the GIL): ``teardown`` keeps the group and frees the
    Reducers, and ``release_left_groups`` drops the group from Python, which frees it with the GIL released."""
    cfg = compose_config(
        ["parallel=ddp2", "parallel.timeout_s=60", "trainer.device=cpu", f"trainer.output_dir={tmp_path}"]
    )
    started = time.monotonic()
    launch(cfg, tmp_path, entrypoint=free_the_model_while_gloo_needs_the_gil)
    assert time.monotonic() - started < 60
    left = [(tmp_path / f"left-rank{r}.txt").read_text() for r in (0, 1)]
    assert left == ["kept 1, model freed True, callback True\n"] * 2
