"""``python -m ddptrain [verb] ...``, ``torchrun ... -m ddptrain [overrides]``: the ``ddptrain`` command (its verbs
in ``cli.py``), and its ``train`` verb: compose the Hydra config, validate it (before any worker starts) and hand it
to ``launch.run``, which trains in this process (torchrun, or one process) or self-launches the workers. Exit codes:
see ``launch.run``.
"""

import gc
import json
import os
import sys

import hydra

from ddptrain import launch
from ddptrain.cli import CONF_DIR, completion_line, main
from ddptrain.config import COMMAND_LINE_ENV, register_configs

# Hydra's task function lives in launch.py: a parallel sweep hands it to the process that runs each job.
hydra_main = hydra.main(config_path=CONF_DIR, config_name="train", version_base="1.3")(launch.hydra_job)


def train(argv: list[str]) -> int:
    """``ddptrain train [overrides]``."""
    register_configs()
    if "-sc" in argv or "--shell-completion" in argv:  # `ddptrain <verb> ...<TAB>`: what Hydra is to complete
        line = completion_line(os.environ.get("COMP_LINE", ""))
        if line is None:
            return 0
        os.environ["COMP_LINE"] = line
    sys.argv = launch.hydra_argv([sys.argv[0], *argv])  # before Hydra reads it
    os.environ[COMMAND_LINE_ENV] = json.dumps(sys.argv)  # for the processes that run a sweep's jobs
    try:
        hydra_main()
    finally:
        gc.freeze()  # exiting next: skip the seconds of garbage collection at interpreter shutdown
    return 0


if __name__ == "__main__":
    sys.exit(main())
