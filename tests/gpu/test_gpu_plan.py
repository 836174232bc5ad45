"""The memory plan against the GPU's allocator: Qwen2.5-0.5B (random init, its bundled architecture config), LoRA
r=16 on every linear layer, bf16 weights under bf16 autocast, one micro-batch of 1,024 and of 4,096 tokens, gradient
checkpointing off and on.

The prediction is the plan's (``ddptrain.plan.simulate.FakeModel`` on fake tensors, added up as
``ddptrain.bench.memory_plan.predicted`` adds them: weights, gradients and AdamW's two states of the trainable
parameters, the step's peak, the allocator's slack), less the CUDA context it counts (``plan.cuda_context_gb``), which
``torch.cuda.max_memory_reserved`` does not see; one process, so no NCCL buffers. The measurement is a real step on
cuda:0: forward, backward and an AdamW step, the second of two (the first makes AdamW's states), its
``max_memory_reserved``. Each row goes to the junit report as a property, where ``make gpu-check`` reads it into its
table. Run by ``make gpu-check`` (scripts/gpu_check.py, tier "memory plan").
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOLERANCE = 0.15  # what the plan claims for a rank's peak (issue 24; tests/distributed/test_evaluation.py holds it)
MODEL = "Qwen2.5-0.5B"


def measured_reserved_gib(cfg, rows: int, width: int, targets: int) -> tuple[float, float]:
    """(max_memory_reserved, max_memory_allocated) in GiB of the second of two real steps on cuda:0."""
    from ddptrain.model import build_model
    from ddptrain.plan.budget import GIB

    device = torch.device("cuda", 0)
    torch.cuda.empty_cache()
    model = build_model(cfg, seed=0, device=device).train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    ids = torch.randint(0, 1000, (rows, width), device=device)
    target_index = torch.arange(targets, device=device)
    for _ in range(2):  # the first step makes AdamW's states; the second is the steady step the plan describes
        torch.cuda.reset_peak_memory_stats(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = model(ids, ids.clone(), target_index=target_index)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del loss
    torch.cuda.synchronize(device)
    figures = torch.cuda.max_memory_reserved(device) / GIB, torch.cuda.max_memory_allocated(device) / GIB
    del model, optimizer
    torch.cuda.empty_cache()
    return figures


@pytest.mark.parametrize("checkpointing", [False, True], ids=["checkpointing-off", "checkpointing-on"])
@pytest.mark.parametrize("tokens", [1024, 4096], ids=["1k-tokens", "4k-tokens"])
def test_the_plan_predicts_max_memory_reserved_of_a_real_step(tokens, checkpointing, record_property) -> None:
    from ddptrain.bench.memory_plan import MODELS, model_config, predicted
    from ddptrain.config import DType, PlanConfig
    from ddptrain.config.hydra import ASSETS_DIR
    from ddptrain.model import architecture_config
    from ddptrain.plan.simulate import BatchShape, FakeModel

    if not (ASSETS_DIR / MODELS[MODEL] / "config.json").is_file():
        pytest.skip(f"no {MODEL} architecture config at {ASSETS_DIR / MODELS[MODEL]}")
    cfg = model_config(MODEL, checkpointing)
    shape = BatchShape(rows=1, width=tokens, targets=tokens // 2, padded=False)
    planned = predicted(FakeModel(architecture_config(cfg), cfg, DType.bf16), shape, world_size=1)
    planned_reserved = planned["peak"] - PlanConfig().cuda_context_gb
    reserved, allocated = measured_reserved_gib(cfg, shape.rows, shape.width, shape.targets)
    error = (planned_reserved - reserved) / reserved
    row = (
        f"{MODEL} {tokens:,} tokens, checkpointing {'on' if checkpointing else 'off'}: planned "
        f"{planned_reserved:.2f} GiB, max_memory_reserved {reserved:.2f} GiB ({error:+.0%}; allocated "
        f"{allocated:.2f} GiB), tolerance {TOLERANCE:.0%}"
    )
    record_property("row", row)
    print(row)
    assert abs(error) <= TOLERANCE, row
