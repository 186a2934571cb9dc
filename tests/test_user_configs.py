"""A user's own config folder on Hydra's search path (README, docs/extending.md).

The configs ship inside the package, so users keep theirs elsewhere: `hydra.searchpath` adds the
folder, its experiments compose like the shipped ones, and its `local/default.yaml` applies to
every run.
"""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from megalab.utils.paths import CONFIG_DIR


def test_user_config_folder_adds_experiments_and_local_defaults(tmp_path: Path) -> None:
    (tmp_path / "experiment" / "my").mkdir(parents=True)
    (tmp_path / "experiment" / "my" / "exp.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: mega\nseed: 1234\n"
    )
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "default.yaml").write_text(
        "# @package _global_\npaths:\n  data_dir: /datasets/megalab\n"
    )
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
            cfg = compose(
                "train",
                overrides=[f"hydra.searchpath=[file://{tmp_path}]", "experiment=my/exp"],
            )
    finally:
        GlobalHydra.instance().clear()
    assert cfg.seed == 1234
    assert cfg.model.backbone._target_ == "megalab.models.mega.Mega"
    assert cfg.paths.data_dir == "/datasets/megalab"
