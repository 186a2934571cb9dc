"""Files that are data run nothing and write nowhere (docs/reliability.md, loading policy).

For each entry point that reads a run folder, a checkpoint, a sweep file, a table file or a cache,
the payloads a crafted file can carry: a pickle through a `torch.load` target or inside a
checkpoint, targets hidden behind interpolations, module attributes (`os.system`,
`builtins.exec`, `subprocess.Popen`), carried-state class names, sweep overrides (`+key=...`,
`_target_` in values), YAML tags and path escapes. Each case asserts that the marker file the
payload would create does not exist, that nothing was written outside the output folder, and
that the refusal names the file and the key.
"""

from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from omegaconf import OmegaConf, open_dict

from megalab.utils.checkpointing import CheckpointError, write_checkpoint
from megalab.utils.safe_config import UnsafeConfigError, check_targets, load_run_config

MODULE_TARGETS = ["os.system", "builtins.exec", "subprocess.Popen", "torch.load", "posix.system"]


class _RunsCode:
    """Unpickling this calls `os.system`: what a crafted file would do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


@pytest.fixture
def marker(tmp_path: Path) -> Iterator[Path]:
    """The file a payload would create; each test asserts it never appears."""
    path = tmp_path / "ran"
    yield path
    assert not path.exists(), "a payload ran"


def _pickle_payload(tmp_path: Path, marker: Path) -> Path:
    path = tmp_path / "payload.pkl"
    path.write_bytes(pickle.dumps(_RunsCode(marker)))
    return path


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


def _run_folder(tmp_path: Path, config: Any, name: str = "sent") -> tuple[Path, Path]:
    """A run folder someone sent: `.hydra/config.yaml` (a mapping or raw YAML text) and an
    empty, checksummed `checkpoints/last.ckpt`; returns (run folder, checkpoint)."""
    run = tmp_path / name
    (run / ".hydra").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    ckpt = run / "checkpoints" / "last.ckpt"
    write_checkpoint({"state_dict": {}}, ckpt)
    text = config if isinstance(config, str) else OmegaConf.to_yaml(OmegaConf.create(config))
    (run / ".hydra" / "config.yaml").write_text(text)
    return run, ckpt


# -- the policy itself --------------------------------------------------------------------------
@pytest.mark.parametrize("target", MODULE_TARGETS)
def test_module_attribute_targets_are_refused_naming_the_key(target: str) -> None:
    cfg = OmegaConf.create({"task": {"backbone": {"evil": {"_target_": target}}}})
    with pytest.raises(UnsafeConfigError, match=r"cfg\.yaml .*task\.backbone\.evil\._target_"):
        check_targets(cfg, "cfg.yaml")


def test_a_target_behind_an_interpolation_is_refused() -> None:
    cfg = OmegaConf.create(
        {
            "hidden": {"_target_": "os.system", "command": "true"},
            "task": {"backbone": "${hidden}"},
            "data": {"x": '${oc.decode:"{_target_: builtins.exec, source: 1}"}'},
        }
    )
    with pytest.raises(UnsafeConfigError, match=r"task\.backbone\._target_='os\.system'"):
        check_targets(cfg.task, "cfg.yaml (task)")
    with pytest.raises(UnsafeConfigError, match=r"data\.x\._target_='builtins\.exec'"):
        check_targets(OmegaConf.create({"data": cfg.data}), "cfg.yaml (data)")


def test_a_resolver_that_runs_code_is_never_resolved(tmp_path: Path, marker: Path) -> None:
    # A resolver some library registered: resolving the config would call it.
    OmegaConf.register_new_resolver("megalab_test_touch", lambda p: Path(p).touch() or "x")
    try:
        run, _ = _run_folder(tmp_path, {"task": {"name": f"${{megalab_test_touch:{marker}}}"}})
        with pytest.raises(UnsafeConfigError, match=r"config\.yaml.*task\.name.*megalab_test_t"):
            load_run_config(run / ".hydra" / "config.yaml")
    finally:
        OmegaConf.clear_resolver("megalab_test_touch")


def test_yaml_tags_are_refused_naming_the_file_and_line(tmp_path: Path, marker: Path) -> None:
    text = f"task:\n  x: !!python/object/apply:os.system ['touch {marker}']\n"
    run, _ = _run_folder(tmp_path, text)
    with pytest.raises(UnsafeConfigError, match=r"config\.yaml line 2 .*x: !!python"):
        load_run_config(run / ".hydra" / "config.yaml")


# -- megalab.cli.eval (and long-context eval, which shares its config) ---------------------------
def test_eval_refuses_a_torch_load_pickle_in_the_run_config(
    compose_cfg, tmp_path: Path, marker: Path
) -> None:
    from megalab.cli.eval import merge_run_config

    payload = _pickle_payload(tmp_path, marker)
    evil = {"_target_": "torch.load", "f": str(payload), "weights_only": False}
    task = {"_target_": "megalab.tasks.LanguageModelingTask", "sib": evil}
    _, ckpt = _run_folder(tmp_path, {"task": task})
    cfg = compose_cfg(f"ckpt_path={ckpt}", config="eval")
    with pytest.raises(UnsafeConfigError, match=r"sent/\.hydra/config\.yaml \(task\).*task\.sib"):
        merge_run_config(cfg, [f"ckpt_path={ckpt}"])


def test_eval_of_a_crafted_run_writes_no_data_anywhere(
    compose_cfg, tmp_path: Path, fixture_data_dir: Path
) -> None:
    """A run folder naming another directory with `generate_if_missing: true`: evaluation
    reads there, and neither generates nor writes anything."""
    import hydra

    from megalab.cli.eval import merge_run_config

    victim = tmp_path / "victim"
    victim.mkdir()
    run_cfg = compose_cfg("data=lra_listops")
    with open_dict(run_cfg):
        run_cfg.data.data_dir = str(victim)
        run_cfg.data.generate_if_missing = True
        del run_cfg["hydra"]
    _, ckpt = _run_folder(tmp_path, OmegaConf.to_yaml(run_cfg))
    cfg = compose_cfg(f"ckpt_path={ckpt}", config="eval")
    merged = merge_run_config(cfg, [f"ckpt_path={ckpt}"])
    assert merged.data.generate_if_missing is False
    with pytest.raises(FileNotFoundError, match="LRA ListOps files missing"):
        hydra.utils.instantiate(merged.data).prepare_data()
    assert _files(victim) == []
    # Asked on the command line, it may generate (the opt-in stays).
    asked = merge_run_config(
        compose_cfg(f"ckpt_path={ckpt}", "data.generate_if_missing=true", config="eval"),
        [f"ckpt_path={ckpt}", "data.generate_if_missing=true"],
    )
    assert asked.data.generate_if_missing is True


def test_eval_and_generate_read_the_runs_data_folder(compose_cfg, tmp_path: Path) -> None:
    """The run's `paths.data_dir` (a small ListOps folder, say), not this command's default;
    a `paths.data_dir` on the command line still wins."""
    from megalab.cli.eval import merge_run_config

    small = tmp_path / "small_data"
    run_cfg = compose_cfg(f"paths.data_dir={small}")
    with open_dict(run_cfg):
        del run_cfg["hydra"]
    _, ckpt = _run_folder(tmp_path, OmegaConf.to_yaml(run_cfg))
    for config in ("eval", "generate"):
        cfg = compose_cfg(f"ckpt_path={ckpt}", config=config, fast=config == "eval")
        with open_dict(cfg):
            cfg.paths.data_dir = str(tmp_path / "default_data")  # what ./data would be
        merged = merge_run_config(cfg, [f"ckpt_path={ckpt}"])
        assert Path(merged.data.data_dir).parent.parent == small, config
        assert merged.data.get("generate_if_missing") in (None, False)
    other = tmp_path / "given"
    cfg = compose_cfg(f"ckpt_path={ckpt}", f"paths.data_dir={other}", config="eval")
    merged = merge_run_config(cfg, [f"ckpt_path={ckpt}", f"paths.data_dir={other}"])
    assert Path(merged.data.data_dir).parent.parent == other
    # A root given for this command's own folders (its logs) keeps a data folder the run was
    # given (it read data below that root); it moves the data of a run that kept it below its
    # root, as a project moved to another disk does.
    root = tmp_path / "elsewhere"
    cfg = compose_cfg(f"ckpt_path={ckpt}", f"paths.root_dir={root}", config="eval")
    merged = merge_run_config(cfg, [f"ckpt_path={ckpt}", f"paths.root_dir={root}"])
    assert Path(merged.data.data_dir).parent.parent == small
    with open_dict(run_cfg):
        run_cfg.paths.data_dir = "${paths.root_dir}/data"  # the default, below the run's root
    _, below_root = _run_folder(tmp_path, OmegaConf.to_yaml(run_cfg), name="derived")
    cfg = compose_cfg(f"ckpt_path={below_root}", f"paths.root_dir={root}", config="eval")
    with open_dict(cfg):
        cfg.paths.data_dir = "${paths.root_dir}/data"  # the command's default, as run
    merged = merge_run_config(cfg, [f"ckpt_path={below_root}", f"paths.root_dir={root}"])
    assert Path(merged.data.data_dir).parent.parent == root / "data"


def test_eval_command_tests_on_the_runs_small_data_and_generates_nothing(
    compose_cfg, tmp_path: Path
) -> None:
    """`python -m megalab.cli.eval ckpt_path=<run>/checkpoints/last.ckpt` of a run trained on a
    small ListOps folder: tested on that folder, nothing generated into the default ./data."""
    import json

    from conftest import run_cli
    from megalab.cli.train import train

    run_cfg = compose_cfg("data=lra_listops")
    train(run_cfg)
    run = tmp_path / "run"
    (run / ".hydra").mkdir(exist_ok=True)
    with open_dict(run_cfg):
        del run_cfg["hydra"]
    (run / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(run_cfg))
    home = tmp_path / "elsewhere"  # this command's default data folder: <root>/data
    proc = run_cli(
        "-m", "megalab.cli.eval", f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}",
        f"hydra.run.dir={tmp_path / 'eval'}", "trainer=cpu", "logger=none",
        env={"MEGALAB_ROOT": str(home)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "eval" / "eval_metrics.json").read_text())
    assert "test/acc" in record["metrics"]
    # It read the run's folder: <root>/data has no ListOps (nor was the full 96K generated).
    assert not (home / "data").exists()


def test_long_context_eval_refuses_a_crafted_checkpoint(
    compose_cfg, tmp_path: Path, marker: Path
) -> None:
    from megalab.long_context import evaluate_long_context

    ckpt = tmp_path / "evil.ckpt"
    write_checkpoint({"state_dict": {}, "x": _RunsCode(marker)}, ckpt)
    cfg = compose_cfg(
        f"ckpt_path={ckpt}", "mode=long_context", "task=language_modeling", "data=enwik8",
        "model=llama", "model.d_model=16", "model.backbone.num_layers=1",
        "model.backbone.num_heads=2", "model.backbone.ffn_dim=16", config="eval", fast=False,
    )  # fmt: skip
    with pytest.raises(CheckpointError, match=r"evil\.ckpt is unreadable"):
        evaluate_long_context(cfg)
    assert not (tmp_path / "run" / "long_context.json").exists()


# -- megalab-generate -----------------------------------------------------------------------------
def test_generate_refuses_a_crafted_checkpoint(compose_cfg, tmp_path: Path, marker: Path) -> None:
    from megalab.cli.generate import load_task

    ckpt = tmp_path / "evil.ckpt"
    write_checkpoint({"state_dict": {}, "x": _RunsCode(marker)}, ckpt)
    cfg = compose_cfg(
        f"ckpt_path={ckpt}", "model=llama", "model.d_model=16", "model.backbone.num_layers=1",
        "model.backbone.num_heads=2", "model.backbone.ffn_dim=16", "data=enwik8",
        config="generate", fast=False,
    )  # fmt: skip
    with pytest.raises(CheckpointError, match=r"evil\.ckpt is unreadable"):
        load_task(cfg, torch.device("cpu"), torch.float32)


# -- megalab.cli.train resume: checkpoints and carried state ------------------------------------
def test_resume_reads_checkpoints_without_running_code(tmp_path: Path, marker: Path) -> None:
    from megalab.utils.checkpointing import AtomicCheckpointIO

    ckpt = tmp_path / "last.ckpt"
    write_checkpoint({"state_dict": {}, "loops": _RunsCode(marker)}, ckpt)
    with pytest.raises(CheckpointError, match=r"last\.ckpt is unreadable"):
        AtomicCheckpointIO().load_checkpoint(ckpt, weights_only=False)


@pytest.mark.parametrize("name", ["os:system", "builtins:exec", "subprocess:Popen"])
def test_resume_rebuilds_carried_state_only_from_the_allow_list(compose_cfg, name: str) -> None:
    import hydra

    from megalab.nn.state import UnsafeStateError

    cfg = compose_cfg(
        "task=language_modeling", "data=enwik8", "model=llama", "model.d_model=16",
        "model.backbone.num_layers=1", "model.backbone.num_heads=2", "model.backbone.ffn_dim=16",
        "task.carry_state=true", fast=False,
    )  # fmt: skip
    task = hydra.utils.instantiate(cfg.task)
    state = {"kind": "object", "class": name, "fields": {"command": "true"}}
    checkpoint = {"lm_train_state": {"ranks": [{"items": [[0, state]]}]}}
    with pytest.raises(UnsafeStateError, match=rf"refusing to rebuild.*{name}"):
        task.on_load_checkpoint(checkpoint)


def test_resume_never_deletes_files_a_checkpoint_records_elsewhere(tmp_path: Path) -> None:
    """The top-k bookkeeping deletes the files it records: a crafted record of paths outside
    the run's checkpoint folder is forgotten, so the next save deletes nothing there."""
    from megalab.utils.checkpointing import BestCheckpoint

    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    kept = str(folder / "best-1.ckpt")
    callback = BestCheckpoint(dirpath=str(folder), monitor="val/acc", mode="max", save_top_k=2)
    callback.load_state_dict(
        {
            "dirpath": str(folder),
            "best_model_score": torch.tensor(0.9),
            "best_model_path": str(victim),
            "kth_best_model_path": str(folder / ".." / ".." / "precious.txt"),
            "kth_value": torch.tensor(0.1),
            "best_k_models": {str(victim): torch.tensor(0.9), kept: torch.tensor(0.5)},
            "last_model_path": str(victim),
        }
    )
    assert list(callback.best_k_models) == [kept]
    assert callback.best_model_path == callback.kth_best_model_path == kept
    assert callback.last_model_path == "" and victim.read_text() == "keep me"


def test_resume_takes_only_a_wandb_id_from_the_run_folder(tmp_path: Path) -> None:
    from megalab.utils.run_folder import RunFolderError, reuse_wandb_run

    (tmp_path / "wandb").mkdir()
    (tmp_path / "wandb" / "run_id").write_text("${oc.env:HOME}\n")
    cfg = OmegaConf.create({"logger": {"wandb": {"id": None}}})
    with pytest.raises(RunFolderError, match=r"wandb/run_id: .* is not a W&B run id"):
        reuse_wandb_run(cfg, tmp_path)
    assert cfg.logger.wandb.id is None


# -- megalab.models.*.convert ---------------------------------------------------------------------
def test_llama_to_hf_refuses_a_torch_load_sibling_of_the_backbone(
    tmp_path: Path, marker: Path, capsys
) -> None:
    from megalab.models.llama.convert import main

    payload = _pickle_payload(tmp_path, marker)
    evil = {"_target_": "torch.load", "weights_only": False, "f": str(payload)}
    config = {
        "task": {
            "_target_": "megalab.tasks.LanguageModelingTask",
            "backbone": {"_target_": "megalab.models.llama.LlamaConfig"},
            "evil": evil,
        },
        "data": {"vocab_size": 10},
    }
    _, ckpt = _run_folder(tmp_path, config)
    out = tmp_path / "hf"
    assert main(["to-hf", str(ckpt), str(out)]) == 2
    err = capsys.readouterr().err
    assert "sent/.hydra/config.yaml (task)" in err and "task.evil._target_='torch.load'" in err
    assert not out.exists()


def test_llama_to_hf_copies_only_a_tokenizer(tmp_path: Path) -> None:
    from megalab.models.llama.convert import _is_hf_tokenizer

    secret = tmp_path / "id_rsa"
    secret.write_text("-----BEGIN PRIVATE KEY-----\n")
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": {}}}')
    assert not _is_hf_tokenizer(secret) and _is_hf_tokenizer(tokenizer)


def test_llama_from_hf_refuses_a_pickled_bin(tmp_path: Path, marker: Path) -> None:
    from megalab.models.llama.convert import load_hf_llama

    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    torch.save({"model.norm.weight": torch.ones(2), "x": _RunsCode(marker)},
               folder / "pytorch_model.bin")  # fmt: skip
    with pytest.raises(ValueError, match=r"pytorch_model\.bin: the checkpoint holds objects"):
        load_hf_llama(folder)


def test_reference_checkpoint_loaders_refuse_pickles(tmp_path: Path, marker: Path) -> None:
    from megalab.models.convert import load_fairseq_checkpoint
    from megalab.models.transformer_xl.convert import load_reference_checkpoint

    evil = tmp_path / "checkpoint_best.pt"
    torch.save({"model": {}, "model_state": {}, "x": _RunsCode(marker)}, evil)
    with pytest.raises(ValueError, match=r"checkpoint_best\.pt"):
        load_fairseq_checkpoint(evil)
    with pytest.raises(ValueError, match=r"checkpoint_best\.pt: not a state dict"):
        load_reference_checkpoint(evil)


# -- megalab-translate ----------------------------------------------------------------------------
def test_translate_refuses_a_pickled_checkpoint(tmp_path: Path, marker: Path, capsys) -> None:
    from megalab.cli.translate import main

    ckpt = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "text_pipeline": _RunsCode(marker)}, ckpt)
    assert main(["--checkpoint", str(ckpt), "--input", "-"]) == 2
    err = capsys.readouterr().err
    # refused before torch.load: a file with no readable checksum is not loaded unasked
    assert "megalab-translate: the checkpoint" in err and "evil.ckpt" in err
    assert not marker.exists()


def test_translate_refuses_a_language_that_is_a_path(tmp_path: Path) -> None:
    from megalab.cli.translate import CheckpointError as TranslateError
    from megalab.cli.translate import load_translator

    ckpt = tmp_path / "mt.ckpt"
    pipeline = {"source_lang": "../../etc/passwd", "target_lang": "de", "bpe": "", "symbols": []}
    spec = {"class": "TransformerEncoderDecoder", "config": {}}
    write_checkpoint({"state_dict": {}, "text_pipeline": pipeline, "seq2seq_model": spec}, ckpt)
    with pytest.raises(TranslateError, match=r"mt\.ckpt: text_pipeline\.source_lang"):
        load_translator(ckpt)


# -- megalab-tables -------------------------------------------------------------------------------
def test_tables_refuse_a_yaml_tag_in_a_run_folder(tmp_path: Path, marker: Path, capsys) -> None:
    from megalab.cli.tables import main

    tagged = f"seed: !!python/object/apply:os.system ['touch {marker}']\n"
    run, _ = _run_folder(tmp_path / "runs", tagged)
    (run / "metrics.json").write_text('{"metrics": {"test/acc": 0.5}}')
    with pytest.raises(SystemExit):
        main([str(tmp_path / "runs"), "--out", str(tmp_path / "tables")])
    err = capsys.readouterr().err
    assert "sent/.hydra/config.yaml line 1" in err and "seed: !!python" in err


# -- megalab-sweep ------------------------------------------------------------------------------
def _sweep(tmp_path: Path, command: list[str], parameters: dict[str, Any] | None = None) -> Path:
    path = tmp_path / "shared_sweep.yaml"
    spec = {
        "method": "grid",
        "command": ["python", "-m", "megalab.cli.train", "experiment=mega/lra_listops", *command],
        "parameters": parameters or {"seed": {"values": [1]}},
    }
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.parametrize(
    ("override", "why"),
    [
        ("+callbacks.zz={_target_:torch.load,f:x,weights_only:false}", "names a `_target_`"),
        ("data={_target_:os.system,command:true}", "names a `_target_`"),
        ("+trainer.evil=1", "adds or deletes a key"),
        ("~callbacks.last_checkpoint", "adds or deletes a key"),
        ("hydra.run.dir=/tmp/elsewhere", "sets `hydra.*`"),
        ("hydra.callbacks.x._target_=os.system", "names a `_target_`"),
        ("paths.data_dir=/etc", "sets `paths.*`"),
        ("experiment=../../../../tmp/evil", "path outside"),
        ("data.tokenizer=/home/someone/secret.json", "path outside"),
        ("seed=${megalab_test_touch:x}", "calls the resolver"),
    ],
)  # fmt: skip
def test_sweep_file_overrides_are_data(
    tmp_path: Path, marker: Path, capsys, override: str, why: str
) -> None:
    from megalab.cli.sweep import main

    path = _sweep(tmp_path, [override])
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        main([str(path), "--out", str(out)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"{path} (command)" in err and repr(override) in err and why in err
    assert not out.exists()


@pytest.mark.parametrize(
    ("parameters", "key"),
    [
        ({"+callbacks.zz": {"values": ["x"]}}, "parameters.+callbacks.zz"),
        ({"trainer.max_steps": {"values": [{"_target_": "os.system", "command": "true"}]}},
         "parameters.trainer.max_steps"),
    ],
)  # fmt: skip
def test_sweep_parameters_are_data(tmp_path: Path, capsys, parameters: dict, key: str) -> None:
    from megalab.cli.sweep import main

    path = _sweep(tmp_path, [], parameters)
    with pytest.raises(SystemExit):
        main([str(path), "--out", str(tmp_path / "out"), "--dry-run"])
    assert f"{path} ({key})" in capsys.readouterr().err


def test_sweep_parameter_keys_must_exist(tmp_path: Path, capsys) -> None:
    from megalab.cli.sweep import main

    path = _sweep(tmp_path, [], {"model.backbone.no_such_key": {"values": [1, 2]}})
    with pytest.raises(SystemExit):
        main([str(path), "--out", str(tmp_path / "out"), "--dry-run"])
    err = capsys.readouterr().err
    assert f"{path}: parameters.model.backbone.no_such_key: no such key" in err


def test_sweep_yaml_tags_are_refused(tmp_path: Path, marker: Path, capsys) -> None:
    from megalab.cli.sweep import main

    path = tmp_path / "tagged.yaml"
    path.write_text(f"method: grid\nname: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(SystemExit):
        main([str(path), "--dry-run"])
    assert f"{path} line 2" in capsys.readouterr().err


def test_allow_targets_on_the_command_line_trusts_the_file(tmp_path: Path, capsys) -> None:
    from megalab.cli.sweep import main

    path = _sweep(tmp_path, ["+extra_note=x"])
    with pytest.raises(SystemExit):  # refused by default
        main([str(path), "--dry-run"])
    capsys.readouterr()
    out = tmp_path / "out"
    assert main([str(path), "--allow-targets", "--dry-run", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "+extra_note=x" in printed and not out.exists()


def test_command_line_overrides_are_trusted(tmp_path: Path, capsys) -> None:
    from megalab.cli.sweep import main

    path = _sweep(tmp_path, [])
    assert main([str(path), "--dry-run", "+extra_note=x"]) == 0
    assert "+extra_note=x" in capsys.readouterr().out


# -- caches (megalab-data, every DataModule) ----------------------------------------------------
def test_a_cache_with_a_pickled_array_runs_nothing(tmp_path: Path, marker: Path) -> None:
    from megalab.data.cache import cache_dir, mark_prepared, prepared

    source = tmp_path / "source.txt"
    source.write_text("text\n")
    cache = cache_dir(tmp_path / "prepared", "demo", {"a": 1})
    np.save(cache / "tokens.npy", np.array([_RunsCode(marker)], dtype=object), allow_pickle=True)
    mark_prepared(cache, {"n": 1}, sources=[source])  # a whole crafted cache: checksums agree
    assert prepared(cache)
    # megalab's loaders memory-map cache arrays (megalab.data.base), which never unpickles.
    with pytest.raises(ValueError, match="Python objects"):
        np.load(cache / "tokens.npy", mmap_mode="r")
    with pytest.raises(ValueError, match="allow_pickle"):
        np.load(cache / "tokens.npy")


def test_eval_prepares_missing_data_in_its_output_folder_only(
    compose_cfg, fixture_data_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Evaluation writes nothing outside its output folder: data the run's folder has not
    prepared (here enwik8, raw archive only) is prepared below the output folder, and a
    finished cache is then read in place without its verification stamp being written."""
    import shutil

    import hydra

    from megalab.data.cache import caches_written_under

    data = tmp_path / "data"
    (data / "enwik8").mkdir(parents=True)  # the raw archive alone, nothing prepared yet
    shutil.copy(fixture_data_dir / "enwik8" / "enwik8.zip", data / "enwik8")

    def tree() -> dict[str, int]:
        return {str(p): p.stat().st_mtime_ns for p in data.rglob("*")}

    small = ["data.max_len=32", "data.valid_size=2000", "data.test_size=2000", "data.sha256=null"]

    def load(out: Path) -> None:
        cfg = compose_cfg("data=enwik8", f"paths.data_dir={data}", *small)
        with caches_written_under(out):
            dm = hydra.utils.instantiate(cfg.data)
            dm.prepare_data()
            dm.setup("test")
            assert next(iter(dm.test_dataloader()))["inputs"].shape[-1] == 32

    before = tree()
    with caplog.at_level(logging.INFO, logger="megalab.data.cache"):
        load(tmp_path / "eval1")
    # Said once, not at each time the data module asks for the folder.
    assert caplog.text.count("(the data folder is not written)") == 1
    assert tree() == before  # the data folder untouched
    assert list((tmp_path / "eval1" / "prepared").rglob(".complete"))
    # Prepared in the data folder (as training does), evaluation reads it and writes nothing.
    cfg = compose_cfg("data=enwik8", f"paths.data_dir={data}", *small)
    hydra.utils.instantiate(cfg.data).prepare_data()
    (stamp,) = data.rglob(".verified")
    stamp.unlink()
    before = tree()
    load(tmp_path / "eval2")
    assert tree() == before
    assert not (tmp_path / "eval2" / "prepared").exists()
