"""The save check (``trainer.save_check``) on one process: the read-back of every save against corrupted files (one
flipped bit included, at the save where it happens), the round trip through plain peft (other logits, another base,
a diverged model), ``best/`` as a verified copy checked once (and carried over on resume), what each mode checks at
which save (a run without ``adapter/`` included), the round trip on every core with a GPU run's host base kept between
checks and never a CPU run's, Liger's patch kept away from it, and the merged model checked weight by weight on 8 bf16
layers with an adapter of a realistic size."""

from __future__ import annotations

import copy
import json
import logging
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ddptrain import checkpoint, parallel
from ddptrain.config import SaveCheckMode
from ddptrain.evaluation import host
from ddptrain.evaluation.peft_check import merge_error
from ddptrain.evaluation.readback import SaveCheckError
from ddptrain.evaluation.save_check import SaveChecks, build_save_checks
from ddptrain.model import build_model, build_tokenizer, liger, point_adapter_at_base, save_random_base
from ddptrain.model.precision import TORCH_DTYPES
from ddptrain.trainer import Trainer
from tests.conftest import REPO, compose_config

TINY = ["data.max_rows=64", "data.eval_fraction=0", "trainer.progress_bar=false", "parallel=single"]
PROBE = ("Sort 3, 1, 2.", "Reverse: red sparrow")
ADAPTER = "adapter_model.safetensors"


def train_like(model: torch.nn.Module, std: float = 0.02) -> torch.nn.Module:
    """``lora_B`` drawn as if trained (it starts at zero: the adapter would do nothing), with spread ``std``."""
    generator = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.copy_(torch.randn(p.shape, generator=generator) * std)
    return model


@pytest.fixture(scope="module")
def trained_lora():
    """The bundled model with LoRA, its lora_B drawn as if trained, and its tokenizer."""
    cfg = compose_config([])
    torch.manual_seed(0)
    module = build_model(cfg.model, seed=0, device=torch.device("cpu"))
    train_like(module)
    return cfg, module.model, build_tokenizer(cfg.model)


def checks_for(run_dir: Path, trained_lora, mode=SaveCheckMode.every, on_cpu: bool = False) -> SaveChecks:
    """The checks a run in ``run_dir`` builds (``on_cpu``: a GPU run's, the base loaded on the host and the training
    model mirrored there, run here on the CPU)."""
    cfg, model, tokenizer = trained_lora
    rows = [tokenizer(text).input_ids for text in PROBE]
    base = checkpoint.base_model_path(cfg.model, run_dir)
    attn = cfg.model.attn_implementation.value
    return build_save_checks(mode, model, base, TORCH_DTYPES[cfg.model.dtype], attn, rows, 0, on_gpu=on_cpu)


def writer_for(run_dir: Path, trained_lora, checks: SaveChecks | None, keep_best_n: int = 1):
    from ddptrain.evaluation.best import BestRule

    cfg, _, tokenizer = trained_lora
    files = checkpoint.AdapterFiles(tokenizer, cfg.model, seed=0)
    rule = BestRule(keep_best_n=keep_best_n)
    return checkpoint.CheckpointWriter(run_dir, keep_last_n=1, files=files, rule=rule, check=checks)


def meta(step: int, best: bool = False) -> dict:
    evaluated = {"eval": {"eval_loss": 1.0 / step, "step": step}, "best": True} if best else {}
    return {"step": step, "epoch": 0, "position": step, **evaluated}


def saved_adapter(tmp_path: Path, trained_lora, on_cpu: bool = False) -> tuple[Path, SaveChecks]:
    """A checkpoint saved and read back as a run saves it (``trainer.save_check=every``, a save before the last)."""
    checks = checks_for(tmp_path, trained_lora, on_cpu=on_cpu)
    writer = writer_for(tmp_path, trained_lora, checks)
    folder = writer.save(trained_lora[1], {"step": 3}, meta(3)) / checkpoint.WEIGHTS
    assert writer.checked["save_check_tensors"] == len(load_file(str(folder / ADAPTER)))  # every tensor, read back
    assert "save_check_round_trip" not in writer.checked  # not at a save before the last
    return folder, checks


def rewrite(folder: Path, change) -> None:
    path = folder / ADAPTER
    save_file(change(load_file(str(path))), str(path))


FLIPPED = "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"


def flip_one_bit(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The lowest mantissa bit of one element of one tensor: the smallest change there is."""
    weights[FLIPPED].view(torch.int32)[0, 0] ^= 1
    return weights


CORRUPTIONS = {
    "module-prefix": (lambda w: {f"module.{k}": v for k, v in w.items()}, "carry a wrapper's prefix"),
    "zeroed-lora_B": (
        lambda w: {
            k: torch.zeros_like(v) if k.endswith("layers.1.mlp.down_proj.lora_B.weight") else v for k, v in w.items()
        },
        r"1 lora_B weight\(s\) are all zero",
    ),
    "dropped-key": (lambda w: dict(list(w.items())[1:]), "missing base_model"),
    "other-weights": (lambda w: {k: v * 1.5 if "lora_B" in k else v for k, v in w.items()}, "not the trained tensor"),
    "flipped-bit": (flip_one_bit, rf"{FLIPPED} as read back is not the trained tensor .* 1 of \d+ elements differ"),
}


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_the_read_back_refuses_a_corrupted_adapter_naming_the_file(tmp_path, trained_lora, kind) -> None:
    folder, checks = saved_adapter(tmp_path, trained_lora)
    change, message = CORRUPTIONS[kind]
    rewrite(folder, change)
    with pytest.raises(SaveCheckError, match=message) as refused:
        checks.read_back(folder, folder)
    assert str(folder / ADAPTER) in str(refused.value)


def test_one_flipped_bit_loads_within_the_logit_bound_only_the_read_back_sees_it(tmp_path, trained_lora) -> None:
    """Why every save is read back bit for bit: plain peft loads an adapter with one bit flipped and computes logits
    within the round trip's bound, so a check by logits alone passes it."""
    folder, checks = saved_adapter(tmp_path, trained_lora)
    rewrite(folder, flip_one_bit)
    assert checks.round_trip([(folder, folder)])["save_check_max_abs_diff"] <= 1e-5
    with pytest.raises(SaveCheckError, match=r"1 of \d+ elements differ"):
        checks.written(folder, folder, final=True)


@pytest.mark.parametrize("on_cpu", [False, True], ids=["beside-the-model", "mirrored-on-the-host"])
def test_the_round_trip_refuses_an_adapter_that_computes_other_logits(tmp_path, trained_lora, on_cpu) -> None:
    folder, checks = saved_adapter(tmp_path, trained_lora, on_cpu)
    rewrite(folder, CORRUPTIONS["other-weights"][0])
    with pytest.raises(
        SaveCheckError, match="loaded onto its base with plain peft, it computes other logits"
    ) as refused:
        checks.round_trip([(folder, folder)])  # the round trip alone: the read-back would refuse it first
    assert str(folder / ADAPTER) in str(refused.value)


@pytest.mark.parametrize("on_cpu", [False, True], ids=["beside-the-model", "mirrored-on-the-host"])
def test_a_diverged_model_saves_with_a_warning_and_its_nans_must_match(tmp_path, trained_lora, on_cpu, caplog) -> None:
    """A run that trained past NaN weights (a learning rate too high) computes NaN logits: its adapter, saved as it
    is, loads and computes the same NaNs, so the save passes with a warning rather than failing the run as "not the
    trained one"; an adapter that holds finite numbers where the model holds NaN is still refused, by both checks."""
    cfg, model, tokenizer = trained_lora
    diverged = copy.deepcopy(model)
    lora_a = next(
        p for name, p in diverged.named_parameters() if name.endswith("layers.0.mlp.down_proj.lora_A.default.weight")
    )
    lora_a.data[0, 0] = math.nan
    folder, checks = saved_adapter(tmp_path, (cfg, diverged, tokenizer), on_cpu)
    with caplog.at_level(logging.WARNING, logger="ddptrain.checkpoint"):
        assert checks.written(folder, folder, final=True)["save_check_max_abs_diff"] == 0.0
    assert "the run has diverged" in caplog.text
    rewrite(folder, lambda w: {k: v.nan_to_num(0.0) for k, v in w.items()})
    with pytest.raises(SaveCheckError, match="not the trained tensor"):
        checks.read_back(folder, folder)
    with pytest.raises(SaveCheckError, match="NaN or infinite where the training model's are not"):
        checks.round_trip([(folder, folder)])


@pytest.mark.parametrize("kind", ["module-prefix", "dropped-key", "flipped-bit"])
def test_a_corrupted_save_fails_the_run_at_that_save_and_leaves_the_one_before(tmp_path, monkeypatch, kind) -> None:
    """The weights of the second save are corrupted on the way to disk (a wrapper's prefix, a lost tensor, one bit):
    the run fails at that save, naming its file, and the first save's checkpoint stays the newest in place."""
    real_write = checkpoint.AdapterFiles.write
    change = CORRUPTIONS[kind][0]

    def corrupting(self, model, folder, run_dir, with_tokenizer, whole=None):
        real_write(self, model, folder, run_dir, with_tokenizer, whole)
        if "step-00000002" in str(folder):
            rewrite(folder, change)

    monkeypatch.setattr(checkpoint.AdapterFiles, "write", corrupting)
    cfg = compose_config([*TINY, "trainer.max_steps=3", "trainer.save_every_n_steps=1"])
    env = parallel.init_distributed(cfg.parallel, cfg.trainer.device)
    try:
        trainer = Trainer(cfg, env, tmp_path)
        with pytest.raises(RuntimeError, match="SaveCheckError") as failed:
            trainer.fit()
    finally:
        parallel.teardown()
    assert str(tmp_path / "checkpoints" / "step-00000002" / "weights" / ADAPTER) in str(failed.value)
    assert checkpoint.newest_complete(tmp_path / "checkpoints") == tmp_path / "checkpoints" / "step-00000001"


@pytest.mark.parametrize("on_cpu", [False, True], ids=["beside-the-model", "mirrored-on-the-host"])
def test_an_adapter_that_names_another_base_is_refused(tmp_path, trained_lora, on_cpu) -> None:
    """adapter_config.json points at a base that is not the one trained on (another seed's random weights): peft
    would load the adapter onto it without a word. The read-back knows the run's base; the round trip alone finds
    the other logits (beside the model) or the other weights (mirrored on the host)."""
    cfg, _, tokenizer = trained_lora
    folder, checks = saved_adapter(tmp_path, trained_lora, on_cpu)
    save_random_base(cfg.model, seed=1, tokenizer=tokenizer, out_dir=tmp_path / "other-base")
    point_adapter_at_base(folder, str(tmp_path / "other-base"))
    with pytest.raises(SaveCheckError, match=r"names the base .*other-base, but the run trains on .*base"):
        checks.read_back(folder, folder)
    with pytest.raises(SaveCheckError, match="not the weight the run trains on" if on_cpu else "other logits"):
        checks.round_trip([(folder, folder)])


def test_an_adapter_config_with_another_lora_alpha_is_refused(tmp_path, trained_lora) -> None:
    """The same tensors under another lora_alpha compute another function: the read-back names the setting."""
    folder, checks = saved_adapter(tmp_path, trained_lora)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 64}))
    with pytest.raises(SaveCheckError, match=r"lora_alpha=64 \(trained: 32\)"):
        checks.read_back(folder, folder)


class Calls:
    """A stand-in for one of the checks that records the folders it is called on, then calls the real one."""

    def __init__(self, real=None):
        self.real, self.folders = real, []

    def __call__(self, *args):
        self.folders.append(str(args[1]) if len(args) == 2 else [str(shown) for _, shown in args[0]])
        return self.real(*args) if self.real is not None else {}


def test_best_is_a_verified_copy_checked_once(tmp_path, trained_lora, monkeypatch) -> None:
    """An improving evaluation saves a checkpoint and best/: the checkpoint's files are read back, best/'s are not
    read back or loaded again, only compared byte for byte with the checkpoint's manifest; a copy that lost a byte is
    refused, naming best/'s file, and best/ keeps the step it held."""
    checks = checks_for(tmp_path, trained_lora)
    checks.read_back, checks.round_trip = Calls(checks.read_back), Calls()
    writer = writer_for(tmp_path, trained_lora, checks)
    step_1 = writer.save(trained_lora[1], {"step": 1}, meta(1, best=True))
    assert checks.read_back.folders == [str(step_1 / checkpoint.WEIGHTS)] and checks.round_trip.folders == []
    assert writer.checked["save_check_copies"] == [str(tmp_path / "best")]
    assert writer.checked["save_check_folders"] == [str(step_1 / checkpoint.WEIGHTS)]
    assert (tmp_path / "best" / ADAPTER).read_bytes() == (step_1 / checkpoint.WEIGHTS / ADAPTER).read_bytes()

    def copy_losing_a_byte(source, target, **kwargs):
        shutil.copyfile(source, target)
        if Path(target).name == ADAPTER:
            with open(target, "r+b") as f:
                f.seek(-1, 2)
                last = f.read(1)
                f.seek(-1, 2)
                f.write(bytes([last[0] ^ 1]))

    monkeypatch.setattr(checkpoint.writer.shutil, "copy2", copy_losing_a_byte)
    with pytest.raises(SaveCheckError, match=rf"{tmp_path / 'best' / ADAPTER} is not the copy of"):
        writer.save(trained_lora[1], {"step": 2}, meta(2, best=True))
    assert checkpoint.best_step_in(tmp_path) == 1


def test_best_carried_over_on_resume_is_verified_against_its_checkpoint(tmp_path, trained_lora) -> None:
    """A run resumed into a new folder carries the old run's best/ over, verified against the old run's checkpoint of
    that step: a best/ that lost a bit on the old run's storage is refused, naming the copy, and nothing is put in
    place. A checkpoint whose manifest lists no weights verifies nothing: a copy of it is refused too."""
    old = tmp_path / "old"
    checks = checks_for(old, trained_lora)
    step_1 = writer_for(old, trained_lora, checks).save(trained_lora[1], {"step": 1}, meta(1, best=True))
    writer_for(tmp_path / "resumed", trained_lora, checks).adopt_best(old, 1)
    assert (tmp_path / "resumed" / "best" / ADAPTER).read_bytes() == (
        step_1 / checkpoint.WEIGHTS / ADAPTER
    ).read_bytes()

    adapter = old / "best" / ADAPTER
    flipped = bytearray(adapter.read_bytes())
    flipped[-1] ^= 1
    adapter.write_bytes(bytes(flipped))
    again = tmp_path / "resumed-again"
    with pytest.raises(SaveCheckError, match=rf"{again / 'best' / ADAPTER} is not the copy of"):
        writer_for(again, trained_lora, checks).adopt_best(old, 1)
    assert not (again / "best").exists()

    manifest = json.loads((step_1 / checkpoint.MANIFEST).read_text())
    manifest["files"] = {k: v for k, v in manifest["files"].items() if not k.startswith(f"{checkpoint.WEIGHTS}/")}
    (step_1 / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(SaveCheckError, match="lists no file under weights/"):
        checks.copied(step_1, tmp_path / "resumed" / "best", tmp_path / "resumed" / "best")


BOTH = ["read back", "round trip"]


@pytest.mark.parametrize(
    ("mode", "before_last", "a_best", "at_the_last"),
    [
        ("every", ["read back"], ["read back"], BOTH),
        ("full", BOTH, BOTH, BOTH),
        ("final", [], ["read back"], BOTH),
    ],
)
def test_each_mode_checks_what_it_says_at_each_save(tmp_path, trained_lora, mode, before_last, a_best, at_the_last):
    """trainer.save_check: which check runs at a checkpoint before the last save, at one that becomes best/ (its copy
    is verified against what that save's read-back proved: final mode reads it back too), and at the last
    (adapter/); off builds none."""
    assert checks_for(tmp_path, trained_lora, SaveCheckMode.off) is None
    checks = checks_for(tmp_path, trained_lora, SaveCheckMode(mode))
    checks.read_back, checks.round_trip = Calls(checks.read_back), Calls()
    writer = writer_for(tmp_path, trained_lora, checks, keep_best_n=1)
    seen = []
    for save in (
        lambda: writer.save(trained_lora[1], {"step": 1}, meta(1)),
        lambda: writer.save(trained_lora[1], {"step": 2}, meta(2, best=True)),
        lambda: writer.save_final(trained_lora[1]),
    ):
        read_back, round_trip = len(checks.read_back.folders), len(checks.round_trip.folders)
        save()
        ran = {"read back": len(checks.read_back.folders) > read_back}
        ran["round trip"] = len(checks.round_trip.folders) > round_trip
        seen.append([name for name, did in ran.items() if did])
    assert seen == [before_last, a_best, at_the_last]
    assert checkpoint.best_step_in(tmp_path) == 2


@pytest.mark.parametrize(
    ("overrides", "read_back"),
    [(["data.eval_fraction=0.2"], [2]), (["trainer.save_every_n_steps=1"], [1, 2])],
    ids=["its-last-evaluation-the-best", "no-eval-split"],
)
def test_without_adapter_the_last_steps_checkpoint_gets_the_round_trip(tmp_path, overrides, read_back) -> None:
    """trainer.save_final=false: no adapter/ is written, so the checkpoint of the run's last step is its last save,
    and the round trip runs there: where the last evaluation is the best so far (saved for best/ anyway), and in a run
    with no evaluation to save for, whose checkpoints (every step here) would otherwise end a step before."""
    cfg = compose_config([*TINY, *overrides, "trainer.max_steps=2", "trainer.save_final=false"])
    env = parallel.init_distributed(cfg.parallel, cfg.trainer.device)
    try:
        Trainer(cfg, env, tmp_path).fit()
    finally:
        parallel.teardown()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    checked = [r for r in records if "save_check_s" in r]
    assert [r["step"] for r in checked] == read_back
    (round_trip,) = [r["save_check_round_trip"] for r in checked if "save_check_round_trip" in r]
    last = tmp_path / "checkpoints" / "step-00000002"
    assert round_trip == [str(last / "weights")]
    assert not (tmp_path / "adapter").exists()

    # The finished run resumed in its own folder: its last checkpoint is checked as the last save, not written again.
    written = {p: p.stat().st_ino for p in last.rglob("*") if p.is_file()}
    env = parallel.init_distributed(cfg.parallel, cfg.trainer.device)
    try:
        Trainer(compose_config([*TINY, *overrides, "trainer.max_steps=2", "trainer.save_final=false",
                                f"trainer.resume={tmp_path}"]), env, tmp_path).fit()  # fmt: skip
    finally:
        parallel.teardown()
    assert {p: p.stat().st_ino for p in last.rglob("*") if p.is_file()} == written, "the checkpoint was written again"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    again = [r for r in records if "save_check_s" in r][len(checked) :]
    assert [(r["step"], r["save_check_round_trip"]) for r in again] == [(2, [str(last / "weights")])]


def test_the_round_trip_runs_on_every_core_and_a_gpu_run_keeps_its_host_base_between_checks(
    tmp_path, trained_lora, monkeypatch
):
    """With trainer.save_check=full the round trip runs at every save: on all the host's cores (torchrun leaves one
    thread per process), back to one after. A GPU run's copy of the base, on the host (run here as such: ``on_cpu``),
    loads once and, after each merge, holds the base's own weights again (it equals the files bit for bit, and the
    next check passes on it); a check that fails lets it go (its weights held the failed adapter), and so does a host
    without the memory to keep it. A CPU run never keeps it: it would stay on the training device, uncounted."""
    from transformers import AutoModelForCausalLM

    loads, threads = [], []
    real_load = AutoModelForCausalLM.from_pretrained.__func__

    def counting_load(cls, path, *args, **kwargs):
        loads.append(str(path))
        return real_load(cls, path, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(counting_load))
    monkeypatch.setattr(host, "host_cores", lambda: 3)  # a host with 3 cores (oversubscribing 2 is harmless)
    gpu_run = tmp_path / "gpu-run"
    checks = checks_for(gpu_run, trained_lora, SaveCheckMode.full, on_cpu=True)
    real_logits = checks.round_trip._logits
    monkeypatch.setattr(
        checks.round_trip, "_logits", lambda m: threads.append(torch.get_num_threads()) or real_logits(m)
    )
    writer = writer_for(gpu_run, trained_lora, checks, keep_best_n=0)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as torchrun leaves each of several processes
    try:
        for step in (1, 2):
            writer.save(trained_lora[1], {"step": step}, meta(step))
        assert torch.get_num_threads() == 1 and threads and set(threads) == {3}
    finally:
        torch.set_num_threads(before)
    base = gpu_run / "base"
    assert loads == [str(base.resolve())], "the base loaded again at the second check"
    kept = checks.round_trip.kept[1].state_dict()
    assert all(torch.equal(kept[k], v) for k, v in load_file(str(base / "model.safetensors")).items())

    bad = tmp_path / "bad"  # the last save's adapter, other weights in it: its round trip fails half-way
    shutil.copytree(gpu_run / "checkpoints" / "step-00000002" / checkpoint.WEIGHTS, bad)
    rewrite(bad, CORRUPTIONS["other-weights"][0])
    with pytest.raises(SaveCheckError, match="other logits"):
        checks.round_trip([(bad, bad)])
    assert checks.round_trip.kept is None, "the copy that held the failed adapter was kept"
    writer.save(trained_lora[1], {"step": 3}, meta(3))  # loads it again, passes, keeps it
    assert len(loads) == 2 and checks.round_trip.kept is not None

    (tmp_path / "meminfo").write_text("MemTotal: 2048 kB\nMemAvailable: 1024 kB\n")  # a host with no room for it
    monkeypatch.setattr(host, "MEMINFO", tmp_path / "meminfo")
    for step in (4, 5):
        writer.save(trained_lora[1], {"step": step}, meta(step))
    assert len(loads) == 3 and checks.round_trip.kept is None  # the kept copy served step 4; step 5 loaded it again

    monkeypatch.setattr(host, "MEMINFO", Path("/proc/meminfo"))
    cpu_run = tmp_path / "cpu-run"
    cpu_checks = checks_for(cpu_run, trained_lora, SaveCheckMode.full, on_cpu=False)
    cpu_writer = writer_for(cpu_run, trained_lora, cpu_checks, keep_best_n=0)
    for step in (1, 2):
        cpu_writer.save(trained_lora[1], {"step": step}, meta(step))
        assert cpu_checks.round_trip.kept is None, "a CPU run kept the base on its training device"
    assert cpu_checks.round_trip.base_loads == 2


def refuses_cpu_tensors(*args, **kwargs):
    """Liger's Triton kernels given host tensors, as this stand-in says."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if any(t.device.type == "cpu" for t in tensors) or not tensors:
        raise RuntimeError("liger stand-in: Triton kernel given CPU tensors")


def test_a_liger_patch_of_the_model_classes_does_not_reach_the_round_trip(tmp_path, trained_lora, monkeypatch):
    """model.liger_kernel=true patches transformers' Qwen2 classes for the whole process (through the product's
    apply_liger_kernel, with a stand-in of Liger's patch whose kernels fail on host tensors): the round trip of a
    GPU run, on the host, builds and runs its models with transformers' own classes, and the patch is back after."""
    from transformers.models.qwen2 import modeling_qwen2

    from ddptrain.model import apply_liger_kernel
    from tests.unit.test_model import _fake_liger

    class LigerRMSNorm(modeling_qwen2.Qwen2RMSNorm):
        def forward(self, hidden_states):
            refuses_cpu_tensors(hidden_states)

    def liger_style_patch(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True, cross_entropy=False):
        monkeypatch.setattr(modeling_qwen2, "apply_rotary_pos_emb", refuses_cpu_tensors)
        monkeypatch.setattr(modeling_qwen2, "Qwen2RMSNorm", LigerRMSNorm)
        monkeypatch.setattr(modeling_qwen2.Qwen2ForCausalLM, "forward", refuses_cpu_tensors)

    monkeypatch.setattr(liger, "_ORIGINALS", {})
    folder, checks = saved_adapter(tmp_path, trained_lora, on_cpu=True)
    _fake_liger(monkeypatch, liger_style_patch)
    apply_liger_kernel(trained_lora[0].model, torch.device("cuda"))
    patched = build_model(trained_lora[0].model, seed=0, device=torch.device("cpu")).model
    with pytest.raises(RuntimeError, match="liger stand-in"):  # the stand-in is live: a model built now fails
        patched(input_ids=torch.tensor([[1, 2, 3]]))
    record = checks.written(folder, folder, final=True)
    assert record["save_check_max_abs_diff"] <= 1e-5
    assert (
        modeling_qwen2.Qwen2RMSNorm is LigerRMSNorm and modeling_qwen2.Qwen2ForCausalLM.forward is refuses_cpu_tensors
    )


def deeper_tiny_model(tmp_path: Path, layers: int) -> Path:
    config = json.loads((REPO / "ddptrain" / "assets" / "tiny_qwen2" / "config.json").read_text())
    folder = tmp_path / f"tiny-{layers}-layers"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    return folder


REALISTIC_LORA_B = 1e-3
"""lora_B's spread for an adapter of a realistic size: on the 8 bf16 layers below it moves the probe's logits by a few
percent of the largest (4.7% measured), as a trained adapter does, where ``train_like``'s 0.02 moves them 77%."""


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_merge_bound_holds_either_way_peft_merges_and_refuses_a_lost_delta(dtype) -> None:
    """merge_error on one weight: peft's merge (the fp32 delta added, rounded once: this check's own merge, bit for
    bit) and its safe_merge (the delta rounded to the dtype first: measured against the exact sum in float64) are
    within the bound; the weight without its delta is not; NaN where the adapter holds NaN is the merge's."""
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(64, 96, generator=generator) * 0.02).to(dtype)
    b, a = torch.randn(64, 16, generator=generator) * 1e-3, torch.randn(16, 96, generator=generator) * 0.1
    merged = weight.clone()
    merged += (b @ a) * 2.0
    assert merge_error(merged, weight, b, a, 2.0) == 0.0
    safe = merge_error(weight + ((b @ a) * 2.0).to(dtype), weight, b, a, 2.0)
    assert safe <= 1.0 and (safe > 0) == (dtype != torch.float32)  # in bf16 and fp16 some 300 of its bits differ
    assert merge_error(weight, weight, b, a, 2.0) > 1.0
    a[0, 0] = math.nan
    merged = weight.clone()
    merged += (b @ a) * 2.0
    assert merged.isnan().any() and merge_error(merged, weight, b, a, 2.0) == 0.0
    assert merge_error(merged.nan_to_num(0.0), weight, b, a, 2.0) == math.inf


def skip_first_merge(monkeypatch) -> list:
    """peft's merge of LoRA linears, the first one left unmerged (its adapter lost, as a merge that drops one layer's
    would); returns the list that holds the layer it skipped."""
    from peft.tuners.lora import Linear

    real_merge, skipped = Linear.merge, []

    def merge(self, *args, **kwargs):
        if not skipped:
            skipped.append(self)
            return None
        return real_merge(self, *args, **kwargs)

    monkeypatch.setattr(Linear, "merge", merge)
    return skipped


def test_the_merge_is_checked_weight_by_weight_and_a_lost_one_refused_at_a_realistic_size(tmp_path, monkeypatch):
    """A bf16 base of 8 layers, every linear adapted by an adapter of a realistic size (its effect on the probe's
    logits a few percent of the largest): the healthy merge passes with every adapted weight within its bound; a merge
    that lost the adapter (the base alone) or one layer's is refused, naming the weight. The logits could not tell
    them apart: rounding moves the merged model's logits by as much as this adapter moves them, and the former bound
    on the logits (14% of the largest at 8 bf16 layers) passes the lost merge."""
    from peft.tuners.lora import LoraModel

    cfg = compose_config([f"model.config_path={deeper_tiny_model(tmp_path, 8)}", "model.dtype=bf16"])
    model = train_like(build_model(cfg.model, seed=0, device=torch.device("cpu")).model, std=REALISTIC_LORA_B)
    folder, checks = saved_adapter(tmp_path, (cfg, model, build_tokenizer(cfg.model)))
    record = checks.round_trip([(folder, folder)])
    assert record["save_check_merged_weights"] == 8 * 7 and record["save_check_merged_worst_share"] <= 1.0
    attended = checks.round_trip.probe.attention_mask.bool()
    trained = checks.round_trip._logits(model)[attended]
    with model.disable_adapter():
        effect = float((checks.round_trip._logits(model)[attended] - trained).abs().max())
    # A lost merge moves the logits by the adapter's effect: at most 10% of the largest here, inside the former bound.
    assert 0.01 <= effect / float(trained.abs().max()) <= 0.1, "the adapter is not of a realistic size"

    skipped = skip_first_merge(monkeypatch)
    with pytest.raises(SaveCheckError, match=r"\(merge_and_unload\), model\.layers\.\S+\.weight is not the training"):
        checks.round_trip([(folder, folder)])
    assert len(skipped) == 1
    monkeypatch.undo()
    monkeypatch.setattr(LoraModel, "merge_and_unload", LoraModel.unload)  # unload: the base without the adapter
    with pytest.raises(SaveCheckError, match=r"merged into its base .*is not the training model's W \+ scale"):
        checks.round_trip([(folder, folder)])
