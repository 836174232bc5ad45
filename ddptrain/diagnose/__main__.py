"""``python -m ddptrain.diagnose RUN_DIR [--what-if ...] [--no-plots]``, as ``ddptrain diagnose``:
see ``ddptrain.diagnose.cli``."""

import sys

from ddptrain.diagnose.cli import main

if __name__ == "__main__":
    sys.exit(main())
