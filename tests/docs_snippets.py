"""The code blocks of README.md and docs/*.md, their `docs-test` markers and their commands.

Every fenced block names its language. `bash`, `console` and `python` blocks are code: the tests
run them (tests/test_docs_commands.py) unless a marker says why not. Other languages (`text`
for output and file trees, `yaml`, `markdown`) are shown, not run. A marker is an HTML comment
on a line of its own right above the block (several may stack):

    <!-- docs-test: skip (CATEGORY: why) -->           the block is not run
    <!-- docs-test: skip `TOKENS` (CATEGORY: why) -->  its commands holding TOKENS are not run
    <!-- docs-test: with [`TOKENS`] ARGS [(why)] -->   ARGS replace or extend the arguments of its
                                                       commands (those holding TOKENS); in Python,
                                                       `name=value` replaces a keyword argument
    <!-- docs-test: fails with "MESSAGE" -->           it must fail, saying MESSAGE
    <!-- docs-test: prints [`TOKENS`] "TEXT" -->       its output (of its commands holding
                                                       TOKENS) holds TEXT
    <!-- docs-test: writes PATH -->                    it writes PATH (as the repository holds
                                                       it, when it does)
    <!-- docs-test: without PATH -->                   PATH is removed before it runs
    <!-- docs-test: given a run of ARGS -->            `<run>` is a run of `megalab-train ARGS`
    <!-- docs-test: given NAME -->                     the test provides NAME (a file, a variable)
    <!-- docs-test: memory GB -->                      the memory plan sees GB gigabytes free
    <!-- docs-test: slow [`TOKENS`] -->                it (its commands holding TOKENS) runs in
                                                       the slow suite only

A sentence "prints `TEXT`" right after a block is checked like a `prints` marker. `make` lines
run as `make -n` (the recipe, not the work).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# README.md and the guides; docs/reference/ holds copied notes on the papers and their code.
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

CODE_LANGUAGES = {"bash", "console", "python"}
SHOWN_LANGUAGES = {"text", "yaml", "markdown"}
# Why a block or command is not run: the first word of a skip marker's reason.
SKIP_CATEGORIES = {
    "setup": "installs or builds software",
    "gpu": "needs CUDA GPUs",
    "network": "needs the internet or a server (the Hub, a download, W&B)",
    "cluster": "needs a SLURM cluster",
    "long": "minutes to hours of computation (benchmarks, full-size runs)",
    "external": "needs files that are not shipped (weights, another checkout)",
}
KINDS = {"skip", "with", "fails", "prints", "writes", "without", "given", "memory", "slow"}

_MARKER = re.compile(r"^<!-- docs-test: (?P<body>.*) -->$")
_FENCE = re.compile(r"^```(?P<lang>[\w-]*)\s*$")
_TARGET = re.compile(r"^`(?P<target>[^`]+)`\s*")
_REASON = re.compile(r"\s*\((?P<reason>[^()]*(?:\([^()]*\)[^()]*)*)\)$")
_QUOTED = re.compile(r'^"(?P<text>.*)"$')
_PROSE_PRINTS = re.compile(r"prints `([^`]+)`")
_ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def shown(path: Path) -> str:
    """`path` relative to the repository (as the documents name files)."""
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


class MarkerError(ValueError):
    """A docs-test marker that does not parse."""


@dataclass(frozen=True)
class Directive:
    """One `docs-test` marker: its kind, the commands it targets and its value."""

    kind: str
    value: str = ""
    target: tuple[str, ...] = ()
    reason: str = ""

    @property
    def category(self) -> str:
        """A skip's category (`gpu`, `network`, ...): the first word of its reason."""
        return self.reason.split(":", 1)[0].strip() if self.kind == "skip" else ""


def parse_directive(body: str) -> Directive:
    """`skip (gpu: ...)`, ``with `megalab-data` --num-samples=40``, `fails with "..."`, ..."""
    kind, _, rest = body.strip().partition(" ")
    if kind not in KINDS:
        raise MarkerError(f"unknown docs-test marker {kind!r} (one of {sorted(KINDS)})")
    rest = rest.strip()
    target: tuple[str, ...] = ()
    if kind in ("skip", "with", "slow", "prints"):
        found = _TARGET.match(rest)
        if found:
            target = tuple(shlex.split(found.group("target")))
            rest = rest[found.end() :]
    if kind in ("fails", "prints"):
        rest = rest.removeprefix("with ").strip() if kind == "fails" else rest
        quoted = _QUOTED.match(rest)
        if not quoted:
            raise MarkerError(f'`{kind}` takes a quoted message: {kind} "..."')
        return Directive(kind, quoted.group("text"), target)
    reason = ""
    found = _REASON.search(rest)
    if found and kind in ("skip", "with", "given", "slow"):
        reason, rest = found.group("reason").strip(), rest[: found.start()].strip()
    if kind == "skip":
        category = reason.split(":", 1)[0].strip()
        if category not in SKIP_CATEGORIES or not reason.partition(":")[2].strip():
            raise MarkerError(
                f"a skip says why: skip (CATEGORY: reason), CATEGORY one of "
                f"{sorted(SKIP_CATEGORIES)}; got {body!r}"
            )
        if rest:
            raise MarkerError(f"unexpected {rest!r} in {body!r}")
    elif kind == "slow":
        if rest:
            raise MarkerError(f"`slow` takes nothing: {body!r}")
    elif not rest:
        raise MarkerError(f"`{kind}` needs a value: {body!r}")
    if kind == "memory":
        try:
            float(rest.removesuffix("GB").strip())
        except ValueError:
            raise MarkerError(f"`memory` takes gigabytes: memory 0.8 GB; got {body!r}") from None
    return Directive(kind, rest, target, reason)


@dataclass(frozen=True)
class Command:
    """One shell command of a block: its words (placeholders unresolved), environment and line."""

    words: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    optional: tuple[str, ...] = ()  # the words of `[...]` groups, which are left out
    text: str = ""

    def holds(self, target: tuple[str, ...]) -> bool:
        """Whether `target` is a run of consecutive words of this command (empty: any)."""
        n = len(target)
        return not n or any(self.words[i : i + n] == target for i in range(len(self.words)))


def split_commands(line: str) -> list[Command]:
    """The commands of one (joined) shell line: `a && b`, `a; b`, `a &`; comments dropped."""
    # A placeholder is one word: `<runs folder>` -> `<runs_folder>`.
    line = re.sub(r"<[^<>]+>", lambda m: m.group(0).replace(" ", "_"), line)
    words = shlex.split(line, comments=True)
    commands, current = [], []
    for word in [*words, "&&"]:
        if word in ("&&", ";", "&", "||"):
            if current:
                commands.append(_command(current, line))
            current = []
        else:
            current.append(word)
    return commands


def _command(words: list[str], text: str) -> Command:
    env = []
    while words and _ENV.match(words[0]):
        key, _, value = words.pop(0).partition("=")
        env.append((key, value))
    kept, optional, depth = [], [], 0
    for word in words:
        if word.startswith("[") and depth == 0 and not word.startswith("[file:"):
            depth = 1
        (optional if depth else kept).append(word)
        if depth and word.endswith("]"):
            depth = 0
    return Command(tuple(kept), tuple(env), tuple(optional), text.strip())


@dataclass
class Block:
    """A fenced block of a document, with the markers above it and the paragraph after it."""

    doc: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    directives: list[Directive] = field(default_factory=list)
    after: str = ""

    @property
    def where(self) -> str:
        """`doc:line` of the block's opening fence."""
        return f"{shown(self.doc)}:{self.line}"

    @property
    def is_code(self) -> bool:
        """Whether the block is code the tests run (bash, console, python)."""
        return self.lang in CODE_LANGUAGES

    def of_kind(self, kind: str) -> list[Directive]:
        """The block's markers of one kind."""
        return [d for d in self.directives if d.kind == kind]

    @property
    def skipped(self) -> Directive | None:
        """The marker that keeps the whole block from running, if any."""
        return next((d for d in self.of_kind("skip") if not d.target), None)

    def skip_of(self, command: Command) -> Directive | None:
        """The marker that keeps `command` from running, if any."""
        return self.skipped or next(
            (d for d in self.of_kind("skip") if d.target and command.holds(d.target)), None
        )

    @property
    def slow(self) -> bool:
        """Whether the whole block runs in the slow suite only."""
        return any(not d.target for d in self.of_kind("slow"))

    def slow_of(self, command: Command) -> bool:
        """Whether `command` runs in the slow suite only."""
        return any(command.holds(d.target) for d in self.of_kind("slow"))

    def commands(self) -> list[Command]:
        """The shell commands of a bash block, or the `$ ` lines of a console transcript."""
        if self.lang not in ("bash", "console"):
            return []
        text = self.code.replace("\\\n", " ")
        lines = text.splitlines()
        if self.lang == "console":
            lines = [line[2:] for line in lines if line.startswith("$ ")]
        return [c for line in lines for c in split_commands(line)]

    def expected_output(self) -> list[tuple[tuple[str, ...], str]]:
        """What the block prints, by its `prints` markers and a "prints `...`" sentence after:
        (the words of the commands that print it, empty for any; the text)."""
        prose = [((), text) for text in _PROSE_PRINTS.findall(self.after)]
        return [(d.target, d.value) for d in self.of_kind("prints")] + prose


def blocks(doc: Path) -> list[Block]:
    """Every fenced block of `doc`, in order; raises MarkerError for a marker that does not
    parse or does not sit right above a block."""
    lines = doc.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    pending: list[tuple[int, Directive]] = []
    i = 0
    while i < len(lines):
        marker = _MARKER.match(lines[i].strip())
        fence = _FENCE.match(lines[i])
        if re.match(r"^\s+```", lines[i]):
            raise MarkerError(
                f"{shown(doc)}:{i + 1}: an indented block is not checked: unindent it"
            )
        if marker:
            try:
                pending.append((i, parse_directive(marker.group("body"))))
            except MarkerError as err:
                raise MarkerError(f"{shown(doc)}:{i + 1}: {err}") from None
            i += 1
            continue
        if pending and not fence:
            where = f"{shown(doc)}:{pending[0][0] + 1}"
            raise MarkerError(f"{where}: a docs-test marker belongs right above a code block")
        if fence:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            rest = lines[end + 1 :]
            while rest and not rest[0].strip():
                rest = rest[1:]
            paragraph = []
            for text in rest:
                if not text.strip() or text.startswith(("```", "<!--")):
                    break
                paragraph.append(text)
            found.append(
                Block(
                    doc=doc,
                    line=i + 1,
                    lang=fence.group("lang"),
                    code="\n".join(lines[i + 1 : end]) + "\n",
                    directives=[d for _, d in pending],
                    after=" ".join(paragraph),
                )
            )
            pending = []
            i = end + 1
            continue
        i += 1
    return found


def all_blocks() -> list[Block]:
    """Every block of README.md and docs/*.md."""
    return [b for doc in DOCS for b in blocks(doc)]


# -- arguments ------------------------------------------------------------------------------


def _key(word: str) -> str | None:
    """The key a Hydra override or `--option[=value]` sets (None for anything else)."""
    if word.startswith("--"):
        return word.partition("=")[0]
    if "=" in word and not word.startswith("-"):
        return word.partition("=")[0].lstrip("+~")
    if word.startswith("~"):
        return word[1:]
    return None


def merge_arguments(words: list[str], extra: list[str]) -> list[str]:
    """`words` with `extra` appended; an override or `--option=value` of `extra` replaces the
    same key's earlier value (`--option value` pairs included)."""
    out = list(words)
    for word in extra:
        key = _key(word)
        if key is not None:
            i = 0
            while i < len(out):
                if _key(out[i]) == key:
                    pair = (
                        key.startswith("--")
                        and "=" not in out[i]
                        and i + 1 < len(out)
                        and not out[i + 1].startswith("-")
                    )
                    del out[i : i + (2 if pair else 1)]
                else:
                    i += 1
        out.append(word)
    return out


def with_keywords(code: str, assignments: list[str]) -> str:
    """Python code with each `name=value` keyword argument's value replaced."""
    for assignment in assignments:
        name, _, value = assignment.partition("=")
        pattern = re.compile(rf"\b{re.escape(name)}=[^,)\n]+")
        if not pattern.search(code):
            raise MarkerError(f"`with {assignment}`: no keyword argument {name}= in the snippet")
        code = pattern.sub(lambda _m, n=name, v=value: f"{n}={v}", code)
    return code
