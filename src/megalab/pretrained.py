"""Trained models people can share: the folders `megalab-export` writes, `megalab.from_pretrained`
loads.

An export is a folder of four kinds of file, none of them a pickle:

- `model.safetensors`: the trained task's weights (encoder, backbone and head);
- `config.json`: what builds the model again (the run's resolved `task` config, whose
  `_target_`s must be megalab's own classes), the data spec it was trained on, its text codec
  (`text`: bytes, an alphabet, words or a tokenizer, read with the files below), the command
  and the final metrics, with the megalab version;
- `tokenizer/`: the files that turn text into the data's token ids, where the data has any (PG-19's
  `tokenizer.json`, WikiText-103's `vocab.txt`, WMT'16's `bpe.json` and `dict.txt`);
- `README.md`: the model card (model, parameters, data, command, metrics, version, the paper).

`from_pretrained(path_or_hub_id)` loads such a folder (and `text_codec(path_or_hub_id)` its
text codec), locally or through `huggingface_hub`'s `snapshot_download` (offline it resolves a
Hub id from the local cache). A folder from a stranger is data: its config may build only
megalab's classes (`megalab.utils.safe_config`), may not interpolate (`${...}` could call a
resolver), and its weights are read by safetensors. `megalab-export --push-to-hub user/name`
uploads the folder with `huggingface_hub`; `--format hf` writes a Llama as a Hugging Face
`transformers` folder instead.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn

from megalab.data.vocabulary import run_vocabulary
from megalab.utils.errors import UserError
from megalab.version import __version__

if TYPE_CHECKING:
    from megalab.data.lm.codec import TextCodec

log = logging.getLogger(__name__)

FORMAT = "megalab"
FORMAT_VERSION = 1
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
CARD = "README.md"
TOKENIZER_DIR = "tokenizer"
DATA_SPEC_KEYS = ("vocab_size", "d_input", "num_classes", "max_len", "pad_id", "pairwise")

# The paper each backbone module comes from, for the model card's citation.
PAPERS: dict[str, str] = {
    "mega": "Ma et al. 2023, Mega: Moving Average Equipped Gated Attention (ICLR 2023)",
    "mega_translation": "Ma et al. 2023, Mega: Moving Average Equipped Gated Attention (ICLR 2023)",
    "seqboat": "Ren et al. 2023, Sparse Modular Activation for Efficient Sequence Modeling "
    "(NeurIPS 2023)",
    "megalodon": "Ma et al. 2024, Megalodon: Efficient LLM Pretraining and Inference with "
    "Unlimited Context Length",
    "lamemo": "Ji et al. 2022, LaMemo: Language Modeling with Look-Ahead Memory (NAACL 2022)",
    "transformer_xl": "Dai et al. 2019, Transformer-XL: Attentive Language Models Beyond a "
    "Fixed-Length Context (ACL 2019)",
    "llama": "Touvron et al. 2023, Llama 2: Open Foundation and Fine-Tuned Chat Models",
    "transformer": "Vaswani et al. 2017, Attention Is All You Need (NeurIPS 2017)",
    "transformer_translation": "Vaswani et al. 2017, Attention Is All You Need (NeurIPS 2017)",
}


class ExportError(UserError):
    """A run folder that cannot be exported, or an export that cannot be loaded."""


# ------------------------------------------------------------------------------------ reading
def run_config(run_dir: Path) -> DictConfig:
    """A run folder's saved config (read as `load_run_config` reads it: safe YAML and
    resolvers, old model targets upgraded), its task and data checked against the allow-list."""
    from megalab.utils.safe_config import check_targets, load_run_config

    for candidate in (run_dir / ".hydra" / "config.yaml", run_dir / "config.yaml"):
        if candidate.is_file():
            cfg = load_run_config(candidate)
            if "task" not in cfg:
                raise ExportError(f"{candidate} is not a megalab run config (no `task` group)")
            for key in ("task", "data"):
                node = cfg.get(key)
                if isinstance(node, DictConfig):
                    check_targets(node, f"{candidate} ({key})")
            return cfg
    raise ExportError(
        f"{run_dir} is not a megalab run folder: it has neither .hydra/config.yaml nor "
        "config.yaml (give the folder megalab-train wrote, logs/<task>/runs/<time>)"
    )


def checkpoint_path(run_dir: Path, which: str) -> Path:
    """`best` (the run's best checkpoint, as metrics.json records it), `last`, or a path."""
    if which == "last":
        path = run_dir / "checkpoints" / "last.ckpt"
    elif which == "best":
        recorded = _read_json(run_dir / "metrics.json").get("best_checkpoint")
        found = sorted(
            (run_dir / "checkpoints").glob("best-*.ckpt"), key=lambda p: p.stat().st_mtime
        )
        if recorded and (run_dir / "checkpoints" / Path(recorded).name).is_file():
            path = run_dir / "checkpoints" / Path(recorded).name
        elif found:
            path = found[-1]
        else:
            path = run_dir / "checkpoints" / "last.ckpt"
            log.warning("%s has no best checkpoint: exporting last.ckpt", run_dir)
    else:
        path = Path(which)
    if not path.is_file():
        raise ExportError(
            f"checkpoint not found: {path} (choose --checkpoint best, last or a .ckpt path)"
        )
    return path


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _backbone_family(task_cfg: Mapping[str, Any]) -> str | None:
    """The model module (`mega`, `megalodon`, ...) of the first megalab.models target."""
    stack: list[Any] = [task_cfg]
    while stack:
        node = stack.pop(0)
        if isinstance(node, Mapping):
            target = node.get("_target_")
            if isinstance(target, str) and target.startswith("megalab.models."):
                return target.split(".")[2]
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return None


# ------------------------------------------------------------------------------- the model
def _check_plain(node: Any, where: str) -> None:
    """Refuse interpolations: `${...}` in a shared config could call a resolver."""
    if isinstance(node, str) and "${" in node:
        raise ExportError(f"{where}: {node!r} is an interpolation; an export holds plain values")
    if isinstance(node, Mapping):
        for k, v in node.items():
            _check_plain(v, f"{where}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _check_plain(v, f"{where}[{i}]")


def build_task(task_cfg: Mapping[str, Any], source: str = "config.json") -> nn.Module:
    """The task module an export describes, built from allow-listed megalab classes only."""
    import hydra

    from megalab.utils.safe_config import check_targets, upgrade_backbone_targets

    _check_plain(task_cfg, f"{source} task")
    cfg = OmegaConf.create(dict(task_cfg))
    upgrade_backbone_targets(cfg, source)  # an export from before the models took their config
    check_targets(cfg, f"{source} (task)")
    return hydra.utils.instantiate(cfg)


def _task_config(cfg: DictConfig) -> dict[str, Any]:
    """The run's task config, resolved, without its optimizer and schedule (not needed to
    use the model, and one thing less to build from a shared file)."""
    task: dict[str, Any] = OmegaConf.to_container(cfg.task, resolve=True)  # type: ignore[assignment]
    assert isinstance(task, dict)
    for key in ("optim", "scheduler"):
        if key in task:
            task[key] = None
    return task


# -------------------------------------------------------------------------------- writing
def export_run(
    run_dir: str | Path,
    out: str | Path,
    checkpoint: str = "best",
    with_tokenizer: bool = True,
) -> Path:
    """Write the run's trained model as a shareable folder `out` (see the module docstring)."""
    from safetensors.torch import save_model

    from megalab.utils.checkpointing import read_checkpoint

    run_dir, out = Path(run_dir), Path(out)
    cfg = run_config(run_dir)
    ckpt = checkpoint_path(run_dir, checkpoint)
    task_cfg = _task_config(cfg)
    task = build_task(task_cfg, str(run_dir))
    state = read_checkpoint(ckpt, offer_alternatives=False)
    if "state_dict" not in state:
        raise ExportError(f"{ckpt} holds no state_dict: not a checkpoint of a megalab run")
    task.load_state_dict(state["state_dict"], strict=True)

    import hydra

    # The run's own copy of its vocabulary; a run from before runs kept one asks its data module
    # (built once, reading no data, which also says what its text codec is).
    tokenizer: dict[str, Path] = run_vocabulary(run_dir) if with_tokenizer else {}
    ask_data = with_tokenizer and not tokenizer
    datamodule = None
    try:
        datamodule = hydra.utils.instantiate(cfg.data)
        if ask_data:
            tokenizer = dict(datamodule.tokenizer_files())
    except Exception as err:
        if ask_data:
            raise ExportError(
                f"the tokenizer of {run_dir}'s data could not be found on this machine "
                f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
                "prepare the data as for training, or export with --without-tokenizer"
            ) from None
        log.warning("no text codec recorded: the data module could not be built (%s)", err)
    if ask_data:
        missing = [str(p) for p in tokenizer.values() if not p.is_file()]
        if missing:
            raise ExportError(
                f"tokenizer file(s) missing: {', '.join(missing)}; prepare the data as for "
                "training, or export with --without-tokenizer"
            )

    out.mkdir(parents=True, exist_ok=True)
    save_model(task, str(out / WEIGHTS), metadata={"format": "pt", "megalab": __version__})
    if tokenizer:
        (out / TOKENIZER_DIR).mkdir(exist_ok=True)
        for name, path in tokenizer.items():
            shutil.copyfile(path, out / TOKENIZER_DIR / name)
    metrics = _read_json(run_dir / "metrics.json")
    evaluated = _read_json(run_dir / "eval_metrics.json").get("metrics") or {}
    overrides_file = run_dir / ".hydra" / "overrides.yaml"
    overrides: list[Any] = list(OmegaConf.load(overrides_file)) if overrides_file.is_file() else []
    command = "python -m megalab.cli.train " + " ".join(str(o) for o in overrides)
    data_cfg = cfg.get("data") or {}
    record = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "megalab_version": __version__,
        "task": task_cfg,
        "data": {
            "target": data_cfg.get("_target_"),
            **{k: OmegaConf.select(cfg, f"data.{k}", default=None) for k in DATA_SPEC_KEYS},
        },
        "tokenizer": sorted(tokenizer),
        "text": datamodule.text_spec() if datamodule is not None else None,
        # metrics.json records the experiment as training resolved it: the saved config's
        # `${hydra:runtime.choices.experiment}` resolves inside a Hydra app only.
        "experiment": metrics.get("experiment")
        or OmegaConf.select(cfg, "experiment_name", throw_on_resolution_failure=False),
        "command": command.strip(),
        "checkpoint": {"file": ckpt.name, "global_step": state.get("global_step")},
        "parameters": sum(p.numel() for p in task.parameters()),
        "metrics": {**(metrics.get("metrics") or {}), **evaluated},
    }
    (out / CONFIG).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    (out / CARD).write_text(model_card(record))
    return out


def model_card(record: Mapping[str, Any]) -> str:
    """The README.md of an export: what the model is, how it was trained, how it scored."""
    family = _backbone_family(record["task"]) or "model"
    metrics = record.get("metrics") or {}
    rows = "\n".join(
        f"| `{k}` | {v:.4f} |" if isinstance(v, float) else f"| `{k}` | {v} |"
        for k, v in sorted(metrics.items())
        if v is not None
    )
    data = record["data"]
    spec = ", ".join(f"{k} {data[k]}" for k in DATA_SPEC_KEYS if data.get(k) is not None)
    tokenizer = ", ".join(f"`tokenizer/{n}`" for n in record.get("tokenizer") or []) or "none"
    codec = (
        '\ncodec = megalab.text_codec("<this folder or Hub id>")  # text <-> its token ids'
        if isinstance(record.get("text"), dict)
        else ""
    )
    return f"""---
library_name: megalab
tags: [megalab, {family}]
---

# {record.get("experiment") or family} ({family})

A {family} model trained with megalab {record["megalab_version"]}:
{record["parameters"]:,} parameters, checkpoint `{record["checkpoint"]["file"]}` at step
{record["checkpoint"]["global_step"]}.

- **Data**: `{data.get("target")}` ({spec}); tokenizer files: {tokenizer}.
- **Trained with**: `{record["command"]}`
- **Paper**: {PAPERS.get(family, "see megalab's documentation")}

## Metrics

| metric | value |
|---|---|
{rows or "| (none recorded) | |"}

## Use

```python
import megalab

model = megalab.from_pretrained("<this folder or Hub id>"){codec}
```

The weights are `model.safetensors`; `config.json` builds the model from megalab's own classes
only.
"""


# -------------------------------------------------------------------------------- loading
def _resolve(name_or_path: str | Path, revision: str | None, cache_dir: str | None) -> Path:
    """A local export folder, or a Hub id fetched (or, offline, found in the cache)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    name = str(name_or_path)
    if name.count("/") != 1 or name.startswith((".", "/")):
        raise ExportError(
            f"{name}: no such folder, and not a Hub id (user/name) either; give the folder "
            "megalab-export wrote or the Hub repository it was pushed to"
        )
    import huggingface_hub

    try:
        folder = huggingface_hub.snapshot_download(
            repo_id=name,
            revision=revision,
            cache_dir=cache_dir,
            allow_patterns=[WEIGHTS, CONFIG, CARD, f"{TOKENIZER_DIR}/*"],
        )
    except Exception as err:
        raise ExportError(
            f"{name}: could not be fetched from the Hugging Face Hub or found in its cache "
            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
        ) from None
    return Path(folder)


def _export(
    name_or_path: str | Path, revision: str | None, cache_dir: str | None
) -> tuple[Path, dict[str, Any]]:
    """The folder of an export (fetched if a Hub id) and its checked `config.json` record."""
    folder = _resolve(name_or_path, revision, cache_dir)
    record = _read_json(folder / CONFIG)
    if record.get("format") != FORMAT or not isinstance(record.get("task"), dict):
        raise ExportError(
            f"{folder / CONFIG}: not a megalab export (write one with megalab-export RUN_DIR OUT)"
        )
    if int(record.get("format_version", 0)) > FORMAT_VERSION:
        raise ExportError(
            f"{folder} was written by a newer megalab ({record.get('megalab_version')}, format "
            f"{record['format_version']}); upgrade megalab to load it"
        )
    if not (folder / WEIGHTS).is_file():
        raise ExportError(f"{folder / WEIGHTS} is missing")
    return folder, record


def export_weights(name_or_path: str | Path, revision: str | None = None) -> dict[str, Tensor]:
    """The task weights of an export (a folder or a Hub id), by the task's parameter names,
    without building its model: what a run started from them (`init_from`) loads."""
    from safetensors.torch import load_file

    folder, _ = _export(name_or_path, revision, None)
    return load_file(str(folder / WEIGHTS))


def from_pretrained(
    name_or_path: str | Path,
    revision: str | None = None,
    cache_dir: str | None = None,
    map_location: str | torch.device = "cpu",
) -> nn.Module:
    """Load a model `megalab-export` wrote: a local folder or a Hub id (`user/name`).

    Returns the task module (encoder, backbone and head) in eval mode. Safe for folders from
    anyone: JSON and safetensors only, and megalab's classes only.
    """
    from safetensors.torch import load_model

    folder, record = _export(name_or_path, revision, cache_dir)
    task = build_task(record["task"], str(folder / CONFIG))
    load_model(task, str(folder / WEIGHTS), strict=True, device=str(map_location))
    return task.eval()


def text_codec(
    name_or_path: str | Path, revision: str | None = None, cache_dir: str | None = None
) -> TextCodec:
    """The text codec of a model `megalab-export` wrote (a folder or a Hub id): prompts to its
    token ids and ids to text, with the vocabulary it was trained with (`tokenizer/`)."""
    from megalab.data.lm.codec import codec_from_spec

    folder, record = _export(name_or_path, revision, cache_dir)
    spec = record.get("text")
    if not isinstance(spec, dict):
        raise ExportError(
            f"{folder} records no text codec: its data is not text, or it was exported before "
            "exports recorded one (export the run again)"
        )
    name, listed = spec.get("file"), list(record.get("tokenizer") or [])
    if name is not None and not listed:
        raise ExportError(
            f"{folder} has no {TOKENIZER_DIR}/{name}: it was exported with --without-tokenizer"
        )
    if name is not None and (name not in listed or Path(str(name)).name != name):
        # A folder from anyone is data: its codec reads only a file the export lists as its
        # own, by a bare name inside tokenizer/ (`megalab-export` writes nothing else).
        raise ExportError(
            f"{folder / CONFIG}: its text codec names {name!r}, which is not one of its "
            f"tokenizer files {listed}"
        )
    if name is not None and not (folder / TOKENIZER_DIR / str(name)).is_file():
        raise ExportError(f"{folder / TOKENIZER_DIR / str(name)} is missing")
    return codec_from_spec(spec, folder / TOKENIZER_DIR)


def push_to_hub(folder: str | Path, repo_id: str, private: bool = False) -> str:
    """Upload an export folder to the Hub repository `repo_id` (created if missing)."""
    import huggingface_hub

    api = huggingface_hub.HfApi()
    api.create_repo(repo_id=repo_id, private=private, exist_ok=True)
    info = api.upload_folder(
        folder_path=str(folder),
        repo_id=repo_id,
        commit_message=f"Upload a megalab {__version__} export",
    )
    return str(getattr(info, "commit_url", None) or f"https://huggingface.co/{repo_id}")
