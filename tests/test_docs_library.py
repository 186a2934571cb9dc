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
    for builder in (models.from_preset, models.encoder_decoder_from_preset):
        hints = inspect.signature(builder).parameters
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


def test_encoder_decoder_presets_build_and_say_which_builder_fits() -> None:
    """from_preset refused the translation presets with no way to build them from Python."""
    import pytest
    import torch

    from megalab.models import encoder_decoder_from_preset, from_preset
    from megalab.models.seq2seq import EncoderDecoder

    small = {"d_model": 32, "encoder_layers": 1, "decoder_layers": 1}
    for name, sizes in (
        ("seq2seq/mega", {"z_dim": 8, "v_dim": 32, "ffn_dim": 32}),
        ("seq2seq/transformer", {"ffn_dim": 32, "num_heads": 4}),
    ):
        model = encoder_decoder_from_preset(name, data={"vocab_size": 50}, **small, **sizes)
        assert isinstance(model, EncoderDecoder) and model.vocab_size == 50
        src, tgt = torch.randint(4, 50, (2, 7)), torch.randint(4, 50, (2, 5))
        assert model(src, None, tgt).shape == (2, 5, 50)
    with pytest.raises(
        ValueError, match=r"vocab_size comes from the dataset .* data=\{'vocab_size'"
    ):
        encoder_decoder_from_preset("seq2seq/mega")
    with pytest.raises(
        ValueError,
        match=r"is an encoder-decoder, not a backbone: build it with "
        r"encoder_decoder_from_preset\('seq2seq/mega', \.\.\.\)",
    ):
        from_preset("seq2seq/mega")
    with pytest.raises(
        ValueError,
        match=r"is a backbone, not an encoder-decoder: build it with from_preset\(.mega., \.\.\.\)",
    ):
        encoder_decoder_from_preset("mega")
    with pytest.raises(ValueError, match=r"the shipped ones are \['seq2seq/mega', 'seq2seq/"):
        encoder_decoder_from_preset("seq2seq/nope")
    with pytest.raises(ValueError, match="no option 'layers'"):
        encoder_decoder_from_preset("seq2seq/mega", data={"vocab_size": 50}, layers=2)
