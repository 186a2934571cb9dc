"""`python -m megalab.tables`, as the Makefile's reproduce targets run it."""

import sys

from megalab.tables.cli import main

if __name__ == "__main__":  # importing the module (walking the package) runs nothing
    sys.exit(main())
