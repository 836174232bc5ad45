"""The CPU suite names its device in every run, so it also passes on a machine with a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ddptrain.config import Device
from tests.conftest import check_device_set, compose_config, pin_device

PYTHON_M = [sys.executable, "-m", "ddptrain"]
UNSET = r"runs ddptrain without trainer\.device"
TORCHRUN_M = ["torchrun", "--standalone", "--nproc_per_node", "2", "-m", "ddptrain"]


@pytest.mark.parametrize("command", [[*PYTHON_M, "trainer.max_steps=1"], [*TORCHRUN_M], ["ddptrain", "-m", "x=1,2"]])
def test_a_ddptrain_command_without_trainer_device_fails_the_test(command: list[str]) -> None:
    with pytest.raises(pytest.fail.Exception, match=UNSET):
        check_device_set(command)
    with pytest.raises(pytest.fail.Exception, match=UNSET):
        check_device_set(" ".join(command))  # shell=True form


@pytest.mark.parametrize(
    "command",
    [
        [*PYTHON_M, "train", "trainer.max_steps=1", "plan"],  # a verb's name elsewhere than the verb's place
        ["ddptrain", "train", "model=tiny_qwen2"],
        "export HF_HOME=/x && python -m ddptrain trainer.max_steps=1",
    ],
)
def test_a_training_command_that_names_a_verb_elsewhere_still_needs_the_device(command) -> None:
    with pytest.raises(pytest.fail.Exception, match=UNSET):
        check_device_set(command)


def test_verbs_that_train_nothing_help_and_completion_need_no_device() -> None:
    check_device_set(["ddptrain", "plan", "model=tiny_qwen2"])
    check_device_set([*PYTHON_M, "report", "outputs/multirun/x"])
    check_device_set(["ddptrain", "train", "--help"])
    check_device_set(["ddptrain", "-sc", "query=bash"])


def test_commands_that_set_the_device_or_do_not_run_ddptrain_pass() -> None:
    check_device_set([*PYTHON_M, "trainer.device=cpu"])
    check_device_set([*TORCHRUN_M, "trainer.max_steps=1", "trainer.device=cuda"])
    check_device_set([sys.executable, "-m", "ddptrain.export", "run", "out"])
    check_device_set(["sleep", "60"])


def test_popen_is_checked_before_anything_starts() -> None:
    """What tests that build their own command line go through (subprocess.run uses Popen too). The command
    reads as a ddptrain run to the check but only runs ``pass``, so a broken check costs nothing."""
    harmless = [sys.executable, "-c", "pass", "-m", "ddptrain"]
    with pytest.raises(pytest.fail.Exception, match=UNSET):
        subprocess.run(harmless, capture_output=True, timeout=60)
    with pytest.raises(pytest.fail.Exception, match=UNSET):
        subprocess.Popen(harmless).wait(timeout=60)
    assert subprocess.run([*harmless, "trainer.device=cpu"], timeout=60).returncode == 0


def test_the_helpers_add_cpu_unless_the_caller_names_a_device() -> None:
    assert pin_device(["trainer.max_steps=1"]) == ["trainer.max_steps=1", "trainer.device=cpu"]
    assert pin_device(["trainer.device=cuda"]) == ["trainer.device=cuda"]
    assert compose_config([]).trainer.device == Device.cpu
    assert compose_config(["trainer.device=auto"]).trainer.device == Device.auto
