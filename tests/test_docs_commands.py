"""README.md and docs/*.md run as written, shrunk onto the fixture datasets.

Every `bash`, `console` and `python` block of the documentation is either run here or carries a
`docs-test: skip (CATEGORY: why)` marker (the markers: tests/docs_snippets.py). Each document runs
in a folder of its own laid out like a checkout (`data/` holds the fixture datasets, `sweeps/`,
`tables/`, `benchmarks/` and `docs/` are copies; `MEGALAB_ROOT` and `HOME` point there), its
blocks in order, so a later block finds what an earlier one wrote (`<run>`: the newest run).

Commands run in this process through their entry points (`megalab-train` is
`megalab.cli.train:main`, `python -m megalab.X` is `megalab.X.main`, `python script.py` runs the
script), which saves the seconds each interpreter takes to import torch. A generic shrink makes
them fast: training and evaluation take the smoke trainer (2 CPU steps, one validation and test
batch, the CSV logger) and the fixture sizes of tests/test_experiments.py; `megalab-data` takes
the fixture sizes too.
`make` lines run as `make -n`. What is not run is still checked: a skipped (or slow-suite)
`megalab-train`/`-eval`/`-generate` command is composed by Hydra and validated, and every
`--option` a command names is one its program's `--help` lists.
"""

from __future__ import annotations

import contextlib
import glob
import io
import json
import logging
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from conftest import FAST, ROOT
from docs_snippets import (
    DOCS,
    SHOWN_LANGUAGES,
    Block,
    Command,
    MarkerError,
    all_blocks,
    blocks,
    merge_arguments,
    with_keywords,
)
from megalab.utils.paths import CONFIG_DIR
from test_experiments import EXPERIMENT_OVERRIDES, FIXTURE_OVERRIDES

# Console scripts (pyproject.toml) -> "module:function".
SCRIPTS = dict(
    re.findall(r'^(megalab-[\w-]+) = "([\w.]+:\w+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
)
# Hydra applications and the config each composes.
HYDRA_APPS = {
    "megalab.cli.train": "train",
    "megalab.cli.eval": "eval",
    "megalab.cli.generate": "generate",
}
# What a run's folder is called in a command: replaced by the newest run this document made.
RUN_PLACEHOLDER = re.compile(r"(?:logs/train/runs/)?<(?:run|time)>")
# `megalab-data <subcommand>` -> the data config it prepares (those taking overrides).
DATA_COMMANDS = {
    "enwik8": "enwik8",
    "text8": "text8",
    "wikitext103": "wikitext103",
    "pg19": "pg19",
    "wmt16": "wmt16_en_de",
}
# Folders of the checkout a document's commands read (copied: a command may write into them).
CHECKOUT = ("sweeps", "tables", "benchmarks", "docs")


def _news_en(folder: Path) -> None:
    """English sentences to translate (the WMT fixture's first test sentences)."""
    (folder / "news.en").write_text("The weather is nice today .\nWe like to read books .\n")


def _my_experiment(folder: Path) -> None:
    """An experiment of one's own: the quick start's, under another name."""
    target = folder / "my_configs" / "experiment" / "my" / "experiment.yaml"
    target.parent.mkdir(parents=True)
    shutil.copy(CONFIG_DIR / "experiment" / "quickstart.yaml", target)


# What `given NAME` markers name: files written into the document's folder.
FILES: dict[str, Callable[[Path], None]] = {
    "news.en": _news_en,
    "$HOME/my_configs/experiment/my/experiment.yaml": _my_experiment,
}
# ... and Python variables, each a fixture of this module of the same name.
VARIABLES = {"export_folder"}


@dataclass
class Outcome:
    """What a command or snippet returned and printed."""

    code: int
    output: str


def hydra_overrides(words: Sequence[str]) -> list[str]:
    """The Hydra overrides of a `megalab-train`-like command (words after the program)."""
    start = 3 if words[0] == "python" else 1
    return [w for w in words[start:] if not w.startswith("-")]


def app_of(command: Command) -> str | None:
    """The module a command runs (`megalab.cli.train` for `megalab-train` and `python -m ...`)."""
    words = command.words
    if words[0] in SCRIPTS:
        return SCRIPTS[words[0]].partition(":")[0]
    if words[:2] == ("python", "-m") and len(words) > 2 and words[2].startswith("megalab"):
        return words[2]
    return None


def runnable(command: Command) -> bool:
    """Whether this test knows how to run `command` (placeholders aside)."""
    words = command.words
    if not words or command.env:
        return False
    if words[0] == "make" or app_of(command):
        return True
    return words[0] == "python" and len(words) > 1 and words[1].endswith(".py")


def unresolved(command: Command) -> list[str]:
    """Placeholders (`<...>`) of a command that this test cannot fill in."""
    rest = [RUN_PLACEHOLDER.sub("", w).replace("<runs_folder>", "") for w in command.words]
    return [w for w in rest if re.search(r"<[^>]+>", w)]


def composed(config: str, overrides: list[str]) -> DictConfig:
    """`config` composed with `overrides` by Hydra (`-m` sweeps: their first values)."""
    first = [re.sub(r"=([^,\[\]]+),.*$", r"=\1", o) if "[" not in o else o for o in overrides]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
            return compose(config, overrides=first, return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()


def shrink(words: Sequence[str], app: str | None) -> list[str]:
    """What makes a command run in seconds on the fixtures (added before the block's `with`)."""
    if app == "megalab.cli.train":
        overrides = hydra_overrides(words)
        names_trainer = any(o.lstrip("+").startswith("trainer=") for o in overrides)
        try:
            choices = composed("train", overrides).hydra.runtime.choices
        except Exception:  # the command itself fails then, saying why
            choices = {}
        data, experiment = choices.get("data"), choices.get("experiment")
        return [
            *(o for o in FAST if not (names_trainer and o.startswith("trainer="))),
            "logger=csv",  # the default: the curves read it (W&B starts a service process)
            "trainer.accumulate_grad_batches=1",
            "data.batch_size=4",
            "data.eval_batch_size=4",
            *FIXTURE_OVERRIDES.get(data, []),
            *EXPERIMENT_OVERRIDES.get(experiment, []),
        ]
    if app == "megalab.cli.eval":
        named = any(o.startswith("trainer=") for o in hydra_overrides(words))
        return [*([] if named else ["trainer=cpu"]), "trainer.limit_test_batches=1"]
    if app == "megalab.cli.data" and len(words) > 1 and words[1] in DATA_COMMANDS:
        return [
            o for o in FIXTURE_OVERRIDES.get(DATA_COMMANDS[words[1]], []) if o.startswith("data.")
        ]
    return []


class DocumentRun:
    """Runs the blocks of one document in its folder, in order, in this process."""

    def __init__(
        self,
        folder: Path,
        capfd: pytest.CaptureFixture[str],
        variables: dict[str, object],
        slow: bool,
    ) -> None:
        self.folder = folder
        self.slow = slow
        self.capfd = capfd
        self.namespace: dict[str, object] = {"__name__": "__docs__", **variables}

    # -- placeholders --------------------------------------------------------------------
    def newest_run(self, experiment: str | None) -> Path:
        """The newest run folder under logs/ (of `experiment`, when given)."""
        runs = []
        for path in (self.folder / "logs").rglob("metrics.json"):
            record = json.loads(path.read_text())
            if experiment is None or record.get("experiment") == experiment:
                runs.append(path.parent)
        assert runs, f"no run{f' of {experiment}' if experiment else ''} to stand for <run>"
        return max(runs, key=lambda p: p.stat().st_mtime)

    def resolve(self, command: Command) -> list[str]:
        """The command's words with `<run>`, `<runs folder>` and `...` globs filled in."""
        experiment = next(
            (w.partition("=")[2] for w in command.words if w.startswith("experiment=")), None
        )
        words = []
        for word in command.words:
            if RUN_PLACEHOLDER.search(word):
                word = RUN_PLACEHOLDER.sub(str(self.newest_run(experiment)), word)
            word = word.replace("<runs_folder>", str(self.folder / "logs"))
            word = os.path.expandvars(word)
            key, _, value = word.rpartition("=") if "=" in word else ("", "", word)
            if "..." in value and "/" in value:  # `best-....ckpt`: the file there is
                matches = sorted(glob.glob(value.replace("...", "*")))
                assert matches, f"nothing matches {value}"
                word = f"{key}={matches[-1]}" if key else matches[-1]
            words.append(word)
        return words

    # -- running -------------------------------------------------------------------------
    @contextlib.contextmanager
    def isolated(self, argv: list[str]) -> Iterator[None]:
        """Process state a command may change, restored after it (argv, environment, working
        folder, logging, Hydra, signal handlers, warning filters, threads)."""
        env, cwd = dict(os.environ), os.getcwd()
        root = logging.getLogger()
        handlers, level = root.handlers[:], root.level
        saved_signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        threads, path, old_argv = torch.get_num_threads(), sys.path[:], sys.argv
        GlobalHydra.instance().clear()
        HydraConfig.instance().cfg = None  # as in a fresh process
        sys.argv = argv
        try:
            with warnings.catch_warnings():
                yield
        finally:
            sys.argv, sys.path[:] = old_argv, path
            os.environ.clear()
            os.environ.update(env)
            os.chdir(cwd)
            GlobalHydra.instance().clear()
            HydraConfig.instance().cfg = None
            for handler in root.handlers:
                if handler not in handlers:
                    handler.close()
            root.handlers[:], root.level = handlers, level
            for sig, handler in saved_signals.items():
                signal.signal(sig, handler)
            torch.set_num_threads(threads)

    def call(self, target: Callable[[], object], argv: list[str]) -> Outcome:
        """Call an entry point as its console script would; its exit code and output."""
        self.capfd.readouterr()
        code = 0
        with self.isolated(argv):
            try:
                returned = target()
                code = returned if isinstance(returned, int) else 0
            except SystemExit as err:
                code = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
            except Exception:
                traceback.print_exc()
                code = 1
        out, err = self.capfd.readouterr()
        return Outcome(code, out + err)

    def run_command(self, block: Block, command: Command) -> Outcome:
        """Run one command of `block`, shrunk, with the block's `with` arguments."""
        words = self.resolve(command)
        app = app_of(command)
        extra = shrink(words, app)
        for directive in block.of_kind("with"):
            if command.holds(directive.target):
                extra += directive.value.split()
        if words[0] == "make":
            # The recipe only: the targets exist and their variables expand.
            argv = ["make", "-n", "--no-print-directory", "-C", str(ROOT), *words[1:]]
            argv += ["REPRO_INSTALL=", f"BIN={Path(sys.executable).parent}"]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
            return Outcome(done.returncode, done.stdout + done.stderr)
        words = merge_arguments(words, extra)
        if app is not None:
            program = words[0] if words[0] != "python" else f"python -m {app}"
            args = words[1:] if words[0] != "python" else words[3:]
            module = import_module(app)
            return self.call(module.main, [program, *args])
        script = self.folder / words[1]
        sys_path = str(script.parent)

        def run_script() -> None:
            sys.path.insert(0, sys_path)
            runpy.run_path(str(script), run_name="__main__")

        return self.call(run_script, words[1:])

    def run_python(self, block: Block) -> Outcome:
        """Run a Python snippet in the document's namespace (shared by its snippets)."""
        code = with_keywords(
            block.code, [v for d in block.of_kind("with") for v in d.value.split()]
        )

        def run() -> None:
            exec(compile(code, block.where, "exec"), self.namespace)

        return self.call(run, ["python"])

    def given_run(self, block: Block, args: str) -> None:
        """`given a run of ARGS`: train it (shrunk) before the block."""
        command = Command(("megalab-train", *args.split()))
        outcome = self.run_command(Block(block.doc, block.line, "bash", ""), command)
        assert outcome.code == 0, f"{block.where}: the given run failed:\n{outcome.output[-3000:]}"

    def run_block(self, block: Block) -> tuple[int, int]:
        """Run one block as its markers say; (commands run, commands skipped)."""
        for directive in block.of_kind("without"):
            target = self.folder / directive.value
            shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
        for directive in block.of_kind("given"):
            if directive.value.startswith("a run of "):
                self.given_run(block, directive.value.removeprefix("a run of "))
            elif directive.value in FILES:
                FILES[directive.value](self.folder)
        written = {}
        for directive in block.of_kind("writes"):
            target = self.folder / directive.value
            written[directive.value] = target.stat().st_mtime_ns if target.exists() else None
        memory = block.of_kind("memory")
        with pytest.MonkeyPatch.context() as patch:
            if memory:
                from megalab import memory as memory_module

                gb = float(memory[0].value.removesuffix("GB"))
                patch.setattr(memory_module, "available_bytes", lambda device: gb * 2**30)
            ran, skipped, deferred = self.run_commands(block)
        outcomes = [outcome for _, outcome in ran]
        output = "\n".join(o.output for o in outcomes)
        fails = block.of_kind("fails")
        for outcome in outcomes:
            if fails:
                assert outcome.code != 0, f"{block.where}: expected to fail, but it exited 0"
            else:
                assert outcome.code == 0, f"{block.where}: exit {outcome.code}\n{output[-4000:]}"
        for text in [d.value for d in fails]:
            assert text in output, f"{block.where}: does not say {text!r}:\n{output[-4000:]}"
        for target, text in block.expected_output():
            printers = [o.output for c, o in ran if c is None or c.holds(target)]
            if deferred and (not target or not printers):
                continue  # printed by a command that runs in the slow suite only
            printed = "\n".join(printers)
            assert text in printed, f"{block.where}: does not print {text!r}:\n{printed[-4000:]}"
        for name, before in written.items():
            target = self.folder / name
            assert target.exists() and target.stat().st_mtime_ns != before, (
                f"{block.where}: did not write {name}"
            )
            if (ROOT / name).is_file():
                assert same_content(target, ROOT / name), f"{block.where}: {name} differs"
        return len(outcomes), skipped

    def run_commands(self, block: Block) -> tuple[list[tuple[Command | None, Outcome]], int, int]:
        """Each command that runs (None: the Python snippet) with its outcome; how many are
        skipped, how many deferred to the slow suite."""
        if block.lang == "python":
            return [(None, self.run_python(block))], 0, 0
        ran, skipped, deferred = [], 0, 0
        for command in block.commands():
            if block.skip_of(command):
                skipped += 1
            elif block.slow_of(command) and not self.slow:
                deferred += 1
            else:
                ran.append((command, self.run_command(block, command)))
        return ran, skipped, deferred


def same_content(ours: Path, theirs: Path) -> bool:
    """Files with the same bytes (images: the same pixels)."""
    if ours.suffix == ".png":
        import numpy as np
        from PIL import Image

        return np.array_equal(np.asarray(Image.open(ours)), np.asarray(Image.open(theirs)))
    return ours.read_bytes() == theirs.read_bytes()


# -- every block: run, or marked ----------------------------------------------------------


def test_every_code_block_is_run_or_says_why() -> None:
    """Each fenced block names its language; each command of a code block is one this test
    runs (placeholders it can fill in) or carries a skip marker with a known reason."""
    problems = []
    for block in all_blocks():
        if not block.is_code:
            if block.lang not in SHOWN_LANGUAGES:
                problems.append(f"{block.where}: say what the block is (```bash, ```text, ...)")
            elif block.directives:
                problems.append(f"{block.where}: a docs-test marker on a block that is not code")
            continue
        for directive in block.of_kind("given"):
            name = directive.value
            if not name.startswith("a run of ") and name not in FILES and name not in VARIABLES:
                problems.append(f"{block.where}: nothing provides `given {name}`")
        if block.lang == "python":
            try:
                with_keywords(
                    block.code, [v for d in block.of_kind("with") for v in d.value.split()]
                )
            except MarkerError as err:
                problems.append(f"{block.where}: {err}")
            continue
        commands = block.commands()
        if not commands:
            problems.append(f"{block.where}: a {block.lang} block without a command")
        for command in commands:
            if block.skip_of(command):
                continue
            if not runnable(command):
                problems.append(f"{block.where}: `{command.text}` is not run: mark why it can't be")
            elif unresolved(command):
                problems.append(
                    f"{block.where}: `{command.text}` has placeholders {unresolved(command)}"
                )
        targeted = [d for k in ("skip", "with", "slow", "prints") for d in block.of_kind(k)]
        for directive in targeted:
            if directive.target and not any(c.holds(directive.target) for c in commands):
                problems.append(f"{block.where}: no command holds `{' '.join(directive.target)}`")
    assert not problems, "\n".join(problems)


def test_markers_parse_and_the_checker_catches_an_unmarked_block(tmp_path: Path) -> None:
    """A bad marker is refused by name, and a block nobody runs is a problem."""
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- docs-test: skip (because) -->\n```bash\nwandb login\n```\n")
    with pytest.raises(MarkerError, match="skip says why"):
        blocks(doc)
    doc.write_text("```bash\nwandb login\n```\n")
    (block,) = blocks(doc)
    assert not runnable(block.commands()[0]) and block.skip_of(block.commands()[0]) is None
    doc.write_text("<!-- docs-test: skip `wandb` (network: W&B) -->\n```bash\nwandb login\n```\n")
    (block,) = blocks(doc)
    assert block.skip_of(block.commands()[0]).category == "network"
    # A `with` argument replaces the same key, `--option value` pairs included.
    words = ["megalab-sweep", "s.yaml", "--seeds", "3", "trainer=gpu", "--smoke"]
    merged = merge_arguments(words, ["--seeds=1", "trainer=cpu"])
    assert merged == ["megalab-sweep", "s.yaml", "--smoke", "--seeds=1", "trainer=cpu"]


def test_every_library_snippet_says_what_it_prints() -> None:
    """docs/library.md shows each snippet's result: the sentence after it says what it prints
    (checked when it runs), unless it is not run."""
    snippets = [b for b in blocks(ROOT / "docs" / "library.md") if b.lang == "python"]
    run = [b for b in snippets if not b.skipped]
    assert len(run) >= 6
    assert all(b.expected_output() for b in run), [b.where for b in run if not b.expected_output()]


def test_commands_not_run_here_compose(tmp_path: Path) -> None:
    """A `megalab-train`/`-eval`/`-generate` command that is skipped, or runs in the slow suite
    only, still composes: its experiment, groups and keys exist (checked by Hydra and, for
    training, by megalab's config schema)."""
    from megalab.config_schema import validate

    checked = 0
    for block in all_blocks():
        for command in block.commands():
            app = app_of(command)
            later = block.slow or block.slow_of(command)
            if app not in HYDRA_APPS or not (block.skip_of(command) or later):
                continue
            if any(RUN_PLACEHOLDER.search(w) for w in command.words):
                continue  # the run it reads exists once the block runs
            # A placeholder (`<partition>`) stands for a value: any will do here.
            overrides = [re.sub(r"<([^>]+)>", "value", o) for o in hydra_overrides(command.words)]
            cfg = composed(HYDRA_APPS[app], overrides)
            if app == "megalab.cli.train":
                cfg.hydra.runtime.output_dir = str(tmp_path)  # paths.output_dir resolves
                validate(cfg)
            checked += 1
    assert checked >= 5


def program_help(command: Command) -> str:
    """The `--help` text of an argparse command (of its subcommand, when it names one)."""
    words = command.words
    app = app_of(command)
    if app is not None:
        target = import_module(app).main
        start = 3 if words[0] == "python" else 1
    else:
        script = ROOT / words[1]

        def target() -> None:
            sys.path.insert(0, str(script.parent))
            runpy.run_path(str(script), run_name="__main__")

        start = 2
    rest = words[start:]
    subcommand = [rest[0]] if rest and re.fullmatch(r"[a-z][a-z0-9-]*", rest[0]) else []
    buffer = io.StringIO()
    old_argv, path = sys.argv, sys.path[:]
    sys.argv = [words[0], *subcommand, "--help"]
    try:
        with contextlib.redirect_stdout(buffer), contextlib.suppress(SystemExit):
            target()
    finally:
        sys.argv, sys.path[:] = old_argv, path
    return buffer.getvalue()


def test_documented_options_exist() -> None:
    """Every `--option` a command of the documentation names, run or not (benchmark synopses,
    `[--optional]` parts), is one its program's `--help` lists."""
    missing, checked = [], 0
    for block in all_blocks():
        for command in block.commands():
            app = app_of(command)
            if app in HYDRA_APPS or not runnable(command) or command.words[0] == "make":
                continue
            words = [w.strip("[]").partition("=")[0] for w in (*command.words, *command.optional)]
            options = [w for w in words if w.startswith("--")]
            help_text = program_help(command) if options else ""
            for option in options:
                checked += 1
                if not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", help_text):
                    missing.append(f"{block.where}: {command.words[0]} has no {option}")
    assert not missing, "\n".join(missing)
    assert checked >= 40


# -- running the documents -----------------------------------------------------------------


@pytest.fixture(scope="module")
def export_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A folder `megalab-export` wrote, of a small causal Mega (not trained)."""
    from megalab.pretrained import export_run
    from test_export import LM, SMALL, _fake_run

    tmp = tmp_path_factory.mktemp("export")
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=["model=mega", *SMALL, *LM, "model.backbone.causal=true"],
            return_hydra_config=True,
        )
    GlobalHydra.instance().clear()
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(tmp / "run")
        cfg.hydra.job.num = 0
    HydraConfig().set_config(cfg)
    _fake_run(cfg, tmp / "run")
    return str(export_run(tmp / "run", tmp / "export", "last"))


def _runnable_docs() -> list[Path]:
    """Documents with a block the default suite runs."""
    return [d for d in DOCS if any(b.is_code and not (b.skipped or b.slow) for b in blocks(d))]


def _has_slow(doc: Path) -> bool:
    """Whether `doc` has a block or command that runs in the slow suite only."""
    return any(b.of_kind("slow") and not b.skipped for b in blocks(doc))


def run_document(
    doc: Path,
    tmp_path: Path,
    fixture_data_dir: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    slow: bool,
) -> None:
    """Run the blocks of `doc` in order in a folder laid out like a checkout."""
    names = {d.value for b in blocks(doc) for d in b.of_kind("given")} & VARIABLES
    variables = {name: request.getfixturevalue(name) for name in names}
    folder = tmp_path / "checkout"
    # The fixtures as written, without the caches other tests prepared from them.
    shutil.copytree(fixture_data_dir, folder / "data", ignore=shutil.ignore_patterns("prepared"))
    for name in CHECKOUT:
        shutil.copytree(ROOT / name, folder / name)
    for key in ("MEGALAB_DATA_DIR", "MEGALAB_CONFIG_DIR"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MEGALAB_ROOT", str(folder))
    monkeypatch.setenv("HOME", str(folder))
    monkeypatch.setenv("MEGALAB_OFFLINE", "1")
    monkeypatch.chdir(folder)
    runner = DocumentRun(folder, capfd, variables, slow)
    ran = 0
    for block in blocks(doc):
        if not block.is_code or block.skipped or (block.slow and not slow):
            continue
        ran += runner.run_block(block)[0]
    assert ran, f"nothing of {doc.name} ran"


@pytest.mark.parametrize("doc", _runnable_docs(), ids=lambda d: d.name)
def test_document_runs(
    doc: Path,
    tmp_path: Path,
    fixture_data_dir: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    """The document's blocks run in order and do what they say (slow-suite ones aside)."""
    run_document(doc, tmp_path, fixture_data_dir, capfd, monkeypatch, request, slow=False)


@pytest.mark.slow
@pytest.mark.parametrize("doc", [d for d in DOCS if _has_slow(d)], ids=lambda d: d.name)
def test_document_runs_with_its_slow_blocks(
    doc: Path,
    tmp_path: Path,
    fixture_data_dir: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    """The whole document, with its slow blocks: smoke sweeps (a training subprocess each),
    the translation chain again, a submitit job (10 to 20 s each on 2 cores)."""
    run_document(doc, tmp_path, fixture_data_dir, capfd, monkeypatch, request, slow=True)
