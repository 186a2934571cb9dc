"""A user's own config folder on Hydra's search path (README, docs/extending.md).

The configs ship inside the package, so users keep theirs elsewhere: `hydra.searchpath` adds the
folder, its experiments compose like the shipped ones, and its `local/default.yaml` applies to
every run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from megalab.utils.paths import CONFIG_DIR


@pytest.mark.parametrize("header", ["", "# @package _global_\n"])
@pytest.mark.parametrize("config", ["train", "eval", "generate"])
def test_user_config_folder_adds_experiments_and_local_defaults(
    tmp_path: Path, header: str, config: str
) -> None:
    """The documented file works as written: keys from the root, with or without a header."""
    (tmp_path / "experiment" / "my").mkdir(parents=True)
    (tmp_path / "experiment" / "my" / "exp.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: mega\nseed: 1234\n"
    )
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "default.yaml").write_text(
        f"{header}paths:\n  data_dir: /datasets/megalab\n"
    )
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
            overrides = [f"hydra.searchpath=[file://{tmp_path}]"]
            if config == "train":
                overrides.append("experiment=my/exp")
            cfg = compose(config, overrides=overrides)
    finally:
        GlobalHydra.instance().clear()
    assert cfg.paths.data_dir == "/datasets/megalab"
    assert "local" not in cfg
    if config == "train":
        assert cfg.seed == 1234
        assert cfg.model.backbone._target_ == "megalab.models.mega.MegaConfig"
