"""Every shipped config composes; bad configs fail early, naming the key and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException

from ddptrain import config
from ddptrain.cli import CONF_DIR
from ddptrain.config import Attention, Batching, CommHook, ConfigError, Device
from tests.conftest import REPO, compose_config

GROUPS = ["model", "data", "parallel", "optim", "trainer", "logger", "plan", "objective"]
NEEDS_PATH = {"alpaca", "chat"}  # data options whose data.path is required
# Options that train only together: preference pairs and DPO.
PARTNERS = {("data", "tiny_preference"): "objective=dpo", ("objective", "dpo"): "data=tiny_preference"}


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml"))


@pytest.mark.parametrize(("group", "option"), [(g, o) for g in GROUPS for o in group_options(g)])
def test_every_config_file_composes(group: str, option: str, tmp_path: Path) -> None:
    overrides = [f"{group}={option}", *([PARTNERS[group, option]] if (group, option) in PARTNERS else [])]
    if group == "data" and option in NEEDS_PATH:
        data_file = tmp_path / "rows.jsonl"
        data_file.write_text('{"instruction": "x", "input": "", "output": "y"}\n')
        overrides.append(f"data.path={data_file}")
    if group == "data" and option == "mixture":
        rows = Path(CONF_DIR).parent / "ddptrain" / "assets" / "tiny_instruct.jsonl"
        overrides.append(f"data.sources=[{{path: {rows}, weight: 2}}, {{path: {rows}, weight: 1}}]")
    cfg = compose_config(overrides)
    assert getattr(cfg, group) is not None


@pytest.mark.parametrize("recipe", sorted(p.stem for p in (REPO / "recipes").glob("*.yaml")))
def test_every_recipe_composes(recipe: str, tmp_path: Path) -> None:
    text = (REPO / "recipes" / f"{recipe}.yaml").read_text()
    assert text.startswith("#"), "a recipe starts with the command that runs it"
    data_file = tmp_path / "rows.jsonl"
    data_file.write_text('{"instruction": "x", "input": "", "output": "y"}\n')
    overrides = [f"data.path={data_file}"] if "data: alpaca" in text or "data: chat" in text else []
    cfg = compose_config(overrides, config_name=recipe, config_dir=REPO / "recipes")
    assert cfg.trainer is not None


def test_default_job_is_two_cpu_processes_on_bundled_assets() -> None:
    cfg = compose_config([])
    assert cfg.parallel.nproc_per_node == 2
    assert Path(cfg.model.name_or_path).is_dir() and Path(cfg.data.path).is_file()
    assert cfg.data.batching == Batching.length_grouped


def test_misspelled_key_names_the_key() -> None:
    with pytest.raises(ConfigCompositionException, match=r"trainer\.max_step"):
        compose_config(["trainer.max_step=3"])


def test_wrong_type_is_refused() -> None:
    with pytest.raises(ConfigCompositionException) as info:
        compose_config(["trainer.max_steps=abc"])
    assert "max_steps" in str(info.value) + str(info.value.__cause__)


def test_unknown_option_lists_the_available_ones() -> None:
    with pytest.raises(MissingConfigException, match="ddp2"):
        compose_config(["parallel=ddp3"])


def test_unknown_choice_value_is_refused() -> None:
    with pytest.raises(ConfigCompositionException) as info:
        compose_config(["trainer.precision=fp8"])
    assert "fp8" in str(info.value.__cause__)


def test_missing_data_file_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"data\.path=/no/such/file\.jsonl: no such file"):
        compose_config(["data.path=/no/such/file.jsonl"])


def test_required_data_path() -> None:
    with pytest.raises(ConfigError, match=r"data\.path is required"):
        compose_config(["data=alpaca"])


def test_all_problems_are_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        compose_config(["optim.lr=-1", "optim.grad_accum_steps=0", "model.device_map=auto", "data.eval_fraction=1.5"])
    message = str(info.value)
    for key in ("optim.lr=-1", "optim.grad_accum_steps=0", "model.device_map=auto", "data.eval_fraction=1.5"):
        assert key in message
    assert len(info.value.problems) == 4


def test_bf16_compress_on_gloo_is_refused_with_the_alternative() -> None:
    with pytest.raises(ConfigError, match="fp16_compress"):
        compose_config(["parallel.comm_hook=bf16_compress", "parallel.backend=gloo"])
    assert compose_config(["parallel.comm_hook=fp16_compress"]).parallel.comm_hook == CommHook.fp16_compress


def cuda_visible(monkeypatch: pytest.MonkeyPatch, available: bool) -> list[bool]:
    """Pretend CUDA is (not) available to the config check; the list records each time it asked."""
    asked: list[bool] = []

    def fake() -> bool:
        asked.append(available)
        return available

    monkeypatch.setattr(config.checks, "_cuda_available", fake)
    return asked


def test_bf16_compress_with_backend_auto_and_no_cuda_is_refused_before_workers(monkeypatch) -> None:
    asked = cuda_visible(monkeypatch, False)
    with pytest.raises(ConfigError) as info:
        compose_config(["parallel.comm_hook=bf16_compress", "trainer.device=auto"])  # parallel.backend=auto
    (problem,) = info.value.problems
    assert problem.startswith("parallel.comm_hook=bf16_compress needs NCCL")
    assert "parallel.backend=auto means gloo here (trainer.device=auto and no CUDA device is visible)" in problem
    assert "use parallel.comm_hook=fp16_compress (or none) on CPU" in problem
    assert asked == [False]


def test_bf16_compress_with_backend_auto_on_cpu_is_refused_without_asking_torch(monkeypatch) -> None:
    asked = cuda_visible(monkeypatch, True)  # even with a GPU, trainer.device=cpu means gloo
    with pytest.raises(ConfigError, match=r"parallel\.backend=auto means gloo with trainer\.device=cpu: use "):
        compose_config(["parallel.comm_hook=bf16_compress", "trainer.device=cpu"])
    assert asked == []


def test_bf16_compress_is_accepted_where_auto_picks_nccl(monkeypatch) -> None:
    asked = cuda_visible(monkeypatch, True)
    cfg = compose_config(["parallel.comm_hook=bf16_compress", "trainer.device=auto"])
    assert cfg.parallel.comm_hook == CommHook.bf16_compress
    assert asked == [True]
    cuda_visible(monkeypatch, False)  # trainer.device=cuda: nccl whatever this machine has
    assert compose_config(["parallel.comm_hook=bf16_compress", "trainer.device=cuda"]).trainer.device == Device.cuda


@pytest.mark.parametrize("hook", [h.value for h in CommHook if h != CommHook.bf16_compress])
def test_only_bf16_compress_asks_torch_about_cuda(monkeypatch, hook: str) -> None:
    """Config errors stay fast: torch is imported only for the one check that needs it."""
    asked = cuda_visible(monkeypatch, False)
    compose_config([f"parallel.comm_hook={hook}"])
    compose_config(["parallel.comm_hook=bf16_compress", "parallel.backend=nccl"])
    assert asked == []


def test_fp16_full_finetune_is_refused() -> None:
    with pytest.raises(ConfigError, match="GradScaler"):
        compose_config(["model.dtype=fp16", "model.lora=false"])


def test_token_budget_must_fit_one_row() -> None:
    with pytest.raises(ConfigError, match="max_tokens_per_batch"):
        compose_config(["data.batching=token_budget", "data.max_tokens_per_batch=100", "data.max_length=512"])


def test_the_budget_check_uses_the_batch_cost_rule_of_the_mode() -> None:
    """A padded row of 509 tokens costs 512 (multiple of 8); a packed row is never rounded, as the collator
    and the sampler build it, so packing accepts a budget of exactly data.max_length."""
    budget = ["data.max_length=509", "data.pad_to_multiple_of=8", "data.max_tokens_per_batch=509"]
    with pytest.raises(ConfigError, match=r"max_tokens_per_batch=509 .*\(512 tokens as a micro-batch\)"):
        compose_config(["data.batching=token_budget", *budget])
    assert compose_config(["data.batching=packed", *budget]).data.max_tokens_per_batch == 509
    with pytest.raises(ConfigError, match=r"max_tokens_per_batch=508"):
        compose_config(["data.batching=packed", *budget[:2], "data.max_tokens_per_batch=508"])


def test_tiny_model_sets_its_own_lr_and_cli_still_wins() -> None:
    assert compose_config([]).optim.lr == pytest.approx(5e-3)
    assert compose_config(["optim.lr=1e-4"]).optim.lr == pytest.approx(1e-4)
    assert compose_config(["model=qwen7b_lora"]).optim.lr == pytest.approx(2e-4)


def test_reentrant_checkpointing_with_unused_parameter_search_is_refused() -> None:
    overrides = [
        "model.gradient_checkpointing=true",
        "model.gradient_checkpointing_reentrant=true",
        "parallel.find_unused_parameters=true",
    ]
    with pytest.raises(ConfigError, match="ready only once"):
        compose_config(overrides)
    assert compose_config(overrides[:2]).model.gradient_checkpointing_reentrant


def test_liger_kernel_on_cpu_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"model\.liger_kernel=true needs a CUDA device"):
        compose_config(["model.liger_kernel=true", "trainer.device=cpu"])


def test_resume_from_a_missing_folder_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.resume=/no/such/run: no such folder"):
        compose_config(["trainer.resume=/no/such/run"])


def test_device_map_under_ddp_is_refused_with_the_reason() -> None:
    with pytest.raises(ConfigError, match=r"model\.device_map=auto .* full replica"):
        compose_config(["model.device_map=auto"])


def test_unknown_attention_kernel_is_refused() -> None:
    with pytest.raises(ConfigCompositionException) as info:
        compose_config(["model.attn_implementation=flex_attention"])
    assert "flex_attention" in str(info.value.__cause__)


def test_static_graph_with_accumulation_is_refused_naming_both_keys() -> None:
    with pytest.raises(ConfigError) as info:
        compose_config(["parallel.static_graph=true", "optim.grad_accum_steps=2"])
    (problem,) = info.value.problems
    assert problem.startswith("parallel.static_graph=true with optim.grad_accum_steps=2 crashes DDP")
    assert "set parallel.static_graph=false, or optim.grad_accum_steps=1." in problem
    assert compose_config(["parallel.static_graph=true"]).parallel.static_graph
    assert compose_config(["optim.grad_accum_steps=2"]).optim.grad_accum_steps == 2


FLASH = "model.attn_implementation=flash_attention_2"


def test_flash_attention_in_fp32_is_refused_with_the_fix(monkeypatch) -> None:
    cuda_visible(monkeypatch, True)
    with pytest.raises(ConfigError) as info:
        compose_config([FLASH, "trainer.device=cuda", "trainer.precision=fp32"])  # and model.dtype=fp32
    (problem,) = info.value.problems
    assert problem.startswith(f"{FLASH} needs fp16/bf16 activations, but model.dtype=fp32 and trainer.precision=fp32")
    assert "set trainer.precision=bf16 (or model.dtype=bf16)" in problem
    for half in (["trainer.precision=bf16"], ["trainer.precision=fp16"], ["model.dtype=bf16"]):
        assert (
            compose_config([FLASH, "trainer.device=cuda", "trainer.precision=fp32", *half]).model.attn_implementation
            == Attention.flash_attention_2
        )


def test_flash_attention_on_cpu_is_refused_without_asking_torch(monkeypatch) -> None:
    asked = cuda_visible(monkeypatch, True)  # even with a GPU, trainer.device=cpu runs on the CPU
    with pytest.raises(ConfigError) as info:
        compose_config([FLASH, "trainer.precision=bf16", "trainer.device=cpu"])
    (problem,) = info.value.problems
    assert problem == (
        f"{FLASH} needs a CUDA device, but trainer.device=cpu: "
        "use model.attn_implementation=sdpa on CPU, or train on GPUs."
    )
    assert asked == []


def test_flash_attention_with_device_auto_follows_the_cuda_probe(monkeypatch) -> None:
    asked = cuda_visible(monkeypatch, False)
    with pytest.raises(ConfigError) as info:
        compose_config([FLASH, "trainer.precision=bf16", "trainer.device=auto"])
    (problem,) = info.value.problems
    assert "but trainer.device=auto means cpu here (no CUDA device is visible): use model.attn_implementation=sdpa" in (
        problem
    )
    assert asked == [False]
    cuda_visible(monkeypatch, True)
    assert compose_config([FLASH, "trainer.precision=bf16", "trainer.device=auto"]).trainer.device == Device.auto


def test_flash_attention_reports_both_problems_at_once(monkeypatch) -> None:
    cuda_visible(monkeypatch, False)
    with pytest.raises(ConfigError) as info:
        compose_config([FLASH, "trainer.device=auto", "trainer.precision=fp32"])
    assert [p.split(", but ")[0] for p in info.value.problems] == [
        f"{FLASH} needs fp16/bf16 activations",
        f"{FLASH} needs a CUDA device",
    ]


# ----------------------------------------------------------------------------- optim.global_batch_size


def test_global_batch_size_derives_the_accumulation_from_processes_and_micro_batch() -> None:
    cfg = compose_config(["optim.global_batch_size=48", "data.micro_batch_size=4"])
    assert config.resolve_global_batch_size(cfg, world_size=2).optim.grad_accum_steps == 6
    assert config.resolve_global_batch_size(cfg, world_size=4).optim.grad_accum_steps == 3
    assert cfg.optim.grad_accum_steps == 1, "the composed config is left as it was"
    unset = compose_config([])
    assert config.resolve_global_batch_size(unset, world_size=2) is unset


def test_a_global_batch_that_does_not_divide_names_all_three_keys_and_the_nearest_values() -> None:
    cfg = compose_config(["optim.global_batch_size=20", "data.micro_batch_size=4"])
    with pytest.raises(ConfigError) as err:
        config.resolve_global_batch_size(cfg, world_size=2)
    message = str(err.value)
    for key in ("optim.global_batch_size=20", "data.micro_batch_size=4", "parallel.nproc_per_node", "= 8 samples"):
        assert key in message
    assert "optim.global_batch_size=16 or 24" in message


def test_a_global_batch_is_refused_with_accumulation_given_too_token_batching_or_a_static_graph() -> None:
    both = compose_config(["optim.global_batch_size=16", "optim.grad_accum_steps=2", "data.micro_batch_size=4"])
    with pytest.raises(ConfigError, match=r"are both set: the first derives the second"):
        config.resolve_global_batch_size(both, world_size=2)
    with pytest.raises(ConfigError, match=r"optim\.global_batch_size=16 counts samples, but data\.batching=packed"):
        compose_config(["optim.global_batch_size=16", "data.batching=packed"])
    static = compose_config(["optim.global_batch_size=16", "data.micro_batch_size=4", "parallel.static_graph=true"])
    with pytest.raises(ConfigError, match=r"parallel\.static_graph=true with optim\.grad_accum_steps=2"):
        config.resolve_global_batch_size(static, world_size=2)


def test_sweep_job_folders_are_named_by_the_swept_keys_only() -> None:
    argv = ["ddptrain", "-m", "optim.lr=1e-3,2e-3", "trainer.progress_bar=false", "data.path=/d/a.jsonl,/d/b.jsonl"]
    job = ["trainer.progress_bar=false", "optim.lr=0.002", "data.path=/d/b.jsonl"]
    assert config.swept_overrides(job, argv) == "data.path=_d_b.jsonl,optim.lr=0.002"
    assert config.swept_overrides(["optim.lr=0.1"], ["ddptrain", "-m", "optim.lr=0.1"]) == ""
    assert config.swept_overrides(["a=1"], ["ddptrain", "-m", "range(1,3)=x"]) == "a=1", "unparsable: every override"
    # A sweeper that sets keys of its own (hydra.sweeper.params, Optuna's trials): those name the folder.
    optuna_trial = ["trainer.max_steps=30", "optim.lr=0.0031", "model.lora_rank=8"]
    command = ["ddptrain", "-m", "--config-dir", "recipes", "--config-name", "optuna_lr_rank", "trainer.max_steps=30"]
    name = config.swept_overrides(optuna_trial, command)
    assert name == "model.lora_rank=8,optim.lr=0.0031"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.profile_steps=[5,3]", r"trainer.profile_steps=\[5, 3\] must be \[START, END\]"),
        ("trainer.profile_steps=[0,2]", r"1 <= START <= END"),
        ("trainer.profile_steps=[3]", r"must be \[START, END\]"),
        ("trainer.profile_steps=[30,40]", r"starts after trainer.max_steps=20"),
        ("trainer.peak_tflops=0", r"trainer.peak_tflops=0.0 must be positive"),
        ("trainer.diagnose.rank_time_imbalance=1.0", r"rank_time_imbalance=1.0 must be above 1"),
        ("trainer.diagnose.comm_share=0", r"trainer.diagnose.comm_share=0.0 must be in \(0, 1\]"),
    ],
)
def test_diagnostics_keys_are_checked_before_any_worker_starts(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        compose_config(["trainer.max_steps=20", override])


def test_profile_ranks_must_be_global_ranks() -> None:
    with pytest.raises(ConfigError, match=r"trainer.profile_ranks=\[-1\]"):
        compose_config(["trainer.profile_steps=[1,2]", "trainer.profile_ranks=[-1]"])


def test_workers_are_spawned_unless_asked_otherwise() -> None:
    """The tests' own launches fork from a forkserver (tests/conftest.py); a user's run spawns its ranks."""
    from ddptrain.config import ParallelConfig, StartMethod

    assert ParallelConfig().start_method is StartMethod.spawn
    for preset in ("ddp2", "ddp4", "ddp8"):
        assert "start_method: spawn " in (Path(CONF_DIR) / "parallel" / f"{preset}.yaml").read_text()


def test_the_plans_fixed_costs_refuse_impossible_values_naming_each_key() -> None:
    """Every bad plan.* cost in one error (the checks report all at once), each named as typed with its fix."""
    bad = ["plan.nccl_gb=-1", "plan.cuda_context_gb=-0.5", "plan.allocator_slack=5", "plan.resident_baseline_gb=-2"]
    with pytest.raises(ConfigError) as refused:
        compose_config(bad)
    message = str(refused.value)
    for typed in ("plan.nccl_gb=-1.0", "plan.cuda_context_gb=-0.5", "plan.allocator_slack=5.0", "give it as 0.05"):
        assert typed in message, message
    assert "plan.resident_baseline_gb=-2.0 must be 0 or more, or null to measure it" in message
