"""Entry point of ``python -m ddptrain [overrides]`` and ``torchrun ... -m ddptrain [overrides]``.

Compose the Hydra config, validate it (before any worker starts) and hand it to ``launch.run``, which trains in this
process (torchrun, or one process) or self-launches the workers. Exit codes: see ``launch.run``.
"""

import gc
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from ddptrain import launch
from ddptrain.config import ConfigError, register_configs, to_run_config

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


@hydra.main(config_path=CONF_DIR, config_name="train", version_base="1.3")
def hydra_main(dict_cfg: DictConfig) -> float | None:
    try:
        cfg = to_run_config(dict_cfg)
    except ConfigError as err:
        sys.exit(f"ddptrain: invalid configuration:\n{err}")
    return launch.run(cfg, Path(HydraConfig.get().runtime.output_dir))


def main() -> None:
    register_configs()
    sys.argv = launch.hydra_argv(sys.argv)  # before Hydra reads it
    try:
        hydra_main()
    finally:
        gc.freeze()  # exiting next: skip the seconds of garbage collection at interpreter shutdown


if __name__ == "__main__":
    main()
