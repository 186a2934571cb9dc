"""The encoder-decoders: incremental decoding == the full decoder pass, beam reordering of the
state, padding, parameter counts, their config dataclasses, and the authors' MT checkpoint names
onto ours."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from megalab.models.mega.convert import (
    convert_mega_translation,
    mega_translation_kwargs_from_fairseq,
)
from megalab.models.mega.translation import MegaEncoderDecoder, MegaEncoderDecoderConfig
from megalab.models.seq2seq import EncoderDecoder, EncoderDecoderConfig
from megalab.models.transformer.translation import (
    TransformerEncoderDecoder,
    TransformerEncoderDecoderConfig,
)
from megalab.nn.state import select_state
from megalab.utils.options import declared, option_rules

V, PAD, EOS = 40, 1, 2
TINY_MEGA = dict(d_model=16, encoder_layers=2, decoder_layers=2, z_dim=8, v_dim=32, ffn_dim=24,
                 ema_dim=4, max_source_positions=64, max_target_positions=64)  # fmt: skip
TINY_XFM = dict(d_model=16, num_heads=4, ffn_dim=32, encoder_layers=2, decoder_layers=2)


def tiny(kind: str, **kw) -> EncoderDecoder:
    """A float64 model with non-trivial weights (the authors' init makes gates ≈ 0.5, Q ≈ K ≈ 0)."""
    torch.manual_seed(0)
    if kind == "transformer":
        config: EncoderDecoderConfig = TransformerEncoderDecoderConfig(V, PAD, **TINY_XFM | kw)
    else:
        config = MegaEncoderDecoderConfig(V, PAD, **TINY_MEGA | kw)
    model = config.build().double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    src = torch.randint(4, V, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[1, 6:] = False
    mask[2, 3:] = False
    src[~mask] = PAD
    tgt = torch.randint(4, V, (3, 7), generator=g)
    tgt[:, 0] = EOS
    return src, mask, tgt


MODELS = [
    pytest.param("mega", {}, id="mega-softmax"),
    pytest.param("mega", {"attention_activation": "laplace"}, id="mega-laplace"),
    pytest.param("mega", {"decoder_chunk_size": 3, "encoder_chunk_size": 4}, id="mega-chunked"),
    pytest.param("mega", {"prenorm": True, "rel_pos_bias": "rotary"}, id="mega-prenorm-rotary"),
    pytest.param("transformer", {}, id="transformer"),
]


@pytest.mark.parametrize(("kind", "kw"), MODELS)
def test_incremental_decoding_equals_the_full_decoder_pass(kind: str, kw: dict) -> None:
    model = tiny(kind, **kw)
    src, mask, tgt = batch()
    with torch.no_grad():
        enc = model.encode(src, mask)
        full = model.decode(tgt, None, enc)
        state = model.initial_state(enc)
        steps = []
        for t in range(tgt.shape[1]):
            logits, state = model.step(tgt[:, t : t + 1], state)
            steps.append(logits)
        assert torch.allclose(torch.cat(steps, 1), full, atol=1e-12, rtol=0)
        # Several tokens per call continue the same streams.
        state = model.initial_state(enc)
        a, state = model.step(tgt[:, :3], state)
        b, state = model.step(tgt[:, 3:], state)
        assert torch.allclose(torch.cat([a, b], 1), full, atol=1e-12, rtol=0)


@pytest.mark.parametrize(("kind", "kw"), MODELS)
def test_select_state_reorders_streams_like_beam_search(kind: str, kw: dict) -> None:
    """Reordering the encoder output and the decoder state mid-stream == decoding the
    reordered batch from the start (what beam search relies on)."""
    model = tiny(kind, **kw)
    src, mask, tgt = batch()
    order = torch.tensor([2, 0, 0, 1])
    with torch.no_grad():
        state = model.initial_state(model.encode(src, mask))
        _, state = model.step(tgt[:, :4], state)
        state = select_state(state, order)
        resumed, _ = model.step(tgt[order, 4:], state)
        fresh, _ = model.step(
            tgt[order], model.initial_state(model.encode(src[order], mask[order]))
        )
    assert torch.allclose(resumed, fresh[:, 4:], atol=1e-12, rtol=0)


@pytest.mark.parametrize(("kind", "kw"), MODELS[:1] + MODELS[-1:])
def test_right_padding_changes_nothing_and_padded_targets_are_not_seen(kind: str, kw: dict) -> None:
    model = tiny(kind, **kw)
    src, mask, tgt = batch()
    tmask = torch.ones_like(tgt, dtype=torch.bool)
    tmask[2, 4:] = False
    with torch.no_grad():
        out = model(src, mask, tgt.masked_fill(~tmask, PAD), tmask)
        alone = model(src[2:3, :3], None, tgt[2:3, :4])
    assert torch.allclose(out[2:3, :4], alone, atol=1e-12, rtol=0)


def test_left_padded_sources_shift_the_mega_cross_attention_bias() -> None:
    """As the authors' code (fairseq pads sources on the left): positions are tensor indices,
    so a left-padded source sees a shifted cross-attention bias; the Transformer's positions
    count from the first real token and do not move."""
    src, mask, tgt = batch()
    left, lmask = torch.full_like(src, PAD), torch.zeros_like(mask)
    for b in range(src.shape[0]):
        n = int(mask[b].sum())
        left[b, src.shape[1] - n :], lmask[b, src.shape[1] - n :] = src[b, :n], True
    with torch.no_grad():
        xfm = tiny("transformer")
        assert torch.allclose(xfm(src, mask, tgt), xfm(left, lmask, tgt), atol=1e-12, rtol=0)
        mega = tiny("mega")
        right_out, left_out = mega(src, mask, tgt), mega(left, lmask, tgt)
    assert torch.allclose(right_out[0], left_out[0], atol=1e-12, rtol=0)  # unpadded: same
    assert not torch.allclose(right_out[2], left_out[2], atol=1e-6)


def test_too_long_inputs_fail_with_the_limit_named() -> None:
    model = tiny("mega")
    src, mask, _ = batch()
    with pytest.raises(ValueError, match="max_source_positions=64"):
        model.encode(torch.full((1, 65), 5), None)
    state = model.initial_state(model.encode(src, mask))
    with pytest.raises(ValueError, match="max_target_positions=64"):
        model.step(torch.full((3, 65), 5), state)


def mega_formula(V: int, d: int, z: int, v: int, F: int, h: int, M: int, layers: int) -> int:
    """docs/reference/mega-paper.md §7: per-layer parameters of Mega, plus the MT decoder's gated
    cross-attention (q_proj d→2d+z, k_proj d→z, v_proj d→d, h_proj d→d, a norm, a bias table),
    and one shared (V, d) embedding."""

    def maga(d_prime: int) -> int:
        ema = 4 * d_prime * h + d
        return ema + (d * v + v) + (d * (z + v + 2 * d) + z + v + 2 * d) + (v * d + d) + 4 * z \
            + (2 * M - 1) + 2 * d  # fmt: skip

    ffn = 2 * d * F + F + d + 2 * d
    cross = (d * (2 * d + z) + 2 * d + z) + (d * z + z) + 2 * (d * d + d) + 2 * d + (2 * M - 1)
    return V * d + layers * (maga(2 * d) + ffn) + layers * (maga(d) + ffn + cross)


def test_parameter_counts_mega_wmt_en_de_and_big() -> None:
    """mega_wmt_en_de with the 33,000-word joint dictionary (--nwordssrc 33000): 63.26M, the
    notes' ≈63M; the paper's Table 10 says 67M for a dictionary size it does not give (67M
    would need about 40K words). mega_wmt_en_de_big: d 1024, z 256, v = d_FFN 2048."""
    base = MegaEncoderDecoder(MegaEncoderDecoderConfig(33000, PAD))
    n = sum(p.numel() for p in base.parameters())
    assert n == mega_formula(33000, 512, 128, 1024, 1024, 16, 1024, 6) == 63_255_534
    big = MegaEncoderDecoderConfig(33000, PAD, d_model=1024, z_dim=256, v_dim=2048,
                                   ffn_dim=2048).build()  # fmt: skip
    n_big = sum(p.numel() for p in big.parameters())
    assert n_big == mega_formula(33000, 1024, 256, 2048, 2048, 16, 1024, 6)


def test_parameter_count_transformer_base() -> None:
    """Transformer-base with one shared 33,000-word table: 61.03M (Table 10 says 65M, the
    Vaswani et al. figure for their 37K vocabulary)."""
    model = TransformerEncoderDecoder(TransformerEncoderDecoderConfig(33000, PAD))
    d, F, L = 512, 2048, 6
    attn, ffn, ln = 4 * (d * d + d), 2 * d * F + F + d, 2 * d
    expected = 33000 * d + L * (attn + ffn + 2 * ln) + L * (2 * attn + ffn + 3 * ln)
    assert sum(p.numel() for p in model.parameters()) == expected == 61_034_496


def authors_state_dict(V: int, d: int, z: int, v: int, F: int, h: int, M: int, layers: int):
    """Random tensors under the names and shapes of the authors' `MegaModel` (post-norm,
    simple bias, shared embeddings), from the code's module structure."""
    g = torch.Generator().manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    def maga(prefix: str, d_prime: int) -> dict:
        return {
            f"{prefix}move.delta": t(d_prime, h, 1),
            f"{prefix}move.alpha": t(d_prime, h, 1),
            f"{prefix}move.beta": t(d_prime, h, 1),
            f"{prefix}move.gamma": t(d_prime, h),
            f"{prefix}move.omega": t(d),
            f"{prefix}v_proj.weight": t(v, d),
            f"{prefix}v_proj.bias": t(v),
            f"{prefix}mx_proj.weight": t(z + v + 2 * d, d),
            f"{prefix}mx_proj.bias": t(z + v + 2 * d),
            f"{prefix}h_proj.weight": t(d, v),
            f"{prefix}h_proj.bias": t(d),
            f"{prefix}gamma": t(2, z),
            f"{prefix}beta": t(2, z),
            f"{prefix}norm.norm.weight": t(d),
            f"{prefix}norm.norm.bias": t(d),
            f"{prefix}rel_pos_bias.rel_pos_bias": t(2 * M - 1),
        }

    def nffn(prefix: str) -> dict:
        return {
            f"{prefix}fc1.weight": t(F, d),
            f"{prefix}fc1.bias": t(F),
            f"{prefix}fc2.weight": t(d, F),
            f"{prefix}fc2.bias": t(d),
            f"{prefix}norm.norm.weight": t(d),
            f"{prefix}norm.norm.bias": t(d),
        }

    embed = t(V, d)
    sd = {
        "encoder.version": torch.tensor([3.0]),
        "decoder.version": torch.tensor([3.0]),
        "encoder.embed_tokens.weight": embed,
        "decoder.embed_tokens.weight": embed,
        "decoder.output_projection.weight": embed,
    }
    for i in range(layers):
        sd.update(maga(f"encoder.layers.{i}.mega_layer.", 2 * d))
        sd.update(nffn(f"encoder.layers.{i}.nffn."))
        sd.update(maga(f"decoder.layers.{i}.mega_layer.", d))
        sd.update(nffn(f"decoder.layers.{i}.nffn."))
        c = f"decoder.layers.{i}.cross_attn."
        sd.update({
            c + "k_proj.weight": t(z, d), c + "k_proj.bias": t(z),
            c + "v_proj.weight": t(d, d), c + "v_proj.bias": t(d),
            c + "q_proj.weight": t(2 * d + z, d), c + "q_proj.bias": t(2 * d + z),
            c + "h_proj.weight": t(d, d), c + "h_proj.bias": t(d),
            c + "norm.norm.weight": t(d), c + "norm.norm.bias": t(d),
            c + "rel_pos_bias.rel_pos_bias": t(2 * M - 1),
        })  # fmt: skip
    return sd


def test_authors_mt_checkpoint_loads_strictly() -> None:
    sd = authors_state_dict(V, 16, 8, 32, 24, 4, 64, 2)
    args = {
        "encoder_embed_dim": 16, "encoder_layers": 2, "decoder_layers": 2, "encoder_z_dim": 8,
        "encoder_hidden_dim": 32, "encoder_ffn_embed_dim": 24, "encoder_n_dim": 4,
        "encoder_chunk_size": -1, "truncation_length": 0, "attention_activation_fn": "softmax",
        "rel_pos_bias": "simple", "max_source_positions": 64, "max_target_positions": 64,
        "normalization_type": "layernorm", "normalize_before": False, "dropout": 0.15,
        "attention_dropout": 0.1, "hidden_dropout": 0.1, "activation_dropout": 0.1,
        "activation_fn": "silu", "share_all_embeddings": True,
    }  # fmt: skip
    kwargs = mega_translation_kwargs_from_fairseq(args)
    assert kwargs["truncation"] is None and kwargs["share_all_embeddings"]
    model = MegaEncoderDecoderConfig(V, PAD, **kwargs).build().double()
    converted = convert_mega_translation(sd)
    # The shared table appears under both embedding names; the tied output has no weight.
    model.load_state_dict(converted, strict=True)
    ours = dict(model.named_parameters())
    assert torch.equal(ours["embed_src.embedding.weight"], sd["encoder.embed_tokens.weight"])
    assert torch.equal(
        ours["decoder_layers.1.maga.ema.alpha"],
        sd["decoder.layers.1.mega_layer.move.delta"][..., 0],
    )
    assert torch.equal(
        ours["decoder_layers.0.cross_attn.rel_pos_bias.weight"],
        sd["decoder.layers.0.cross_attn.rel_pos_bias.rel_pos_bias"],
    )
    assert torch.equal(ours["encoder.layers.1.maga.kappa"], sd["encoder.layers.1.mega_layer.gamma"])
    sd["decoder.layers.0.cross_attn.unexpected"] = torch.zeros(1)
    with pytest.raises(KeyError, match="unexpected"):
        convert_mega_translation(sd)


# -- the config dataclasses -------------------------------------------------------------------
KINDS = [
    pytest.param(MegaEncoderDecoder, MegaEncoderDecoderConfig, TINY_MEGA, id="mega"),
    pytest.param(TransformerEncoderDecoder, TransformerEncoderDecoderConfig, TINY_XFM,
                 id="transformer"),
]  # fmt: skip
# The keyword arguments of the constructors before they took their config object: what
# checkpoints written then store by name (`seq2seq_model.config`).
KEYWORD_ARGUMENTS = {
    MegaEncoderDecoder: [
        "vocab_size", "pad_id", "d_model", "encoder_layers", "decoder_layers", "z_dim", "v_dim",
        "ffn_dim", "ema_dim", "encoder_chunk_size", "decoder_chunk_size", "truncation",
        "attention_activation", "rel_pos_bias", "max_source_positions", "max_target_positions",
        "norm_type", "prenorm", "dropout", "attention_dropout", "hidden_dropout",
        "activation_dropout", "activation", "share_all_embeddings",
        "share_decoder_input_output_embed",
    ],
    TransformerEncoderDecoder: [
        "vocab_size", "pad_id", "d_model", "num_heads", "ffn_dim", "encoder_layers",
        "decoder_layers", "dropout", "attention_dropout", "activation_dropout", "activation",
        "prenorm", "max_source_positions", "max_target_positions", "share_all_embeddings",
    ],
}  # fmt: skip


@pytest.mark.parametrize(("model_class", "config_class", "small"), KINDS)
def test_every_option_is_declared_with_a_meaning_and_a_schema_rule(
    model_class: type, config_class: type, small: dict
) -> None:
    undocumented = [k for k, (_, s) in declared(config_class).items() if s is None or not s.doc]
    assert not undocumented
    rules = option_rules(config_class)
    for options in (config_class(V, PAD).options(), config_class(V, PAD, **small).options()):
        assert [k for k, v in options.items() if not rules[k].check(v)] == []


@pytest.mark.parametrize(("model_class", "config_class", "small"), KINDS)
def test_a_model_takes_its_config_keeps_it_and_reads_its_sizes_from_it(
    model_class: type[EncoderDecoder], config_class: type, small: dict
) -> None:
    assert list(inspect.signature(model_class.__init__).parameters) == ["self", "config"]
    assert model_class.config_class() is config_class
    config = config_class(V, PAD, **small)
    model = config.build()
    assert type(model) is model_class and model.config is config
    sizes = (model.vocab_size, model.pad_id, model.d_model, model.max_source_len,
             model.max_target_len)  # fmt: skip
    assert sizes == (V, PAD, small["d_model"], config.max_source_positions,
                     config.max_target_positions)  # fmt: skip
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.dropout = 0.3
    with pytest.raises(TypeError):
        config_class(pad_id=PAD)  # the vocabulary has no default


@pytest.mark.parametrize(("model_class", "config_class", "small"), KINDS)
def test_options_stored_as_the_old_keyword_arguments_build_the_same_model(
    model_class: type[EncoderDecoder], config_class: type, small: dict
) -> None:
    """The config's fields are the constructor's former keyword arguments, by name, so the
    options a checkpoint stored then build the same model, to the last weight and output."""
    config = config_class(V, PAD, **small)
    assert sorted(config.options()) == sorted(KEYWORD_ARGUMENTS[model_class])
    torch.manual_seed(0)
    model = config.build().eval()
    old = {k: getattr(config, k) for k in KEYWORD_ARGUMENTS[model_class]}
    torch.manual_seed(0)
    rebuilt = model_class.from_options(old).eval()
    assert rebuilt.config == config
    for (name, a), (other, b) in zip(model.state_dict().items(), rebuilt.state_dict().items(),
                                     strict=True):  # fmt: skip
        assert name == other and torch.equal(a, b), name
    src, mask, tgt = batch()
    with torch.no_grad():
        assert torch.equal(model(src, mask, tgt), rebuilt(src, mask, tgt))
    with pytest.raises(TypeError, match="unknown"):
        model_class.from_options({**old, "unknown": 1})


@pytest.mark.parametrize(
    ("config_class", "change", "message"),
    [
        (MegaEncoderDecoderConfig, {"pad_id": V}, "pad_id must be an id of the vocabulary"),
        (MegaEncoderDecoderConfig, {"encoder_chunk_size": 0},
         r"encoder_chunk_size must be >= 1, or -1 \(no chunking\), got 0"),
        (MegaEncoderDecoderConfig, {"hidden_dropout": 1.0}, r"hidden_dropout must be in \[0, 1\)"),
        (MegaEncoderDecoderConfig, {"ema_dim": -1}, "ema_dim must be >= 0"),
        (TransformerEncoderDecoderConfig, {"num_heads": 3}, "not divisible by num_heads=3"),
        (TransformerEncoderDecoderConfig, {"decoder_layers": 0}, "decoder_layers must be >= 1"),
        (TransformerEncoderDecoderConfig, {"dropout": -0.1}, r"dropout must be in \[0, 1\)"),
    ],
)  # fmt: skip
def test_a_config_refuses_an_option_out_of_range_by_name(
    config_class: type, change: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        config_class(**{"vocab_size": V, "pad_id": PAD, **change})


@pytest.mark.parametrize("name", ["mega", "transformer"])
def test_the_model_configs_target_the_config_classes_with_their_fields(name: str) -> None:
    from omegaconf import OmegaConf

    from megalab.utils.paths import CONFIG_DIR
    from megalab.utils.safe_config import megalab_object

    yaml = OmegaConf.load(CONFIG_DIR / "model" / "seq2seq" / f"{name}.yaml")
    node = OmegaConf.to_container(yaml.encoder_decoder, resolve=False)
    assert isinstance(node, dict)
    config_class = megalab_object(node["_target_"])
    assert config_class in (MegaEncoderDecoderConfig, TransformerEncoderDecoderConfig)
    assert sorted(k for k in node if k != "_target_") == sorted(declared(config_class))
    defaults = config_class(V, PAD).options()
    data = ("_target_", "vocab_size", "pad_id", "d_model")  # the target and interpolations
    shipped = {k: v for k, v in node.items() if k not in data}
    assert shipped == {k: defaults[k] for k in shipped}  # the YAML repeats the defaults
