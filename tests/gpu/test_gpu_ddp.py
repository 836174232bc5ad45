"""GPU checks over 2 ranks on NCCL (skipped with fewer than 2 GPUs), and attention over packed rows (1 GPU).

The paths a multi-GPU node takes and the CPU suite cannot: NCCL collectives, accumulation with one all-reduce per
step, gradient checkpointing and torch.compile under DDP, eval and save and a bit-identical resume, torchrun, and
each rank's process on its own GPU. One 2-rank run is shared by the tests that read it. Run by ``make gpu-check``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from ddptrain.config import DType
from ddptrain.observe.flops import lookup_peak_tflops
from tests.conftest import REPO, read_metrics, run_ddptrain, run_dirs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (DDP over 2 ranks, nccl)")

STEPS = 20
DDP2 = [
    "parallel=ddp2",
    "trainer.device=cuda",
    f"trainer.max_steps={STEPS}",
    "trainer.log_every_n_steps=5",
    "trainer.progress_bar=false",
    "data.max_rows=1000",
    "data.micro_batch_size=8",
]
# The shared run: accumulation, checkpointing, eval and saves on the way (precision: the default, auto). Eager
# attention: sdpa's fused backward kernels add into the query gradient with atomics, so two runs of the same steps
# may differ in the last bits, and the resume below must be bit-identical (the frozen embedding has no gradient to
# scatter; matmuls and a 2-rank NCCL sum are deterministic). sdpa and flash run in the other tests.
SHARED = [
    *DDP2,
    "model.attn_implementation=eager",
    "optim.grad_accum_steps=2",
    "model.gradient_checkpointing=true",
    "data.eval_fraction=0.05",
    "trainer.eval_every_n_steps=10",
    "trainer.save_every_n_steps=10",
]


def gpus_of_processes() -> dict[int, set[str]]:
    """pid -> the GPUs (UUIDs) on which that process holds memory now, from nvidia-smi."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    held: dict[int, set[str]] = {}
    for line in out.splitlines():
        pid, _, uuid = line.partition(",")
        if pid.strip().isdigit():
            held.setdefault(int(pid), set()).add(uuid.strip())
    return held


def train_watching_gpus(args: list[str], launcher: list[str] | None = None) -> tuple[Path, list[dict], dict]:
    """Run ddptrain and poll nvidia-smi meanwhile. Returns (run folder, logged records, pid -> GPUs ever held)."""
    seen: dict[int, set[str]] = {}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for pid, gpus in gpus_of_processes().items():
                seen.setdefault(pid, set()).update(gpus)
            time.sleep(0.5)

    already = set(gpus_of_processes())  # other processes on these GPUs (and this one) are no ranks of the run
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        result = run_ddptrain(args, timeout=400, launcher=launcher)
    finally:
        done.set()
        watcher.join()
    assert result.returncode == 0, result.stderr[-4000:]
    out = Path(next(a.split("=", 1)[1] for a in args if a.startswith("trainer.output_dir=")))
    (run_dir,) = run_dirs(out)
    return run_dir, read_metrics(run_dir), {pid: gpus for pid, gpus in seen.items() if pid not in already and gpus}


def losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records if "loss" in r]


def assert_trains(records: list[dict]) -> None:
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(5, STEPS + 1, 5)), steps
    found = losses(records)
    assert all(math.isfinite(x) for x in found) and found[-1] < found[0] - 0.3, found


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory) -> tuple[Path, list[dict], dict]:
    out = tmp_path_factory.mktemp("ddp2")
    return train_watching_gpus([*SHARED, f"trainer.output_dir={out}"])


@two_gpus
def test_accumulation_over_nccl_syncs_once_per_optimizer_step(shared_run) -> None:
    run_dir, records, _ = shared_run
    assert_trains(records)
    train = [r for r in records if "loss" in r]
    assert all(r["allreduce_syncs_per_step"] == 1.0 for r in train), [r["allreduce_syncs_per_step"] for r in train]
    config = (run_dir / "config.yaml").read_text()
    assert "\n  precision: bf16\n" in config, "trainer.precision=auto on a bf16 GPU trains under bf16 autocast"
    # The peak MFU is measured against is the bf16 one (the matmuls run in bf16), not fp32's (15x lower on Hopper).
    bf16_peak = lookup_peak_tflops(torch.cuda.get_device_name(0), DType.bf16)
    assert all(r["peak_tflops"] == bf16_peak for r in train), [r["peak_tflops"] for r in train]
    assert all(r["mfu"] is None or 0 < r["mfu"] < 1 for r in train), [r["mfu"] for r in train]


@two_gpus
def test_eval_runs_on_both_ranks_and_every_save_is_written(shared_run) -> None:
    run_dir, records, _ = shared_run
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [10, 20] and all(math.isfinite(r["eval_loss"]) for r in evals), evals
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert saved == ["step-00000010", "step-00000020"], saved
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()


@two_gpus
def test_each_rank_process_holds_memory_on_exactly_one_gpu(shared_run) -> None:
    _, _, ranks = shared_run
    if not ranks:
        pytest.skip("nvidia-smi lists no process of this run (a container without the host's process ids)")
    assert len(ranks) >= 2, f"nvidia-smi saw {ranks}"
    assert all(len(gpus) == 1 for gpus in ranks.values()), ranks
    assert len(set().union(*ranks.values())) == len(ranks), f"two ranks on one GPU: {ranks}"


@two_gpus
def test_resume_from_the_middle_is_bit_identical(shared_run, tmp_path) -> None:
    run_dir, records, _ = shared_run
    _, resumed, _ = train_watching_gpus(
        [*SHARED, f"trainer.output_dir={tmp_path}", f"trainer.resume={run_dir}/checkpoints/step-00000010"]
    )
    after = [r for r in resumed if "loss" in r]
    assert [r["step"] for r in after] == [15, 20]
    assert losses(after) == losses(records)[2:], "the resumed steps differ from the uninterrupted run's"
    final_eval = [
        [r["eval_loss"] for r in run if r.get("step") == STEPS and "eval_loss" in r] for run in (resumed, records)
    ]
    assert final_eval[0] == final_eval[1], final_eval


@two_gpus
def test_compile_and_checkpointing_under_ddp(tmp_path) -> None:
    _, records, _ = train_watching_gpus([*DDP2, "trainer.compile=true", "model.gradient_checkpointing=true",
                                         "data.eval_fraction=0", "trainer.save_final=false",
                                         f"trainer.output_dir={tmp_path}"])  # fmt: skip
    assert_trains(records)


@two_gpus
def test_torchrun_on_two_gpus(tmp_path) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    _, records, _ = train_watching_gpus(
        [*DDP2, "data.eval_fraction=0", "trainer.save_final=false", f"trainer.output_dir={tmp_path}"], torchrun
    )
    assert_trains(records)


# ----------------------------------------------------------------------------- packed rows (one GPU)

# Qwen2.5-7B's attention (hidden 3584, 28 query heads and 4 key/value heads of 128) at 2 layers and a 32k
# vocabulary: the shapes the kernels see in the headline run, small enough to build in seconds.
SEVEN_B_ATTENTION = {
    "num_hidden_layers": 2,
    "vocab_size": 32768,
    "intermediate_size": 4096,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
SAMPLE_LENGTHS = [37, 300, 128, 511]
# The same sample alone and packed goes through kernels tiled differently, so bf16 rounding differs by a few units
# in the last place of logits that reach ~8 (0.03 each). On the CPU in fp32 the two agree within 6e-6, and a row
# whose samples attend to each other (position_ids dropped) differs by 8.5: the bound sits far from both.
PACKED_BF16_MAX_ABS = 0.25


def packed_vs_alone(attn: str, tmp_path: Path, device: torch.device | None = None, dtype: str = "bf16") -> float:
    """Max abs difference between the logits of samples packed into one row (the product's collator and model)
    and the same samples run one at a time."""
    from ddptrain.config import Attention, DType, ModelConfig, ModelInit
    from ddptrain.data import Collator
    from ddptrain.model import build_model

    seven_b = json.loads((REPO / "ddptrain" / "assets" / "model_configs" / "qwen2.5-7b" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**seven_b, **SEVEN_B_ATTENTION}))
    cfg = ModelConfig(
        name_or_path=str(tmp_path), init=ModelInit.random, dtype=DType(dtype), attn_implementation=Attention(attn)
    )
    device = device or torch.device("cuda", 0)
    loss_module = build_model(cfg, seed=0, device=device).eval()
    generator = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, 32768, (n,), generator=generator).tolist() for n in SAMPLE_LENGTHS]
    rows = [[{"input_ids": s, "labels": s} for s in samples]]
    packed = Collator(0, packed=True, flash_varlen=attn == "flash_attention_2")(rows)
    packed.pop("labels"), packed.pop("target_index")

    def logits(batch: dict) -> torch.Tensor:
        on_device = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
        hidden = loss_module.decoder(**on_device, use_cache=False).last_hidden_state
        return loss_module.lm_head(hidden).float()[0]

    with torch.no_grad():
        together = logits(packed)
        alone = torch.cat([logits({"input_ids": torch.tensor([s])}) for s in samples])
    return float((together - alone).abs().max())


@pytest.mark.parametrize(
    "attn",
    [
        "sdpa",
        pytest.param(
            "flash_attention_2",
            marks=pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="pip install flash-attn"),
        ),
    ],
)
def test_a_packed_row_computes_each_sample_as_if_alone(attn, tmp_path) -> None:
    difference = packed_vs_alone(attn, tmp_path)
    assert difference <= PACKED_BF16_MAX_ABS, f"{attn}: packed logits differ from the samples alone by {difference}"
