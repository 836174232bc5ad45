"""The ``logger`` group: it composes as a list, refuses what it cannot run, and each logger records
the metrics, the config and the report where its own tool reads them back."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from hydra.errors import MissingConfigException

from ddptrain import config
from ddptrain.config import (
    ConfigError,
    LoggerConfig,
    MlflowLoggerConfig,
    TensorBoardLoggerConfig,
    WandbLoggerConfig,
)
from ddptrain.observe import loggers
from tests import logger_readers as read
from tests.conftest import REPO, compose_config

ALL = "logger=[tensorboard,wandb,mlflow]"
RECORDS = [
    {"step": 1, "loss": 2.0, "lr": 1e-3, "mem_peak_gb_by_rank": [0.5, 0.75], "note": "text", "grad_norm": math.nan},
    {"step": 2, "loss": 1.5, "lr": 1e-3, "mem_peak_gb_by_rank": [0.5, 0.8], "note": "text", "grad_norm": 3.0},
    {"step": 2, "eval_loss": 1.25, "eval_tokens": 40},
]
REPORT = {
    "verdict": "communication",
    "summary": {"tokens_per_s": 1234.5, "mfu": None, "time_comm_s": {"0": 0.25, "1": 0.5}},
    "levers": [{"key": "optim.grad_accum_steps", "expected": "comm per sample / 4"}],
}
CONFIG = {
    "optim": {"lr": 0.005, "betas": [0.9, 0.999]},
    "trainer": {"max_steps": None, "device": "cpu", "progress_bar": True},
}


# ----------------------------------------------------------------------------- composition


def test_default_is_no_logger() -> None:
    assert compose_config([]).logger == LoggerConfig()


def test_one_logger_is_chosen_without_plus() -> None:
    cfg = compose_config(["logger=tensorboard"]).logger
    assert cfg == LoggerConfig(tensorboard=TensorBoardLoggerConfig())


def test_all_three_compose_into_the_typed_schema() -> None:
    cfg = compose_config([ALL, "logger.wandb.mode=offline", "logger.mlflow.run_name=r1"]).logger
    assert isinstance(cfg.tensorboard, TensorBoardLoggerConfig)
    assert cfg.wandb == WandbLoggerConfig(mode="offline")
    assert cfg.mlflow == MlflowLoggerConfig(run_name="r1")


def test_each_yaml_matches_its_schema_defaults() -> None:
    """The YAML files repeat the schema's defaults for the reader: they must not drift from it."""
    cfg = compose_config([ALL]).logger
    assert (cfg.tensorboard, cfg.wandb, cfg.mlflow) == (
        TensorBoardLoggerConfig(),
        WandbLoggerConfig(),
        MlflowLoggerConfig(),
    )


def test_each_yaml_starts_with_its_command() -> None:
    for path in sorted((REPO / "conf" / "logger").glob("*.yaml")):
        assert path.read_text().startswith("# ") and f"logger={path.stem}" in path.read_text().splitlines()[0]


def test_a_misspelled_logger_lists_the_options() -> None:
    with pytest.raises(MissingConfigException) as error:
        compose_config(["logger=tensorbord"])
    assert all(name in str(error.value) for name in ("mlflow", "tensorboard", "wandb"))


def test_a_misspelled_logger_in_a_list_is_named() -> None:
    with pytest.raises(MissingConfigException, match="logger/wandbb"):
        compose_config(["logger=[tensorboard,wandbb]"])


def test_a_wrong_key_in_a_logger_is_refused() -> None:
    with pytest.raises(Exception, match="projekt"):
        compose_config(["logger=wandb", "logger.wandb.projekt=x"])


@pytest.mark.parametrize("name", ["tensorboard", "wandb", "mlflow"])
def test_a_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda mod, *a: None if mod == name else real_find_spec(mod, *a))
    with pytest.raises(ConfigError, match=rf"logger={name} needs .* pip install 'ddptrain\[{name}\]'"):
        compose_config([f"logger={name}"])
    assert config._check_loggers(LoggerConfig()) == []  # a logger not chosen needs no package


# ----------------------------------------------------------------------------- what a logger receives


def test_metrics_are_the_numbers_flattened() -> None:
    values = loggers.metric_values(RECORDS[0])
    assert math.isnan(values.pop("grad_norm"))  # a diverged step's NaN reaches the charts
    assert values == {"loss": 2.0, "lr": 1e-3, "mem_peak_gb_by_rank/0": 0.5, "mem_peak_gb_by_rank/1": 0.75}
    by_rank = [{"rank": 0, "time_s": 1}, {"rank": 1, "time_s": 2}]
    nested = loggers.numeric_items({"by_rank": by_rank, "x": {"y": 3}, "off": None, "inf": -math.inf})
    assert nested == {"by_rank/0/time_s": 1.0, "by_rank/1/time_s": 2.0, "x/y": 3.0, "inf": -math.inf}


def test_config_is_flattened_with_the_keys_users_type() -> None:
    flat = loggers.flat_config({**CONFIG, "logger": {"tensorboard": {}, "wandb": None}})
    assert flat == {
        "optim.lr": 0.005,
        "optim.betas": "[0.9, 0.999]",
        "trainer.max_steps": "null",
        "trainer.device": "cpu",
        "trainer.progress_bar": True,
        "logger.tensorboard": "{}",
        "logger.wandb": "null",
    }


def test_unchosen_loggers_are_never_imported(tmp_path: Path) -> None:
    """Only the chosen logger's package is imported (each import costs seconds at start-up)."""
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from ddptrain.config import LoggerConfig, TensorBoardLoggerConfig\n"
        "from ddptrain.observe.loggers import build_loggers\n"
        "before = {m for m in ('wandb', 'mlflow', 'torch.utils.tensorboard') if m in sys.modules}\n"
        f"built = build_loggers(LoggerConfig(tensorboard=TensorBoardLoggerConfig()), Path({str(tmp_path)!r}), {{}})\n"
        "built[0].close()\n"
        "print(sorted(before), 'wandb' in sys.modules, 'mlflow' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]", "False", "False"], out.stdout


def run_all_loggers(run_dir: Path) -> None:
    """What MetricsLogger does on rank 0, with every logger: build, log each record, the report, close."""
    cfg = LoggerConfig(TensorBoardLoggerConfig(), WandbLoggerConfig(mode="offline"), MlflowLoggerConfig())
    built = loggers.build_loggers(cfg, run_dir, CONFIG)
    report_md = run_dir / "report.md"
    report_md.write_text("# Run report\n\nverdict: **communication**\n")
    for record in RECORDS:
        for logger in built:
            logger.log_metrics(record, record["step"])
    for logger in built:
        logger.log_report(REPORT, report_md)
        logger.close()
        logger.close()  # a second close (an error path after the first) is harmless


LOCAL_HOSTS = {"127.0.0.1", "::1", "localhost"}


def refuse_the_network(patch: pytest.MonkeyPatch) -> list:
    """Refuse, and record, every name lookup and connection beyond this machine (W&B's Python side talks
    to its own service over a local socket; that is allowed)."""
    attempts: list = []
    real_connect, real_lookup = socket.socket.connect, socket.getaddrinfo

    def connect(sock: socket.socket, address) -> None:
        if sock.family != socket.AF_UNIX and address[0] not in LOCAL_HOSTS:
            attempts.append(address)
            raise OSError(f"test: no network ({address})")
        real_connect(sock, address)

    def lookup(host, *args, **kwargs):
        if host not in LOCAL_HOSTS:
            attempts.append(host)
            raise socket.gaierror(f"test: no network ({host})")
        return real_lookup(host, *args, **kwargs)

    patch.setattr(socket.socket, "connect", connect)
    patch.setattr(socket, "getaddrinfo", lookup)
    return attempts


def keep_wandb_home_in(patch: pytest.MonkeyPatch, folder: Path) -> None:
    """W&B's cache, config and data folders in ``folder``, not the user's home."""
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        patch.setenv(var, str(folder / "wandb-home"))
    patch.delenv("WANDB_MODE", raising=False)  # logger.wandb.mode=offline must suffice on its own


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run of all three loggers for the tests below (W&B start-up takes seconds), with no network."""
    run_dir = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as patch:
        keep_wandb_home_in(patch, run_dir.parent)
        # MLflow sends telemetry unless it sees a test or CI: hide both, so that ddptrain's own opt-out is tested.
        for marker in ("PYTEST_CURRENT_TEST", "CI", "GITHUB_ACTIONS"):
            patch.delenv(marker, raising=False)
        attempts = refuse_the_network(patch)
        run_all_loggers(run_dir)
    assert attempts == [], f"the loggers tried the network: {attempts}"
    assert sys.modules["wandb"].run is None, "close() left the W&B run open (finish was not called)"
    return run_dir


def test_tensorboard_gets_metrics_config_and_report(logged_run: Path) -> None:
    events = read.tensorboard_run(logged_run / "tensorboard")
    assert read.tensorboard_series(events, "loss") == [(1, 2.0), (2, 1.5)]
    assert read.tensorboard_series(events, "eval_loss") == [(2, 1.25)]
    assert read.tensorboard_series(events, "mem_peak_gb_by_rank/1") == [(1, 0.75), (2, pytest.approx(0.8))]
    assert math.isnan(read.tensorboard_series(events, "grad_norm")[0][1])
    assert "step" not in events.Tags()["scalars"] and "note" not in events.Tags()["scalars"]
    assert "lr: 0.005" in read.tensorboard_text(events, "config")
    assert "verdict: **communication**" in read.tensorboard_text(events, "report")
    assert read.tensorboard_series(events, "report/time_comm_s/1") == [(2, 0.5)]


def test_wandb_gets_metrics_config_and_report_offline(logged_run: Path) -> None:
    path = read.wandb_file(logged_run)
    assert path.parent.name.startswith("offline-run-"), path
    records = read.wandb_records(path)
    assert read.wandb_series(records, "loss") == [(1, 2.0), (2, 1.5)]
    assert read.wandb_series(records, "eval_loss") == [(2, 1.25)]  # joined the training row of step 2
    assert read.wandb_series(records, "mem_peak_gb_by_rank/0") == [(1, 0.5), (2, 0.5)]
    state = read.wandb_state(path)
    assert (state["state"], state["exit_code"], state["name"]) == ("finished", 0, logged_run.name)
    assert state["config"]["optim"] == CONFIG["optim"]
    assert state["summary"]["report"] == REPORT
    copied = path.parent / "files" / "report.md"
    assert not copied.is_symlink() and "communication" in copied.read_text()


def test_mlflow_gets_metrics_params_and_report_in_the_run_folder(logged_run: Path) -> None:
    client, run = read.mlflow_run(read.mlflow_default_store(logged_run))
    assert read.mlflow_series(client, run.info.run_id, "loss") == [(1, 2.0), (2, 1.5)]
    assert read.mlflow_series(client, run.info.run_id, "eval_loss") == [(2, 1.25)]
    params = run.data.params
    assert (params["optim.lr"], params["optim.betas"]) == ("0.005", "[0.9, 0.999]")
    assert (params["trainer.max_steps"], params["trainer.progress_bar"]) == ("null", "true")  # as users type them
    assert run.data.tags["verdict"] == "communication" and run.info.status == "FINISHED"
    assert run.info.run_name == logged_run.name
    assert read.mlflow_series(client, run.info.run_id, "report/tokens_per_s") == [(2, 1234.5)]
    artifacts = Path(client.download_artifacts(run.info.run_id, ""))
    assert json.loads((artifacts / "report.json").read_text()) == REPORT
    kept = list((logged_run / "mlartifacts").rglob("report.json"))
    assert len(kept) == 1, f"the artifacts belong in the run folder, not where the run started: {kept}"
    assert "communication" in (artifacts / "report.md").read_text()


def test_a_failed_start_ends_the_loggers_already_started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    closed = []

    class Started:
        def __init__(self, *args) -> None:
            pass

        def close(self, status: str = "finished") -> None:
            closed.append(status)

    def refuse(*args) -> None:
        raise RuntimeError("W&B could not start")

    monkeypatch.setattr(loggers, "TensorBoardLogger", Started)
    monkeypatch.setattr(loggers, "WandbLogger", refuse)
    cfg = LoggerConfig(TensorBoardLoggerConfig(), WandbLoggerConfig())
    with pytest.raises(RuntimeError, match="W&B could not start"):
        loggers.build_loggers(cfg, tmp_path, {})
    assert closed == ["failed"], "a run that never started training did not finish"


@pytest.mark.parametrize(
    ("status", "mlflow_status", "wandb_exit_code", "tracking_uri"),
    [("failed", "FAILED", 1, None), ("stopped", "KILLED", 75, "sqlite:///{tmp_path}/elsewhere.db")],
)
def test_a_failed_or_stopped_run_does_not_end_as_finished(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    status: str,
    mlflow_status: str,
    wandb_exit_code: int,
    tracking_uri: str | None,
) -> None:
    """close(status) reaches each tool's own record of the run; the first close wins (the logged_run tests
    above check "finished": MLflow FINISHED, W&B finished with exit code 0). The stopped run goes to a store
    named by logger.mlflow.tracking_uri, outside the run folder, as a server or a shared database would be."""
    keep_wandb_home_in(monkeypatch, tmp_path)
    uri = tracking_uri and tracking_uri.format(tmp_path=tmp_path)
    mlflow_cfg = MlflowLoggerConfig(tracking_uri=uri)
    cfg = LoggerConfig(TensorBoardLoggerConfig(), WandbLoggerConfig(mode="offline"), mlflow_cfg)
    built = loggers.build_loggers(cfg, tmp_path, CONFIG)
    for logger in built:
        with pytest.raises(ValueError, match="'crashed'"):  # a misspelled status ends nothing
            logger.close("crashed")
        logger.close(status)
        logger.close("finished")  # a second close (an error path after the first) does not overwrite it
    _, run = read.mlflow_run(uri or read.mlflow_default_store(tmp_path))
    assert (tmp_path / "mlflow.db").exists() == (uri is None), "the default store is <run>/mlflow.db, and only it"
    assert run.info.status == mlflow_status
    state = read.wandb_state(read.wandb_file(tmp_path))
    assert (state["state"], state["exit_code"]) == ("failed", wandb_exit_code)  # W&B: any code but 0 is Failed
    assert "lr: 0.005" in read.tensorboard_text(read.tensorboard_run(tmp_path / "tensorboard"), "config")  # flushed


def test_logger_config_round_trips_as_data() -> None:
    """config_as_dict (what the loggers record) keeps the logger group as plain data."""
    cfg = compose_config([ALL])
    assert config.config_as_dict(cfg)["logger"]["wandb"] == asdict(WandbLoggerConfig())


def test_metrics_jsonl_keeps_one_type_per_column_and_the_loggers_chart_the_nan(tmp_path: Path) -> None:
    """A diverged step's NaN loss and infinite gradient norm are null in metrics.jsonl (a number or null, as JSON has
    no NaN: a string there breaks every reader that plots the column), at any depth; a logger gets the floats."""
    from ddptrain.observe.metrics import MetricsLogger

    class Recorder:
        def __init__(self) -> None:
            self.got: list[dict] = []

        def log_metrics(self, record: dict, step: int) -> None:
            self.got.append(record)

    recorder = Recorder()
    writer = MetricsLogger(tmp_path / "metrics.jsonl", [recorder])
    writer.log({"step": 3, "loss": torch.tensor(math.nan), "grad_norm": math.inf, "by_rank": [{"x": -math.inf}]})
    writer.file.close()

    def refuse(constant: str) -> None:
        raise AssertionError(f"metrics.jsonl holds {constant}, which is not JSON")

    line = (tmp_path / "metrics.jsonl").read_text()
    assert json.loads(line, parse_constant=refuse) == {
        "step": 3,
        "loss": None,
        "grad_norm": None,
        "by_rank": [{"x": None}],
    }
    (got,) = recorder.got
    assert math.isnan(got["loss"]) and got["grad_norm"] == math.inf


def test_the_progress_bar_shows_a_window_without_a_finite_loss(capsys) -> None:
    """Under trainer.on_nonfinite=skip a log window whose every step was dropped logs loss null: rank 0's bar says so
    instead of failing the run there (the other ranks would wait for it until the collective timeout)."""
    from ddptrain.observe.console import ProgressBar

    bar = ProgressBar(total=2)
    bar.update({"loss": None, "tokens_per_s": 12.0})
    bar.advance()
    bar.close()
    assert "loss=n/a" in capsys.readouterr().err
