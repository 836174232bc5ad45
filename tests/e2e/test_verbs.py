"""``ddptrain <verb>`` (issue 41): the installed command's help, its verbs, and the ``python -m`` forms beside them.

The installed script (``.venv/bin/ddptrain``, what ``pip install`` wrote from pyproject.toml) is run as a user runs it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddptrain.cli import VERBS, completion_line, main
from tests.conftest import REPO

pytestmark = pytest.mark.e2e
DDPTRAIN = str(Path(sys.executable).parent / "ddptrain")


def run(command: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
    )


@pytest.mark.parametrize("verb", [v for v in VERBS if v != "train"])
def test_each_verbs_help_exits_0_names_the_verb_and_shows_an_example(verb: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([verb, "--help"])
    assert exit_.value.code == 0
    shown = capsys.readouterr().out
    assert shown.startswith(f"usage: ddptrain {verb} ")
    assert f"example:\n  ddptrain {verb} " in shown
    assert f"python -m {VERBS[verb].python_m}" in shown


def test_ddptrain_help_says_what_it_is_and_lists_the_verbs_and_groups() -> None:
    done = run([DDPTRAIN, "--help"])
    assert done.returncode == 0, done.stderr
    first, *rest = done.stdout.splitlines()
    assert first.startswith("ddptrain: fine-tune language models"), first
    shown = "\n".join(rest)
    for verb in VERBS:
        assert re.search(rf"^  {verb} +\w", shown, re.M), f"{verb} not listed"
    assert re.search(r"^  model +.*\bllama3_1_8b_lora\b", shown, re.M)
    assert "README.md" in shown


def test_train_help_is_hydras_with_the_verb_and_every_group() -> None:
    done = run([DDPTRAIN, "train", "--help"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ddptrain train: fine-tune"), done.stdout[:200]
    assert "== Configuration groups ==" in done.stdout and "lora_rank:" in done.stdout


def test_a_word_that_is_no_verb_is_refused_with_the_nearest_verb() -> None:
    done = run([DDPTRAIN, "plna", "model=tiny_qwen2", "trainer.device=cpu"])
    assert done.returncode == 1
    assert "did you mean `ddptrain plan`?" in done.stderr


def test_a_bare_word_after_a_verb_that_takes_overrides_is_refused_before_hydra_reads_it() -> None:
    with pytest.raises(SystemExit, match=r"ddptrain train: 'train' is not a key=value override"):
        main(["train", "train", "model=tiny_qwen2"])


def test_shell_completion_completes_after_the_train_verb() -> None:
    """What bash's completion function runs on ``ddptrain train model=tiny<TAB>``."""
    line = "ddptrain train model=tiny"
    done = run([DDPTRAIN, "-sc", "query=bash"], COMP_LINE=line, COMP_POINT=str(len(line)))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["model=tiny_qwen2"]


def test_completion_reads_the_line_after_a_verb_that_takes_overrides() -> None:
    assert completion_line("ddptrain  train  model=q") == "ddptrain  model=q"
    assert completion_line("ddptrain plan model=") == "ddptrain model="
    assert completion_line("ddptrain train ") == "ddptrain "  # a new word: every group
    assert completion_line("ddptrain model=q") == "ddptrain model=q"  # no verb: as it is
    assert completion_line("ddptrain report outputs/") is None  # no overrides: the shell completes the path
    assert completion_line("ddptrain plan") is None  # the verb itself being typed


def test_the_plan_verb_and_python_m_print_the_same_plan(tmp_path: Path) -> None:
    # plan.resident_baseline_gb: the one measured figure, the same in both processes only when given
    overrides = [
        "--no-levers",
        "trainer.device=cpu",
        "plan.resident_baseline_gb=0.5",
        f"data.cache_dir={tmp_path}",
        "data.max_rows=400",
    ]
    by_verb = run([DDPTRAIN, "plan", *overrides])
    by_module = run([sys.executable, "-m", "ddptrain.plan", *overrides])
    assert by_verb.returncode == by_module.returncode == 0, by_verb.stderr + by_module.stderr

    def plan(out: str) -> str:
        return re.sub(r"planned in \d+ s", "planned in N s", out)

    assert "predicted peak" in by_verb.stdout
    assert plan(by_verb.stdout) == plan(by_module.stdout)
