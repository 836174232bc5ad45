"""``python -m ddptrain.diagnose RUN_DIR [--what-if ...] [--no-plots]``: see ``ddptrain.diagnose.cli``."""

import sys

from ddptrain.diagnose import __doc__ as package_doc
from ddptrain.diagnose.cli import main

if __name__ == "__main__":
    # The --help description is the package docstring's first line: one text for both.
    sys.exit(main(description=package_doc.split("\n")[0]))
