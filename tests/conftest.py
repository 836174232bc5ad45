"""Shared test helpers: paths, config composition, subprocess runs of the real entrypoint.

Before writing a test, read tests/README.md: a test must be able to fail (break it once), its scenario is built by
design (never by pushing a learning rate into chaos), and its tolerances follow from the arithmetic
(``tests/numerics.py``), so that it passes on any CPU and fails only for a defect.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest
from hydra import compose, initialize_config_dir

from ddptrain.cli import CONF_DIR, VERBS
from ddptrain.config import RunConfig, register_configs, to_run_config

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"
ALPACA = SHARED_DATA / "alpaca" / "alpaca_data_52k.jsonl"
QWEN2_TOKENIZER = SHARED_DATA / "tokenizers" / "qwen2"

# CI runs every test: under CI (as .ci/run sets), what would skip a test elsewhere fails it.
UNDER_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}
# Tests that read the real data beside the repository; see pytest_runtest_setup.
requires_shared = pytest.mark.requires_shared

# One thread per rank: the CI machine has 2 cores and the tests run 2 ranks.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def skip_or_fail(reason: str) -> NoReturn:
    """Skip the test here; under CI fail it instead, so a missing prerequisite cannot pass unnoticed."""
    if UNDER_CI:
        pytest.fail(f"{reason} (CI=true: this test must run, not skip)", pytrace=False)
    pytest.skip(reason)


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "requires_shared: reads ../shared/data (Alpaca, Qwen2 tokenizer)")


# Under `make test` (pytest -n 2, pytest-xdist) two workers share the 2 cores. The tests that train on 2 ranks run in
# turn on one of them: two 2-rank runs side by side slow each other's lockstep steps more than they gain. The tests
# below run beside them on the other worker, in the third of the cores the 2-rank runs leave idle
# (docs/suite_timings.md): one process each, 2-rank runs that mostly wait (for a timeout, a signal, a killed
# launcher), and the compiled run (under a minute of torch.compile on a cold cache, as in CI, then 3 steps), none
# timed tightly.
BESIDE_THE_RANKS = (
    "tests/unit/",
    "tests/gpu/",
    "tests/e2e/test_bench.py",
    "tests/e2e/test_hangs.py",
    "tests/distributed/test_slow_saves.py",
    "tests/distributed/test_start_method.py",
    "tests/distributed/test_train_step.py::test_compiled_model_computes_the_eager_loss_and_syncs_once_per_step_under",
    "tests/e2e/test_sweeps.py::test_a_killed_sweep_run_again_skips_what_finished_and_resumes_the_rest",
    "tests/e2e/test_sweeps.py::test_the_optuna_recipe_runs_three_trials_and_the_report_ranks_them",
    "tests/e2e/test_sweeps.py::test_a_slurm_preset_submits_the_nodes_tasks_and_gpus_of_the_job",
    # A 2-rank run that stops after planning, before any weight loads: short, and timed loosely.
    "tests/e2e/test_refusals.py::test_a_run_the_memory_plan_says_will_not_fit_stops_before_loading_weights",
    # Two ranks that generate a few tokens each, one of them after sleeping 5 s: timed only against that sleep.
    "tests/distributed/test_evaluation.py::test_a_rank_generates_its_samples_while_the_other_rank_is_away",
)
# Tests whose figures are timings: they run last of the 2-rank tests, with the other worker held still (timed_alone).
TIMED_LAST = ("tests/distributed/test_diagnose_injected.py",)
IN_TURN = "2-rank tests, in turn"


def pytest_collection_modifyitems(items) -> None:
    items.sort(key=lambda item: item.nodeid.startswith(TIMED_LAST))  # stable: the order is otherwise kept


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: without pytest-xdist it is never called
def pytest_xdist_make_scheduler(config, log):
    """pytest -n: the tests outside BESIDE_THE_RANKS form one unit of work, handed to one worker and run in the order
    collected; the rest are shared out by module. (pytest-xdist's own ``--dist loadgroup`` would do the same from
    markers, but with pytest 9 the group it adds to a test's id no longer reaches the scheduler.)"""
    from xdist.scheduler import LoadScopeScheduling

    class TwoRankTestsInTurn(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return nodeid.split("::")[0] if nodeid.startswith(BESIDE_THE_RANKS) else IN_TURN

    return TwoRankTestsInTurn(config, log)


def _timing_lock_paths(config: pytest.Config) -> tuple[Path, Path] | None:
    """The lock file and the "a timed run is waiting" flag of this pytest -n session, in the folder that holds each
    worker's temporary folder (None without pytest-xdist: one test at a time has the machine to itself)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return None
    shared = Path(config.option.basetemp).parent  # pytest-xdist gives each worker --basetemp=<session's>/popen-gwN
    return shared / "timing.lock", shared / "timing.wanted"


# How long a timed run waits for the test beside it to end before it runs anyway (with a warning), and how long a
# test beside waits for a timed run: both within pytest's 300 s per test.
TIMED_ALONE_WAIT_S = 120


def _lock_within(handle, operation: int, seconds: float) -> bool:
    """``fcntl.lockf(handle, operation)``, retried for up to ``seconds``; whether the lock was taken. POSIX record
    locks, not flock: a process forked by a test does not inherit them, and the kernel drops them when the process
    that took them dies, so no lock outlives its test or its worker."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.lockf(handle, operation | fcntl.LOCK_NB)
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)


@contextlib.contextmanager
def timed_alone(config: pytest.Config) -> Iterator[None]:
    """Hold the tests beside the 2-rank ones still while the body runs: it waits for the test running there to end,
    and the next one waits for the body. The diagnosis test compares the tokens/s of runs trained one after another
    (test_diagnose_injected.py): a test beside them would take cores from some of those runs and not from others."""
    paths = _timing_lock_paths(config)
    if paths is None:
        yield
        return
    lock, wanted = paths
    with wanted.open("a+") as flag, lock.open("a+") as handle:
        fcntl.lockf(flag, fcntl.LOCK_EX)  # from now on no test beside starts
        if not _lock_within(handle, fcntl.LOCK_EX, TIMED_ALONE_WAIT_S):
            late = f"a test beside the 2-rank ones still ran after {TIMED_ALONE_WAIT_S} s: timing anyway"
            warnings.warn(late, stacklevel=3)
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test beside the 2-rank ones (its module's fixtures included) waits while a timed run wants the machine, and
    holds it off while it runs."""
    paths = _timing_lock_paths(item.config)
    if paths is None or not item.nodeid.startswith(BESIDE_THE_RANKS):
        return (yield)
    lock, wanted = paths
    with wanted.open("a+") as flag, lock.open("a+") as handle:
        # The flag first: a lock alone lets a new shared holder overtake a waiting exclusive one.
        if _lock_within(flag, fcntl.LOCK_SH, TIMED_ALONE_WAIT_S):
            fcntl.lockf(flag, fcntl.LOCK_UN)
        _lock_within(handle, fcntl.LOCK_SH, TIMED_ALONE_WAIT_S)
        return (yield)


def pytest_runtest_setup(item) -> None:
    if item.get_closest_marker("requires_shared") is None:
        return
    missing = [str(p) for p in (ALPACA, QWEN2_TOKENIZER) if not p.exists()]
    if missing:
        skip_or_fail(f"needs ../shared/data beside the repository; missing: {', '.join(missing)}")


# Every run the suite starts names its device: trainer.device=auto (the default) would put a 2-rank run on
# a machine with one GPU onto cuda and fail with "local rank 1 has no GPU". tests/gpu passes trainer.device=cuda.
CPU_DEVICE = "trainer.device=cpu"


def sets_device(args: list[str]) -> bool:
    """Whether a list of Hydra overrides (or a command line) sets trainer.device."""
    return any(str(a).lstrip("+~").startswith("trainer.device=") for a in args)


def pin_device(overrides: list[str]) -> list[str]:
    """``overrides`` with trainer.device=cpu added, unless they already set trainer.device."""
    return list(overrides) if sets_device(overrides) else [*overrides, CPU_DEVICE]


def check_device_set(command: str | bytes | os.PathLike | list) -> None:
    """Fail the test when ``command`` runs ddptrain (``[torchrun ...] -m ddptrain``) without trainer.device=...

    Raises:
        pytest.fail.Exception: naming the command and the fix.
    """
    if isinstance(command, (str, bytes, os.PathLike)):
        argv = os.fsdecode(command).split()
    else:
        argv = [os.fsdecode(a) for a in command]
    after_m = [i + 2 for i, pair in enumerate(itertools.pairwise(argv)) if pair == ("-m", "ddptrain")]
    starts = after_m or ([1] if argv and Path(argv[0]).name == "ddptrain" else [])
    rest = argv[starts[0] :] if starts else []
    # A verb that trains nothing (ddptrain plan, ddptrain --help, shell completion) needs no device.
    trains = not (rest[:1] and rest[0] in set(VERBS) - {"train"}) and not {"--help", "-h", "-sc"} & set(rest)
    if starts and trains and not sets_device(argv):
        pytest.fail(
            f"this test runs ddptrain without trainer.device: {' '.join(argv)}\n"
            "Start it with tests.conftest.run_ddptrain, or add trainer.device=cpu to its command "
            "(trainer.device=auto fails 2-rank runs on a machine with one GPU).",
            pytrace=False,
        )


class _DeviceCheckedPopen(subprocess.Popen):
    """subprocess.Popen (and so subprocess.run) that first applies check_device_set."""

    def __init__(self, args, *rest, **kwargs) -> None:
        check_device_set(args)
        super().__init__(args, *rest, **kwargs)


@pytest.fixture(autouse=True, scope="session")
def runs_set_their_device():
    """Fail any test (or fixture) that starts ddptrain in a subprocess without naming its device."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess, "Popen", _DeviceCheckedPopen)
        yield


def from_forkserver(overrides: list[str]) -> list[str]:
    """``overrides`` with parallel.start_method=forkserver added, unless they already choose a start method."""
    if any(str(o).startswith("parallel.start_method=") for o in overrides):
        return list(overrides)
    return [*overrides, "parallel.start_method=forkserver"]


def compose_config(overrides: list[str], config_name: str = "train", config_dir: Path | None = None) -> RunConfig:
    """Compose and validate a run config as ``python -m ddptrain [--config-dir DIR --config-name NAME]`` does,
    on trainer.device=cpu unless ``overrides`` set trainer.device."""
    register_configs()
    # Tests that launch in this process fork their ranks from one forkserver that imported the libraries once for the
    # whole session (about 5 s sooner per launch on 2 cores). run_ddptrain does the same for the command line.
    overrides = from_forkserver(pin_device(overrides))
    primary_dir = CONF_DIR
    if config_dir is not None:  # like --config-dir: the recipe is primary, conf/ stays on the search path
        primary_dir = str(config_dir)
        overrides = [*overrides, f"hydra.searchpath=[file://{CONF_DIR}]"]
    with initialize_config_dir(primary_dir, version_base="1.3"):
        return to_run_config(compose(config_name, overrides=overrides))


def train_in_process(run_dir: Path, overrides: list[str]) -> Path:
    """The run ``python -m ddptrain *overrides`` trains, into ``run_dir`` (made here), launched from this process: its
    ranks fork from the session's forkserver instead of a launcher and two workers importing torch, transformers and
    peft (about 10 s on 2 cores). For runs whose results are compared; what the command line itself does (signals,
    restarts, torchrun, sweeps) is tested on the command line."""
    from ddptrain.launch import launch  # imports torch: only the tests that train pay for it

    run_dir.mkdir(parents=True)
    launch(compose_config([*overrides, f"trainer.output_dir={run_dir.parent}"]), run_dir)
    return run_dir


@pytest.fixture(scope="session")
def datasets_cache(tmp_path_factory) -> Path:
    """One datasets cache for the session: hermetic, yet each file is converted only once."""
    return tmp_path_factory.mktemp("datasets-cache")


RUN_TAG = "DDPTRAIN_TEST_COMMAND"


def run_ddptrain(
    args: list[str], timeout: float = 300, launcher: list[str] | None = None
) -> subprocess.CompletedProcess:
    """Run the real entrypoint in a subprocess (``python -m ddptrain`` unless ``launcher`` says otherwise),
    on trainer.device=cpu unless ``args`` set trainer.device.

    A CPU self-launch forks its ranks from a forkserver unless ``args`` set parallel.start_method: the server
    imports torch, transformers and peft once instead of each spawned rank (6 CPU-seconds less per launch, measured;
    one sweep's jobs share one server). The shipped default, spawn, is what the GPU tests (which set trainer.device),
    the signal, hang, restart and start-method tests launch with, and the Alpaca run in test_cli.py sets it."""
    if launcher is None and not sets_device(args):
        args = from_forkserver(args)
    command = (launcher or [sys.executable]) + ["-m", "ddptrain", *pin_device(args)]
    # Every process of the run inherits its command line in the environment, so that
    # assert_no_process_left also finds workers whose own command line does not show it (spawned ones).
    env = {**os.environ, "PYTHONUNBUFFERED": "1", RUN_TAG: " ".join(command)}
    env.pop("MASTER_PORT", None)
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def read_written_metrics(run_dir: Path) -> list[dict]:
    """The records of a run that is still writing: a line not yet ended by its newline is left for later
    (another process may be in the middle of writing it)."""
    *complete, _unfinished = (run_dir / "metrics.jsonl").read_text().split("\n")
    return [json.loads(line) for line in complete]


def run_dirs(output_dir: Path) -> list[Path]:
    """Run folders (hidden bookkeeping such as .torchrun/ excluded)."""
    return sorted(p for p in output_dir.iterdir() if p.is_dir() and not p.name.startswith("."))


def _read_or_empty(path: Path) -> str:
    try:
        return path.read_bytes().decode(errors="replace")
    except PermissionError:  # another user's process: its command line is still readable
        return ""


def processes_mentioning(marker: str) -> list[str]:
    """Live processes (not this one) whose command line or environment contains ``marker``, from /proc.

    Raises:
        pytest.fail: no /proc to read (the check must not pass by seeing nothing).
    """
    proc = Path("/proc")
    if not (proc / "self" / "cmdline").is_file():
        pytest.fail("cannot list processes: no /proc on this machine", pytrace=False)
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = _read_or_empty(entry / "environ")
        except (FileNotFoundError, ProcessLookupError):
            continue  # ended while we looked
        if marker in cmdline or marker in environ:
            found.append(f"{entry.name}: {cmdline.strip()}")
    return found


def assert_no_process_left(marker: str) -> None:
    """No process started for a run (its command line, or the RUN_TAG that run_ddptrain gives each
    process of the run) is still alive."""
    left = processes_mentioning(marker)
    assert not left, f"processes left behind: {left}"
