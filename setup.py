"""Build hook: the wheel also carries the paper tables and the sweep files.

Everything else about the build is declared in pyproject.toml. `tables/` and `sweeps/` stay at
the repository root, where `make reproduce-*` and `wandb sweep` read them; the wheel gets a copy
of them under `megalab/resources/`, so `megalab-sweep` and `megalab-tables` (and the smoke
reproductions) work from an installed package too (`megalab.utils.paths.resource_dir`). An
editable install reads them from the checkout and copies nothing.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# folder at the repository root -> the files of it the wheel carries
RESOURCES = {"sweeps": ("*.yaml",), "tables": ("**/*.yaml", "README.md")}


class BuildPyWithResources(build_py):
    """`build_py` that also copies RESOURCES into `megalab/resources/<folder>/`."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for folder, patterns in RESOURCES.items():
            source = ROOT / folder
            if not source.is_dir():
                raise FileNotFoundError(
                    f"{source} is missing: build the wheel from a checkout or an sdist of megalab"
                )
            for pattern in patterns:
                for path in sorted(source.glob(pattern)):
                    target = Path(self.build_lib, "megalab", "resources", folder)
                    target = target / path.relative_to(source)
                    self.mkpath(str(target.parent))
                    self.copy_file(str(path), str(target))


setup(cmdclass={"build_py": BuildPyWithResources})
