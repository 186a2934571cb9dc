"""`megalab.models` finds its model packages: a new folder is enrolled without editing the module.

Each `megalab/models/<model>/` package lists its public names in a literal `__all__`;
`megalab.models` exports them lazily and `block_classes()` collects every backbone's declared
`block_class` (FSDP units, activation checkpointing). The first test adds a model folder
megalab has never seen, in a fresh interpreter, and uses it the way user code and the
`trainer=fsdp_blocks` config do.
"""

from __future__ import annotations

import ast
import json
import textwrap
from pathlib import Path

import pytest

import megalab.models as models
from conftest import run_cli

TOY_INIT = '''
"""A toy model, only in this test's temporary folder."""

from megalab.models.toy_discovered.model import ToyBackbone, ToyBlock

__all__ = ["ToyBackbone", "ToyBlock"]
'''

TOY_MODEL = '''
"""One block that returns its input."""

from torch import Tensor, nn

from megalab.models.base import Backbone, BackboneOutput as Out


class ToyBlock(nn.Module):
    """y = x."""

    def forward(self, x: Tensor) -> Tensor:
        return x


class ToyBackbone(Backbone):
    """A stack of identity blocks."""

    block_class = ToyBlock

    def __init__(self, d_model: int = 4) -> None:
        super().__init__()
        self.d_model, self.causal = d_model, True
        self.layers = nn.ModuleList([ToyBlock()])

    def forward(self, x: Tensor, mask: Tensor | None = None, state: object = None) -> Out:
        for layer in self.layers:
            x = layer(x)
        return Out(x)
'''

CHECK = """
import json, sys
import megalab.models as models

models.__path__.append(sys.argv[1])  # a second folder of model packages, as a new one would be
lazy = not any(m.startswith("megalab.models.toy") for m in sys.modules)
from megalab.models import ToyBackbone, ToyBlock, block_classes
import hydra

print(json.dumps({
    "lazy": lazy,
    "module": ToyBackbone.__module__,
    "block_found": ToyBlock in block_classes(),
    "fsdp_unit": ToyBlock in hydra.utils.instantiate({"_target_": "megalab.models.block_classes"}),
    "in_all": "ToyBackbone" in models.__all__ and "ToyBlock" in models.__all__,
    "in_dir": "ToyBackbone" in dir(models),
    "output": ToyBackbone()(__import__("torch").ones(1, 2, 4)).y.sum().item(),
}))
"""


def test_a_new_model_folder_is_found_without_editing_megalab_models(tmp_path: Path) -> None:
    package = tmp_path / "toy_discovered"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent(TOY_INIT))
    (package / "model.py").write_text(textwrap.dedent(TOY_MODEL))
    (tmp_path / "not_a_package").mkdir()  # a folder without __init__.py is not a model
    proc = run_cli("-c", CHECK, str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {
        "lazy": True,
        "module": "megalab.models.toy_discovered.model",
        "block_found": True,
        "fsdp_unit": True,
        "in_all": True,
        "in_dir": True,
        "output": 8.0,
    }


def test_importing_megalab_models_loads_no_model() -> None:
    proc = run_cli(
        "-c",
        "import sys, megalab.models as m; m.__all__; dir(m)\n"
        "print(sorted(k for k in sys.modules if k.startswith('megalab.models.')))",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]"


def test_every_model_package_is_exported_with_its_block() -> None:
    root = Path(models.__file__).parent
    packages = sorted(p.parent.name for p in root.glob("*/__init__.py"))
    assert {"mega", "megalodon", "s4d", "llama", "transformer"} <= set(packages)
    blocks = models.block_classes()
    for package in packages:
        exported = __import__(f"megalab.models.{package}", fromlist=["__all__"])
        for name in exported.__all__:
            assert getattr(models, name) is getattr(exported, name), name
            assert name in models.__all__ and name in dir(models)
        backbones = [
            c
            for c in map(exported.__getattribute__, exported.__all__)
            if isinstance(c, type) and issubclass(c, models.Backbone)
        ]
        for backbone in backbones:
            assert backbone.block_class is None or backbone.block_class in blocks, backbone
    assert models.MegaBlock in blocks and models.S4DBlock in blocks
    with pytest.raises(AttributeError, match="no attribute 'NoSuchModel'"):
        _ = models.NoSuchModel


def test_the_static_names_for_type_checkers_match_what_is_exported() -> None:
    """The `TYPE_CHECKING` imports (for IDEs; optional for a new model) name exported objects."""
    tree = ast.parse(Path(models.__file__).read_text())
    block = next(
        n for n in tree.body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
    )
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names:
            assert alias.asname == alias.name, "re-export as `import X as X`"
            module = __import__(node.module, fromlist=[alias.name])
            assert getattr(models, alias.name) is getattr(module, alias.name)


MODELS_PATH = list(models.__path__)


def _with_path(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    monkeypatch.setattr(models, "__path__", [*MODELS_PATH, str(folder)])
    models._model_packages.cache_clear()


def test_a_clash_or_a_missing_all_is_an_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    clash, unlisted = tmp_path / "clash", tmp_path / "unlisted"
    for folder in (clash, unlisted):
        (folder / "copy_of_mega").mkdir(parents=True)
    (clash / "copy_of_mega" / "__init__.py").write_text('__all__ = ["MegaBlock"]\n')
    (unlisted / "copy_of_mega" / "__init__.py").write_text("from megalab.models.mega import *\n")
    try:
        _with_path(monkeypatch, clash)
        with pytest.raises(ImportError, match="copy_of_mega both export 'MegaBlock'"):
            models.block_classes()
        _with_path(monkeypatch, unlisted)
        with pytest.raises(ImportError, match="literal `__all__"):
            _ = models.Mega
    finally:
        monkeypatch.undo()
        models._model_packages.cache_clear()
    assert models.Mega.__name__ == "Mega"
