"""Hugging Face Llama checkpoints to megalab and back, on a tiny random model written here.

`transformers` is an optional extra (`megalab[hf]`): the test writes a random
`LlamaForCausalLM` with it, converts the folder to a megalab run, compares the logits with
transformers' own forward pass, converts back and has transformers load the result.
"""

from __future__ import annotations

import json
from pathlib import Path

import hydra
import pytest
import torch
from omegaconf import OmegaConf

from megalab.models.llama.convert import (
    from_hf_state_dict,
    hf_to_run,
    llama_kwargs_from_hf,
    load_hf_llama,
    run_to_hf,
    to_hf_state_dict,
)

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face round trip needs transformers: pip install megalab[hf]"
)


def tiny_hf_llama(folder: Path, tied: bool, kv_heads: int = 2, seed: int = 0):
    """A random LlamaForCausalLM (weights perturbed away from the init) saved to `folder`."""
    config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        rms_norm_eps=1e-6,
        rope_theta=5000.0,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True)
    return model


def load_task(ckpt: Path):
    cfg = OmegaConf.load(ckpt.parent.parent / ".hydra" / "config.yaml")
    task = hydra.utils.instantiate(cfg.task)
    task.load_state_dict(torch.load(ckpt, weights_only=True)["state_dict"])
    return task.eval(), cfg


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_round_trip_matches_transformers(tmp_path: Path, tied: bool) -> None:
    hf = tiny_hf_llama(tmp_path / "hf", tied)
    ckpt = hf_to_run(tmp_path / "hf", tmp_path / "run", data="pg19")
    task, cfg = load_task(ckpt)
    assert cfg.task.tie_weights is tied and cfg.model.backbone.num_kv_heads == 2
    assert task.backbone.config.hidden_dim == 40 and task.backbone.config.rope_base == 5000.0

    tokens = torch.randint(0, 97, (2, 23), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(tokens).logits
        ours = task.head.proj(task(tokens).y)
    # transformers computes the RoPE angles in float32 whatever the dtype; so do we here.
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)

    back = run_to_hf(ckpt, tmp_path / "hf_back")
    config = json.loads((back / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and config["tie_word_embeddings"] is tied
    reloaded = transformers.LlamaForCausalLM.from_pretrained(back).eval()
    original = hf.state_dict()
    for name, value in reloaded.state_dict().items():
        torch.testing.assert_close(value, original[name], rtol=0, atol=0, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, ref, rtol=0, atol=0)


def test_eval_tests_a_converted_checkpoint(compose_cfg, fixture_data_dir: Path, tmp_path: Path):
    """`megalab-eval ckpt_path=<from-hf run>/checkpoints/hf.ckpt` (docs/long_context.md)
    tests the converted model: the checkpoint is a verified Lightning checkpoint."""
    from megalab.cli.eval import evaluate, merge_run_config
    from megalab.utils.checkpointing import verify_checkpoint

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    lm = ["data.max_len=64", "data.eval_max_len=64", "data.sha256=null", "data.valid_size=3000",
          "data.test_size=3000", f"paths.data_dir={fixture_data_dir}"]  # fmt: skip
    ckpt = hf_to_run(tmp_path / "hf", tmp_path / "run", data="enwik8", overrides=lm)
    assert verify_checkpoint(ckpt)
    cfg = compose_cfg(f"ckpt_path={ckpt}", f"paths.output_dir={tmp_path / 'eval'}", config="eval")
    record = evaluate(merge_run_config(cfg, []))  # as megalab.cli.eval's main does
    assert record["metrics"]["test/loss"] > 0
    assert json.loads((tmp_path / "eval" / "eval_metrics.json").read_text())["metrics"]


def test_incremental_decoding_matches_transformers_generate(tmp_path: Path) -> None:
    """Greedy decoding with megalab's KV cache gives transformers' greedy tokens."""
    from megalab.generation.sampling import sample_tokens

    hf = tiny_hf_llama(tmp_path / "hf", tied=False, kv_heads=1, seed=4)
    task, _ = load_task(hf_to_run(tmp_path / "hf", tmp_path / "run"))
    prompt = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    ours = sample_tokens(task, prompt, max_new_tokens=12, temperature=0.0)
    assert ours.tolist() == ref[:, 9:].tolist()


def test_state_dict_names_map_both_ways(tmp_path: Path) -> None:
    tiny_hf_llama(tmp_path / "hf", tied=False)
    config, sd = load_hf_llama(tmp_path / "hf")
    ours = from_hf_state_dict(sd, tie_word_embeddings=False)
    assert "backbone.layers.1.ffn.fc3.weight" in ours and "head.proj.weight" in ours
    assert to_hf_state_dict(ours, tie_word_embeddings=False).keys() == sd.keys()
    kwargs = llama_kwargs_from_hf(config)
    assert kwargs["num_kv_heads"] == 2 and kwargs["norm_eps"] == 1e-6


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_scaling"),
        ({"attention_bias": True}, "biases"),
        ({"hidden_act": "gelu"}, "silu"),
        ({"model_type": "mistral"}, "not a Llama"),
    ],
)
def test_unsupported_configurations_are_refused(change: dict, message: str) -> None:
    config = {
        "model_type": "llama",
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_hidden_layers": 1,
        "intermediate_size": 40,
        **change,
    }
    with pytest.raises(ValueError, match=message):
        llama_kwargs_from_hf(config)
