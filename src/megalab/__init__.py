"""megalab: long-sequence models of the Mega family, exact and tested."""

from __future__ import annotations

from typing import Any

from megalab.utils.moved import install as _install_moved
from megalab.version import __version__ as __version__

_install_moved()  # old module names of code that moved still import, with a warning


def from_pretrained(name_or_path: str, revision: str | None = None) -> Any:
    """Load a model `megalab-export` wrote, from a folder or a Hub id (`megalab.pretrained`)."""
    from megalab.pretrained import from_pretrained as load

    return load(name_or_path, revision=revision)


def text_codec(name_or_path: str, revision: str | None = None) -> Any:
    """The text codec of a model `megalab-export` wrote: prompts to its token ids, ids to text
    (`megalab.pretrained.text_codec`)."""
    from megalab.pretrained import text_codec as load

    return load(name_or_path, revision=revision)
