"""``make gpu-check`` (scripts/gpu_check.py) on a machine without a GPU: what it would run on 1, 2 and 8 GPUs, and
that a tier killed for time leaves the rows of the tiers before it. Also the rule the one-GPU 2-rank tier rests on:
ranks may share a GPU over gloo, never over NCCL (``parallel.cuda_index``, ``parallel.check_one_rank_per_gpu``)."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import logging
import re
import socket
import sys
import types

import pytest
import torch
import torch.distributed as dist

from ddptrain import parallel
from tests.conftest import REPO

SPEC = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
gpu_check = sys.modules.setdefault("gpu_check", importlib.util.module_from_spec(SPEC))  # dataclasses look it up
SPEC.loader.exec_module(gpu_check)
ONE_GPU_TIERS = ["one-gpu", "shared-gpu", "memory-plan", "throughput"]
EIGHT_MINUTES_S = 480


def sections(text: str) -> dict[int, dict[str, tuple[float, list[str]]]]:
    """The listing as {GPUs: {tier: (budget in s, [test ids])}}, read from its text."""
    found: dict[int, dict[str, tuple[float, list[str]]]] = {}
    tiers: dict[str, tuple[float, list[str]]] = {}
    for line in text.splitlines():
        if m := re.match(r"== (\d+) GPUs?: ", line):
            tiers = found.setdefault(int(m.group(1)), {})
        elif m := re.match(r"-- (\S+) \(.*\): .*, budget (\d+) s$", line):
            current: list[str] = []
            tiers[m.group(1)] = (float(m.group(2)), current)
        elif line.startswith("   "):
            current.append(line.strip())
    return found


@pytest.fixture(scope="module")
def listed() -> dict[int, dict[str, tuple[float, list[str]]]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert gpu_check.main(["--list"]) == 0
    return sections(out.getvalue())


def test_the_listing_names_the_tiers_of_1_2_and_8_gpus_with_budgets_that_grow(listed) -> None:
    assert sorted(listed) == [1, 2, 8]
    assert list(listed[1]) == ONE_GPU_TIERS, "one GPU: no NCCL tier"
    assert list(listed[2]) == list(listed[8]) == [*ONE_GPU_TIERS[:3], "nccl", "throughput"]
    totals = {gpus: sum(budget for budget, _ in tiers.values()) for gpus, tiers in listed.items()}
    assert totals[1] < EIGHT_MINUTES_S, f"one GPU must fit in under 8 minutes: {totals}"
    assert totals[1] < totals[2] < totals[8], totals
    for tier, (budget, _) in listed[2].items():
        assert budget <= listed[8][tier][0], f"{tier}'s budget shrinks with more GPUs"
    assert listed[8]["throughput"][0] > listed[2]["throughput"][0] > listed[1]["throughput"][0]


def test_every_listed_test_exists_and_every_gpu_test_file_is_in_a_tier(listed) -> None:
    """Each id names a test function in its file (read here, not by the script's own collection), and no file of
    tests/gpu is left out of the tiers."""
    named = set()
    for tiers in listed.values():
        for tier, (_, ids) in tiers.items():
            assert ids, f"{tier} lists nothing"
            for test_id in ids if tier != "throughput" else []:
                path, _, name = test_id.partition("::")
                function = name.split("[")[0]
                assert re.search(rf"^def {function}\(", (REPO / path).read_text(), re.M), test_id
                named.add(path)
    assert named == {f"tests/gpu/{p.name}" for p in (REPO / "tests" / "gpu").glob("test_*.py")}
    shared = [i.split("::")[1] for i in listed[1]["shared-gpu"][1]]
    for what in ("syncs_once", "compile", "resume", "checked_in_full_on_the_host", "samples"):
        assert any(what in name for name in shared), f"the shared-GPU tier has no test of {what}: {shared}"
    plan = {test_id.split("[")[1].rstrip("]") for test_id in listed[1]["memory-plan"][1]}
    assert plan == {f"{k}-tokens-checkpointing-{c}" for k in ("1k", "4k") for c in ("on", "off")}, plan


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA path")
def test_without_cuda_it_lists_what_it_would_run_and_exits_2(listed, capsys) -> None:
    assert gpu_check.main([]) == 2
    captured = capsys.readouterr()
    assert sections(captured.out) == listed and "no CUDA device: nothing run" in captured.err


def test_a_tier_killed_for_time_leaves_the_rows_of_the_tiers_before_it(tmp_path) -> None:
    (tmp_path / "test_fast.py").write_text(
        "def test_one():\n    pass\n\n\n"
        "def test_row(record_property):\n    record_property('row', 'planned 1.00 GiB')\n"
    )
    (tmp_path / "test_slow.py").write_text("import time\n\n\ndef test_sleeps():\n    time.sleep(60)\n")
    tiers = [
        # 20 s: a child pytest's start on a loaded 2-core machine took 7 s; what it leaves unused goes to the next tier
        gpu_check.Tier("fast", "passes", (str(tmp_path / "test_fast.py"),), 1, budget_s=20),
        gpu_check.Tier("slow", "runs past its budget", (str(tmp_path / "test_slow.py"),), 1, budget_s=0.5),
    ]
    ok, rows = gpu_check.run_tiers(tiers, 1, 1.0, tmp_path, argparse.Namespace())
    assert not ok
    assert [(tier, name, outcome) for tier, name, outcome, _ in rows[:2]] == [
        ("fast", "test_one", "passed"),
        ("fast", "test_row", "passed: planned 1.00 GiB"),
    ]
    (tier, name, outcome, seconds) = rows[2]
    assert len(rows) == 3 and (tier, name) == ("slow", "(the whole tier)"), rows
    assert outcome.startswith("FAILED: killed after") and seconds < 20 + 0.5 + 10, rows  # its limit, with a margin


# ----------------------------------------------------------------------------- ranks sharing one GPU


def test_over_gloo_more_local_ranks_than_gpus_share_them_round_robin() -> None:
    assert [parallel.cuda_index(r, visible=2, share=True) for r in range(4)] == [0, 1, 0, 1]
    assert [parallel.cuda_index(r, visible=1, share=True) for r in range(2)] == [0, 0]
    with pytest.raises(RuntimeError, match=r"local rank 2 has no GPU: only 2 visible.*parallel\.backend=gloo"):
        parallel.cuda_index(2, visible=2)


def test_two_ranks_on_one_gpu_pass_over_gloo_with_a_warning_and_are_refused_over_nccl(monkeypatch, caplog) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(uuid="GPU-a"))
    for backend in ("gloo", "nccl"):
        store = dist.HashStore()
        store.set("ddptrain/device/rank1", f"{socket.gethostname()} GPU-a")
        env = parallel.DistEnv(0, 0, 2, 2, torch.device("cuda", 0), backend)
        if backend == "nccl":
            with pytest.raises(RuntimeError, match=r"ranks 0, 1 all run on one GPU .*set parallel\.backend=gloo"):
                parallel.check_one_rank_per_gpu(env, store)
            continue
        with caplog.at_level(logging.WARNING, logger="ddptrain.parallel.group"):
            parallel.check_one_rank_per_gpu(env, store)
        assert "ranks 0, 1 share one GPU" in caplog.text and "not for speed" in caplog.text
