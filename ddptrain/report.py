"""``python -m ddptrain.report SWEEP_DIR``: the sweep report (``ddptrain/sweep/report.py``) from a sweep folder."""

import sys

from ddptrain.sweep.report import main

if __name__ == "__main__":
    sys.exit(main())
