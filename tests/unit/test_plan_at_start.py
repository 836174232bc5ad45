"""The memory plan of a starting run (issue 38): the limit a refusal is planned against and the GPUs it asks, and
what a CPU run that plans at start does with freed memory (nothing unless asked) and what its report says of it."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import pytest
import torch

from ddptrain import diagnose, parallel
from ddptrain.data import build_datasets
from ddptrain.model import build_tokenizer
from ddptrain.plan import at_start
from ddptrain.plan.__main__ import main
from ddptrain.plan.at_start import RunDoesNotFit, plan_at_start
from ddptrain.plan.budget import GIB
from ddptrain.plan.planner import make_plan
from tests.conftest import compose_config
from tests.unit.test_diagnose import make_run, rank_entry, record

MIB = 2**20
OWN_GPU, GPUS = 1, 4


@dataclass
class FakeGpus:
    """torch sees ``GPUS`` GPUs and this process runs on ``OWN_GPU``; ``mem_get_info`` answers from ``free`` and
    records in ``asked`` every GPU it is asked about: asking a GPU is what creates a CUDA context on it."""

    free: dict[int, int] = field(default_factory=lambda: dict.fromkeys(range(GPUS), 80 * GIB))
    asked: list[int] = field(default_factory=list)

    def mem_get_info(self, index: int) -> tuple[int, int]:
        self.asked.append(index)
        return self.free[index], 80 * GIB


@pytest.fixture
def gpus(monkeypatch) -> FakeGpus:
    fake = FakeGpus()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: GPUS)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: OWN_GPU)
    monkeypatch.setattr(torch.cuda, "mem_get_info", fake.mem_get_info)
    return fake


def test_a_refusal_asks_its_own_gpu_alone_and_names_sizes_that_fit_the_limit_it_prints(
    gpus, monkeypatch, datasets_cache, capsys, caplog
) -> None:
    """Two ranks on CUDA (fake tensors, a fake torch.cuda), this one rank 0 on GPU 1 with the costliest micro-batch;
    rank 1's GPU has the least free memory, below rank 0's peak, and GPU 1 twice that peak. The run stops. Every
    question about free memory, the verdict's and the refusal's own plan, went to GPU 1 (another GPU would have got
    a CUDA context). The refusal prints the least limit, and each setting it names, and each largest micro-batch the
    plan logged with it (for this data, for any data), fits that limit, planned again with it as
    plan.device_memory_gb; planned against GPU 1's own limit, over twice as large, they would be larger and would
    not fit."""
    common = [
        "parallel=ddp2",
        "trainer.device=cuda",
        "trainer.precision=bf16",
        "data.max_rows=400",
        f"data.cache_dir={datasets_cache}",
        "plan.cuda_context_gb=0",  # the tensors alone: the fixed costs would take most of a limit this small
        "plan.nccl_gb=0",
    ]
    cfg = compose_config(common)
    data = build_datasets(cfg.data, build_tokenizer(cfg.model), cfg.trainer.seed)
    peak = make_plan(cfg, data, 2, with_levers=False, only_ranks={0}).worst
    gpus.free[OWN_GPU] = 2 * peak
    least = int(0.9 * peak) // MIB * MIB  # rank 1's limit, below rank 0's peak; whole MiB: exact as GiB
    gpus.asked.clear()
    # Rank 1 sends a smaller peak (rank 0 is the fullest: it plans the refusal) and the least limit.
    monkeypatch.setattr(parallel, "all_gather_object", lambda mine: [mine, (mine[0] // 2, mine[1] // 2, least)])
    monkeypatch.setattr(parallel, "broadcast_object", lambda obj, src: obj)
    monkeypatch.setattr(parallel, "barrier", lambda: None)
    with pytest.raises(RunDoesNotFit) as refused, caplog.at_level(logging.ERROR, logger="ddptrain.plan"):
        plan_at_start(cfg, data, rank=0, world_size=2)
    message = str(refused.value)
    assert set(gpus.asked) == {OWN_GPU}, f"asked GPUs {sorted(set(gpus.asked))}, not only its own GPU {OWN_GPU}"
    assert f"over the device's {least / GIB:.2f} GiB" in message, message
    named = message.split("predicted to fit with ")[1].split(". Nothing was loaded")[0].split("; or ")
    named = [fix.rsplit(" (", 1)[0] for fix in named]
    # The plan logged beside the refusal: its two largest sizes (the line names up to three fixes, levers first).
    largest = re.findall(r"^largest that fits .*: (data\.micro_batch_size=\d+)", caplog.text, re.MULTILINE)
    assert len(largest) == 2, caplog.text
    capsys.readouterr()
    for fix in {*named, *largest}:
        assert main([*common, *fix.split(), f"plan.device_memory_gb={least / GIB}", "--no-levers"]) == 0, fix
        assert "fits: predicted peak" in capsys.readouterr().out


def test_a_cpu_run_planning_at_start_keeps_glibcs_allocator_unless_asked_and_its_report_says_so(
    monkeypatch, tmp_path, datasets_cache
) -> None:
    """A CPU run with a device size plans at start. Freed memory goes back to the system (``process.memory``: steps
    1.5-2.4 times as long on the tiny model) only with plan.cpu_returns_freed_memory=true. Without it, the report
    built from the run's metrics says that glibc's freed blocks kept for reuse are in the measured peak, naming the
    key that hands them back, and what the two figures are: the plan the training step's, the measured peak the
    run's up to its last logged step."""
    calls: list[bool] = []  # the product's call recorded, not made: the tests after this one run in this process
    monkeypatch.setattr(at_start, "return_freed_memory", lambda: calls.append(True) or True)
    monkeypatch.setattr(parallel, "all_gather_object", lambda mine: [mine])
    common = ["parallel=single", "data.max_rows=200", f"data.cache_dir={datasets_cache}", "plan.device_memory_gb=8"]
    cfg = compose_config(common)
    data = build_datasets(cfg.data, build_tokenizer(cfg.model), cfg.trainer.seed)
    kept = plan_at_start(cfg, data, rank=0, world_size=1)
    assert kept.train_gb and calls == [], "planned, and glibc's allocator left as it is"
    windows = [record(5 * w, [rank_entry(0, mem=0.7)]) for w in (1, 2, 3)]
    report = diagnose.build_report(make_run(tmp_path / "kept", [kept.as_record(step=0), *windows]))
    words = diagnose.render_markdown(report)
    assert "predicted before the start:" in words and "for the training step" in words, words
    assert "the peak measured is the run's up to its last logged step" in words, words
    assert "glibc's freed blocks kept for reuse" in words and "`plan.cpu_returns_freed_memory=true`" in words, words
    returned = plan_at_start(compose_config([*common, "plan.cpu_returns_freed_memory=true"]), data, 0, 1)
    assert calls == [True], "asked, it hands freed memory back"
    report = diagnose.build_report(make_run(tmp_path / "returned", [returned.as_record(step=0), *windows]))
    assert "glibc" not in diagnose.render_markdown(report)
