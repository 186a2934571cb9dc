"""Fast fault-injection cases (default suite): crafted data cannot run code, corrupt checkpoints
and caches are detected with clear messages, busy run folders are refused, bad settings name
their key. The kill matrix (subprocesses, DDP) is in test_kill_matrix.py (slow)."""

from __future__ import annotations

import argparse
import os
import resource
import signal
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from megalab.config_schema import ConfigError, validate
from megalab.data.cache import CacheError, cache_dir, mark_prepared, prepared
from megalab.models.convert import load_checkpoint
from megalab.utils.checkpointing import (
    AtomicCheckpointIO,
    CheckpointError,
    read_checkpoint,
    remove_stale_temporaries,
    write_checkpoint,
)
from megalab.utils.locking import RunFolderLockedError, lock_run_folder, unlock_run_folder
from megalab.utils.safe_config import UnsafeConfigError, check_targets

MARKER = "megalab-reliability-marker"


class _RunsCode:
    """Unpickling this calls `os.system`: what a crafted file would do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


# -- crafted data cannot run code ---------------------------------------------------------------
def test_crafted_fairseq_checkpoint_is_refused(tmp_path: Path) -> None:
    evil = tmp_path / "evil.pt"
    ran = tmp_path / "ran"
    torch.save({"model": {}, "args": argparse.Namespace(x=1), "x": _RunsCode(ran)}, evil)
    with pytest.raises(ValueError, match="holds objects other than tensors"):
        load_checkpoint(evil)
    assert not ran.exists()


def test_crafted_run_checkpoint_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    ckpt = tmp_path / "last.ckpt"
    ran = tmp_path / "ran"
    write_checkpoint({"state_dict": {}, "x": _RunsCode(ran)}, ckpt)
    with pytest.raises(CheckpointError, match="unreadable"):
        read_checkpoint(ckpt)
    assert not ran.exists()


def test_crafted_carried_state_cannot_call_anything() -> None:
    from megalab.nn.state import UnsafeStateError, unpack_state

    packed = {"kind": "object", "class": "torch:os.system", "fields": {"command": "true"}}
    with pytest.raises(UnsafeStateError, match="refusing to rebuild"):
        unpack_state(packed)


@pytest.mark.parametrize(
    "target",
    ["torch.load", "os.system", "subprocess.run",
     "megalab.utils.checkpointing.callbacks.subprocess.call",
     "megalab.utils.run.atomic_write_text", "builtins.eval"],
)  # fmt: skip
def test_run_folder_config_cannot_name_other_targets(target: str) -> None:
    cfg = OmegaConf.create({"data": {"_target_": target, "f": "x", "weights_only": False}})
    with pytest.raises(UnsafeConfigError, match="names objects megalab does not build"):
        check_targets(cfg, "run/.hydra/config.yaml")


def test_run_folder_config_with_megalab_targets_passes() -> None:
    cfg = OmegaConf.create(
        {
            "task": {"_target_": "megalab.tasks.ClassificationTask"},
            "optim": {"optimizer": {"_target_": "torch.optim.AdamW"}},
            "scheduler": {"_target_": "megalab.optim.linear_warmup_decay"},
        }
    )
    check_targets(cfg, "config")


def test_eval_refuses_a_crafted_run_config(compose_cfg, tmp_path: Path) -> None:
    from megalab.cli.eval import merge_run_config

    run = tmp_path / "sent"
    (run / ".hydra").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    ckpt = run / "checkpoints" / "last.ckpt"
    write_checkpoint({"state_dict": {}}, ckpt)
    crafted = {
        "data": {"_target_": "torch.load", "f": str(tmp_path / "x.pkl"), "weights_only": False}
    }
    (run / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(crafted)))
    cfg = compose_cfg(f"ckpt_path={ckpt}", config="eval")
    with pytest.raises(UnsafeConfigError, match=r"torch\.load"):
        merge_run_config(cfg, [f"ckpt_path={ckpt}"])


# -- checkpoints: atomic, verified ---------------------------------------------------------------
def test_checkpoint_round_trip_and_bit_flip_is_detected(tmp_path: Path) -> None:
    ckpt = tmp_path / "last.ckpt"
    best = tmp_path / "best-epoch_000-step_0000002.ckpt"
    write_checkpoint({"w": torch.arange(1000.0), "global_step": 3}, ckpt)
    write_checkpoint({"w": torch.zeros(3), "global_step": 2}, best)
    assert torch.equal(read_checkpoint(ckpt)["w"], torch.arange(1000.0))
    data = bytearray(ckpt.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size, one bit
    ckpt.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(ckpt)
    message = str(err.value)
    assert "is corrupt" in message and str(ckpt) in message and str(best) in message


@pytest.mark.parametrize("content", [b"", b"not a checkpoint at all", b"PK\x03\x04" + b"\0" * 50])
def test_empty_or_foreign_checkpoint_fails_naming_the_file(tmp_path: Path, content: bytes) -> None:
    ckpt = tmp_path / "last.ckpt"
    ckpt.write_bytes(content)
    with pytest.raises(CheckpointError, match=str(ckpt)):
        read_checkpoint(ckpt)


def test_truncated_checkpoint_fails_naming_the_file(tmp_path: Path) -> None:
    ckpt = tmp_path / "last.ckpt"
    write_checkpoint({"w": torch.randn(5000)}, ckpt)
    ckpt.write_bytes(ckpt.read_bytes()[:-3000])
    with pytest.raises(CheckpointError, match=r"last\.ckpt"):
        read_checkpoint(ckpt)


@pytest.mark.parametrize("where", ["tag", "length"])
def test_damaged_checksum_is_refused_unless_loading_unverified(tmp_path: Path, where: str) -> None:
    """One byte of the checksum's tag (or of the comment length before it) and one of the
    content changed: the file is refused, not loaded unverified with a warning."""
    ckpt = tmp_path / "last.ckpt"
    write_checkpoint({"exp_avg": torch.ones(1000), "global_step": 3}, ckpt)
    data = bytearray(ckpt.read_bytes())
    data[-(64 + 15) if where == "tag" else -(64 + 15 + 2)] ^= 0x01  # "megalab-sha256:" / length
    data[len(data) // 2] ^= 0x01
    ckpt.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="no readable checksum") as err:
        read_checkpoint(ckpt)
    assert str(ckpt) in str(err.value) and "ckpt_verify=false" in str(err.value)
    assert isinstance(read_checkpoint(ckpt, verify=False), dict)  # the user's explicit choice
    assert AtomicCheckpointIO(verify=False).verify is False


def test_ckpt_verify_false_still_refuses_a_checksum_mismatch(tmp_path: Path) -> None:
    ckpt = tmp_path / "last.ckpt"
    write_checkpoint({"w": torch.arange(1000.0)}, ckpt)
    data = bytearray(ckpt.read_bytes())
    data[len(data) // 2] ^= 0x01
    ckpt.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="is corrupt"):
        read_checkpoint(ckpt, verify=False)


@pytest.mark.parametrize("written_by", ["torch.save", "megalab"])
def test_foreign_checkpoint_is_refused_on_resume_and_eval(
    compose_cfg, tmp_path: Path, written_by: str
) -> None:
    """A dict that is no run's checkpoint as `last.ckpt`: one message naming the file and what
    to pass instead (no KeyError from inside Lightning), when resuming and when evaluating."""
    from megalab.cli.eval import evaluate
    from megalab.cli.train import train
    from megalab.utils.errors import actionable

    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    if written_by == "torch.save":
        torch.save({"a": torch.zeros(3)}, ckpt)
        expected = "no readable checksum"
    else:
        write_checkpoint({"a": torch.zeros(3)}, ckpt)
        expected = "is not a checkpoint of a megalab run"
    for cfg in (
        compose_cfg("ckpt_path=last"),
        compose_cfg(f"ckpt_path={ckpt}", "use_run_config=false", config="eval"),
    ):
        with pytest.raises(Exception) as err:
            (train if cfg.task_name == "train" else evaluate)(cfg)
        found = actionable(err.value)
        assert isinstance(found, CheckpointError), err.value
        assert expected in str(found) and str(ckpt) in str(found)
        assert not isinstance(err.value, KeyError)


def _in_child(fn: Callable[[], int]) -> int:
    """Run `fn` in a forked child (this process's imports, no new interpreter) and return its
    exit status: what `fn` returns, 1 if it raised."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            code = fn()
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_full_disk_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    """RLIMIT_FSIZE (in a child process) makes writes past a size fail as a full disk does."""
    ckpt = tmp_path / "last.ckpt"
    write_checkpoint({"w": torch.zeros(10)}, ckpt)
    before = ckpt.read_bytes()

    def write_on_a_full_disk() -> int:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
        try:
            write_checkpoint({"w": torch.randn(1_000_000)}, ckpt)
        except CheckpointError as err:
            return 0 if "previous last.ckpt is kept" in str(err) else 3
        return 2

    assert _in_child(write_on_a_full_disk) == 0
    assert ckpt.read_bytes() == before
    assert not list(tmp_path.glob(".*.tmp")), "the temporary file is removed"


def test_stale_temporary_files_are_removed(tmp_path: Path) -> None:
    stale = tmp_path / ".last.ckpt.1234.tmp"
    stale.write_bytes(b"half")
    assert remove_stale_temporaries(tmp_path) == [stale] and not stale.exists()


# -- run folders ---------------------------------------------------------------------------------
def test_a_busy_run_folder_is_refused(tmp_path: Path) -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child holds the lock until it is killed
        try:
            lock_run_folder(tmp_path)
            os.write(write, b"L")
            time.sleep(60)
        finally:
            os._exit(0)
    try:
        assert os.read(read, 1) == b"L"
        with pytest.raises(RunFolderLockedError, match=f"process {pid}"):
            lock_run_folder(tmp_path)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read)
        os.close(write)
    lock_run_folder(tmp_path)  # free again once the holder is gone (even killed)
    unlock_run_folder(tmp_path)


def test_a_fresh_run_over_an_earlier_one_is_refused(compose_cfg, tmp_path: Path) -> None:
    from megalab.utils.run_folder import RunFolderError, start_run

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    write_checkpoint({"global_step": 5}, run / "checkpoints" / "last.ckpt")
    with pytest.raises(RunFolderError, match="ckpt_path=last"):
        start_run(compose_cfg(), run)
    unlock_run_folder(run)
    assert start_run(compose_cfg("ckpt_path=last"), run) == str(run / "checkpoints" / "last.ckpt")
    unlock_run_folder(run)


# -- caches --------------------------------------------------------------------------------------
def _cache(tmp_path: Path) -> tuple[Path, Path]:
    source = tmp_path / "source.txt"
    source.write_text("some source text\n")
    cache = cache_dir(tmp_path / "prepared", "demo", {"a": 1})
    np.save(cache / "tokens.npy", np.arange(100, dtype=np.int16))
    mark_prepared(cache, {"n": 100}, sources=[source])
    return cache, source


def test_cache_corruption_is_detected(tmp_path: Path) -> None:
    cache, _ = _cache(tmp_path)
    assert prepared(cache)
    tokens = cache / "tokens.npy"
    data = bytearray(tokens.read_bytes())
    data[-10] ^= 0x7F  # changed ids, same size: the file's status changed, so it is re-hashed
    tokens.write_bytes(bytes(data))
    with pytest.raises(CacheError, match=f"{tokens}.*is corrupt.*Delete {cache}"):
        prepared(cache)


def test_truncated_cache_names_the_file(tmp_path: Path) -> None:
    cache, _ = _cache(tmp_path)
    tokens = cache / "tokens.npy"
    tokens.write_bytes(tokens.read_bytes()[:-20])
    with pytest.raises(CacheError, match="truncated or overwritten"):
        prepared(cache)


def test_source_edited_in_place_with_same_size_and_mtime(tmp_path: Path) -> None:
    cache, source = _cache(tmp_path)
    st = source.stat()
    source.write_text("SOME SOURCE TEXT\n")  # same size
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns))  # same mtime (ctime still moves)
    with pytest.raises(CacheError, match=r"source file .* changed"):
        prepared(cache)


@pytest.mark.parametrize("how", ["move", "copy"])
def test_moved_data_root_checks_the_moved_sources(tmp_path: Path, how: str) -> None:
    """The marker names sources relative to the cache: after the data root is moved (or copied,
    the old files left as they were), a one-byte change of the moved source with the same size
    and mtime is refused, naming the moved file; a clean move is accepted."""
    import shutil

    root = tmp_path / "root"
    root.mkdir()
    cache, source = _cache(root)
    assert prepared(cache)
    for name in ("clean", "edited"):
        moved = tmp_path / name
        (shutil.copytree if how == "copy" else shutil.move)(root, moved)
        if how == "move":
            shutil.copytree(moved, root)  # for the next case
        moved_cache = moved / cache.relative_to(root)
        moved_source = moved / source.relative_to(root)
        if name == "clean":
            assert prepared(moved_cache)
            continue
        st = moved_source.stat()
        data = bytearray(moved_source.read_bytes())
        data[3] ^= 0x01
        moved_source.write_bytes(bytes(data))
        os.utime(moved_source, ns=(st.st_atime_ns, st.st_mtime_ns))
        with pytest.raises(CacheError, match=f"source file {moved_source} changed"):
            prepared(moved_cache)


def test_cache_marked_with_absolute_source_paths_is_still_checked(tmp_path: Path) -> None:
    """A marker of an earlier version (sources keyed by absolute path) keeps its check."""
    import json

    cache, source = _cache(tmp_path)
    marker = json.loads((cache / ".complete").read_text())
    marker["integrity"]["sources"] = {
        str(source): {k: v for k, v in entry.items() if k != "absolute"}
        for entry in marker["integrity"]["sources"].values()
    }
    (cache / ".complete").write_text(json.dumps(marker))
    (cache / ".verified").unlink()
    assert prepared(cache)
    source.write_text("SOME SOURCE TEXT\n")
    with pytest.raises(CacheError, match=r"source file .* changed"):
        prepared(cache)


def test_object_array_in_a_cache_is_refused_with_a_message(tmp_path: Path) -> None:
    """An `.npy` of Python objects (with a marker that matches it) fails naming the file, not
    with numpy's `allow_pickle=False` error."""
    from megalab.data.base import TokenSequences, cached_sequences

    def build() -> TokenSequences:
        return TokenSequences(np.arange(6), np.array([0, 3, 6]), np.array([0, 1]))

    cached_sequences(tmp_path, "demo", {"a": 1}, build)
    (cache,) = (tmp_path / "demo").iterdir()
    np.save(cache / "tokens.npy", np.array([{"a": 1}] * 6, dtype=object), allow_pickle=True)
    mark_prepared(cache, {"sequences": 2})  # its checksums now describe the replaced file
    with pytest.raises(CacheError, match=f"{cache / 'tokens.npy'} holds Python objects"):
        cached_sequences(tmp_path, "demo", {"a": 1}, build)


class _DiesInWorker(torch.utils.data.Dataset):
    """Its worker process is killed (SIGKILL, as the out-of-memory killer does) at item 1."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.zeros(1)


def test_killed_dataloader_worker_gives_one_message(capsys) -> None:
    from megalab.utils.errors import reported

    loader = torch.utils.data.DataLoader(_DiesInWorker(), batch_size=1, num_workers=1)
    with pytest.raises(SystemExit) as exit_info, reported():
        list(loader)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "a data-loading worker process died: DataLoader worker (pid" in err
    assert "out-of-memory killer" in err and "data.num_workers" in err


@pytest.mark.parametrize(
    ("kind", "message", "said"),
    [
        (
            "UsageError",
            "No API key configured. Use `wandb login` to log in.",
            "W&B would not start the run: No API key configured. Use `wandb login` to log in "
            "(once; or set WANDB_API_KEY), or log offline with logger.wandb.offline=true",
        ),
        (
            "CommError",
            "Failed to get resume status for run x: context deadline exceeded\n"
            "while retrying: Post: no such host",
            "W&B could not reach its server: Failed to get resume status for run x: context "
            "deadline exceeded while retrying: Post: no such host. Check the network",
        ),
    ],
    ids=["no-api-key", "no-server"],
)
def test_wandb_refusing_an_online_run_is_one_message(
    capsys, kind: str, message: str, said: str
) -> None:
    """`logger.wandb.offline=false` without `wandb login`, or without a route to the server:
    W&B's error (raised where the logger first starts its run) is the message, with what to do,
    not a traceback through Lightning's logger."""
    import wandb.errors

    from megalab.utils.errors import reported

    with pytest.raises(SystemExit), reported():
        try:
            raise getattr(wandb.errors, kind)(message)
        except Exception as err:  # as the logger's first use wraps it: any chain will do
            raise RuntimeError("logging the hyperparameters failed") from err
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("Error: ") == 1
    assert err.strip().startswith(f"Error: {said}"), err
    assert "wandb sync <run folder>/wandb" in err


@pytest.mark.parametrize("damage", ["missing", "garbage"])
def test_generate_refusals_are_one_message(tmp_path: Path, damage: str) -> None:
    from conftest import run_cli

    ckpt = tmp_path / "last.ckpt"
    if damage == "garbage":
        ckpt.write_bytes(b"PK\x03\x04" + b"\0" * 200)
    proc = run_cli(
        "-m", "megalab.cli.generate", f"ckpt_path={ckpt}", f"hydra.run.dir={tmp_path / 'out'}"
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    expected = "checkpoint not found" if damage == "missing" else "has no readable checksum"
    error = proc.stderr[proc.stderr.index("Error: ") :]
    assert expected in error and str(ckpt) in error


def test_listops_over_long_inputs_fail_unless_truncate(tmp_path: Path, caplog) -> None:
    from megalab.data.base import TruncationError
    from megalab.data.lra.listops import ListOpsDataModule
    from megalab.testing import listops

    listops.write(tmp_path)
    folder = tmp_path / "lra" / "listops"
    with pytest.raises(TruncationError, match=r"longer than data.max_len=8.*data.truncate=true"):
        ListOpsDataModule(folder, max_len=8, generate_if_missing=False).setup()
    dm = ListOpsDataModule(folder, max_len=8, generate_if_missing=False, truncate=True)
    dm.setup()
    assert "cut to that length" in caplog.text


# -- settings ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("trainer.max_steps=abc", "trainer.max_steps"),
        ("data.batch_size=abc", "data.batch_size"),
        ("seed=abc", "seed"),
        ("optim.optimizer.lr=fast", "optim.optimizer.lr"),
        ("trainer.val_check_interval=0", "trainer.val_check_interval"),
        ("model.backbone.num_layers=0", "model.backbone.num_layers"),
        ("data.eval_batch_size=0", "data.eval_batch_size"),
        ("trainer.max_time=20h", "trainer.max_time"),
        ("trainer.max_time={hour: 20}", "trainer.max_time"),
        ("trainer.profiler=detailed", "trainer.profiler"),
    ],
)
def test_bad_values_name_their_key(compose_cfg, override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=f"{key}="):
        validate(compose_cfg(override))


@pytest.mark.parametrize("value", ["00:20:00:00", "{hours: 20}", "{days: 1, minutes: 30.5}"])
def test_a_time_limit_is_taken_in_lightnings_forms(compose_cfg, value: str) -> None:
    validate(compose_cfg(f"trainer.max_time={value}"))


def test_a_choice_lists_each_value_once(compose_cfg) -> None:
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg("trainer.precision=fp8"))
    listed = str(err.value).split("expected one of ")[1].splitlines()[0].split(", ")
    assert "bf16-mixed" in listed and len(listed) == len(set(listed))  # 16 and "16": one "16"


def test_language_model_data_with_a_classifier_says_what_to_use(compose_cfg) -> None:
    with pytest.raises(ConfigError, match="task=language_modeling"):
        validate(compose_cfg("data=enwik8"))
    # A corpus of one's own has no experiment of its name: the PG-19 ones take it as data.
    with pytest.raises(ConfigError, match="experiment=megalodon/pg19 data=text_corpus"):
        validate(compose_cfg("data=text_corpus"))


def test_an_option_of_another_model_is_named_before_anything_is_built(compose_cfg) -> None:
    """`experiment=quickstart` sets a Transformer's `num_heads`; with `model=seqboat` Hydra's
    instantiation failed on it with a bare TypeError. It removes with `~key`."""
    cfg = compose_cfg("experiment=quickstart", "model=seqboat")
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert str(err.value).splitlines()[1].strip() == (
        "model.backbone.num_heads: SeqBoatConfig (model=seqboat) has no such option; a config "
        "made for another model (an experiment=) may set it: ~model.backbone.num_heads removes it"
    )
    validate(compose_cfg("experiment=quickstart", "model=seqboat", "~model.backbone.num_heads"))
    with pytest.raises(ConfigError, match=r"no such option \(did you mean num_layers\?\)"):
        validate(compose_cfg("+model.backbone.num_layer=2"))


def test_options_that_do_not_fit_together_are_named_before_anything_is_built(
    compose_cfg,
) -> None:
    """Each option in range, the pair not (the config dataclass's own check): one message
    naming the model's config, not a bare ValueError from inside the task's instantiation."""
    cfg = compose_cfg("experiment=megalodon/sc10", "model.d_model=16")
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert str(err.value).splitlines()[1] == (
        "  model.backbone (MegalodonConfig): d_model=16 must be a multiple of norm_groups=12"
    )
    validate(compose_cfg("experiment=megalodon/sc10", "model.d_model=24"))


def test_a_fraction_of_an_epoch_with_validation_by_steps_says_what_to_set(compose_cfg) -> None:
    """The experiments that validate every N steps set check_val_every_n_epoch to null, where
    Lightning refuses a fraction as the interval: its MisconfigurationException came inside
    Hydra's instantiation error, after the data was prepared."""
    # As the quickstart sets it; the tests' fast trainer validates once per epoch instead.
    by_steps = ("experiment=quickstart", "trainer.check_val_every_n_epoch=null")
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg(*by_steps, "trainer.val_check_interval=0.5"))
    assert str(err.value).splitlines()[1] == (
        "  trainer.val_check_interval=0.5 is a fraction of an epoch, which needs "
        "trainer.check_val_every_n_epoch (null here: validation every N training batches, "
        "across epochs): set trainer.check_val_every_n_epoch=1, or give the interval in "
        "training batches (an integer)"
    )
    for fix in ("trainer.check_val_every_n_epoch=1", "trainer.val_check_interval=100"):
        validate(compose_cfg(*by_steps, "trainer.val_check_interval=0.5", fix))


def test_a_language_model_asked_to_classify_says_what_to_use(compose_cfg) -> None:
    """The classification task reads the model's head settings, which the language models
    lack: an interpolation error when the config was written out, before."""
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg("experiment=quickstart", "model=lamemo"))
    lines = str(err.value).splitlines()[1:-1]
    assert lines == [
        "  model=lamemo is a language model: it sets no classifier head (model.head_dropout); "
        "train it with task=language_modeling on a language-modelling dataset, or classify with "
        "model=llama, model=mega, model=megalodon_classifier, model=s4d, model=seqboat, "
        "model=transformer"
    ]


def test_a_setting_that_cannot_be_resolved_is_named(compose_cfg) -> None:
    with pytest.raises(ConfigError, match=r"task\.extra: cannot be resolved \(.*model\.nothing"):
        validate(compose_cfg("+task.extra=${model.nothing}"))


def test_an_option_that_is_not_there_lists_the_nested_ones() -> None:
    """Hydra lists only a group's top folder ("Available options in 'experiment': quickstart");
    the hint names the close options in every folder, and those of the folder asked for."""
    from megalab.utils.errors import explain_composition_error

    hint = explain_composition_error("train", ["experiment=megalodon/enwik8"])
    assert hint is not None
    first, folder = hint.splitlines()
    assert "did you mean: experiment=lamemo/enwik8, experiment=mega/enwik8" in first
    assert folder.startswith("The options under experiment/megalodon/: imagenet, lra_image")
    assert "wikitext103" in folder
    hint = explain_composition_error("train", ["model=megalodon/7B"])
    assert hint is not None and "did you mean: model=megalodon/7b" in hint
    hint = explain_composition_error("eval", ["ckpt_path=x", "experiment=nothing"])
    assert hint is not None and "more options of experiment in its folders: lamemo, llama" in hint


def test_misspelled_key_lists_the_closest(fixture_data_dir: Path) -> None:
    from megalab.utils.errors import explain_composition_error

    hint = explain_composition_error("train", ["model.backbone.num_layerz=2"])
    assert hint is not None and "model.backbone.num_layers" in hint
    hint = explain_composition_error("train", ["lr=0.1"])
    assert hint is not None and "optim.optimizer.lr" in hint
    # The right name under the wrong group: the key that has it comes first.
    hint = explain_composition_error("train", ["model.compile=true"])
    assert hint is not None and "did you mean: task.compile" in hint
    # Hydra names the first bad key only; the hint names each.
    argv = ["experiment=transformer/wmt16_en_de", "model.encoder_layers=1",
            "model.decoder_layers=1", "trainer.max_steps=2"]  # fmt: skip
    hint = explain_composition_error("train", argv)
    lines = (hint or "").splitlines()
    assert len(lines) == 2, hint
    for line, part in zip(lines, ("encoder", "decoder"), strict=True):
        assert line.startswith(
            f"'model.{part}_layers' is not a key of this configuration; did you mean: "
            f"model.encoder_decoder.{part}_layers, "
        ), hint
