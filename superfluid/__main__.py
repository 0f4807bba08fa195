"""`python -m superfluid` runs the command line."""

import sys

from superfluid.cli import main

# The guard matters: multiprocessing's spawn re-imports the main module.
if __name__ == "__main__":
    sys.exit(main())
