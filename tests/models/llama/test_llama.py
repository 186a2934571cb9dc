"""Llama-2: parameter counts of the presets, its equations, grouped-query attention, errors.

The backbone contract (shapes, padding, causality, streaming, gradients, compile) runs over
configs/model/llama*.yaml in test_backbone_contract.py; the Hugging Face round trip is in
test_llama_hf.py.
"""

from __future__ import annotations

import math

import hydra
import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from megalab.models.llama.model import Llama, LlamaConfig, count_parameters, llama_ffn_dim
from megalab.tasks.language_modeling import LanguageModelingTask
from megalab.utils.paths import CONFIG_DIR

DT = torch.float64


def compose_model(name: str, vocab_size: int = 32_000, experiment: str | None = None):
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                *([f"experiment={experiment}"] if experiment else []),
                f"model={name}",
                "data=pg19",
                "task=language_modeling",
                "task.tie_weights=false",
                f"data.vocab_size={vocab_size}",
            ],
        )
    GlobalHydra.instance().clear()
    return cfg


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        # Llama-2-7B as released (Touvron et al. 2023; HF meta-llama/Llama-2-7b-hf).
        ("llama_7b", 6_738_415_616),
        # The sizes of Megalodon's mega1.3B (~1.34B) and mega200M (~0.22B) presets.
        ("llama_1_3b", 1_364_297_728),
        ("llama_200m", 219_702_272),
    ],
)
@pytest.mark.parametrize("experiment", [None, "llama/pg19", "llama/pg19_32k"])
def test_preset_parameter_counts_on_the_meta_device(
    name: str, expected: int, experiment: str | None
) -> None:
    """A preset's sizes win over an experiment's (docs/cluster.md: `experiment=llama/pg19
    model=llama_1_3b task.tie_weights=false` is the 1.36B model)."""
    cfg = compose_model(name, experiment=experiment)
    with torch.device("meta"):
        task = hydra.utils.instantiate(cfg.task)
    assert isinstance(task, LanguageModelingTask)
    total = sum(p.numel() for p in task.parameters())
    assert total == expected
    assert count_parameters(task.backbone.config, 32_000) == expected


def test_llama_pg19_experiment_is_its_100m_preset() -> None:
    """experiment=llama/pg19 takes its sizes from model=llama_100m: 109.5M with the tied head."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["experiment=llama/pg19"])
    GlobalHydra.instance().clear()
    assert (cfg.model.d_model, cfg.model.backbone.num_layers) == (768, 12)
    with torch.device("meta"):
        task = hydra.utils.instantiate(cfg.task)
    assert round(sum(p.numel() for p in task.parameters()) / 1e5) == 1095


def test_ffn_width_follows_metas_rule() -> None:
    assert llama_ffn_dim(4096) == 11_008  # Llama-2 7B
    assert llama_ffn_dim(5120) == 13_824  # Llama-2 13B
    assert llama_ffn_dim(8192, multiple_of=4096, multiplier=1.3) == 28_672  # Llama-2 70B


def test_block_is_the_llama_equations() -> None:
    """One layer, written out: pre-norm RMSNorm, RoPE on halves, causal softmax, SwiGLU."""
    torch.manual_seed(0)
    cfg = LlamaConfig(d_model=16, num_layers=1, num_heads=4, num_kv_heads=2, ffn_dim=24)
    model = Llama(cfg).to(DT)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    blk = model.layers[0]
    x = torch.randn(2, 7, 16, dtype=DT)

    def rms(t, w):
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    def rope(t):  # (B, L, H, d): pairs (j, j + d/2), angle p * 10000^(-2j/d)
        d = t.shape[-1]
        inv = 10000.0 ** (-torch.arange(0, d, 2, dtype=DT) / d)
        ang = torch.arange(t.shape[1], dtype=DT)[:, None] * inv
        cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]
        a, b = t[..., : d // 2], t[..., d // 2 :]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)

    h = rms(x, blk.input_norm.weight)
    q = rope((h @ blk.attn.q_proj.weight.T).view(2, 7, 4, 4))
    k = rope((h @ blk.attn.k_proj.weight.T).view(2, 7, 2, 4)).repeat_interleave(2, dim=2)
    v = (h @ blk.attn.v_proj.weight.T).view(2, 7, 2, 4).repeat_interleave(2, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(4)
    scores = scores.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), v).reshape(2, 7, 16)
    x1 = x + o @ blk.attn.o_proj.weight.T
    g = rms(x1, blk.ffn_norm.weight)
    ffn = (F.silu(g @ blk.ffn.fc1.weight.T) * (g @ blk.ffn.fc3.weight.T)) @ blk.ffn.fc2.weight.T
    expected = rms(x1 + ffn, model.final_norm.weight)
    with torch.no_grad():
        torch.testing.assert_close(model(x).y, expected, rtol=1e-12, atol=1e-12)


def test_grouped_query_attention_equals_repeated_heads() -> None:
    """num_kv_heads=2 of 4 is multi-head attention whose K/V projections repeat per group."""
    torch.manual_seed(1)
    gqa = (
        LlamaConfig(d_model=16, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=24)
        .build()
        .to(DT)
    )
    mha = LlamaConfig(d_model=16, num_layers=2, num_heads=4, ffn_dim=24).build().to(DT)
    state = gqa.state_dict()
    for name in list(state):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            w = state[name].view(2, 4, 16)  # (kv heads, head width, d)
            state[name] = w.repeat_interleave(2, dim=0).reshape(16, 16)
    mha.load_state_dict(state)
    x = torch.randn(2, 9, 16, dtype=DT)
    with torch.no_grad():
        torch.testing.assert_close(gqa(x).y, mha(x).y, rtol=1e-12, atol=1e-12)


def test_rope_base_changes_the_output() -> None:
    torch.manual_seed(2)
    a = LlamaConfig(d_model=16, num_layers=1, num_heads=2, ffn_dim=24).build().to(DT)
    b = (
        LlamaConfig(d_model=16, num_layers=1, num_heads=2, ffn_dim=24, rope_base=100_000.0)
        .build()
        .to(DT)
    )
    b.load_state_dict(a.state_dict())
    x = torch.randn(1, 12, 16, dtype=DT)
    with torch.no_grad():
        assert not torch.allclose(a(x).y, b(x).y)
        torch.testing.assert_close(a(x[:, :1]).y, b(x[:, :1]).y)  # position 0 is not rotated


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"d_model": 16, "num_heads": 3}, "multiple of num_heads"),
        ({"d_model": 12, "num_heads": 4}, "must be even"),
        ({"d_model": 16, "num_heads": 4, "num_kv_heads": 3}, "must divide num_heads"),
        ({"num_layers": 0}, "num_layers"),
    ],
)
def test_bad_configurations_fail_early(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LlamaConfig(**kwargs).build()


def test_an_encoder_refuses_to_stream() -> None:
    model = LlamaConfig(d_model=16, num_layers=1, num_heads=2, causal=False).build()
    x = torch.randn(1, 3, 16)
    with pytest.raises(ValueError, match="causal=True to stream"):
        model.initial_state(1, x)
