"""``python -m ddptrain [overrides]`` and ``torchrun ... -m ddptrain [overrides]``.

Compose the Hydra config -> validate (before any worker starts) -> run in this process
(torchrun, or one process) or self-launch the workers -> train.

Exit codes: 0 finished (and, under torchrun, stopped by a signal: a non-zero exit would make
``torchrun --max-restarts`` restart the workers); 75 stopped by SIGTERM or Ctrl-C after saving a
checkpoint (``signals.STOPPED_EXIT_CODE``); 130 aborted by a second Ctrl-C; 1 failed.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from ddptrain import signals
from ddptrain.config import ConfigError, register_configs, to_run_config

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
log = logging.getLogger("ddptrain")


def _under_torchrun() -> bool:
    return all(v in os.environ for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"))


def _restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _quiet_hydra_on_other_ranks() -> None:
    """Under torchrun, only rank 0's first attempt creates Hydra's run folder; nobody else writes one."""
    if _under_torchrun() and (os.environ["RANK"] != "0" or _restart_count() > 0):
        sys.argv += ["hydra.output_subdir=null", "hydra.run.dir=."]


def _torchrun_run_dir(hydra_dir: Path, output_dir: str) -> Path:
    """Rank 0's run directory under torchrun, kept across ``--max-restarts`` restarts.

    A restarted group must find its own checkpoints (trainer.resume=auto), but Hydra would
    pick a new timestamped folder; the first attempt leaves its folder's name in
    ``<output_dir>/.torchrun/<rendezvous id>`` for the restarts to read.
    """
    marker = Path(output_dir) / ".torchrun" / os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if _restart_count() > 0 and marker.is_file():
        return Path(marker.read_text().strip())
    if os.environ["RANK"] == "0":
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"{hydra_dir}\n")
    return hydra_dir


def _reject_multirun_under_torchrun() -> None:
    if _under_torchrun() and any(a in ("-m", "--multirun") for a in sys.argv[1:]):
        sys.exit(
            "ddptrain: sweeps (-m) start a fresh process group per job, which torchrun cannot do: "
            "run `python -m ddptrain -m ...` (it launches each job's workers itself)."
        )


@hydra.main(config_path=CONF_DIR, config_name="train", version_base="1.3")
def hydra_main(dict_cfg: DictConfig) -> float | None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = to_run_config(dict_cfg)
    except ConfigError as err:
        sys.exit(f"ddptrain: invalid configuration:\n{err}")
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if _under_torchrun():
        _check_torchrun_size(cfg.parallel.nproc_per_node)
        from ddptrain.launch import worker

        run_dir = _torchrun_run_dir(run_dir, cfg.trainer.output_dir)
        result = worker(cfg, str(run_dir), None)
    elif (cfg.parallel.nproc_per_node or 1) == 1:
        from ddptrain.launch import worker

        result = worker(cfg, str(run_dir), None)
    else:
        from ddptrain.launch import launch

        try:
            result = launch(cfg, run_dir)
        except RuntimeError as err:
            sys.exit(f"ddptrain: {err}")
        except signals.Aborted:
            print(signals.stopped_line("aborted by a second Ctrl-C", run_dir, None), file=sys.stderr)
            sys.exit(signals.ABORTED_EXIT_CODE)
    _exit_if_stopped(result, run_dir)
    return result.get("loss") if result else None


def _exit_if_stopped(result: dict | None, run_dir: Path) -> None:
    """After SIGTERM or Ctrl-C: one line saying where the checkpoint is, and the exit code for it."""
    if not result or signals.STOPPED_BY not in result:
        return
    line = signals.stopped_line(f"stopped by {result[signals.STOPPED_BY]}", run_dir, result[signals.STOPPED_AT_STEP])
    if not _under_torchrun():
        print(line, file=sys.stderr)
        sys.exit(signals.STOPPED_EXIT_CODE)
    if os.environ["RANK"] == "0":  # and exit 0: see the module docstring
        print(line, file=sys.stderr)


def _check_torchrun_size(nproc_per_node: int | None) -> None:
    started = int(os.environ["LOCAL_WORLD_SIZE"])
    if nproc_per_node is not None and nproc_per_node != started:
        sys.exit(
            f"ddptrain: parallel.nproc_per_node={nproc_per_node} but torchrun started {started} processes per node: "
            f"launch with --nproc_per_node {nproc_per_node}, or pick the matching parallel= option "
            "(parallel=auto adopts torchrun's count)."
        )


def main() -> None:
    register_configs()
    _reject_multirun_under_torchrun()
    _quiet_hydra_on_other_ranks()
    try:
        hydra_main()
    finally:
        gc.freeze()  # exiting next: skip the seconds of garbage collection at interpreter shutdown


if __name__ == "__main__":
    main()
