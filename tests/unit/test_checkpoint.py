"""Checkpoint files: atomic writes that survive a failed save, safe loading, prefixes, export, and a full fine-tune's
weights with a tied head: loaded, and proven by the save check."""

from __future__ import annotations

import errno
import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import PeftModel
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from ddptrain import checkpoint, export, parallel
from ddptrain.checkpoint.format import FORMAT_VERSION, upgrade_state
from ddptrain.config import SaveCheckMode, to_yaml
from ddptrain.evaluation.save_check import SaveCheckError, build_save_checks
from ddptrain.model import build_model, build_tokenizer
from ddptrain.process import rng
from ddptrain.trainer import Trainer
from tests.conftest import REPO, compose_config

TINY = ["parallel=single", "data.max_rows=64", "data.eval_fraction=0", "trainer.progress_bar=false"]


@pytest.fixture
def lora_model():
    torch.manual_seed(0)
    module = build_model(compose_config([]).model, seed=0, device=torch.device("cpu"))
    for name, p in module.named_parameters():
        if "lora_B" in name:
            p.data.normal_()  # trained-looking adapter: lora_B is zero at init
    return module.model


class Payload:
    """An arbitrary object: unpickling it could run code, so a checkpoint must refuse it."""


def save(writer: checkpoint.CheckpointWriter, model, step: int) -> Path:
    return writer.save(model, {"step": step}, {"step": step, "epoch": 0, "position": step})


def test_failed_save_leaves_the_previous_checkpoint_loadable(tmp_path, lora_model, monkeypatch) -> None:
    writer = checkpoint.CheckpointWriter(tmp_path, keep_last_n=3)
    good = save(writer, lora_model, 1)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.writer.torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        save(writer, lora_model, 2)
    assert checkpoint.newest_complete(tmp_path / "checkpoints") == good
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == good.name
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", good.name]
    checkpoint.load_trainable_weights(lora_model, good / checkpoint.WEIGHTS)


def test_trainer_reports_a_failed_save_naming_the_intact_checkpoint(tmp_path, monkeypatch) -> None:
    cfg = compose_config([*TINY, "trainer.max_steps=4", "trainer.save_every_n_steps=2"])
    env = parallel.init_distributed(cfg.parallel, cfg.trainer.device)
    try:
        trainer = Trainer(cfg, env, tmp_path)
        real_save = checkpoint.writer.torch.save

        def fail_second_save(obj, path, *args, **kwargs):
            if "step-00000004" in str(path):
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_save(obj, path, *args, **kwargs)

        monkeypatch.setattr(checkpoint.writer.torch, "save", fail_second_save)
        with pytest.raises(RuntimeError, match=r"checkpoint of step 4 failed.*intact: .*step-00000002"):
            trainer.fit()
    finally:
        parallel.teardown()


def test_incomplete_or_corrupt_checkpoints_are_never_loaded(tmp_path, lora_model) -> None:
    writer = checkpoint.CheckpointWriter(tmp_path, keep_last_n=5)
    first, second = save(writer, lora_model, 1), save(writer, lora_model, 2)
    (second / checkpoint.STATE).write_bytes(b"truncated")
    with pytest.raises(checkpoint.CheckpointError, match="differs from the manifest"):
        checkpoint.verify(second)
    assert checkpoint.newest_complete(tmp_path / "checkpoints") == first
    (first / checkpoint.MANIFEST).unlink()
    assert checkpoint.newest_complete(tmp_path / "checkpoints") is None
    with pytest.raises(checkpoint.CheckpointError, match="no complete checkpoint"):
        checkpoint.find_checkpoint(str(tmp_path), tmp_path)


def test_only_the_last_n_checkpoints_are_kept(tmp_path, lora_model) -> None:
    writer = checkpoint.CheckpointWriter(tmp_path, keep_last_n=2)
    for step in (1, 2, 3):
        save(writer, lora_model, step)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step-00000002", "step-00000003"]


def draw_from_every_stream() -> dict[str, list[float]]:
    """A few numbers from every stream a user's code or a library may draw from (CUDA where there is one)."""
    draws = {
        "python": [random.random(), random.gauss(0, 1)],
        "numpy": [*np.random.rand(2).tolist(), float(np.random.standard_normal())],
        "torch": torch.rand(3).tolist(),
    }
    if torch.cuda.is_available():
        draws["cuda"] = torch.rand(3, device="cuda").tolist()
    return draws


def test_every_random_stream_continues_after_a_restore_from_the_saved_state(tmp_path) -> None:
    """Saved (as a checkpoint holds it), then every stream drawn from and reseeded; after loading and restoring,
    each stream gives again what it gave right after the save."""
    if torch.cuda.is_available():
        torch.rand(1, device="cuda")  # a CUDA stream in use is one capture_rng keeps
    random.gauss(0, 1)  # Python and numpy keep a spare normal: the restore must bring that back too
    np.random.standard_normal()
    torch.save({"rng": rng.capture_rng(), "step": 3}, tmp_path / checkpoint.STATE)
    expected = draw_from_every_stream()
    rng.seed_rng(seed=1, rank=0)
    moved = draw_from_every_stream()
    assert all(moved[k] != expected[k] for k in expected), "reseeding must move every stream, or the test means nothing"
    rng.restore_rng(checkpoint.load_state(tmp_path)["rng"])
    assert draw_from_every_stream() == expected


def test_state_loads_without_unpickling_objects(tmp_path) -> None:
    torch.save({"evil": Payload()}, tmp_path / checkpoint.STATE)
    with pytest.raises(Exception, match=r"[Ww]eights only"):
        checkpoint.load_state(tmp_path)


def test_weights_saved_with_a_module_prefix_load(tmp_path, lora_model) -> None:
    lora_model.save_pretrained(tmp_path / "clean")
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "clean" / "adapter_model.safetensors"))
    (tmp_path / "ddp").mkdir()
    save_file(
        {f"module._orig_mod.{k}": v for k, v in weights.items()}, str(tmp_path / "ddp" / "adapter_model.safetensors")
    )
    fresh = build_model(compose_config([]).model, seed=0, device=torch.device("cpu")).model
    checkpoint.load_trainable_weights(fresh, tmp_path / "ddp")
    loaded = {k: v for k, v in fresh.state_dict().items() if "lora_" in k}
    expected = {k: v for k, v in lora_model.state_dict().items() if "lora_" in k}
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in loaded)


def test_mismatched_weights_name_the_missing_and_unexpected_keys(tmp_path, lora_model) -> None:
    lora_model.save_pretrained(tmp_path / "clean")
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "clean" / "adapter_model.safetensors"))
    dropped = sorted(weights)[0]
    weights.pop(dropped)
    weights["base_model.model.not_a_layer.lora_A.weight"] = torch.zeros(1)
    (tmp_path / "bad").mkdir()
    save_file(weights, str(tmp_path / "bad" / "adapter_model.safetensors"))
    with pytest.raises(checkpoint.CheckpointError, match=r"missing .*lora.*unexpected .*not_a_layer"):
        checkpoint.load_trainable_weights(lora_model, tmp_path / "bad")


def test_merged_export_gives_the_adapter_models_logits(tmp_path, lora_model) -> None:
    cfg = compose_config([])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    tokenizer = build_tokenizer(cfg.model)
    files = checkpoint.AdapterFiles(tokenizer, cfg.model, seed=0)
    checkpoint.CheckpointWriter(run_dir, keep_last_n=1, files=files).save_final(lora_model)
    export.main([str(run_dir), str(tmp_path / "merged"), "--merge"])
    export.main([str(run_dir), str(tmp_path / "adapter")])

    ids = tokenizer("### Instruction:\nSort 3, 1, 2.\n\n### Response:\n", return_tensors="pt").input_ids
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any("lora" in k for k in merged.state_dict())
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(adapter_config["base_model_name_or_path"])
    adapted = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        expected = lora_model.eval()(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(adapted(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)


def train_and_save(run: Path, overrides: list[str]) -> None:
    cfg = compose_config([*TINY, "trainer.max_steps=2", *overrides])
    env = parallel.init_distributed(cfg.parallel, cfg.trainer.device)
    try:
        Trainer(cfg, env, run).fit()
    finally:
        parallel.teardown()


def build_trainer(run: Path, overrides: list[str]) -> Trainer:
    cfg = compose_config([*TINY, "trainer.max_steps=4", f"trainer.resume={run}", *overrides])
    env = parallel.init_distributed(cfg.parallel, cfg.trainer.device)
    try:
        return Trainer(cfg, env, run)
    finally:
        parallel.teardown()


def test_a_resume_that_would_change_the_data_order_names_the_keys_as_the_user_sets_them(tmp_path) -> None:
    train_and_save(tmp_path, ["trainer.seed=3"])
    with pytest.raises(checkpoint.CheckpointError, match=r"different data order \(trainer\.seed: 3 -> 4\)"):
        build_trainer(tmp_path, ["trainer.seed=4"])
    changed = r"optim\.grad_accum_steps: 1 -> 2, data\.max_length: 512 -> 256"
    with pytest.raises(checkpoint.CheckpointError, match=changed):
        build_trainer(tmp_path, ["trainer.seed=3", "data.max_length=256", "optim.grad_accum_steps=2"])


@pytest.mark.parametrize(
    ("world", "accum", "fix"),
    [
        (1, 2, r"saved: 2 processes x optim\.grad_accum_steps=2; on 1 process: optim\.grad_accum_steps=4\)"),
        (3, 1, r"optim\.grad_accum_steps=2 = 4, which 3 processes cannot split: run 1, 2, 4 processes\)"),
    ],
)
def test_a_resume_on_another_number_of_processes_is_told_the_accumulation_that_keeps_each_step(
    tmp_path, world, accum, fix
) -> None:
    """A checkpoint of 2 processes x 2 micro-steps resumes on any number of processes that keeps its 4 micro-batches
    per step (``data.build_training_data`` trains its plan there); one that does not is refused, and the error names
    the optim.grad_accum_steps that keeps them on this number of processes, or the numbers that can."""
    from ddptrain.data import DataOrder

    data_cfg = compose_config([]).data
    order = lambda w, a: DataOrder.build(data_cfg, world_size=w, seed=0, grad_accum_steps=a, dataset_rows=9)  # noqa: E731
    checkpoint._write_manifest(tmp_path, {"step": 4, "world_size": 2, "data_order": order(2, 2).values})
    checkpoint.check_same_data_order(tmp_path, order(2, 2), world_size=1)  # planned as saved: any count resumes it
    with pytest.raises(checkpoint.CheckpointError, match=rf"number of processes: 2 -> {world}.*{fix}"):
        checkpoint.check_same_data_order(tmp_path, order(world, accum), world)


def rewrite_as_format_1(folder: Path, windows: list[dict] | None) -> None:
    """Make ``folder`` a checkpoint as ddptrain wrote them before the manifest said its format: no format_version,
    no ``sources`` in the data order of a run without a mixture, and the given log windows (None: none kept)."""
    state = checkpoint.load_state(folder)
    state.pop("windows", None)
    if windows is not None:
        state["windows"] = windows
    torch.save(state, folder / checkpoint.STATE)
    manifest = json.loads((folder / checkpoint.MANIFEST).read_text())
    manifest.pop("format_version", None)
    manifest["data_order"].pop("sources", None)
    (folder / checkpoint.MANIFEST).unlink()
    checkpoint._write_manifest(folder, {k: v for k, v in manifest.items() if k != "files"})  # the new state hash
    rewritten = json.loads((folder / checkpoint.MANIFEST).read_text())
    rewritten.pop("format_version")  # which _write_manifest puts in
    (folder / checkpoint.MANIFEST).write_text(json.dumps(rewritten))


def test_a_checkpoint_of_format_1_still_resumes(tmp_path) -> None:
    """Checkpoints written before the format version: they kept no per-rank "windows" at first, named the
    overflow count "skipped", counted no FLOPs, and kept no "sources" without a mixture. They resume."""
    train_and_save(tmp_path, [])
    folder = checkpoint.newest_complete(tmp_path / "checkpoints")
    written = json.loads((folder / checkpoint.MANIFEST).read_text())
    assert written["format_version"] == FORMAT_VERSION and written["data_order"]["sources"] == [], (
        "what a checkpoint says now"
    )
    rewrite_as_format_1(folder, windows=None)
    trainer = build_trainer(tmp_path, [])
    assert trainer.step == 2 and trainer.window.steps == 0
    old_window = {"loss_sum": 1.5, "target_tokens": 3, "batch_tokens": [[4, 8]], "skipped": 1, "steps": 1}
    rewrite_as_format_1(folder, windows=[old_window])
    trainer = build_trainer(tmp_path, [])
    assert trainer.window.overflowed_steps == 1 and trainer.window.batch_tokens == [(4, 8)]
    assert trainer.window.steps == 1 and trainer.window.flops == 0.0


def test_a_checkpoint_of_a_newer_format_is_refused_naming_both(tmp_path) -> None:
    train_and_save(tmp_path, [])
    folder = checkpoint.newest_complete(tmp_path / "checkpoints")
    manifest = json.loads((folder / checkpoint.MANIFEST).read_text())
    (folder / checkpoint.MANIFEST).write_text(json.dumps({**manifest, "format_version": FORMAT_VERSION + 1}))
    reads = ", ".join(map(str, range(1, FORMAT_VERSION + 1)))
    newer = FORMAT_VERSION + 1
    refused = rf"{re.escape(str(folder))} is checkpoint format {newer}; this ddptrain reads formats {reads}\. Resume"
    with pytest.raises(RuntimeError, match=refused):
        build_trainer(tmp_path, [])


# ----------------------------------------------------------------------------- full fine-tunes: a tied head


def full_model(tmp_path: Path, tied: bool, trained: bool = True) -> torch.nn.Module:
    """The bundled tiny model as a full fine-tune (model.lora=false) builds it, its LM head tied to its embedding (as
    shipped) or its own (a copy of the config with tie_word_embeddings=false); ``trained``: every weight moved off
    its initial value, so that a load that leaves one alone shows."""
    overrides = ["model.lora=false"]
    if not tied:
        folder = tmp_path / "untied-config"
        if not folder.is_dir():
            config = json.loads((REPO / "ddptrain" / "assets" / "tiny_qwen2" / "config.json").read_text())
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
        overrides.append(f"model.name_or_path={folder}")
    model = build_model(compose_config(overrides).model, seed=0, device=torch.device("cpu")).model
    if trained:
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=generator) * 0.01)
    return model


def test_full_weights_load_into_a_tied_head_and_a_missing_untied_head_is_refused(tmp_path) -> None:
    """save_pretrained leaves a tied head out: it loads with the embedding it shares. An untied head left out would
    keep its random initial values: refused, by name."""
    trained = full_model(tmp_path, tied=True)
    trained.save_pretrained(tmp_path / "tied")
    assert "lm_head.weight" not in checkpoint.read_weights(tmp_path / "tied"), "the files hold no head: the case"
    fresh = full_model(tmp_path, tied=True, trained=False)
    checkpoint.load_trainable_weights(fresh, tmp_path / "tied")
    assert fresh.lm_head.weight is fresh.get_input_embeddings().weight
    expected, loaded = trained.state_dict(), fresh.state_dict()
    assert loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in expected)

    full_model(tmp_path, tied=False).save_pretrained(tmp_path / "untied")
    weights = checkpoint.read_weights(tmp_path / "untied")
    assert weights.pop("lm_head.weight") is not None
    save_file(weights, str(tmp_path / "untied" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(checkpoint.CheckpointError, match=r"does not fit this model: missing lm_head\.weight;"):
        checkpoint.load_trainable_weights(full_model(tmp_path, tied=False, trained=False), tmp_path / "untied")


def flip_a_bit(folder: Path) -> str:
    """One bit of one weight in the saved file changed (the lowest of the mantissa: the smallest change there is)."""
    key = "model.layers.0.mlp.down_proj.weight"
    weights = checkpoint.read_weights(folder)
    weights[key].view(torch.int32)[0, 0] ^= 1
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return rf"{key} as read back is not the trained tensor"


def untie_on_load(folder: Path) -> str:
    """The head written out and the config untied: every value right, but the loaded model no longer ties them."""
    weights = checkpoint.read_weights(folder)
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    return r"it ties nothing; the training model ties lm_head\.weight = model\.embed_tokens\.weight"


def untie_without_head(folder: Path) -> str:
    """The config untied, the head still left out: transformers would start the head from random values."""
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    return r"from_pretrained loads it with missing keys lm_head\.weight"


def wrap_keys(folder: Path) -> str:
    """The keys as a DDP-wrapped model names them: transformers would load none of them."""
    wrapped = {f"module.{k}": v for k, v in checkpoint.read_weights(folder).items()}
    save_file(wrapped, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return r"carry a wrapper's prefix \(module\.model\."


@pytest.mark.parametrize("corrupt", [None, flip_a_bit, untie_on_load, untie_without_head, wrap_keys])
def test_the_save_check_of_full_weights_loads_them_in_transformers_bit_for_bit(tmp_path, corrupt) -> None:
    """trainer.save_check with model.lora=false, at the final save: the files read back hold the training model's
    tensors bit for bit (the tied head left out), and the folder loads with plain AutoModelForCausalLM holding them
    all, tied head included; each way of spoiling it is named (a flipped bit and a wrapper's prefix by the read-back,
    the ties by the load)."""
    model = full_model(tmp_path, tied=True)
    folder = tmp_path / "weights"
    model.save_pretrained(folder)
    check = build_save_checks(SaveCheckMode.every, model, None, torch.float32, "sdpa", [], 0, on_gpu=False)
    if corrupt is None:
        record = check.written(folder, folder, final=True)
        assert record["save_check_tensors"] == len(checkpoint.read_weights(folder))  # every tensor in the files
        assert record["save_check_loaded_tensors"] == len(model.state_dict())  # and every one of the loaded model
        assert record["save_check_folders"] == record["save_check_round_trip"] == [str(folder)]
        return
    named = corrupt(folder)
    with pytest.raises(SaveCheckError, match=named):
        check.written(folder, tmp_path / "shown", final=True)


@pytest.mark.parametrize("version", [1, 3, 4])
def test_an_older_checkpoint_s_data_position_counts_in_the_processes_that_wrote_it(version) -> None:
    """Before format 5 the sampler's state did not say the number of processes its position counts micro-steps of:
    they are the manifest's (the ranks that wrote it), so a resume on another number converts the position; a
    format 5 state keeps what it says."""
    state = {"step": 6, "sampler": {"epoch": 1, "position": 6}, "windows": [{}, {}], "rng": [{}, {}], "best": {}}
    upgraded = upgrade_state(state, version, fresh={}, world_size=2, fresh_shared={"best": {}})
    assert upgraded["sampler"] == {"epoch": 1, "position": 6, "world_size": 2}
    current = {**state, "sampler": {"epoch": 1, "position": 6, "world_size": 4}}
    assert upgrade_state(current, FORMAT_VERSION, fresh={}, world_size=2)["sampler"]["world_size"] == 4
