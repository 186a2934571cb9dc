"""`python -m megalab.tables`, as the Makefile's reproduce targets run it."""

import sys

from megalab.tables.cli import main

sys.exit(main())
