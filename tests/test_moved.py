"""Modules that moved into the model folders keep their old names, with a deprecation warning
(`megalab.utils.moved`): imports, config targets, `python -m` and saved carried state; and
runs that name a backbone or encoder-decoder class with its options beside it build from its
config class."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from megalab.utils.moved import BECAME_PACKAGES, MOVED, PACKAGES_GONE


@pytest.mark.parametrize("old", sorted(set(MOVED) - PACKAGES_GONE))
def test_an_old_module_name_is_the_new_module_with_a_warning(old: str) -> None:
    sys.modules.pop(old, None)
    with pytest.warns(FutureWarning, match=f"{old} moved to {MOVED[old]}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])
    assert module.__spec__ is not None and module.__spec__.name == MOVED[old]


def test_every_new_module_exists_and_no_old_file_is_left() -> None:
    src = Path(importlib.import_module("megalab").__file__ or "").parent.parent
    for old, new in {**MOVED, **BECAME_PACKAGES}.items():
        assert importlib.util.find_spec(new) is not None, new
        assert not (src / (old.replace(".", "/") + ".py")).exists(), old


def test_a_config_target_under_an_old_name_still_builds() -> None:
    from hydra.utils import get_object

    from megalab.utils.safe_config import check_targets

    target = "megalab.models.mega_translation.MegaEncoderDecoder"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        check_targets({"model": {"_target_": target}}, "a run's config")
        cls = get_object(target)
    from megalab.models.mega.translation import MegaEncoderDecoder

    assert cls is MegaEncoderDecoder


def test_state_saved_under_a_module_that_became_a_package_loads() -> None:
    from megalab.models.transformer_xl import XLMemory
    from megalab.nn.state import pack_state, unpack_state

    state = XLMemory(hidden=[torch.ones(1, 2, 4)], ended=torch.zeros(1, dtype=torch.bool))
    packed = pack_state(state)
    assert packed["class"] == "megalab.models.transformer_xl.model:XLMemory"
    packed["class"] = "megalab.models.transformer_xl:XLMemory"  # how checkpoints saved it before
    restored = unpack_state(packed)
    assert isinstance(restored, XLMemory) and torch.equal(restored.hidden[0], state.hidden[0])


def test_python_dash_m_under_an_old_name_runs_and_says_the_new_one() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "megalab.convert.llama", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "from-hf" in done.stdout
    assert "megalab.convert.llama moved to megalab.models.llama.convert" in done.stderr


OLD_BACKBONES = {
    "megalab.models.mega.Mega": ("megalab.models.mega.MegaConfig", {"chunk_size": 4}),
    "megalab.models.llama.Llama": ("megalab.models.llama.LlamaConfig", {"num_heads": 2}),
    "megalab.models.transformer_xl.model.TransformerXL": (
        "megalab.models.transformer_xl.model.TransformerXLConfig",
        {"mem_len": 3, "num_heads": 2},
    ),
}


def load_old_run(tmp_path: Path, saved: dict[str, Any], old: str, new: str) -> Any:
    """The run config `saved` (naming the class `old`) as a run folder reads it: with a warning
    that names its config class `new`, and passing the allow-list of targets."""
    import yaml

    from megalab.utils.safe_config import check_targets, load_run_config

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(saved))
    with pytest.warns(FutureWarning, match=f"`_target_: {old}`.*`_target_: {new}`"):
        cfg = load_run_config(path)
    check_targets(cfg.task, str(path))
    return cfg


@pytest.mark.parametrize("old", sorted(OLD_BACKBONES))
def test_a_run_that_names_the_backbone_class_with_flat_options_still_loads(
    old: str, tmp_path: Path
) -> None:
    """A run saved before backbones took their config object names the backbone class with
    its options beside it; it is read as the config class, with a warning that names it."""
    import hydra

    from megalab.models.base import built

    new, options = OLD_BACKBONES[old]
    saved = {
        "model": {"d_model": 16, "backbone": {"_target_": old, "d_model": 16, "num_layers": 1}},
        "task": {"backbone": "${model.backbone}"},
    }
    saved["model"]["backbone"].update(options)  # type: ignore[index]
    cfg = load_old_run(tmp_path, saved, old, new)
    assert cfg.model.backbone._target_ == new and cfg.task.backbone._target_ == new
    backbone = built(hydra.utils.instantiate(cfg.task.backbone))
    assert type(backbone).__name__ == old.rsplit(".", 1)[1]
    assert backbone.config.num_layers == 1
    assert all(getattr(backbone.config, k) == v for k, v in options.items())


OLD_ENCODER_DECODERS = {
    "megalab.models.mega.translation.MegaEncoderDecoder": (
        "megalab.models.mega.translation.MegaEncoderDecoderConfig",
        {"z_dim": 8, "v_dim": 16, "ffn_dim": 16, "ema_dim": 2, "dropout": 0.3},
    ),
    "megalab.models.transformer.translation.TransformerEncoderDecoder": (
        "megalab.models.transformer.translation.TransformerEncoderDecoderConfig",
        {"num_heads": 2, "ffn_dim": 16, "dropout": 0.3},
    ),
}


@pytest.mark.parametrize("old", sorted(OLD_ENCODER_DECODERS))
def test_a_run_that_names_the_encoder_decoder_class_with_flat_options_still_loads(
    old: str, tmp_path: Path
) -> None:
    """A translation run saved before the encoder-decoders took their config object names the
    model class with its options beside it; it is read as the config class, with a warning that
    names it, and builds the model those options describe, weight for weight."""
    import hydra

    from megalab.tasks import Seq2SeqTask

    new, options = OLD_ENCODER_DECODERS[old]
    flat = {"_target_": old, "vocab_size": 20, "pad_id": 1, "d_model": 8, "encoder_layers": 1,
            "decoder_layers": 1, **options}  # fmt: skip
    saved = {
        "model": {"d_model": 8, "encoder_decoder": flat},
        "task": {"_target_": "megalab.tasks.Seq2SeqTask", "model": "${model.encoder_decoder}"},
    }
    cfg = load_old_run(tmp_path, saved, old, new)
    assert cfg.model.encoder_decoder._target_ == new and cfg.task.model._target_ == new
    torch.manual_seed(0)
    task = hydra.utils.instantiate(cfg.task)
    assert isinstance(task, Seq2SeqTask) and type(task.model).__name__ == old.rsplit(".", 1)[1]
    assert all(getattr(task.model.config, k) == v for k, v in options.items())
    torch.manual_seed(0)
    reference = type(task.model).from_options({k: v for k, v in flat.items() if k != "_target_"})
    for (name, a), (_, b) in zip(task.model.state_dict().items(),
                                 reference.state_dict().items(), strict=True):  # fmt: skip
        assert torch.equal(a, b), name


def test_a_current_config_is_left_as_it_is() -> None:
    from omegaconf import OmegaConf

    from megalab.utils.safe_config import upgrade_backbone_targets

    cfg = OmegaConf.create({"backbone": {"_target_": "megalab.models.mega.MegaConfig"}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        upgrade_backbone_targets(cfg)
    assert cfg.backbone._target_ == "megalab.models.mega.MegaConfig"


def test_a_model_class_given_its_config_object_is_left_as_it_is() -> None:
    import hydra
    from omegaconf import OmegaConf

    from megalab.models.mega import Mega
    from megalab.utils.safe_config import upgrade_backbone_targets

    config = {"_target_": "megalab.models.mega.MegaConfig", "d_model": 8, "num_layers": 1}
    cfg = OmegaConf.create({"backbone": {"_target_": "megalab.models.mega.Mega", "config": config}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        upgrade_backbone_targets(cfg)
    assert cfg.backbone._target_ == "megalab.models.mega.Mega"
    backbone = hydra.utils.instantiate(cfg.backbone)
    assert isinstance(backbone, Mega) and backbone.config.num_layers == 1


def test_a_command_without_the_run_config_reads_an_old_target_too(
    compose_cfg, tmp_path: Path
) -> None:
    """megalab-eval and megalab-generate compose the model themselves with
    use_run_config=false: an old class target there is read as its config class as well."""
    from megalab.run_loading import merge_run_config

    old = "megalab.models.transformer.Transformer"
    cfg = compose_cfg(f"ckpt_path={tmp_path / 'last.ckpt'}", "use_run_config=false",
                      f"model.backbone._target_={old}", config="eval")  # fmt: skip
    with pytest.warns(FutureWarning, match=f"`_target_: {old}`.*`_target_: {old}Config`"):
        merged = merge_run_config(cfg, [])
    assert merged.model.backbone._target_ == f"{old}Config"


def test_from_config_still_builds_with_a_warning() -> None:
    from megalab.models.mega import Mega, MegaConfig

    cfg = MegaConfig(d_model=8, num_layers=1, z_dim=4, v_dim=8, ffn_dim=8)
    with pytest.warns(FutureWarning, match=r"Mega.from_config\(cfg\) is deprecated.*Mega\(cfg\)"):
        model = Mega.from_config(cfg)
    assert isinstance(model, Mega) and model.config is cfg
