"""``logger=[tensorboard,wandb,mlflow]`` through the real CLI, W&B offline: each tool reads back the
``loss`` series that ``metrics.jsonl`` holds, the samples of every evaluation that ``samples.jsonl`` holds, and the
end-of-run report that ``report.json``/``report.md`` hold, and rank 0 alone wrote them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import logger_readers as read
from tests.conftest import read_metrics
from tests.e2e.conftest import DEBUG_RUN_EVAL_EVERY, DEBUG_RUN_PROMPTS, DEBUG_RUN_STEPS, FinishedRun

pytestmark = pytest.mark.e2e
STEPS = DEBUG_RUN_STEPS


@pytest.fixture(scope="module")
def logged_run(debug_run: FinishedRun) -> Path:
    """The session's 6-step run of the default tiny job (2 CPU ranks) with all three loggers (tests/e2e/conftest.py)."""
    assert debug_run.seconds < 120, "W&B or MLflow held the run up at start or at close"
    return debug_run.run_dir


def run_report(run_dir: Path) -> dict:
    """The report the run wrote at its end (the oracle for what the loggers got), with a verdict to compare."""
    report = json.loads((run_dir / "report.json").read_text())
    assert report["verdict"], f"trainer=debug times its steps: the report should have a verdict: {report}"
    return report


def jsonl_losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir) if "loss" in r]


def assert_same_series(got: list[tuple[int, float]], want: list[tuple[int, float]], rel: float) -> None:
    """The same steps, and values equal within ``rel`` (TensorBoard stores float32, the others float64)."""
    assert [step for step, _ in got] == [step for step, _ in want]
    assert [value for _, value in got] == pytest.approx([value for _, value in want], rel=rel)


def test_metrics_jsonl_has_the_steps(logged_run: Path) -> None:
    assert [step for step, _ in jsonl_losses(logged_run)] == list(range(1, STEPS + 1))


def test_tensorboard_loss_equals_metrics_jsonl(logged_run: Path) -> None:
    log_dir = logged_run / "tensorboard"
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 1, "one event file: rank 0 alone writes"
    events = read.tensorboard_run(log_dir)
    assert_same_series(read.tensorboard_series(events, "loss"), jsonl_losses(logged_run), rel=1e-6)
    report_text = read.tensorboard_text(events, "report")
    assert report_text == (logged_run / "report.md").read_text()
    assert f"verdict `{run_report(logged_run)['verdict']}`" in report_text


def test_wandb_offline_loss_equals_metrics_jsonl(logged_run: Path) -> None:
    path = read.wandb_file(logged_run)  # exactly one W&B run: rank 0 alone
    assert path.parent.name.startswith("offline-run-")
    records = read.wandb_records(path)
    assert_same_series(read.wandb_series(records, "loss"), jsonl_losses(logged_run), rel=1e-12)
    state = read.wandb_state(path)
    assert (state["state"], state["config"]["trainer"]["max_steps"]) == ("finished", STEPS)
    assert state["summary"]["report"]["verdict"] == run_report(logged_run)["verdict"]


def test_mlflow_loss_equals_metrics_jsonl(logged_run: Path) -> None:
    client, run = read.mlflow_run(read.mlflow_default_store(logged_run))  # exactly one MLflow run: rank 0 alone
    assert_same_series(read.mlflow_series(client, run.info.run_id, "loss"), jsonl_losses(logged_run), rel=1e-12)
    assert run.data.params["trainer.max_steps"] == str(STEPS) and run.info.status == "FINISHED"
    report = run_report(logged_run)
    assert run.data.tags["verdict"] == report["verdict"]
    artifacts = Path(client.download_artifacts(run.info.run_id, ""))
    assert json.loads((artifacts / "report.json").read_text()) == report


EVAL_STEPS = list(range(DEBUG_RUN_EVAL_EVERY, STEPS + 1, DEBUG_RUN_EVAL_EVERY))


def jsonl_samples(run_dir: Path) -> dict[int, list[tuple[str, str]]]:
    """``samples.jsonl`` by step: (prompt, completion) in prompt order."""
    by_step: dict[int, list[tuple[str, str]]] = {}
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_step.setdefault(row["step"], []).append((row["prompt"], row["completion"]))
    return by_step


def test_samples_of_every_evaluation_are_in_samples_jsonl_and_in_each_logger(logged_run: Path) -> None:
    samples = jsonl_samples(logged_run)
    assert sorted(samples) == EVAL_STEPS, "samples at every evaluation (steps 3 and 6)"
    for rows in samples.values():
        assert [prompt for prompt, _ in rows] == list(DEBUG_RUN_PROMPTS)
        assert all(completion.strip() for _, completion in rows), "greedy decoding of 8 tokens writes something"
    evals = [r for r in read_metrics(logged_run) if "samples_s" in r]
    assert [r["step"] for r in evals] == EVAL_STEPS and all(r["samples_s"] > 0 for r in evals)

    texts = read.tensorboard_texts(read.tensorboard_run(logged_run / "tensorboard"), "samples")
    assert [step for step, _ in texts] == EVAL_STEPS
    for step, text in texts:  # Markdown: each line of a completion an indented code line
        lines = [line.strip() for _, completion in samples[step] for line in completion.splitlines() if line.strip()]
        assert all(prompt in text for prompt, _ in samples[step]) and all(line in text for line in lines)

    path = read.wandb_file(logged_run)
    tables = read.wandb_tables(read.wandb_records(path), "samples", path.parent / "files")
    assert [(step, [tuple(row[1:]) for row in table["data"]]) for step, table in tables] == sorted(samples.items())

    client, run = read.mlflow_run(read.mlflow_default_store(logged_run))
    artifacts = Path(client.download_artifacts(run.info.run_id, "samples"))
    logged = {int(f.stem.split("-")[1]): json.loads(f.read_text()) for f in sorted(artifacts.glob("step-*.json"))}
    assert {step: [(r["prompt"], r["completion"]) for r in v["samples"]] for step, v in logged.items()} == samples


def test_the_last_samples_are_what_the_saved_adapter_writes(logged_run: Path) -> None:
    """The completions of the last evaluation (the run's end) are the ones plain transformers writes, greedily, with
    the saved adapter on its base: each prompt got its own completion, from the trained model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter = logged_run / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"]), adapter)
    tokenizer = AutoTokenizer.from_pretrained(adapter)
    expected = []
    for prompt in DEBUG_RUN_PROMPTS:  # data=tiny_instruct: the Alpaca prompt without an input
        text = "Below is an instruction that describes a task. Write a response that appropriately completes the "
        text += f"request.\n\n### Instruction:\n{prompt}\n\n### Response:\n"
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        out = model.eval().generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=tokenizer.eos_token_id)
        expected.append((prompt, tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)))
    assert jsonl_samples(logged_run)[STEPS] == expected
