"""Checkpoints on 2 gloo ranks: resume equals uninterrupted bit for bit (LoRA, and a full fine-tune with a tied head
and with an untied one), a killed worker restarts and catches up, and only rank 0 writes."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from ddptrain import export
from ddptrain.launch import launch
from tests.conftest import (
    REPO,
    compose_config,
    read_metrics,
    read_written_metrics,
    run_dirs,
    skip_or_fail,
    train_in_process,
)
from tests.distributed.workers import train_recording_dropout_masks
from tests.distributed.workers_audit import (
    changes_after_training,
    changes_by_rank,
    private_view_unavailable,
    train_then_write_as_rank1,
)

pytestmark = pytest.mark.dist

# Dropout draws random numbers every step: a resume is bit-identical only if each rank's RNG state
# comes back and nothing else draws from it (a DataLoader iterator did, at every epoch and resume).
COMMON = [
    "model.lora_dropout=0.1",
    "data.max_rows=240",
    "data.eval_fraction=0",
    "data.micro_batch_size=8",
    "trainer.progress_bar=false",
    "trainer.log_every_n_steps=1",
    "parallel.timeout_s=60",
    "trainer.device=cpu",  # also in the commands built below (not through run_ddptrain)
]
STEPS_PER_EPOCH = 240 // 16  # 2 ranks x 8 rows, length_grouped drops nothing at 240 rows


def saved_tensors(folder: Path) -> dict:
    """Every tensor in a folder's safetensors files: an adapter's, or a full fine-tune's model."""
    files = sorted(folder.glob("*.safetensors"))
    assert files, f"{folder} holds no safetensors file"
    return {key: value for file in files for key, value in load_file(str(file)).items()}


def final_weights(run_dir: Path) -> dict:
    return saved_tensors(run_dir / "adapter")


def assert_bit_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def untied_tiny_model(folder: Path) -> Path:
    """The bundled tiny model's architecture with its own LM head (tie_word_embeddings=false), written to ``folder``
    (the tiny preset's model.init=random builds it from the config alone)."""
    config = json.loads((REPO / "ddptrain" / "assets" / "tiny_qwen2" / "config.json").read_text())
    assert config["tie_word_embeddings"], "the bundled model ties its head: the other cases cover a tied one"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    return folder


# LoRA resumes in two batchings; the third trains a full fine-tune whose head is not tied (the tied head resumes in
# the restart tests below, model.lora=false there too).
@pytest.mark.parametrize(
    ("batching", "weights"), [("length_grouped", "lora"), ("token_budget", "lora"), ("packed", "full-untied")]
)
def test_resume_from_mid_epoch_and_epoch_boundary_equals_uninterrupted(tmp_path, batching, weights) -> None:
    """Checkpoints of an uninterrupted run (one per step) are resumed from a mid-epoch step and from the
    last step of epoch 1; both resumed runs end bit-identical to it, with the same logged losses."""
    untied = untied_tiny_model(tmp_path / "untied") if weights == "full-untied" else None
    full = [] if untied is None else ["model.lora=false", f"model.name_or_path={untied}"]
    args = [
        "parallel=ddp2",
        *COMMON,
        *full,
        f"data.batching={batching}",
        "data.max_tokens_per_batch=1024",
        # A loader worker (started at every epoch and resume) in one mode: they are slow to start here.
        f"data.num_workers={1 if batching == 'length_grouped' else 0}",
        f"trainer.max_steps={STEPS_PER_EPOCH + 6}",
    ]
    whole = train_in_process(tmp_path / "whole", [*args, "trainer.save_every_n_steps=1", "trainer.keep_last_n=100"])
    reference, ref_losses = final_weights(whole), train_losses(whole)
    if untied is not None:  # the head is saved, a tensor of its own
        assert not torch.equal(reference["lm_head.weight"], reference["model.embed_tokens.weight"])
    manifests = {
        p: json.loads((p / "manifest.json").read_text())
        for p in sorted((whole / "checkpoints").iterdir())
        if p.name.startswith("step-")
    }
    first_epoch = [p for p, m in manifests.items() if m["epoch"] == 0]
    assert len(first_epoch) >= 4 and len(first_epoch) < len(manifests), "the run must cross an epoch boundary"
    for resume_from in (first_epoch[len(first_epoch) // 2], first_epoch[-1]):
        run = train_in_process(tmp_path / f"resumed-{resume_from.name}", [*args, f"trainer.resume={resume_from}"])
        assert_bit_identical(final_weights(run), reference)
        checked = [r for r in read_metrics(run) if "save_check_s" in r]  # a resumed run's saves load as trained
        assert checked and any("save_check_round_trip" in r for r in checked)  # the last save's round trip
        if weights == "lora":
            assert all(r.get("save_check_max_abs_diff", 0.0) <= 1e-5 for r in checked)
        else:  # every tensor of each folder read back bit for bit (the head saved: none left out)
            assert all(r["save_check_tensors"] == len(reference) * len(r["save_check_folders"]) for r in checked)
        losses = train_losses(run)
        assert min(losses) == manifests[resume_from]["step"] + 1
        assert all(losses[s] == ref_losses[s] for s in losses), "metrics after resuming differ"


def test_ranks_start_from_the_same_weights_and_draw_different_dropout_masks(tmp_path) -> None:
    """Both ranks train step 1 on the same rows: same weights, same inputs to every dropout, different masks. That
    a resume still replays each rank's masks bit for bit is the test above (its runs have model.lora_dropout=0.1)."""
    p = 0.5
    cfg = compose_config([*COMMON, "parallel=ddp2", f"model.lora_dropout={p}", f"trainer.output_dir={tmp_path}"])
    launch(cfg, tmp_path, entrypoint=train_recording_dropout_masks)
    rank0, rank1 = (torch.load(tmp_path / f"masks-rank{r}.pt") for r in (0, 1))
    assert rank0["weights"].keys() == rank1["weights"].keys() and rank0["weights"]
    assert all(torch.equal(rank0["weights"][k], rank1["weights"][k]) for k in rank0["weights"]), "init differs"
    assert rank0["dropout"].keys() == rank1["dropout"].keys() and rank0["dropout"], "no LoRA dropout ran"
    for name, seen in rank0["dropout"].items():
        other = rank1["dropout"][name]
        assert torch.equal(seen["input"], other["input"]), f"{name}: the ranks' inputs differ, the test is void"
        nonzero = seen["input"] != 0  # padding rows come in as zeros: dropout cannot show on them
        dropped = seen["mask"][nonzero].float().mean().item()
        assert abs(dropped - p) < 0.05, f"{name} zeroed {dropped:.3f} of its input, not p={p}"
        same = torch.equal(seen["mask"], other["mask"])
        assert not same, f"{name}: both ranks drew the same dropout mask"


def _worker_pids(launcher_pid: int) -> list[int]:
    """The training processes the launcher started (not multiprocessing's resource tracker): its spawned children,
    or the children of its forkserver."""
    workers = []
    for pid, cmd in _children(launcher_pid).items():
        if "forkserver" in cmd:
            workers += _children(pid)
        elif "spawn_main" in cmd or "ddptrain" in cmd:
            workers.append(pid)
    return workers


def _children(pid: int) -> dict[int, str]:
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return {int(p): Path(f"/proc/{p}/cmdline").read_text(errors="ignore") for p in children}


def signal_workers_mid_run(command: list[str], output_dir: Path, signum: int, after_step: int) -> tuple[bool, int, str]:
    """Start ``command``; once its metrics reach ``after_step``, send ``signum`` to one worker.

    Returns:
        (whether the signal was sent, the launcher's exit code, its output).
    """
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sent = False
    try:
        deadline = time.monotonic() + 120
        while not sent and time.monotonic() < deadline and proc.poll() is None:
            dirs = run_dirs(output_dir) if output_dir.exists() else []
            if dirs and (dirs[0] / "metrics.jsonl").exists():
                steps = [r["step"] for r in read_written_metrics(dirs[0]) if "loss" in r]
                if steps and steps[-1] >= after_step:
                    workers = _worker_pids(proc.pid)
                    for pid in workers[-1:]:
                        os.kill(pid, signum)
                    sent = True
            time.sleep(0.02)
        output = proc.communicate(timeout=240)[0]
    finally:
        proc.kill()
    return sent, proc.returncode, output


TORCHRUN = str(Path(sys.executable).parent / "torchrun")


# A worker is killed once step KILL_AFTER_STEP is logged: the restarted group resumes from the checkpoint at step 4
# (one every SAVE_EVERY steps), retrains the few steps after it and trains on, through the checkpoint at step 8, to
# RESTART_STEPS, all in the first epoch (600 rows are 37 steps of 16). Unless the kill lands three steps late (after
# the checkpoint at step 8), at least one step is trained twice.
KILL_AFTER_STEP = 5
SAVE_EVERY = 4
RESTART_STEPS = 12
RESTART_ARGS = [
    *(arg for arg in COMMON if not arg.startswith(("data.eval_fraction=", "model.lora_dropout="))),
    # A full fine-tune of the bundled model, whose LM head is tied to its embedding (the weights leave the head out).
    # LoRA resumes in the test above and in tests/e2e/test_signals.py.
    "model.lora=false",
    # An evaluation every 4 steps. The best is built, not found: at the tiny preset's learning rate (5e-3, well
    # within what the model takes) the eval loss falls at every evaluation, by far more than rounding (the reference
    # run checks it). Ranked the usual way, the best moves to every new evaluation, after the restart too (best/ is
    # rewritten at 8 and 12); with trainer.greater_is_better=true (BEST_FIRST) the first evaluation stays the best,
    # found before the kill, and its checkpoint outlives trainer.keep_last_n=1 and the restart.
    "data.eval_fraction=0.03",
    "trainer.eval_every_n_steps=4",
    "trainer.keep_last_n=1",
    "data.num_workers=2",
    "data.max_rows=600",
    f"trainer.max_steps={RESTART_STEPS}",
    f"trainer.save_every_n_steps={SAVE_EVERY}",
]


BEST_FIRST = "trainer.greater_is_better=true"  # on a falling eval loss: the first evaluation is the best


@pytest.fixture(scope="module")
def uninterrupted_restart_run(tmp_path_factory) -> Callable[[bool, str], Path]:
    """The runs the killed runs must end bit-identical to, with the best first (``BEST_FIRST``) or last, under each
    parallel.strategy (trained once each for the module, in this process: what it is compared with is the command
    line's)."""
    runs: dict[tuple[bool, str], Path] = {}

    def reference(best_first: bool, strategy: str) -> Path:
        if (best_first, strategy) not in runs:
            args = [
                "parallel=ddp2",
                f"parallel.strategy={strategy}",
                *RESTART_ARGS,
                *([BEST_FIRST] if best_first else []),
            ]
            runs[best_first, strategy] = ref = train_in_process(tmp_path_factory.mktemp("ref") / "run", args)
            assert read_metrics(ref)[-1]["step"] == RESTART_STEPS
            evals = [r["eval_loss"] for r in read_metrics(ref) if "eval_loss" in r]
            falls = [before - after for before, after in itertools.pairwise(evals)]
            # Rounding moves an fp32 loss of ~8 by ~1e-6; a fall of 0.01 is no kernel's accident.
            assert len(evals) == RESTART_STEPS // 4 and min(falls) > 0.01, f"the eval loss must fall: {evals}"
            best = json.loads((ref / "best" / "best.json").read_text())["step"]
            assert best == (4 if best_first else RESTART_STEPS), f"best at step {best}: the eval loss did not fall"
        return runs[best_first, strategy]

    return reference


def assert_same_best(run: Path, reference: Path) -> None:
    """The restarted run chose the best evaluation the uninterrupted one chose: the same step and loss in best/, the
    same weights bit for bit, and the checkpoint kept for it."""
    named, expected = (json.loads((r / "best" / "best.json").read_text()) for r in (run, reference))
    assert (named["step"], named["eval_loss"]) == (expected["step"], expected["eval_loss"])
    assert_bit_identical(*(saved_tensors(r / "best") for r in (run, reference)))
    assert (run / "checkpoints" / f"step-{named['step']:08d}").is_dir()


def assert_export_loads_as_trained(run: Path, out: Path) -> None:
    """``python -m ddptrain.export <run> <out>`` writes a folder plain transformers loads with the run's weights bit
    for bit and its head tied to its embedding, as in training (the files leave the head out)."""
    export.main([str(run), str(out)])
    model = AutoModelForCausalLM.from_pretrained(out)
    trained, loaded = final_weights(run), model.state_dict()
    assert "lm_head.weight" not in trained and loaded.keys() - trained.keys() == {"lm_head.weight"}
    assert model.lm_head.weight is model.get_input_embeddings().weight, "the exported head is not tied"
    assert_bit_identical({key: loaded[key] for key in trained}, trained)


def assert_every_save_checked(run: Path) -> None:
    """Rank 0 read back each folder it saved bit for bit (the best at step 4, the checkpoint at step 8 before or after
    the restart, the last one and adapter/ at the end), and loaded the last in plain transformers."""
    checked = {r["step"] for r in read_metrics(run) if r.get("save_check_tensors")}
    assert {4, 8, RESTART_STEPS} <= checked, f"save checks at steps {sorted(checked)}"
    assert any(r.get("save_check_loaded_tensors") for r in read_metrics(run)), "no round trip at the end"


def assert_resumed_once_from_the_last_checkpoint(run: Path) -> None:
    """The run restarted once and retrained only the steps after its last checkpoint before the kill."""
    assert (run / "train.log").read_text().count("resumed from") == 1
    logged = [r["step"] for r in read_metrics(run) if "loss" in r]
    repeated = len(logged) - len(set(logged))
    assert 0 < repeated <= SAVE_EVERY, f"{repeated} steps were trained twice (save_every_n_steps={SAVE_EVERY})"
    assert read_metrics(run)[-1]["step"] == RESTART_STEPS


# torchrun's restart of a killed worker is test_two_torchrun_nodes_train_one_run (a torchrun case here ran the same
# kill and the same checks on one node, 34 s of the suite's critical path).
# fsdp2: every rank's shards and the optimizer's in the checkpoint's sharded/, the full weights gathered into
# weights/ (what the save check reads and the export writes).
@pytest.mark.parametrize(
    ("launcher", "best_first", "strategy"),
    [("self-launch", True, "ddp"), ("self-launch-forkserver", False, "ddp"), ("self-launch-forkserver", True, "fsdp2")],
    ids=[
        "self-launch-best-before-the-kill",
        "self-launch-forkserver-best-after-the-restart",
        "fsdp2-self-launch-forkserver-best-before-the-kill",
    ],
)
def test_killed_worker_restarts_and_ends_with_the_same_parameters(
    tmp_path, launcher, best_first, strategy, uninterrupted_restart_run
) -> None:
    reference = uninterrupted_restart_run(best_first, strategy)
    command = [
        sys.executable,
        "-m",
        "ddptrain",
        f"parallel.strategy={strategy}",
        *RESTART_ARGS,
        *([BEST_FIRST] if best_first else []),
        "parallel.max_restarts=1",
        f"parallel.start_method={'forkserver' if launcher.endswith('forkserver') else 'spawn'}",
        f"trainer.output_dir={tmp_path}/run",
    ]
    killed, returncode, output = signal_workers_mid_run(
        command, tmp_path / "run", signal.SIGKILL, after_step=KILL_AFTER_STEP
    )
    assert killed, "the run ended before a worker could be killed"
    assert returncode == 0, output[-3000:]
    (run,) = run_dirs(tmp_path / "run")
    assert_bit_identical(final_weights(run), final_weights(reference))
    assert_resumed_once_from_the_last_checkpoint(run)
    assert_same_best(run, reference)
    assert_every_save_checked(run)
    best = json.loads((run / "best" / "best.json").read_text())
    last_line = f"the best weights (step {best['step']}, eval_loss {best['eval_loss']:.4f}) are in {run / 'best'}"
    assert last_line in output, output[-800:]
    assert_export_loads_as_trained(run, tmp_path / "exported")


def test_only_rank_zero_writes_in_the_run_directory(tmp_path) -> None:
    """Rank 1 runs the real worker in a private overlay view of the run folder, so every file it creates,
    changes or deletes there lands in its own upper layer, whichever API wrote it (torch.save writes from
    C++, safetensors from Rust: a Python audit hook sees neither). Rank 1 changed nothing by the end of training;
    then it writes with both, and the check flags them (one run for both: they were two cases, 27 s in all)."""
    unavailable = private_view_unavailable(tmp_path / "probe")
    if unavailable:
        skip_or_fail(f"needs a mount namespace with overlayfs (root, or unprivileged user namespaces): {unavailable}")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = compose_config(
        [
            "parallel=ddp2",
            # Spawned: unshare() needs a single-threaded process, and a forked rank runs a thread that watches
            # its launcher (ddptrain/process/forkserver.py).
            "parallel.start_method=spawn",
            *COMMON,
            "trainer.max_steps=4",
            "trainer.save_every_n_steps=2",
            f"trainer.output_dir={tmp_path}",
        ]
    )
    launch(cfg, run_dir, entrypoint=train_then_write_as_rank1)

    # Each rank keeps its own breadcrumbs under hang/ (its phase, its stacks: docs/hangs.md), never a shared file.
    def by_rank1(changes: list[str]) -> list[str]:
        return [p for p in changes if not p.startswith("hang/rank1.")]

    trained = by_rank1(changes_after_training(run_dir, rank=1))
    assert trained == [], f"rank 1 created or changed {trained} in the run folder"
    assert by_rank1(changes_by_rank(run_dir, rank=1)) == ["adapter/adapter_model.safetensors", "rank1.pt"]
    assert not (run_dir / "rank1.pt").exists(), "rank 1's write reached the real run folder"
    # Rank 0 wrote everything, into the real folder (the one the launcher and the user see).
    for written in ("config.yaml", "train.log", "metrics.jsonl", "checkpoints/step-00000004/manifest.json"):
        assert (run_dir / written).is_file(), written
    assert "base_model.model" in next(iter(final_weights(run_dir))), "rank 0's adapter was replaced"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# The killed-worker case failed in CI (2026-12-01 and 2026-12-02) and nowhere else: in-process launches earlier in
# the session had left TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment, so these agents shared no store
# and the nodes' ranks met under different attempts after the restart. ``launch`` now restores the environment.
def test_two_torchrun_nodes_train_one_run(tmp_path, uninterrupted_restart_run) -> None:
    """Two torchrun agents on 127.0.0.1 (--nnodes 2, one process each) form one job through the c10d rendezvous, as
    two machines would, and train one run in one run folder. One agent's worker is SIGKILLed mid-run, --max-restarts
    1 restarts the group on both nodes, and the run resumes once from its last checkpoint in the same folder, ending
    bit-identical to a 2-process run. (A case without the kill ran the same first round to the end: its checks are
    this case's, less the resume, and it cost 26 s of the suite's critical path.)"""
    out = tmp_path / "run"
    rendezvous = [
        "--rdzv-backend",
        "c10d",
        f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
        f"--rdzv-id={uuid.uuid4().hex}",
    ]
    agent = [TORCHRUN, "--nnodes", "2", "--nproc_per_node", "1", *rendezvous, "--max-restarts", "1"]
    command = [*agent, "-m", "ddptrain", "parallel=auto", *RESTART_ARGS, BEST_FIRST, f"trainer.output_dir={out}"]
    env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
    # For the failure message: the agents' rendezvous rounds and restarts, the store's and gloo's own lines.
    env.update(LOGLEVEL="INFO", TORCH_CPP_LOG_LEVEL="INFO")
    # Each agent writes to a file: a pipe nobody reads while the test waits for the other agent would fill and stop
    # that agent (and its worker) mid-write.
    logs = [tmp_path / f"agent{i}.log" for i in range(2)]
    timed_out = False
    with logs[0].open("w") as log0, logs[1].open("w") as log1:
        nodes = [
            subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT) for log in (log0, log1)
        ]
        killed = False
        deadline = time.monotonic() + 240  # within pytest's 300 s, so that a hang still reports both logs
        try:
            while not killed and time.monotonic() < deadline and all(n.poll() is None for n in nodes):
                dirs = run_dirs(out) if out.exists() else []
                if dirs and (dirs[0] / "metrics.jsonl").exists():
                    steps = [r["step"] for r in read_written_metrics(dirs[0]) if "loss" in r]
                    if steps and steps[-1] >= KILL_AFTER_STEP:
                        for pid in _worker_pids(nodes[1].pid):
                            os.kill(pid, signal.SIGKILL)
                        killed = True
                time.sleep(0.02)
            for node in nodes:
                node.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            for node in nodes:  # torchrun's workers run in their own session: they would outlive their agent
                for pid in _worker_pids(node.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                node.kill()
                node.wait()
    # Both agents' whole output (c10d's own log included): a failure across nodes can start on either of them, and
    # its first error is rarely in the last lines.
    outputs = "\n".join(
        f"===== agent {i} (exit {n.returncode}) =====\n{log.read_text(errors='replace')}"
        for i, (n, log) in enumerate(zip(nodes, logs))
    )
    assert not timed_out, f"the agents were still running after 240 s\n{outputs}"
    assert killed, f"the run ended before a worker could be killed\n{outputs}"
    assert [n.returncode for n in nodes] == [0, 0], outputs
    (run,) = run_dirs(out)
    reference = uninterrupted_restart_run(best_first=True, strategy="ddp")
    assert_bit_identical(final_weights(run), final_weights(reference))
    # Once: the first round trained undisturbed until the kill, the second resumed.
    assert_resumed_once_from_the_last_checkpoint(run)
    assert_same_best(run, reference)
    assert_every_save_checked(run)
    assert "rank 0 of 2 on cpu" in (run / "train.log").read_text(), "one group of two, across the two agents"
