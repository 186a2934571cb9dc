"""Llama checkpoints in the Hugging Face format (`LlamaForCausalLM`) to and from megalab.

A Hugging Face Llama folder holds `config.json` and the weights (`model.safetensors`, sharded
`model-0000x-of-0000y.safetensors` with an index, or the older `pytorch_model*.bin`). Its
tensors map one to one onto a `LanguageModelingTask(SequenceEncoder, Llama, LinearLMHead)`:

    model.embed_tokens.weight                        encoder.embed.embedding.weight
    model.layers.{i}.input_layernorm.weight          backbone.layers.{i}.input_norm.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight backbone.layers.{i}.attn.{q,k,v,o}_proj.weight
    model.layers.{i}.post_attention_layernorm.weight backbone.layers.{i}.ffn_norm.weight
    model.layers.{i}.mlp.gate_proj.weight            backbone.layers.{i}.ffn.fc1.weight
    model.layers.{i}.mlp.up_proj.weight              backbone.layers.{i}.ffn.fc3.weight
    model.layers.{i}.mlp.down_proj.weight            backbone.layers.{i}.ffn.fc2.weight
    model.norm.weight                                backbone.final_norm.weight
    lm_head.weight                                   head.proj.weight (absent when tied)

No permutation is needed: megalab's Llama pairs RoPE channels by halves as Hugging Face does
(Meta's original checkpoints pair adjacent channels; their HF conversion permutes W_q and W_k,
so convert Meta's files with transformers' own script first). Configurations this
architecture does not have are refused: RoPE scaling (Llama 3.1's `rope_scaling`), attention
or MLP biases, an activation other than SiLU, a head width other than hidden/heads.

Command line (a megalab "run" folder works with `megalab-eval` and `megalab-generate`):

    python -m megalab.models.llama.convert from-hf <hf folder> <run folder> [--data pg19]
    python -m megalab.models.llama.convert to-hf <megalab checkpoint of a Llama run> <hf folder>

Weights are read with `safetensors` or `torch.load(weights_only=True)`: converting a downloaded
checkpoint runs no code. A megalab run folder is data too: `to-hf` reads its config and
checkpoint through the loading policy of `megalab.utils.safe_config` (safe YAML, only megalab's
classes built, the checkpoint's checksum verified) and copies its tokenizer only when it is a
Hugging Face `tokenizer.json`. `safetensors` comes with the `hf` extra
(`pip install megalab[hf]`).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from megalab.models.convert import load_checkpoint
from megalab.models.llama.model import LlamaConfig
from megalab.utils.errors import MissingExtraError

__all__ = [
    "from_hf_state_dict",
    "hf_config_from_llama",
    "llama_kwargs_from_hf",
    "load_hf_llama",
    "save_hf_llama",
    "to_hf_state_dict",
]

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_OURS_LAYER = re.compile(r"^backbone\.layers\.(\d+)\.(.+)$")
# Per-layer names: Hugging Face -> megalab (below `model.layers.{i}.` / `backbone.layers.{i}.`).
_LAYER_NAMES = {
    "input_layernorm.weight": "input_norm.weight",
    "self_attn.q_proj.weight": "attn.q_proj.weight",
    "self_attn.k_proj.weight": "attn.k_proj.weight",
    "self_attn.v_proj.weight": "attn.v_proj.weight",
    "self_attn.o_proj.weight": "attn.o_proj.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn.fc1.weight",
    "mlp.up_proj.weight": "ffn.fc3.weight",
    "mlp.down_proj.weight": "ffn.fc2.weight",
}
_OURS_NAMES = {v: k for k, v in _LAYER_NAMES.items()}
_TOP_NAMES = {
    "model.embed_tokens.weight": "encoder.embed.embedding.weight",
    "model.norm.weight": "backbone.final_norm.weight",
    "lm_head.weight": "head.proj.weight",
}
_OURS_TOP = {v: k for k, v in _TOP_NAMES.items()}


# ------------------------------------------------------------------------------------- configs
def llama_kwargs_from_hf(config: Mapping[str, Any]) -> dict[str, Any]:
    """`LlamaConfig` keyword arguments from a Hugging Face `config.json`; unsupported ones fail."""
    model_type = config.get("model_type", "llama")
    if model_type != "llama":
        raise ValueError(f"not a Llama checkpoint: model_type is {model_type!r}")
    problems = []
    # transformers >= 5 writes `rope_parameters`, earlier versions `rope_theta`/`rope_scaling`.
    rope = dict(config.get("rope_parameters") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if config.get("rope_scaling") or rope_type != "default":
        scaling = config.get("rope_scaling") or rope
        problems.append(f"rope_scaling={scaling!r} (only plain RoPE is built)")
    rope_base = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    if config.get("attention_bias") or config.get("mlp_bias"):
        problems.append("attention_bias/mlp_bias (Llama has no biases)")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={config['hidden_act']!r} (SwiGLU uses silu)")
    d, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = config.get("head_dim")
    if head_dim is not None and int(head_dim) * heads != d:
        problems.append(f"head_dim={head_dim} (megalab's Llama has head width hidden/heads)")
    if problems:
        raise ValueError("cannot convert this Llama configuration: " + "; ".join(problems))
    kv = config.get("num_key_value_heads")
    return {
        "d_model": d,
        "num_layers": int(config["num_hidden_layers"]),
        "num_heads": heads,
        "num_kv_heads": None if kv is None or int(kv) == heads else int(kv),
        "ffn_dim": int(config["intermediate_size"]),
        "rope_base": float(rope_base),
        "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "init_std": float(config.get("initializer_range", 0.02)),
        "attention_dropout": float(config.get("attention_dropout", 0.0)),
    }


def hf_config_from_llama(
    cfg: LlamaConfig, vocab_size: int, tie_word_embeddings: bool, dtype: str = "float32"
) -> dict[str, Any]:
    """A Hugging Face `config.json` (LlamaForCausalLM) for a megalab Llama."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab_size),
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_len or 4096,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_base,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base},
        "attention_bias": False,
        "attention_dropout": cfg.attention_dropout,
        "mlp_bias": False,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": bool(tie_word_embeddings),
        "torch_dtype": dtype,
        "use_cache": True,
    }


# ------------------------------------------------------------------------------- state dicts
def _renamed(
    sd: Mapping[str, Tensor],
    layer: re.Pattern[str],
    layer_names: Mapping[str, str],
    top_names: Mapping[str, str],
    layers_to: str,
    unknown: str,
) -> dict[str, Tensor]:
    """`sd` with each per-layer entry (`layer` gives its index and the rest of its name) moved
    to `layers_to{i}.{layer_names[rest]}` and each other entry to `top_names[name]`; a
    KeyError names the first entry in neither (`unknown`: what was expected, for the message)."""
    out: dict[str, Tensor] = {}
    for name, value in sd.items():
        m = layer.match(name)
        if m is not None and m.group(2) in layer_names:
            out[f"{layers_to}{m.group(1)}.{layer_names[m.group(2)]}"] = value
        elif m is None and name in top_names:
            out[top_names[name]] = value
        else:
            raise KeyError(f"unexpected entry {name!r}: {unknown}")
    return out


def from_hf_state_dict(sd: Mapping[str, Tensor], tie_word_embeddings: bool) -> dict[str, Tensor]:
    """A Hugging Face LlamaForCausalLM state dict -> the megalab language-model task's.

    With tied embeddings the head's weight is the embedding (both keys are returned, as a task
    built with `tie_weights=True` lists them). `rotary_emb.inv_freq`, a buffer older
    transformers versions saved, is dropped: it is recomputed from rope_theta.
    """
    kept = {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}
    out = _renamed(
        kept, _LAYER, _LAYER_NAMES, _TOP_NAMES, "backbone.layers.", "not a Llama checkpoint entry"
    )
    if tie_word_embeddings:
        out["head.proj.weight"] = out["encoder.embed.embedding.weight"]
    elif "head.proj.weight" not in out:
        raise KeyError("the checkpoint has no lm_head.weight but tie_word_embeddings is false")
    return out


def to_hf_state_dict(sd: Mapping[str, Tensor], tie_word_embeddings: bool) -> dict[str, Tensor]:
    """The megalab Llama language-model state dict -> Hugging Face LlamaForCausalLM names."""
    out = _renamed(
        sd,
        _OURS_LAYER,
        _OURS_NAMES,
        _OURS_TOP,
        "model.layers.",
        "not a Llama language model (SequenceEncoder token embedding, Llama backbone, "
        "LinearLMHead without bias)",
    )
    if tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


# ----------------------------------------------------------------------------------- files
def _safetensors() -> types.ModuleType:
    try:
        import safetensors.torch
    except ImportError:
        raise MissingExtraError(
            "reading and writing .safetensors files needs the safetensors package: "
            "pip install 'megalab[hf]'"
        ) from None
    return safetensors.torch


def _weight_files(folder: Path) -> list[Path]:
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = folder / index_name
        if index.exists():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [folder / n for n in names]
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (folder / single).exists():
            return [folder / single]
    raise FileNotFoundError(
        f"{folder}: no model.safetensors, pytorch_model.bin or their sharded index: not a "
        "Hugging Face checkpoint folder"
    )


def load_hf_llama(folder: str | Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(config.json as a dict, the Hugging Face state dict) of a Llama checkpoint folder."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{folder}: no config.json (not a Hugging Face model folder)")
    config = json.loads(config_path.read_text())
    sd: dict[str, Tensor] = {}
    for path in _weight_files(folder):
        if path.suffix == ".safetensors":
            sd.update(_safetensors().load_file(str(path)))
        else:
            sd.update(load_checkpoint(path))
    return config, sd


def save_hf_llama(
    folder: str | Path,
    sd: Mapping[str, Tensor],
    cfg: LlamaConfig,
    vocab_size: int,
    tie_word_embeddings: bool,
) -> Path:
    """Write a megalab Llama state dict as a Hugging Face folder (config.json,
    model.safetensors, generation_config.json); returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hf_sd = to_hf_state_dict(sd, tie_word_embeddings)
    dtype = str(hf_sd["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    config = hf_config_from_llama(cfg, vocab_size, tie_word_embeddings, dtype=dtype)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {k: v.detach().cpu().contiguous() for k, v in hf_sd.items()}
    _safetensors().save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": False}) + "\n")
    return folder


# ------------------------------------------------------------------------------ megalab runs
def _run_config(
    hf_config: Mapping[str, Any], data: str, overrides: Sequence[str], tokenizer: Path | None
) -> Any:
    """The composed megalab config of a language model with the checkpoint's architecture."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from megalab.utils.paths import CONFIG_DIR

    kwargs = llama_kwargs_from_hf(hf_config)
    tied = bool(hf_config.get("tie_word_embeddings", False))
    args = [
        "model=llama",
        f"data={data}",
        "task=language_modeling",
        f"model.d_model={kwargs['d_model']}",
        f"task.tie_weights={str(tied).lower()}",
        f"+task.head.init_std={kwargs['init_std']}",
        f"data.vocab_size={int(hf_config['vocab_size'])}",
    ]
    args += [f"model.backbone.{k}={'null' if v is None else v}" for k, v in kwargs.items()]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
            cfg = compose("train", overrides=[*args, *overrides])
    finally:
        GlobalHydra.instance().clear()
    if tokenizer is not None and "tokenizer" in cfg.data:
        cfg.data.tokenizer = str(tokenizer)
    return cfg


def hf_to_run(
    hf_folder: str | Path, run_dir: str | Path, data: str = "pg19", overrides: Sequence[str] = ()
) -> Path:
    """Write a Hugging Face Llama as a megalab run folder: `.hydra/config.yaml` (so
    `megalab-eval` and `megalab-generate` rebuild it) and `checkpoints/hf.ckpt`; returns the
    checkpoint path. The folder's `tokenizer.json`, if any, becomes the data's tokenizer."""
    import hydra
    import lightning
    from omegaconf import OmegaConf

    from megalab.utils.checkpointing import write_checkpoint

    hf_folder, run_dir = Path(hf_folder), Path(run_dir)
    config, hf_sd = load_hf_llama(hf_folder)
    tokenizer = hf_folder / "tokenizer.json"
    cfg = _run_config(config, data, overrides, tokenizer if tokenizer.exists() else None)
    task = hydra.utils.instantiate(cfg.task)
    tied = bool(config.get("tie_word_embeddings", False))
    task.load_state_dict(from_hf_state_dict(hf_sd, tied), strict=True)
    (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
    (run_dir / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    ckpt = run_dir / "checkpoints" / "hf.ckpt"
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    # A checkpoint as Lightning writes one at step 0 (its version key is what `trainer.test`
    # reads first), with megalab's checksum, so `megalab.eval` and resuming verify it.
    write_checkpoint(
        {
            "state_dict": task.state_dict(),
            "pytorch-lightning_version": lightning.__version__,
            "epoch": 0,
            "global_step": 0,
            "source": str(hf_folder),
        },
        ckpt,
    )
    return ckpt


def run_to_hf(ckpt_path: str | Path, hf_folder: str | Path) -> Path:
    """Write the Llama of a megalab checkpoint (in its run folder) as a Hugging Face folder."""
    import hydra
    from omegaconf import OmegaConf

    from megalab.utils.checkpointing import read_checkpoint
    from megalab.utils.run_folder import find_run_config
    from megalab.utils.safe_config import check_targets, load_run_config

    ckpt_path = Path(ckpt_path)
    run_cfg_path = find_run_config(ckpt_path)
    if run_cfg_path is None:
        raise FileNotFoundError(
            f"{ckpt_path}: no .hydra/config.yaml in the folders above it; converting needs the "
            "run's config (a checkpoint written by megalab-train or from-hf)"
        )
    cfg = load_run_config(run_cfg_path)  # the run folder is data: safe YAML, safe resolvers
    target = OmegaConf.select(cfg, "task.backbone._target_")
    if target != "megalab.models.llama.LlamaConfig":  # (an older run's Llama is read as it)
        raise ValueError(
            f"{ckpt_path}: the run's backbone is {target}, not a Llama: the Hugging Face "
            "transformers format holds Llamas only (megalab-export's default format, read by "
            "megalab.from_pretrained, holds any model)"
        )
    hint = "Convert only run folders written by megalab-train or from-hf"
    check_targets(cfg.task, f"{run_cfg_path} (task)", hint=hint)
    task = hydra.utils.instantiate(cfg.task)
    state = read_checkpoint(ckpt_path)["state_dict"]
    task.load_state_dict(state, strict=True)
    tied = bool(cfg.task.get("tie_weights", False))
    sd = {k: v for k, v in task.state_dict().items()}
    folder = save_hf_llama(
        hf_folder, sd, task.backbone.config, int(cfg.data.vocab_size), tie_word_embeddings=tied
    )
    tokenizer = OmegaConf.select(cfg, "data.tokenizer", default=None)
    if tokenizer and Path(str(tokenizer)).is_file() and _is_hf_tokenizer(Path(str(tokenizer))):
        shutil.copy(str(tokenizer), folder / "tokenizer.json")
    return folder


def _is_hf_tokenizer(path: Path) -> bool:
    """Whether `path` is a Hugging Face `tokenizer.json` (a JSON object with a `model`): a run
    config naming any other file does not get it copied into the published folder."""
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(spec, dict) and isinstance(spec.get("model"), dict)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megalab.models.llama.convert",
        description="Convert Llama checkpoints between the Hugging Face format and megalab.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_from = sub.add_parser("from-hf", help="a Hugging Face Llama folder -> a megalab run folder")
    p_from.add_argument("hf_folder", type=Path)
    p_from.add_argument("run_dir", type=Path)
    p_from.add_argument("--data", default="pg19", help="data config (its tokenizer is replaced "
                        "by the folder's tokenizer.json when there is one)")  # fmt: skip
    p_from.add_argument("overrides", nargs="*", help="extra Hydra overrides (key=value)")
    p_to = sub.add_parser("to-hf", help="a megalab Llama checkpoint -> a Hugging Face folder")
    p_to.add_argument("ckpt_path", type=Path)
    p_to.add_argument("hf_folder", type=Path)
    ns = parser.parse_args(argv)
    from megalab.utils.checkpointing import CheckpointError
    from megalab.utils.safe_config import UnsafeConfigError

    try:
        if ns.command == "from-hf":
            print(hf_to_run(ns.hf_folder, ns.run_dir, ns.data, ns.overrides))
        else:
            print(run_to_hf(ns.ckpt_path, ns.hf_folder))
    except (UnsafeConfigError, CheckpointError) as err:  # refused data: one message, no trace
        print(f"{parser.prog}: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
