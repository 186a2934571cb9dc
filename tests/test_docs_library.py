"""docs/library.md runs as written: its Python snippets, in order, in one session.

Each snippet's output is checked against the "prints `...`" sentence after it. A snippet that
cannot run here (a file that is not shipped) carries a `<!-- not run: reason -->` note right
above it, and the test checks the note is there instead of running it.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

from conftest import ROOT
from megalab.export import export_run
from test_export import LM, SMALL, _fake_run

DOC = ROOT / "docs" / "library.md"
BLOCK = re.compile(r"(<!-- not run: (?P<why>[^>]+) -->\n)?```python\n(?P<code>.*?)```\n"
                   r"(?P<after>(?:(?!```|<!--).)*)", re.S)  # fmt: skip


def snippets() -> list[tuple[str, str | None, str | None]]:
    """(code, reason it is not run, what it prints) of every Python block, in order."""
    out = []
    for m in BLOCK.finditer(DOC.read_text(encoding="utf-8")):
        prints = re.search(r"prints `([^`]+)`", m.group("after").split("\n\n")[0])
        out.append((m.group("code"), m.group("why"), prints.group(1) if prints else None))
    return out


def test_every_snippet_of_the_library_guide_runs(compose_cfg, tmp_path: Path) -> None:
    blocks = snippets()
    assert len(blocks) >= 6
    cfg = compose_cfg("model=mega", *SMALL, *LM, "model.backbone.causal=true")
    _fake_run(cfg, tmp_path / "run")
    namespace = {"export_folder": str(export_run(tmp_path / "run", tmp_path / "export", "last"))}
    checked = 0
    for code, why, expected in blocks:
        if why is not None:
            assert why.strip(), "a snippet that is not run says why"
            continue
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            exec(compile(code, str(DOC), "exec"), namespace)
        if expected is not None:
            assert expected in buffer.getvalue(), (code, buffer.getvalue())
            checked += 1
    assert checked == sum(why is None for _, why, _ in blocks) >= 6, "every run snippet prints"


def test_public_names_resolve_with_a_docstring() -> None:
    import inspect

    import megalab
    import megalab.models as models

    for name in models.__all__:
        obj = getattr(models, name)
        assert inspect.getdoc(obj), f"megalab.models.{name} has no docstring"
    assert inspect.getdoc(megalab.from_pretrained)
    hints = inspect.signature(models.from_preset).parameters
    assert all(p.annotation is not inspect.Parameter.empty for p in hints.values())


def test_from_preset_names_what_exists() -> None:
    import pytest

    from megalab.models import from_preset

    with pytest.raises(ValueError, match="megalodon/mega200M"):
        from_preset("megalodon/no_such")
    with pytest.raises(ValueError, match="no option 'chunk'"):
        from_preset("mega", chunk=4)
