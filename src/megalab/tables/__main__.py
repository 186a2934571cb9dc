"""Deprecated: `python -m megalab.tables` still runs `megalab-tables`, saying so."""

from megalab.cli.deprecated import run_moved

if __name__ == "__main__":  # importing the module (walking the package) runs nothing
    run_moved("megalab.tables", "megalab.cli.tables", "megalab-tables")
