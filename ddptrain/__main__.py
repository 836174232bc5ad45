"""Entry point of ``python -m ddptrain [overrides]`` and ``torchrun ... -m ddptrain [overrides]``.

Compose the Hydra config, validate it (before any worker starts) and hand it to ``launch.run``, which trains in this
process (torchrun, or one process) or self-launches the workers. Exit codes: see ``launch.run``.
"""

import gc
import json
import os
import sys

import hydra

from ddptrain import launch
from ddptrain.config import COMMAND_LINE_ENV, register_configs
from ddptrain.config.hydra import CONF_DIR as _CONF_DIR

CONF_DIR = str(_CONF_DIR)

# Hydra's task function lives in launch.py: a parallel sweep hands it to the process that runs each job.
hydra_main = hydra.main(config_path=CONF_DIR, config_name="train", version_base="1.3")(launch.hydra_job)


def main() -> None:
    register_configs()
    sys.argv = launch.hydra_argv(sys.argv)  # before Hydra reads it
    os.environ[COMMAND_LINE_ENV] = json.dumps(sys.argv)  # for the processes that run a sweep's jobs
    try:
        hydra_main()
    finally:
        gc.freeze()  # exiting next: skip the seconds of garbage collection at interpreter shutdown


if __name__ == "__main__":
    main()
