"""The types and ranges of the settings a run is made of, checked before anything is built.

Hydra passes an override's value on as it was typed, so `trainer.max_steps=abc` or
`data.batch_size=abc` used to fail minutes later inside Lightning or a DataLoader with a type
error about neither. `validate` checks the composed config against the rules below (the top
level, `trainer`, `data`, `optim`, `scheduler`, the model and the checkpoint schedule)
and raises one `ConfigError` listing every bad key, what it expects, and what it got. A key that
is absent is not required here (configs differ); a present one must have the right type.
The rules of `model.backbone.*` are not written here: they are derived from the fields of the
config dataclass of the backbone the config targets, where each option is declared once with its
type, range and meaning (`megalab.utils.options`).

It also checks that the task fits the data: a classification task needs classes, language
modelling needs a language-model dataset; and, once every option fits its rule, that a model's
options fit together, as its config dataclass checks them (`combination_problems`).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megalab.utils.errors import UserError
from megalab.utils.options import (
    Rule,
    boolean,
    choice,
    config_class_of,
    either,
    integer,
    is_int,
    is_number,
    number,
    option_rules,
    text,
)
from megalab.utils.safe_config import megalab_object


class ConfigError(UserError, ValueError):
    """Settings with the wrong type or range; the message names each key."""


def _str_list(v: Any) -> bool:
    return isinstance(v, list | tuple) and all(isinstance(x, str) for x in v)


_TIMEDELTA_KEYS = {"weeks", "days", "hours", "minutes", "seconds", "milliseconds", "microseconds"}


def _duration(v: Any) -> bool:
    """Lightning's `max_time`: "DD:HH:MM:SS" or a dict of `datetime.timedelta` arguments."""
    if isinstance(v, str):
        return re.fullmatch(r"\d+:\d+:\d+:\d+", v) is not None
    if isinstance(v, dict):
        return bool(v) and set(v) <= _TIMEDELTA_KEYS and all(is_number(x) for x in v.values())
    return v is None


_FRACTION_OR_COUNT = either(integer(0), number(0.0, 1.0))
# `trainer.profiler` by name: Lightning's profilers (megalab.utils.run writes their report to the
# run folder).
PROFILERS = ("simple", "advanced", "pytorch")
PRECISIONS = (
    "64", "32", "16", "bf16", "transformer-engine", "transformer-engine-float16",
    "16-true", "16-mixed", "bf16-true", "bf16-mixed", "32-true", "64-true",
    64, 32, 16,
)  # fmt: skip

RULES: dict[str, Rule] = {
    # top level
    "seed": integer(0, null=True),
    "train": boolean(),
    "test": boolean(),
    "ckpt_path": text(null=True),
    "ckpt_verify": boolean(),
    "init_from": text(null=True),
    "init_skip": Rule(_str_list, "a list of module or weight names"),
    "task_name": text(),
    "tags": Rule(_str_list, "a list of strings"),
    "monitor": text(null=True),
    "monitor_mode": choice("min", "max"),
    # trainer
    "trainer.max_steps": integer(-1, note=" (-1: no step limit)"),
    "trainer.max_epochs": integer(-1, null=True, note=" (-1 or null: no epoch limit)"),
    "trainer.min_steps": integer(0, null=True),
    "trainer.min_epochs": integer(0, null=True),
    "trainer.max_time": Rule(
        _duration,
        '"DD:HH:MM:SS" (days:hours:minutes:seconds), a dict such as {hours: 20}, or null',
    ),
    "trainer.val_check_interval": either(
        integer(1, note=" (every N training batches)"),
        number(0.0, 1.0, lo_open=True, note=" (a fraction of an epoch)"),
        Rule(lambda v: v is None, "null (once per epoch)"),
    ),
    "trainer.check_val_every_n_epoch": integer(1, null=True),
    "trainer.limit_train_batches": either(_FRACTION_OR_COUNT, Rule(lambda v: v is None, "null")),
    "trainer.limit_val_batches": either(_FRACTION_OR_COUNT, Rule(lambda v: v is None, "null")),
    "trainer.limit_test_batches": either(_FRACTION_OR_COUNT, Rule(lambda v: v is None, "null")),
    "trainer.overfit_batches": _FRACTION_OR_COUNT,
    "trainer.accumulate_grad_batches": integer(1),
    "trainer.gradient_clip_val": number(0.0, null=True),
    "trainer.gradient_clip_algorithm": choice("norm", "value", null=True),
    "trainer.log_every_n_steps": integer(1),
    "trainer.num_sanity_val_steps": integer(-1, note=" (-1: the whole validation set)"),
    "trainer.precision": choice(*PRECISIONS),
    "trainer.devices": either(
        integer(-1, note=" (-1: all)"),
        text(),
        Rule(
            lambda v: isinstance(v, list | tuple) and all(is_int(x) for x in v),
            "a list of device ids",
        ),
    ),
    "trainer.num_nodes": integer(1),
    "trainer.accelerator": text(),
    "trainer.deterministic": boolean(null=True, also=("warn",)),
    "trainer.benchmark": boolean(null=True),
    "trainer.profiler": either(
        choice(*PROFILERS, null=True),
        Rule(lambda v: isinstance(v, DictConfig) and "_target_" in v, "a profiler's _target_"),
    ),
    "trainer.fast_dev_run": either(boolean(), integer(0)),
    "trainer.enable_model_summary": boolean(),
    "trainer.enable_progress_bar": boolean(),
    # megalab's own trainer keys (megalab.memory; removed before Lightning sees the config)
    "trainer.memory_check": boolean(),
    "trainer.max_tokens_per_step": integer(1, null=True, note=" (tokens per micro-batch)"),
    # data
    "data.batch_size": integer(1, note=" (the global batch per optimizer step)"),
    "data.eval_batch_size": integer(1, null=True),
    "data.num_workers": integer(0),
    "data.max_len": integer(1),
    "data.seed": integer(0, null=True),
    "data.pin_memory": boolean(),
    "data.truncate": boolean(),
    "data.sort_eval_by_length": boolean(),
    # optimizer and schedule
    "optim.optimizer.lr": number(0.0, lo_open=True, note=" (the peak learning rate)"),
    "optim.optimizer.weight_decay": number(0.0),
    "optim.optimizer.eps": number(0.0, lo_open=True),
    "optim.optimizer.momentum": number(0.0),
    "optim.optimizer.betas": Rule(
        lambda v: (
            isinstance(v, list | tuple)
            and len(v) == 2
            and all(is_number(b) and 0.0 <= b < 1.0 for b in v)
        ),
        "two numbers in [0, 1), e.g. [0.9, 0.98]",
    ),
    "scheduler.warmup_steps": integer(0),
    "scheduler.init_lr": number(0.0),
    "scheduler.end_lr": number(0.0),
    "scheduler.min_lr_ratio": number(0.0, 1.0),
    "scheduler.warmup_power": number(0.0, lo_open=True),
    "scheduler.decay_steps": integer(1, null=True),
    # the model's width (the backbone's options: `model_rules`)
    "model.d_model": integer(1),
    # checkpoints
    "callbacks.last_checkpoint.every_n_train_steps": integer(1, null=True),
    "callbacks.last_checkpoint.every_n_minutes": number(0.0, lo_open=True, null=True),
}
# The parts of `model` built from a config dataclass, whose fields give their own rules.
MODEL_PARTS = ("backbone", "encoder_decoder")
# Dropout rates anywhere else in the model (encoder, head): probabilities.
_DROPOUT = number(0.0, 1.0, hi_open=True)


def _model_configs(cfg: DictConfig) -> list[tuple[str, DictConfig, type]]:
    """(part, its node, its config dataclass) for each `model.<part>` whose `_target_` is one of
    megalab's models built from a config dataclass (the class, or a backbone class taking it)."""
    out = []
    for part in MODEL_PARTS:
        try:
            node = OmegaConf.select(cfg, f"model.{part}")
        except OmegaConfBaseException:
            continue
        target = node.get("_target_") if isinstance(node, DictConfig) else None
        model = megalab_object(target) if isinstance(target, str) else None
        config_class = config_class_of(model) if isinstance(model, type) else None
        if config_class is not None:
            out.append((part, node, config_class))
    return out


def model_rules(cfg: DictConfig) -> dict[str, Rule]:
    """`model.<part>.<field>` -> rule, for every field of the config dataclass that
    `model.backbone._target_` (or a translation model's `model.encoder_decoder._target_`)
    names (`megalab.utils.options`); none for a target that is not one of megalab's models
    built from a config dataclass."""
    return {
        f"model.{part}.{k}": r
        for part, _, config_class in _model_configs(cfg)
        for k, r in option_rules(config_class).items()
    }


def unknown_model_options(cfg: DictConfig) -> list[str]:
    """Keys under `model.<part>` that the config dataclass its `_target_` names has no field for
    (an experiment written for another model, a key of the wrong model): found here, before
    Hydra's instantiation fails on them with a bare TypeError."""
    out = []
    model = group_choice("model")
    for part, node, config_class in _model_configs(cfg):
        fields = [f.name for f in dataclasses.fields(config_class) if f.init]
        for key in map(str, node):
            if key.startswith("_") or key in fields:
                continue
            close = difflib.get_close_matches(key, fields, n=3, cutoff=0.75)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            out.append(
                f"model.{part}.{key}: {config_class.__name__}"
                f"{f' (model={model})' if model else ''} has no such option{hint}; a config "
                f"made for another model (an experiment=) may set it: ~model.{part}.{key} "
                "removes it"
            )
    return out


def backbone_rules(cfg: DictConfig) -> dict[str, Rule]:
    """The `model_rules` of `model.backbone` alone."""
    return {k: r for k, r in model_rules(cfg).items() if k.startswith("model.backbone.")}


def _value(cfg: DictConfig, key: str) -> tuple[bool, Any]:
    """(present?, resolved value) of a dotted key."""
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    if not isinstance(node, DictConfig) or leaf not in node:
        return False, None
    value = OmegaConf.select(cfg, key, throw_on_resolution_failure=True)
    if isinstance(value, DictConfig | list) or OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=True)
    return True, value


def _dropouts(cfg: DictConfig) -> list[str]:
    model = cfg.get("model")
    if not isinstance(model, DictConfig):
        return []
    keys = []

    def walk(node: DictConfig, prefix: str) -> None:
        for k in node:
            child = node._get_node(k)
            full = f"{prefix}.{k!s}"
            if isinstance(child, DictConfig):
                walk(child, full)
            elif str(k).endswith("dropout"):
                keys.append(full)

    walk(model, "model")
    return keys


def problems(cfg: DictConfig) -> list[str]:
    """One line per key whose value does not fit its rule."""
    out = []
    derived = model_rules(cfg)
    dropouts = ((k, _DROPOUT) for k in _dropouts(cfg) if k not in derived)
    checks = [*RULES.items(), *derived.items(), *dropouts]
    for key, rule in checks:
        try:
            present, value = _value(cfg, key)
        except OmegaConfBaseException as err:
            out.append(f"{key}: cannot be resolved ({str(err).splitlines()[0]})")
            continue
        if present and not rule.check(value):
            out.append(f"{key}={value!r}: expected {rule.expects}")
    return out


def group_choice(group: str) -> str | None:
    """The option of config group `group` in the Hydra run composing this process's config
    (None outside one)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().runtime.choices.get(group)
    except Exception:
        return None


def _experiments_for(data: str) -> list[str]:
    from megalab.utils.paths import CONFIG_DIR

    root = CONFIG_DIR / "experiment"
    return sorted(
        p.relative_to(root).with_suffix("").as_posix() for p in root.rglob(f"{data}.yaml")
    )


def unresolved(cfg: DictConfig) -> list[str]:
    """Settings whose interpolation cannot be resolved (a key no chosen group sets), found here
    rather than when the run's config is first written out. Only in a run: outside one,
    `${hydra:...}` has no Hydra state to read."""
    from hydra.core.hydra_config import HydraConfig

    out: list[str] = []
    if not HydraConfig.initialized():
        return out

    def walk(node: DictConfig | ListConfig, prefix: str) -> None:
        keys = range(len(node)) if isinstance(node, ListConfig) else list(node)
        for k in keys:
            full = f"{prefix}[{k}]" if isinstance(k, int) else f"{prefix}.{k}".lstrip(".")
            if full == "hydra":
                continue
            try:
                value = node[k]
            except OmegaConfBaseException as err:
                out.append(f"{full}: cannot be resolved ({str(err).splitlines()[0]})")
                continue
            # An interpolated container is a copy of a part walked where it is set.
            if isinstance(value, DictConfig | ListConfig) and not OmegaConf.is_interpolation(
                node, k
            ):
                walk(value, full)

    walk(cfg, "")
    return out


def model_task_problems(cfg: DictConfig) -> list[str]:
    """A classifier's task on a model that has no classifier head (the language models)."""
    task, model = cfg.get("task"), cfg.get("model")
    if not isinstance(task, DictConfig) or not isinstance(model, DictConfig):
        return []
    if not str(task.get("_target_", "")).endswith(("ClassificationTask", "RetrievalTask")):
        return []
    if "head_dropout" in model:
        return []
    from megalab.utils.paths import CONFIG_DIR

    with_head = sorted(
        p.relative_to(CONFIG_DIR / "model").with_suffix("").as_posix()
        for p in (CONFIG_DIR / "model").rglob("*.yaml")
        if "\nhead_dropout:" in "\n" + p.read_text()
    )
    name = group_choice("model") or "this model"
    return [
        f"model={name} is a language model: it sets no classifier head (model.head_dropout); "
        "train it with task=language_modeling on a language-modelling dataset, or classify "
        f"with model={', model='.join(with_head)}"
    ]


def task_data_problems(cfg: DictConfig) -> list[str]:
    """A task that cannot work with the data (a classifier on a corpus, and the reverse)."""
    task, data = cfg.get("task"), cfg.get("data")
    if not isinstance(task, DictConfig) or not isinstance(data, DictConfig):
        return []
    target = str(task.get("_target_", ""))
    data_name = group_choice("data") or str(data.get("_target_", "the data")).rsplit(".", 1)[-1]
    experiments = _experiments_for(data_name) if group_choice("data") else []
    suggestion = (
        f" (or an experiment: {', '.join('experiment=' + e for e in experiments)})"
        if experiments
        else " (or an experiment= that sets it up)"
    )
    try:
        classes = OmegaConf.select(data, "num_classes")
    except OmegaConfBaseException:
        classes = None
    if target.endswith(("ClassificationTask", "RetrievalTask")) and classes is None:
        if group_choice("data") and not experiments:
            # A corpus of one's own has no experiments of its name: PG-19's take it as data.
            keeping = [f"experiment={e} data={data_name}" for e in _experiments_for("pg19")]
            suggestion = f" (or a language-model experiment with this data: {', '.join(keeping)})"
        return [
            f"data={data_name} has no classes (data.num_classes is null): it is a language-"
            f"modelling dataset, which needs task=language_modeling{suggestion}"
        ]
    if target.endswith("LanguageModelingTask") and classes is not None:
        return [
            f"data={data_name} is a classification dataset ({classes} classes): use "
            f"task=classification (or task=retrieval for document pairs){suggestion}"
        ]
    return []


def trainer_problems(cfg: DictConfig) -> list[str]:
    """Trainer settings Lightning refuses together: a fraction of an epoch as the validation
    interval with validation by steps across epochs (`check_val_every_n_epoch: null`, as the
    experiments that validate every N steps set it)."""
    trainer = cfg.get("trainer")
    if not isinstance(trainer, DictConfig):
        return []
    interval = trainer.get("val_check_interval")
    if isinstance(interval, float) and trainer.get("check_val_every_n_epoch") is None:
        return [
            f"trainer.val_check_interval={interval!r} is a fraction of an epoch, which needs "
            "trainer.check_val_every_n_epoch (null here: validation every N training batches, "
            "across epochs): set trainer.check_val_every_n_epoch=1, or give the interval in "
            "training batches (an integer)"
        ]
    return []


def combination_problems(cfg: DictConfig) -> list[str]:
    """What a model's config dataclass refuses of its options together (`d_model` not a
    multiple of `norm_groups`, ...), found by building the dataclass alone (its checks; no
    model) and named by its key, before the data and the model are built."""
    out = []
    for part, node, config_class in _model_configs(cfg):
        try:
            values = OmegaConf.to_container(node, resolve=True)
        except OmegaConfBaseException:
            continue  # reported by `unresolved`
        assert isinstance(values, dict)
        try:
            config_class(**{str(k): v for k, v in values.items() if not str(k).startswith("_")})
        except ValueError as err:
            out.append(f"model.{part} ({config_class.__name__}): {err}")
        except TypeError:
            continue  # an unknown option: reported by `unknown_model_options`
    return out


def validate(cfg: DictConfig) -> None:
    """Raise `ConfigError` listing every setting of the wrong type or range (see module doc)."""
    found = problems(cfg) + unknown_model_options(cfg) + task_data_problems(cfg)
    headless = model_task_problems(cfg)
    found += headless + [
        p for p in unresolved(cfg) if not (headless and "'model.head_" in p) and p not in found
    ]
    if not found:  # each option fits its own rule: now the rules between them
        found = trainer_problems(cfg) + combination_problems(cfg)
    if found:
        lines = "\n".join(f"  {p}" for p in found)
        raise ConfigError(
            f"invalid setting{'s' if len(found) > 1 else ''}:\n{lines}\n"
            "Fix the override(s) on the command line (key=value), or the config file that sets "
            "them."
        )
