"""How a run-config key is declared: :class:`KeySpec`, :func:`key`, the :func:`section` decorator and the
validating base of every section dataclass.

Owns: the declaration machinery, the type, range and choice checks of one value, and the fence each key
declares besides its type (``resume``: may change when a run is resumed; ``privacy``: privacy-relevant,
recorded in the ledger's ``run-start`` entry; ``experimental``: a research knob, listed after the keys every
user needs). A key's name is ``<section>.<field name with _ -> ->``; its type comes from the annotation.

Must not: import anything of distmoe, or declare keys itself (the ``*_keys`` modules of this package do).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

Scalar = int | float | str | bool


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type, out of range or inconsistent."""


@dataclass(frozen=True)
class KeySpec:
    """One run-config key: what :func:`key` declared plus what the section decorator filled in."""

    default: Scalar
    doc: str  # one line of Markdown: the "meaning" column of docs/configuration.md
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # lo itself is excluded
    choices: tuple[str, ...] | None = None
    off: float | None = None  # a value outside [lo, hi] that is allowed and switches the feature off
    allowed: str = ""  # how the docs state what is allowed, where lo/hi/choices alone do not say it
    kind: type | None = None  # the value type; None = from the field's annotation
    resume: bool = False  # a resumed run may change it (where things are, timeouts, threads, kept checkpoints)
    privacy: bool | None = None  # privacy-relevant (recorded at run start); None = the section's default
    experimental: bool = False  # a research knob: marked in docs/configuration.md and `distmoe config show`
    name: str = ""  # "<section>.<key>", set by @section
    attr: str = ""  # the dataclass field name, set by @section

    def check(self, value: Any) -> Scalar:
        """``value`` of this key, type-checked (ints accepted for floats, integral floats for ints), range- and
        choice-checked; a ConfigError names the key, the value and what is allowed."""
        key, kind = self.name, self.kind
        if kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"config key '{key}': value {value!r} must be a number")
            value = float(value)
            if not math.isfinite(value):
                raise ConfigError(f"config key '{key}': value {value!r} must be finite")
        elif kind is int:
            if isinstance(value, bool) or not isinstance(value, int):
                if not (isinstance(value, float) and value.is_integer()):
                    raise ConfigError(f"config key '{key}': value {value!r} must be an integer")
                value = int(value)
        elif kind is bool:
            if not isinstance(value, bool):
                raise ConfigError(f"config key '{key}': value {value!r} must be true or false")
        elif not isinstance(value, str):
            raise ConfigError(f"config key '{key}': value {value!r} must be a string")
        if self.choices is not None:
            check_choice(key, value, self.choices)
        if kind in (int, float) and not (self.off is not None and value == self.off):
            check_range(key, value, self.lo, self.hi, self.lo_open)
        return value


def key(default: Scalar, doc: str, *, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
        choices: tuple[str, ...] | None = None, off: float | None = None, allowed: str = "",
        kind: type | None = None, resume: bool = False, privacy: bool | None = None,
        experimental: bool = False) -> Any:
    """A section field that is a run-config key (see the module docstring)."""
    spec = KeySpec(default=default, doc=doc, lo=lo, hi=hi, lo_open=lo_open, choices=choices, off=off,
                   allowed=allowed, kind=kind, resume=resume, privacy=privacy, experimental=experimental)
    return dataclasses.field(default=default, metadata={"key": spec})


_KINDS = {"int": int, "float": float, "str": str, "bool": bool}
# the sections in documentation (and parsing) order: `run` first, since `model` and `data` carry run.seed
ORDER = ("run", "model", "data", "train", "routing", "retention", "rl", "dpo", "schedule", "federation", "privacy",
         "checkpoint", "eval", "report", "sim")
SECTIONS: dict[str, type] = {}  # section name -> its dataclass, in ORDER whichever module was imported first


def section(name: str, *, privacy: bool = False):
    """Class decorator: a frozen dataclass whose :func:`key` fields are the keys ``<name>.<field>``; ``privacy``
    is the default of its keys' ``privacy`` flag."""

    def wrap(cls):
        cls = dataclass(frozen=True)(cls)
        specs = []
        for f in dataclasses.fields(cls):
            spec = f.metadata.get("key")
            if spec is None:
                continue
            kind = spec.kind or _KINDS.get(f.type if isinstance(f.type, str) else f.type.__name__)
            if kind is None:
                raise TypeError(f"{cls.__name__}.{f.name}: annotation {f.type!r} needs key(..., kind=...)")
            specs.append(dataclasses.replace(spec, kind=kind, attr=f.name, name=f"{name}.{f.name.replace('_', '-')}",
                                             privacy=privacy if spec.privacy is None else spec.privacy))
        cls.SECTION, cls.KEYS = name, tuple(specs)
        if name not in ORDER:
            raise TypeError(f"section {name!r}: give it its place in keys.ORDER (the documentation order)")
        SECTIONS[name] = cls
        ordered = sorted(SECTIONS.items(), key=lambda item: ORDER.index(item[0]))
        SECTIONS.clear()
        SECTIONS.update(ordered)
        return cls

    return wrap


class Section:
    """Base of the section dataclasses: validation on construction (every key, then ``check``)."""

    SECTION: ClassVar[str]
    KEYS: ClassVar[tuple[KeySpec, ...]]

    def __post_init__(self) -> None:
        for spec in self.KEYS:
            value = getattr(self, spec.attr)
            if isinstance(value, tuple):  # already parsed (schedule.phases), checked when it was parsed
                continue
            object.__setattr__(self, spec.attr, spec.check(value))
        self.check()

    def check(self) -> None:
        """Checks across the keys of this section (none by default)."""


def check_range(key: str, value: float, lo: float | None = None, hi: float | None = None,
                lo_open: bool = False) -> None:
    if lo is not None and (value < lo or (lo_open and value == lo)):
        op = ">" if lo_open else ">="
        raise ConfigError(f"config key '{key}': value {value!r} is out of range (must be {op} {lo})")
    if hi is not None and value > hi:
        raise ConfigError(f"config key '{key}': value {value!r} is out of range (must be <= {hi})")


def check_choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"config key '{key}': value {value!r} is not one of {', '.join(allowed)}")
