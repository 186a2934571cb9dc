"""Run a W&B sweep YAML without a W&B server: `megalab-sweep sweeps/<file>.yaml`.

The sweep files under `sweeps/` are written for `wandb sweep` + `wandb agent`; this command runs
the same grid on one machine. It expands the sweep's parameters into Hydra overrides and runs
them as one Hydra multirun (`python -m megalab.cli.train -m experiment=... key=v1,v2,...`), so
every point is an ordinary training run with its own folder and `metrics.json` under the sweep
folder, which `megalab-tables` reads. Points whose trainer starts several processes (DDP over
the GPUs of a node) run one process each instead, since a DDP job re-launches its own command
line. `method: random` draws `run_cap` points (one process each); `bayes` needs the server.

    megalab-sweep sweeps/mega_lra_text_chunk_size.yaml --seeds 3
    megalab-sweep sweeps/mega_lra.yaml --smoke --seeds 1 --out logs/reproduce/lra
    megalab-sweep sweeps/mega_lra.yaml --only experiment=mega/lra_listops --dry-run trainer=gpu

A sweep file is data (shared like a config): its `command` overrides and parameters may not
name a `_target_`, add or delete keys outside megalab's config groups (`+key=...`), set
`hydra.*` or `paths.*`, or give paths outside the run, and its parameter keys must exist in the
composed config (`megalab.utils.safe_config.check_file_override`); `--allow-targets` on the
command line lifts this for a file you trust.

Trailing `key=value` arguments are extra Hydra overrides for every run. `--smoke` trains each
point for 2 steps on CPU on the tiny fixture datasets (`megalab-data smoke`): a check that
everything composes, trains, tests and lands in the table, not a result.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import logging
import math
import os
import random
import re
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megalab.utils.paths import CONFIG_DIR, project_root, resource_dir
from megalab.utils.safe_config import UnsafeConfigError, check_file_override, load_yaml

log = logging.getLogger(__name__)

ROOT = project_root()

# What `--smoke` adds to every run: 2 steps of 4 examples on CPU, one validation and one test
# batch, on the fixture data. Gradient accumulation is turned off so that any paper's batch
# split (update-freq) fits the 4-example batch.
SMOKE_TRAINER = [
    "trainer=cpu",
    "trainer.max_steps=2",
    "trainer.max_epochs=null",
    "trainer.val_check_interval=null",
    "trainer.check_val_every_n_epoch=1",
    "trainer.limit_train_batches=2",
    "trainer.limit_val_batches=1",
    "trainer.limit_test_batches=1",
    "trainer.num_sanity_val_steps=0",
    "trainer.log_every_n_steps=1",
    "trainer.enable_model_summary=false",
]
SMOKE_OVERRIDES = [
    *SMOKE_TRAINER,
    "trainer.accumulate_grad_batches=1",
    "trainer.enable_progress_bar=false",
    "data.batch_size=4",
    "data.eval_batch_size=4",
    "data.num_workers=0",
]
# Attention positions per example (L x min(L, c)) a CPU smoke run takes: LRA Path-X (16,384
# pixels, 16,384 x 4,096 even chunked) needs minutes per step there; Text (4K x 4K) does not.
SMOKE_MAX_CPU_ATTENTION = 32 * 1024 * 1024
# Keys of the sweep command that only concern the W&B server; offline runs use the config's
# own logger unless an extra override names one.
_SERVER_ONLY = re.compile(r"^[+~]*logger(\.|=)")
_SAFE_VALUE = re.compile(r"^[A-Za-z0-9_\-+./:@]+$")


class SweepError(ValueError):
    """The sweep file cannot be run offline."""


@dataclass
class Sweep:
    """A W&B sweep config, reduced to what an offline run needs."""

    path: Path
    name: str
    method: str
    metric: dict[str, Any]
    parameters: dict[str, dict[str, Any]]  # dotted Hydra key -> W&B parameter spec
    fixed: list[str]  # the command's own Hydra overrides (server-only ones dropped)
    run_cap: int | None = None

    @property
    def stem(self) -> str:
        return self.path.stem


@dataclass
class Point:
    """One run of a sweep: its parameter values, its Hydra overrides and its fate."""

    params: dict[str, Any]
    overrides: list[str]
    multiprocess: bool = False
    skip: str | None = None


@dataclass
class Plan:
    """What `run_sweep` will execute for one sweep file."""

    sweep: Sweep
    out: Path
    points: list[Point]
    commands: list[list[str]] = field(default_factory=list)

    @property
    def runnable(self) -> list[Point]:
        return [p for p in self.points if p.skip is None]

    @property
    def skipped(self) -> list[Point]:
        return [p for p in self.points if p.skip is not None]


# -- reading sweep files ---------------------------------------------------------------------
def flatten_parameters(params: dict[str, Any], prefix: str = "") -> dict[str, dict[str, Any]]:
    """W&B nested parameters (`{a: {parameters: {b: {...}}}}`) -> dotted keys (`a.b`)."""
    flat: dict[str, dict[str, Any]] = {}
    for name, spec in params.items():
        key = f"{prefix}{name}"
        if not isinstance(spec, dict):
            raise SweepError(f"parameter {key!r}: expected a mapping, got {spec!r}")
        if "parameters" in spec:
            flat.update(flatten_parameters(spec["parameters"], prefix=f"{key}."))
        else:
            flat[key] = spec
    return flat


def command_overrides(command: Sequence[str] | None) -> list[str]:
    """The fixed Hydra overrides in a sweep's `command` (after the train module, no macros;
    `~key` deletions included, so that the loading policy sees them)."""
    if not command:
        return []
    items = [str(c) for c in command]
    start = 0
    for i, item in enumerate(items):
        if item in ("megalab.cli.train", "megalab.train", "megalab-train") or item.endswith(
            "train.py"
        ):
            start = i + 1
    return [
        c
        for c in items[start:]
        if ("=" in c or c.startswith("~")) and not c.startswith("${") and not _SERVER_ONLY.match(c)
    ]


def load_sweep(path: str | Path, allow_targets: bool = False) -> Sweep:
    """Read a W&B sweep YAML (safe YAML; its overrides checked as data unless
    `allow_targets`, see the module doc)."""
    path = Path(path)
    cfg = load_yaml(path)
    if not isinstance(cfg, dict):
        raise SweepError(f"{path}: not a sweep config (expected a mapping)")
    method = cfg.get("method")
    if method not in ("grid", "random", "bayes"):
        raise SweepError(f"{path}: method must be grid, random or bayes, got {method!r}")
    sweep = Sweep(
        path=path,
        name=str(cfg.get("name") or path.stem),
        method=method,
        metric=dict(cfg.get("metric") or {}),
        parameters=flatten_parameters(cfg.get("parameters") or {}),
        fixed=command_overrides(cfg.get("command")),
        run_cap=cfg.get("run_cap"),
    )
    check_sweep(sweep, allow_targets)
    return sweep


def check_sweep(sweep: Sweep, allow_targets: bool = False) -> None:
    """Refuse the overrides a sweep file may not give (`check_file_override`): its command's and
    each parameter with each of its listed values."""
    for override in sweep.fixed:
        check_file_override(override, f"{sweep.path} (command)", allow_targets)
    for key, spec in sweep.parameters.items():
        where = f"{sweep.path} (parameters.{key})"
        listed = list(spec.get("values") or []) + ([spec["value"]] if "value" in spec else [])
        for value in listed or [0]:
            check_file_override(f"{key}={format_value(value)}", where, allow_targets)


# -- expanding parameters into points --------------------------------------------------------
def grid_values(key: str, spec: dict[str, Any]) -> list[Any]:
    """The values a grid takes for one parameter (`values` or a constant `value`)."""
    if "values" in spec:
        return list(spec["values"])
    if "value" in spec:
        return [spec["value"]]
    raise SweepError(
        f"parameter {key!r}: a grid needs `values` or `value`, not a distribution ({spec})"
    )


def sample_value(key: str, spec: dict[str, Any], rng: random.Random) -> Any:
    """One random draw of a W&B parameter (the common distributions)."""
    dist = spec.get("distribution")
    if "value" in spec:
        return spec["value"]
    if "values" in spec and dist in (None, "categorical"):
        return rng.choice(list(spec["values"]))
    if "values" in spec and dist == "categorical_w_probabilities":
        return rng.choices(list(spec["values"]), weights=spec["probabilities"])[0]
    lo: Any = spec.get("min")
    hi: Any = spec.get("max")
    if dist == "int_uniform" or (dist is None and isinstance(lo, int) and isinstance(hi, int)):
        return rng.randint(int(lo), int(hi))
    if dist in (None, "uniform"):
        return rng.uniform(float(lo), float(hi))
    if dist == "q_uniform":
        q = spec.get("q", 1.0)
        return round(rng.uniform(float(lo), float(hi)) / q) * q
    if dist == "log_uniform_values":
        return math.exp(rng.uniform(math.log(float(lo)), math.log(float(hi))))
    if dist == "log_uniform":  # min/max are natural logs of the bounds
        return math.exp(rng.uniform(float(lo), float(hi)))
    if dist == "normal":
        return rng.gauss(spec.get("mu", 0.0), spec.get("sigma", 1.0))
    raise SweepError(f"parameter {key!r}: distribution {dist!r} is not supported offline")


def format_value(value: Any) -> str:
    """A Python value as a Hydra override value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ",".join(format_value(v) for v in value) + "]"
    text = str(value)
    if _SAFE_VALUE.match(text):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def parse_seeds(text: str | None) -> list[int] | None:
    """`5` -> seeds 1..5; `1,4,7` -> those seeds; None/'' -> the sweep's own."""
    if text is None or str(text).strip() == "":
        return None
    text = str(text).strip()
    parts = [p for p in re.split(r"[,\s]+", text) if p]
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        raise SweepError(
            f"--seeds takes N (seeds 1..N) or a list such as 1,2,7, got {text!r}"
        ) from None
    if len(parts) == 1 and "," not in text:
        n = numbers[0]
        if n < 1:
            raise SweepError(f"--seeds must be >= 1, got {n}")
        return list(range(1, n + 1))
    return numbers


def parse_only(items: Iterable[str]) -> dict[str, list[str]]:
    """`--only key=v1,v2` restrictions -> {key: [v1, v2]} (values compared as text)."""
    only: dict[str, list[str]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep:
            raise SweepError(f"--only expects key=v1,v2, got {item!r}")
        only[key] = [v for v in values.split(",") if v]
    return only


def check_only(sweeps: Sequence[Sweep], only: dict[str, list[str]]) -> None:
    """Refuse an `--only` value that no sweep's grid has: a misspelt value would otherwise drop
    its points without a word. Seeds (`--seeds`) and distributions have no list to check."""
    for key, wanted in only.items():
        specs = [s.parameters[key] for s in sweeps if key in s.parameters]
        if key == "seed" or not specs or not all("values" in p or "value" in p for p in specs):
            continue
        values = [v for spec in specs for v in grid_values(key, spec)]
        offered = {format_value(v) for v in values} | {str(v) for v in values}
        missing = [v for v in wanted if v not in offered]
        if missing:
            shown = ", ".join(dict.fromkeys(format_value(v) for v in values))
            raise SweepError(
                f"--only {key}={','.join(missing)}: not among the values the sweeps give it "
                f"({shown})"
            )


def expand(
    sweep: Sweep,
    seeds: list[int] | None = None,
    only: dict[str, list[str]] | None = None,
    count: int | None = None,
    random_seed: int = 0,
) -> list[dict[str, Any]]:
    """The sweep's points as ordered {key: value} dicts (grid order as W&B and Hydra)."""
    params = dict(sweep.parameters)
    if seeds is not None:
        params["seed"] = {"values": list(seeds)}
    only = only or {}
    unknown = set(only) - set(params)
    if unknown:
        raise SweepError(f"--only names parameters the sweep does not have: {sorted(unknown)}")
    if sweep.method == "bayes":
        raise SweepError(
            f"{sweep.path}: bayes search needs the W&B server (`wandb sweep {sweep.path}` then "
            "`wandb agent <id>`); offline runs take grid and random sweeps"
        )
    if sweep.method == "grid":
        keys = list(params)
        lists = []
        for key in keys:
            values = grid_values(key, params[key])
            if key in only:  # may leave nothing: then this sweep has no point to run
                values = [v for v in values if format_value(v) in only[key] or str(v) in only[key]]
            lists.append(values)
        return [dict(zip(keys, combo)) for combo in itertools.product(*lists)]
    n = count or sweep.run_cap or 10
    rng = random.Random(random_seed)
    points = []
    for _ in range(n):
        point = {k: sample_value(k, spec, rng) for k, spec in params.items() if k != "seed"}
        points.append(point)
    if "seed" in params:
        seed_values = grid_values("seed", params["seed"])
        points = [{**p, "seed": s} for p in points for s in seed_values]
    return points


# -- overrides -------------------------------------------------------------------------------
def override_key(override: str) -> str:
    """The key an override sets (`+a.b=1` -> `a.b`, `trainer=gpu` -> `trainer`)."""
    return override.split("=", 1)[0].lstrip("+~")


def merge_overrides(*groups: Sequence[str]) -> list[str]:
    """Concatenate override lists; a later override of the same key replaces an earlier one."""
    merged: dict[str, str] = {}
    for group in groups:
        for override in group:
            key = override_key(override)
            merged.pop(key, None)
            merged[key] = override
    return list(merged.values())


def _is_multiprocess(trainer: Any) -> bool:
    """Whether a composed trainer config starts several processes (DDP, FSDP, many devices)."""
    from omegaconf import DictConfig

    strategy = trainer.get("strategy") if trainer is not None else None
    target = strategy.get("_target_", "") if isinstance(strategy, DictConfig | dict) else strategy
    if isinstance(target, str) and re.search(r"ddp|fsdp|deepspeed", target, re.IGNORECASE):
        return True
    devices = trainer.get("devices", 1) if trainer is not None else 1
    nodes = trainer.get("num_nodes", 1) if trainer is not None else 1
    if isinstance(devices, list | tuple) or str(devices) == "-1" or (nodes or 1) > 1:
        return True
    return str(devices) not in ("1", "auto", "None", "null")


def _check_key(point: Point) -> tuple[str, ...]:
    """What decides a point's check: its overrides without the seed."""
    return tuple(o for o in point.overrides if override_key(o) != "seed")


def check_points(points: list[Point], smoke: bool) -> None:
    """Compose each point's config: skip points whose experiment (or its data) does not exist
    yet, and, in smoke mode on CPU, attention too large for a CPU; mark DDP points."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.errors import MissingConfigException
    from omegaconf import OmegaConf, open_dict

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
            done: dict[tuple[str, ...], Point] = {}
            for point in points:
                key = _check_key(point)
                if key in done:
                    point.skip, point.multiprocess = done[key].skip, done[key].multiprocess
                    continue
                done[key] = point
                try:
                    cfg = compose("train", overrides=point.overrides, return_hydra_config=True)
                except MissingConfigException as err:
                    point.skip = str(err).strip().splitlines()[0]
                    continue
                except Exception as err:  # a bad override: no point of this sweep would run
                    unknown = [k for k in point.params if f"Could not override '{k}'" in str(err)]
                    if unknown:  # a sweep file sets existing keys only (no `+` from data)
                        raise SweepError(
                            f"parameters.{unknown[0]}: no such key in the composed config "
                            f"({' '.join(point.overrides)}); a sweep parameter must name a key "
                            "of the experiment's config"
                        ) from None
                    raise SweepError(f"{' '.join(point.overrides)}: {err}") from err
                with open_dict(cfg):
                    cfg.hydra.runtime.output_dir = str(ROOT)
                    cfg.hydra.job.num = 0
                HydraConfig().set_config(cfg)
                point.multiprocess = _is_multiprocess(cfg.get("trainer"))
                if smoke and OmegaConf.select(cfg, "trainer.accelerator") == "cpu":
                    length = int(OmegaConf.select(cfg, "data.max_len", default=0) or 0)
                    chunk = int(OmegaConf.select(cfg, "model.backbone.chunk_size", default=-1))
                    span = min(length, chunk) if chunk > 0 else length
                    if OmegaConf.select(cfg, "model.backbone.attention", default=None) == "full":
                        span = length  # SeqBoat-full: every activated token, whatever chunk_size
                    if length * span > SMOKE_MAX_CPU_ATTENTION:
                        point.skip = (
                            f"attention over {length:,} x {span:,} positions per example takes "
                            "minutes per step on a CPU; smoke it on a GPU (trainer=gpu; make: "
                            "TRAINER=gpu)"
                        )
    finally:
        GlobalHydra.instance().clear()


# -- planning and running --------------------------------------------------------------------
def _train_cmd() -> list[str]:
    return [sys.executable, "-m", "megalab.cli.train"]


def plan_sweep(
    sweep: Sweep,
    out: Path,
    seeds: list[int] | None = None,
    only: dict[str, list[str]] | None = None,
    extra: Sequence[str] = (),
    smoke_overrides: Sequence[str] = (),
    smoke: bool = False,
    count: int | None = None,
    check: bool = True,
) -> Plan:
    """Expand a sweep into points and the commands that run them under `out`."""
    values = expand(sweep, seeds=seeds, only=only, count=count)
    swept = set(values[0]) if values else set()
    clash = sorted(swept & {override_key(o) for o in extra})
    if clash:
        raise SweepError(
            f"{sweep.path.name}: {', '.join(clash)} is swept; restrict it with --only, not with "
            "an override"
        )
    points = []
    for params in values:
        own = [f"{k}={format_value(v)}" for k, v in params.items()]
        overrides = merge_overrides(sweep.fixed, own, smoke_overrides, extra)
        points.append(Point(params=params, overrides=overrides))
    if check:
        try:
            check_points(points, smoke=smoke)
        except SweepError as err:
            raise SweepError(f"{sweep.path}: {err}") from None
    plan = Plan(sweep=sweep, out=out, points=points)
    runnable = plan.runnable
    single = [p for p in runnable if not p.multiprocess]
    multi = [p for p in runnable if p.multiprocess]
    keys = list(values[0]) if values else []
    # One multirun when the single-process points form a grid (the usual case); else one
    # process per point.
    lists = {k: list(dict.fromkeys(format_value(p.params[k]) for p in single)) for k in keys}
    grid = {tuple(combo) for combo in itertools.product(*(lists[k] for k in keys))} == {
        tuple(format_value(p.params[k]) for k in keys) for p in single
    }
    index = 0
    if single and sweep.method == "grid" and grid:
        sweep_args = [f"{k}={','.join(lists[k])}" for k in keys]
        base = merge_overrides(sweep.fixed, smoke_overrides, extra)
        base = [o for o in base if override_key(o) not in keys]
        plan.commands.append(
            [*_train_cmd(), "-m", *base, *sweep_args, f"hydra.sweep.dir={format_value(str(out))}"]
        )
        index = len(single)
        multi_or_rest = multi
    else:
        multi_or_rest = single + multi
    for point in multi_or_rest:
        run_dir = format_value(str(out / str(index)))
        plan.commands.append([*_train_cmd(), *point.overrides, f"hydra.run.dir={run_dir}"])
        index += 1
    return plan


def write_manifest(plan: Plan, seeds: list[int] | None, smoke: bool, extra: Sequence[str]) -> Path:
    """`sweep.json` in the sweep folder: which parameters vary (for the tables), and how."""
    plan.out.mkdir(parents=True, exist_ok=True)
    record = {
        "sweep": str(plan.sweep.path),
        "name": plan.sweep.name,
        "method": plan.sweep.method,
        "metric": plan.sweep.metric,
        "parameters": [k for k in plan.points[0].params] if plan.points else [],
        "fixed": plan.sweep.fixed,
        "extra": list(extra),
        "seeds": seeds,
        "smoke": smoke,
        "runs": len(plan.runnable),
        "points": [
            {"experiment": _experiment(p), "params": p.params, "skipped": p.skip}
            for p in plan.points
        ],
        "commands": [" ".join(c) for c in plan.commands],
        "created": dt.datetime.now().isoformat(timespec="seconds"),
    }
    path = plan.out / "sweep.json"
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return path


def _experiment(point: Point) -> str | None:
    """The experiment a point runs (from its `experiment=` override)."""
    for override in point.overrides:
        if override_key(override) == "experiment":
            return override.split("=", 1)[1]
    return None


def _describe(params: dict[str, Any]) -> str:
    return " ".join(f"{k}={format_value(v)}" for k, v in params.items())


def run_plan(plan: Plan, dry_run: bool = False) -> int:
    """Run (or print) a plan's commands; return the number of failed commands."""
    for point in plan.skipped:
        print(f"[sweep {plan.sweep.stem}] skipping {_describe(point.params)}: {point.skip}")
    failures = 0
    for cmd in plan.commands:
        print(f"[sweep {plan.sweep.stem}] $ {' '.join(cmd)}", flush=True)
        if dry_run:
            continue
        env = {**os.environ, "MEGALAB_ROOT": os.environ.get("MEGALAB_ROOT", str(ROOT))}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, check=False)
        if proc.returncode != 0:
            failures += 1
            print(f"[sweep {plan.sweep.stem}] failed with exit code {proc.returncode}")
    return failures


# -- command line ----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megalab-sweep",
        description="Run W&B sweep YAMLs offline as Hydra multiruns (no W&B server).",
        epilog="Trailing key=value arguments are Hydra overrides added to every run.",
    )
    parser.add_argument("args", nargs="+", help="sweep YAML files, then key=value overrides")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for the runs (one subfolder per sweep file; default logs/sweeps/<time>)",
    )
    parser.add_argument("--seeds", default=None, help="N (seeds 1..N) or a list such as 1,2,7")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="restrict a parameter to some of its grid values (repeatable)",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="2 CPU steps per run on the fixture datasets"
    )
    parser.add_argument("--count", type=int, default=None, help="points of a random sweep")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    parser.add_argument(
        "--allow-targets",
        action="store_true",
        help="trust the sweep files: let their overrides add keys, name _target_s and set "
        "hydra.*/paths.* (refused by default: a sweep file is data)",
    )
    return parser


def find_sweep_file(arg: str) -> Path:
    """A sweep file by its path, else by its name (`sweeps/mega_lra.yaml`, `mega_lra`) among
    the project's sweeps/ or, from an installed wheel, the sweep files it carries."""
    path = Path(arg)
    if path.is_file() or path.is_absolute():
        return path
    name = path.name if path.suffix in (".yaml", ".yml") else f"{path.name}.yaml"
    known = resource_dir("sweeps") / name
    return known if known.is_file() else path


def split_args(args: Sequence[str]) -> tuple[list[Path], list[str]]:
    """Positional arguments -> (sweep files, Hydra overrides)."""
    files, overrides = [], []
    for arg in args:
        if "=" in arg and not arg.endswith((".yaml", ".yml")):
            overrides.append(arg)
        else:
            files.append(find_sweep_file(arg))
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        known = sorted(p.stem for p in resource_dir("sweeps").glob("*.yaml"))
        raise SweepError(
            f"sweep file(s) not found: {', '.join(missing)}; known sweeps: {', '.join(known)}"
        )
    if not files:
        raise SweepError("name at least one sweep YAML (see sweeps/)")
    return files, overrides


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `megalab-sweep`; returns the process exit code."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = build_parser()
    ns = parser.parse_intermixed_args(argv)
    try:
        files, extra = split_args(ns.args)
        seeds = parse_seeds(ns.seeds)
        only = parse_only(ns.only)
        sweeps = [load_sweep(f, allow_targets=ns.allow_targets) for f in files]
        known = {k for s in sweeps for k in s.parameters} | {"seed"}
        if set(only) - known:
            raise SweepError(f"--only names no swept parameter: {sorted(set(only) - known)}")
        check_only(sweeps, only)
    except (SweepError, UnsafeConfigError, OSError, yaml.YAMLError) as err:
        parser.error(str(err))
    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    out = (ns.out or ROOT / "logs" / "sweeps" / stamp).absolute()

    smoke_overrides: list[str] = []
    if ns.smoke:
        smoke_overrides = list(SMOKE_OVERRIDES)
        data_dir = out / "smoke_data"
        if not ns.dry_run:
            from megalab.data.smoke import write_smoke_data

            write_smoke_data(data_dir)
        smoke_overrides.append(f"paths.data_dir={format_value(str(data_dir))}")

    failures = runs = planned = 0
    for sweep in sweeps:
        try:
            plan = plan_sweep(
                sweep,
                out / sweep.stem,
                seeds=seeds,
                only={k: v for k, v in only.items() if k in sweep.parameters or k == "seed"},
                extra=extra,
                smoke_overrides=smoke_overrides,
                smoke=ns.smoke,
                count=ns.count,
            )
        except SweepError as err:
            parser.error(str(err))
        if not plan.points:
            print(f"[sweep {sweep.stem}] no grid point left after --only: nothing to run")
            continue
        planned += len(plan.points)
        if not ns.dry_run:
            write_manifest(plan, seeds, ns.smoke, extra)
        failures += run_plan(plan, dry_run=ns.dry_run)
        runs += len(plan.runnable)
    if not planned:
        parser.error("--only leaves no grid point in any of the sweeps")
    if not ns.dry_run:
        print(f"[sweep] {runs} run(s) under {out}; table: megalab-tables {out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
