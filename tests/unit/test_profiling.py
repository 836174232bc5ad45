"""Out-of-memory errors that name the micro-batch that raised them (the rest of trainer.profile_steps is
proven end to end in tests/e2e/test_profile_and_report.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ddptrain.observe import profiling
from ddptrain.parallel import DistEnv
from ddptrain.process import hangs


@pytest.fixture(autouse=True)
def board_restored():
    """The tests set this process's phase board; leave it as they found it."""
    before = hangs.board.current
    yield
    hangs.board.current = before


def micro_batch(rows: int, width: int, real: int) -> dict[str, torch.Tensor]:
    mask = torch.zeros(rows, width, dtype=torch.long)
    mask.view(-1)[:real] = 1
    return {"input_ids": torch.ones(rows, width, dtype=torch.long), "attention_mask": mask}


def test_out_of_memory_names_the_micro_batch_the_phase_and_the_fixes(tmp_path: Path) -> None:
    env = DistEnv(rank=1, local_rank=1, world_size=2, local_world_size=2, device=torch.device("cpu"), backend="gloo")
    batches = [micro_batch(8, 128, 1000), micro_batch(4, 1024, 4000)]
    hangs.board.enter("backward", 7, 1)  # as the trainer's clock does on entering the second backward
    with pytest.raises(RuntimeError) as raised, profiling.out_of_memory_named(batches, env, tmp_path):
        raise profiling.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    message = str(raised.value)
    assert "rank 1 in backward of step 7, micro-batch 1: input_ids of shape [4, 1024] (4000 real tokens)" in message
    assert "data.micro_batch_size" in message and "model.gradient_checkpointing=true" in message
    assert isinstance(raised.value.__cause__, profiling.OutOfMemoryError)


def test_other_errors_pass_through_unchanged(tmp_path: Path) -> None:
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend="gloo")
    with pytest.raises(ValueError, match="not memory"), profiling.out_of_memory_named([], env, tmp_path):
        raise ValueError("not memory")


def test_out_of_memory_outside_a_micro_step_lists_every_micro_batch(tmp_path: Path) -> None:
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend="gloo")
    batches = [micro_batch(8, 128, 1000), micro_batch(4, 1024, 4000)]
    hangs.board.enter("optimizer", 7)
    with pytest.raises(RuntimeError) as raised, profiling.out_of_memory_named(batches, env, tmp_path):
        raise profiling.OutOfMemoryError("CUDA out of memory")
    message = str(raised.value)
    assert "in optimizer of step 7, micro-batches input_ids of shape [8, 128] (1000 real tokens), " in message
    assert "input_ids of shape [4, 1024] (4000 real tokens)" in message
