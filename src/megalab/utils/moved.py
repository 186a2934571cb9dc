"""Modules that moved, still importable under their old names with a deprecation warning.

Each model now lives in one folder (`megalab.models.<model>`: its config, blocks, backbone,
converter and model-only layers), so modules moved. Code and configs written against the old
names keep working for now: `import megalab.nn.sma`, a config's
`_target_: megalab.models.mega_translation.MegaEncoderDecoder`, `python -m
megalab.convert.llama` and a checkpoint's carried state saved as `megalab.models.mega:MegaState`
all reach the new module, and the first three warn once (`FutureWarning`) with the new name.
The import hook is installed by `import megalab`; it imports only modules named in `MOVED`.
(A config that names a backbone class with its options beside it, from before backbones took
their config object, is read as the config class: `megalab.utils.safe_config`.)
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import CodeType, ModuleType

#: old module -> the module it is now.
MOVED: dict[str, str] = {
    "megalab.convert": "megalab.models",
    "megalab.convert.common": "megalab.models.convert",
    "megalab.convert.lamemo": "megalab.models.lamemo.convert",
    "megalab.convert.llama": "megalab.models.llama.convert",
    "megalab.convert.mega": "megalab.models.mega.convert",
    "megalab.convert.mega_args": "megalab.models.mega.convert_args",
    "megalab.convert.megalodon": "megalab.models.megalodon.convert",
    "megalab.convert.seqboat": "megalab.models.seqboat.convert",
    "megalab.convert.transformer_xl": "megalab.models.transformer_xl.convert",
    "megalab.models.mega_translation": "megalab.models.mega.translation",
    "megalab.models.state": "megalab.nn.state",
    "megalab.models.transformer_translation": "megalab.models.transformer.translation",
    "megalab.nn.attention_functions": "megalab.kernels.attention_functions",
    # named apart from the checkpoint files (megalab.utils.checkpointing)
    "megalab.nn.checkpoint": "megalab.nn.activation_checkpoint",
    "megalab.nn.cema": "megalab.models.megalodon.cema",
    "megalab.nn.cross_attention": "megalab.models.mega.cross_attention",
    "megalab.nn.normalized_attention": "megalab.models.megalodon.normalized_attention",
    "megalab.nn.relative_memory": "megalab.models.transformer_xl.memory",
    "megalab.nn.sma": "megalab.models.seqboat.sma",
    "megalab.nn.sma_routing": "megalab.models.seqboat.sma_routing",
    "megalab.nn.timestep_norm": "megalab.models.megalodon.timestep_norm",
}
#: Old packages with no module of their own now: an empty stand-in holds their old submodules.
PACKAGES_GONE = frozenset({"megalab.convert"})
#: Modules that became packages: a saved state's "module:qualname" names the old module.
BECAME_PACKAGES: dict[str, str] = {
    f"megalab.models.{name}": f"megalab.models.{name}.model"
    for name in ("lamemo", "llama", "mega", "megalodon", "seqboat", "transformer", "transformer_xl")
}


def current_module(name: str) -> str:
    """The module `name` is now (itself if it did not move)."""
    return MOVED.get(name) or BECAME_PACKAGES.get(name) or name


def _message(old: str, new: str) -> str:
    return f"{old} moved to {new}; the old name will be removed in a future release"


class _AliasLoader(importlib.abc.Loader):
    """Loads an old name as the module it became (the same module object, not a copy)."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        if self.old in PACKAGES_GONE:  # its submodules warn when imported
            return ModuleType(self.old, f"Deprecated: moved to {self.new}.")
        warnings.warn(_message(self.old, self.new), FutureWarning, stacklevel=2)
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        if self.old not in PACKAGES_GONE:
            module.__spec__ = self.spec  # importlib set the alias's spec; keep the module's own

    def get_code(self, fullname: str) -> CodeType | None:
        """The new module's code, for `python -m <old name>` (runpy asks for it)."""
        print(f"note: {_message(self.old, self.new)}", file=sys.stderr)
        spec = importlib.util.find_spec(self.new)
        loader = spec.loader if spec is not None else None
        get_code = getattr(loader, "get_code", None)
        return get_code(self.new) if get_code is not None else None

    def is_package(self, fullname: str) -> bool:
        return False


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        spec = importlib.machinery.ModuleSpec(fullname, _AliasLoader(fullname, new))
        if fullname in PACKAGES_GONE:
            spec.submodule_search_locations = []  # its old submodules resolve through MOVED only
        return spec


def install() -> None:
    """Put the old names' finder on `sys.meta_path` (once)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())  # it answers only the names in MOVED
