"""The library's public names, as docs/library.md presents them.

The guide's snippets run with every other code block of the documentation
(tests/test_docs_commands.py); these tests check what the guide states about the names.
"""

from __future__ import annotations


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
    # A preset whose option comes from a dataset says what to give, instead of failing in a
    # layer that compared None with a number.
    with pytest.raises(
        ValueError,
        match=r"mega: max_positions comes from the dataset .* "
        r"data=\{'max_len': \.\.\.\} or max_positions=",
    ):
        from_preset("mega")
    assert from_preset("mega", data={"max_len": 64}).config.max_positions == 64
    # A config check is the preset's one message, not Hydra's instantiation error around it.
    with pytest.raises(ValueError, match=r"^llama_100m: d_model=32 must be a positive multiple"):
        from_preset("llama_100m", d_model=32)
