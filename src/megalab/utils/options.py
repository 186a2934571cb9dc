"""Options of a config dataclass, declared once: the type, the range and a one-line meaning.

A field is declared as

    num_layers: int = option(4, ge=1, doc="number of blocks")
    chunk_size: int = option(-1, ge=1, also={-1: "no chunking"}, doc="attention chunk c")
    dropout: float = rate(0.0, doc="on X', Ĥ and the FFN output")

and that one declaration serves both checks of the option:

- `check_options(config)`, called by the dataclass's `__post_init__`, refuses a value out of the
  declared range or choices with a ValueError that names the option (`num_layers must be >= 1,
  got 0`; `unknown positions 'x'; choose one of none, learned`), and None for a field whose
  type does not allow it (a `${data.max_len}` built without a dataset), and a value of another
  type (`d_model must be an integer, got '32'`). Numbers are checked as numbers, not as Python
  classes: converters from the authors' checkpoints pass numpy scalars.
- `option_rules(config_class)` gives the `Rule` of every field for `megalab.config_schema`,
  which checks a run's settings before anything is built: the type from the annotation (int,
  float, bool, str, Literal[...], a tuple of numbers, `X | None`) and the declared range.

`Rule` and its builders (`integer`, `number`, ...) are the schema's vocabulary, here so that the
options and the schema say a range in the same words.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union

import numpy as np

OPTION = "megalab.option"


def is_int(v: Any) -> bool:
    """An integer, a numpy one included; not a bool."""
    return isinstance(v, numbers.Integral) and not is_bool(v)


def is_number(v: Any) -> bool:
    """A finite real number, a numpy one included; not a bool."""
    return isinstance(v, numbers.Real) and not is_bool(v) and math.isfinite(v)


def is_bool(v: Any) -> bool:
    """True or False, numpy's included."""
    return isinstance(v, bool | np.bool_)


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def bounds(
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    hi_open: bool = False,
) -> str:
    """A range in words: `>= 1`, `> 0`, `<= 5`, `in [0, 1)` ('' when unbounded)."""
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{_num(lo)}, {_num(hi)}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {_num(lo)}"
    if hi is not None:
        return f"{'<' if hi_open else '<='} {_num(hi)}"
    return ""


def _in_range(
    v: Any, lo: float | None, hi: float | None, lo_open: bool = False, hi_open: bool = False
) -> bool:
    if lo is not None and (v <= lo if lo_open else v < lo):
        return False
    return not (hi is not None and (v >= hi if hi_open else v > hi))


def _expects(word: str, said: str, null: bool, note: str) -> str:
    """`an integer >= 1 or null (note)`: the type, its range, null and a note."""
    return word + (f" {said}" if said else "") + (" or null" if null else "") + note


@dataclass(frozen=True)
class Rule:
    """What a key accepts: `check(value) -> bool` and how to say it."""

    check: Callable[[Any], bool]
    expects: str


def integer(
    lo: int | None = None, hi: int | None = None, null: bool = False, note: str = ""
) -> Rule:
    def check(v: Any) -> bool:
        if v is None:
            return null
        return is_int(v) and _in_range(v, lo, hi)

    said = bounds(lo, hi)
    return Rule(
        check, "an integer" + (f" {said}" if said else "") + (" or null" if null else "") + note
    )


def number(
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    hi_open: bool = False,
    null: bool = False,
    note: str = "",
) -> Rule:
    def check(v: Any) -> bool:
        if v is None:
            return null
        return is_number(v) and _in_range(v, lo, hi, lo_open, hi_open)

    said = bounds(lo, hi, lo_open, hi_open)
    return Rule(
        check, "a number" + (f" {said}" if said else "") + (" or null" if null else "") + note
    )


def boolean(null: bool = False, also: tuple[Any, ...] = ()) -> Rule:
    def check(v: Any) -> bool:
        return is_bool(v) or (v is None and null) or (v in also and not is_number(v))

    extra = "".join(f" or {a!r}" for a in also)
    return Rule(check, "true or false" + extra + (" or null" if null else ""))


def choice(*options: Any, null: bool = False) -> Rule:
    def check(v: Any) -> bool:
        return (v is None and null) or (isinstance(v, str | int) and v in options)

    listed = ", ".join(dict.fromkeys(str(o) for o in options))  # 16 and "16" once
    return Rule(check, f"one of {listed}" + (" or null" if null else ""))


def text(null: bool = False) -> Rule:
    return Rule(
        lambda v: isinstance(v, str) or (v is None and null),
        "a string" + (" or null" if null else ""),
    )


def either(*rules: Rule) -> Rule:
    return Rule(lambda v: any(r.check(v) for r in rules), " or ".join(r.expects for r in rules))


@dataclass(frozen=True)
class Option:
    """What a field declares besides its type: its meaning, range, choices and special values."""

    doc: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[Any, ...] = ()
    also: Mapping[Any, str] = dataclasses.field(default_factory=dict)
    note: str = ""

    @property
    def range_words(self) -> str:
        """The declared range in words, special values included (`>= 1, or -1 (no chunking)`)."""
        lo = self.gt if self.gt is not None else self.ge
        hi = self.lt if self.lt is not None else self.le
        said = bounds(lo, hi, self.gt is not None, self.lt is not None)
        return said + "".join(f", or {v!r} ({what})" for v, what in self.also.items())

    def in_range(self, v: Any) -> bool:
        """Whether a number lies in the declared range or is one of the special values."""
        if v in self.also:
            return True
        lo = self.gt if self.gt is not None else self.ge
        hi = self.lt if self.lt is not None else self.le
        return _in_range(v, lo, hi, self.gt is not None, self.lt is not None)


def option(
    default: Any,
    *,
    doc: str,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    choices: tuple[Any, ...] = (),
    also: Mapping[Any, str] | None = None,
    note: str = "",
) -> Any:
    """A dataclass field with its default, range (`ge`, `gt`, `le`, `lt`), `choices`, special
    values outside the range (`also`: value -> meaning), a `note` for the schema's message and
    its one-line meaning `doc`."""
    spec = Option(doc, ge, gt, le, lt, tuple(choices), dict(also or {}), note)
    return dataclasses.field(default=default, metadata={OPTION: spec})


def rate(default: float, *, doc: str) -> Any:
    """A dropout-like probability in [0, 1)."""
    return option(default, ge=0.0, lt=1.0, doc=doc)


def declared(config_class: type) -> dict[str, tuple[Any, Option | None]]:
    """name -> (resolved annotation, its `Option` or None) for every init field."""
    hints = typing.get_type_hints(config_class)
    return {
        f.name: (hints[f.name], f.metadata.get(OPTION))
        for f in dataclasses.fields(config_class)
        if f.init
    }


def check_options(config: Any) -> None:
    """Raise a ValueError naming the first option of `config` of another type than declared, or
    out of its declared range or choices."""
    for name, (annotation, spec) in declared(type(config)).items():
        value = getattr(config, name)
        if value is None and spec is not None and not _unwrap_optional(annotation)[1]:
            raise ValueError(f"{name} must be {rule_of(annotation, spec).expects}, got None")
        if spec is None or value is None:
            continue
        if spec.choices and value not in spec.choices:
            listed = ", ".join(str(c) for c in spec.choices)
            raise ValueError(f"unknown {name} {value!r}; choose one of {listed}")
        typed = rule_of(annotation, Option(doc="", also=spec.also))
        if not typed.check(value):
            raise ValueError(f"{name} must be {rule_of(annotation, spec).expects}, got {value!r}")
        numeric = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if spec.range_words and numeric and not spec.in_range(value):
            raise ValueError(f"{name} must be {spec.range_words}, got {value!r}")


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = typing.get_args(annotation)
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(rest) < len(args):
            return rest[0], True
    return annotation, False


def _number_tuple(length: int, null: bool) -> Rule:
    def check(v: Any) -> bool:
        if v is None:
            return null
        listed = isinstance(v, Sequence) and not isinstance(v, str)  # a ListConfig from YAML
        return listed and len(v) == length and all(map(is_number, v))

    return Rule(check, f"a list of {length} numbers" + (" or null" if null else ""))


def rule_of(annotation: Any, spec: Option | None) -> Rule:
    """The schema's rule for a field of this type and declaration."""
    kind, null = _unwrap_optional(annotation)
    spec = spec or Option(doc="")
    note = spec.note
    if spec.choices or typing.get_origin(kind) is Literal:
        return choice(*(spec.choices or typing.get_args(kind)), null=null)
    if kind is bool:
        return boolean(null=null)
    if kind is str:
        return text(null=null)
    if typing.get_origin(kind) is tuple:
        return _number_tuple(len(typing.get_args(kind)), null)
    if kind is int or kind is float:
        words = spec.range_words
        word = "an integer" if kind is int else "a number"
        typed = is_int if kind is int else is_number

        def check(v: Any) -> bool:
            if v is None:
                return null
            return typed(v) and (not words or spec.in_range(v))

        return Rule(check, _expects(word, words, null, note))
    raise TypeError(f"no schema rule for options of type {annotation!r}")


def option_rules(config_class: type) -> dict[str, Rule]:
    """name -> `Rule` of every field of a config dataclass; a TypeError names a field that is
    not declared with `option` (so a new field cannot go unchecked)."""
    out = {}
    for name, (annotation, spec) in declared(config_class).items():
        if spec is None:
            raise TypeError(
                f"{config_class.__name__}.{name} is not declared with megalab.utils.options."
                "option (its range and meaning)"
            )
        out[name] = rule_of(annotation, spec)
    return out


def config_class_of(target: Any) -> type | None:
    """The config dataclass a `model.backbone._target_` stands for: the config class it names,
    or the one the backbone class it names takes (its `__init__`'s `config`); else None."""
    if isinstance(target, type) and dataclasses.is_dataclass(target):
        return target
    init = getattr(target, "__init__", None)
    try:
        hint = typing.get_type_hints(init).get("config") if init is not None else None
    except (NameError, TypeError):
        return None
    for candidate in (hint, *typing.get_args(hint)):
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            return candidate
    return None
