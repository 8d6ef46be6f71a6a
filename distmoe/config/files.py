"""Config files and override strings: a TOML override file, Flower's ``"k=v"`` override syntax, and a flat
mapping written back as TOML (the run's ``config.toml``, ``distmoe config show``).

Owns: reading and writing flat keys in TOML; the ``# experimental`` mark of a research knob in what it writes.

Must not: validate values (:mod:`distmoe.config.parse` does), or import anything of distmoe outside this package.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from distmoe.config.keys import ConfigError, Scalar
from distmoe.config.parse import EXPERIMENTAL_KEYS


def load_override_file(path: str | Path) -> dict[str, Scalar]:
    """Read a TOML override file (nested tables or dotted keys) into flat Flower-style keys."""
    p = Path(path)
    try:
        with p.open("rb") as fh:
            raw = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {p}: not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {p}: invalid TOML: {exc}") from None
    # a file may hold a whole pyproject-like tree; take the app config table if present
    if "tool" in raw:
        raw = raw.get("tool", {}).get("flwr", {}).get("app", {}).get("config", {})
    return flatten(raw)


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Scalar]:
    out: dict[str, Scalar] = {}
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            out.update(flatten(v, key))
        elif isinstance(v, (int, float, str, bool)):
            out[key] = v
        else:
            raise ConfigError(f"config key '{key}': value {v!r} must be a number, string or boolean")
    return out


def parse_kv_pairs(text: str) -> dict[str, Scalar]:
    """Parse Flower's ``"k=v k2='s'"`` override syntax (values are TOML)."""
    out: dict[str, Scalar] = {}
    for m in re.finditer(r"(\S+?)=('[^']*'|\"[^\"]*\"|\S+)", text):
        key, val = m.group(1), m.group(2)
        try:
            out[key] = tomllib.loads(f"v = {val}")["v"]
        except tomllib.TOMLDecodeError:
            out[key] = val  # bare word: treat as a string, as a user would mean it
    leftover = re.sub(r"(\S+?)=('[^']*'|\"[^\"]*\"|\S+)", "", text).strip()
    if leftover:
        raise ConfigError(f"--run-config: cannot parse {leftover!r} (expected key=value pairs)")
    return out


def to_toml(flat: Mapping[str, Scalar]) -> str:
    """Serialise a flat mapping as TOML with quoted dotted keys (round-trips through flatten)."""
    lines = []
    for k in sorted(flat):
        v = flat[k]
        if isinstance(v, bool):
            s = "true" if v else "false"
        elif isinstance(v, (int, float)):
            s = repr(v)
        else:
            s = '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'
        head, _, last = k.rpartition(".")
        lines.append((head, last, s))
    out: list[str] = []
    current = None
    for head, last, s in sorted(lines, key=lambda t: (t[0], t[1])):
        if head != current:
            out.append(f"\n[{head}]" if head else "")
            current = head
        line = f'"{last}" = {s}' if "." in last else f"{last} = {s}"
        out.append(line + ("  # experimental" if f"{head}.{last}" in EXPERIMENTAL_KEYS else ""))
    return "\n".join(out).strip() + "\n"
