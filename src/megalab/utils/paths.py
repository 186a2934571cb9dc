"""Where megalab finds its configs and its project folder: computed here, once.

- `CONFIG_DIR`: the Hydra config tree, shipped inside the package (`megalab/configs`), so an
  installed wheel runs outside a checkout; `MEGALAB_CONFIG_DIR` points to another tree.
- `project_root()`: the folder `data/`, `logs/`, `tables/` and `sweeps/` hang off:
  `MEGALAB_ROOT` if set, else the source checkout the package runs from, else the current
  directory (an installed package).
- `data_root()`: where the datasets are by default (`paths.data_dir`): `MEGALAB_DATA_DIR`, else
  `data/` below the project root; `megalab-data` prepares them there.
- `resource_dir(name)`: the paper tables (`tables/`) and sweep files (`sweeps/`): the project's
  own folder when it has one, else the copy an installed wheel carries (`megalab/resources/`,
  written by the build hook in `setup.py`), else the source checkout's.
- `group_config(group, name)`: one config of a group as Hydra composes it, for code that builds a
  model from its file without composing a whole run (the contract tests, the benchmarks).
"""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

PACKAGE_DIR = Path(__file__).resolve().parents[1]
CONFIG_DIR = Path(os.environ.get("MEGALAB_CONFIG_DIR", str(PACKAGE_DIR / "configs")))


def source_checkout() -> Path | None:
    """The repository root when megalab runs from a source checkout (src layout), else None."""
    root = PACKAGE_DIR.parents[1]
    if (root / "pyproject.toml").is_file() and (root / "src" / "megalab").is_dir():
        return root
    return None


def project_root() -> Path:
    """The folder holding data/, logs/, tables/ and sweeps/ (see the module docstring)."""
    env = os.environ.get("MEGALAB_ROOT")
    if env:
        return Path(env)
    return source_checkout() or Path.cwd()


def data_root() -> Path:
    """The data root the configs read by default (`paths.data_dir`): `MEGALAB_DATA_DIR` if
    set, else `data/` below the project root."""
    env = os.environ.get("MEGALAB_DATA_DIR")
    return Path(env) if env else project_root() / "data"


def export_project_root() -> Path:
    """Set MEGALAB_ROOT (read by the configs' `paths.root_dir`) unless the user set it."""
    root = project_root()
    os.environ.setdefault("MEGALAB_ROOT", str(root))
    return root


def resource_dir(name: str) -> Path:
    """`tables` or `sweeps`: the project root's folder if it exists, else the wheel's copy,
    else the source checkout's (a checkout whose `MEGALAB_ROOT` puts data and logs elsewhere)."""
    own = project_root() / name
    if own.is_dir():
        return own
    checkout = source_checkout()
    for candidate in (PACKAGE_DIR / "resources" / name, checkout / name if checkout else None):
        if candidate is not None and candidate.is_dir():
            return candidate
    return own


def group_config(group: str, name: str) -> DictConfig:
    """`<group>/<name>.yaml` with its defaults merged in, as Hydra composes a group option.

    A preset extends its base through a defaults list of other configs of the group:
    `- llama` (the same folder), `- /model/megalodon@_here_` (a path from the config root,
    merged at this node); `_self_` goes last when not listed, as in Hydra.
    """
    cfg = OmegaConf.load(CONFIG_DIR / group / f"{name}.yaml")
    assert isinstance(cfg, DictConfig)
    defaults = list(cfg.pop("defaults", None) or [])
    if "_self_" not in defaults:
        defaults.append("_self_")
    parts = []
    for entry in defaults:
        if entry == "_self_":
            parts.append(cfg)
            continue
        path, _, package = str(entry).partition("@")
        if not isinstance(entry, str) or package not in ("", "_here_") or ":" in path:
            raise ValueError(
                f"{group}/{name}.yaml: defaults entry {entry!r} is not another config of a "
                "group merged at this node (`- name`, `- /group/name@_here_` and `_self_` are "
                "read here)"
            )
        if path.startswith("/"):
            other_group, _, other = path.strip("/").rpartition("/")
            parts.append(group_config(other_group, other))
        else:
            folder = str(Path(group, name).parent)
            parts.append(group_config(folder, path))
    merged = OmegaConf.merge(*parts)
    assert isinstance(merged, DictConfig)
    return merged
