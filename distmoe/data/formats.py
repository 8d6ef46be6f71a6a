"""Instruction-data file formats: reading and validating one JSONL task file into ``Example`` s.

Owns: ``DataError``, the ``Example`` record, the accepted line formats and their validation
(every error names the file, the 1-based line number and the field), the Alpaca -> chat
normalisation, and the in-memory ``datasets.Dataset`` view.

Accepted lines (any other key is an error naming the allowed ones, so a typo such as ``"inptu"`` is not
silently dropped; a line mixing both formats is an error):

* Alpaca: ``{"instruction": str, "input": str (optional, may be ""), "output": str}`` -> user turn
  ``instruction`` (+ ``"\\n" + input`` when input is non-empty), assistant turn ``output``.
* Chat: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}`` with at least
  one user turn and a final, non-empty assistant turn; a turn has only ``role`` and ``content``.
* Preference (for ``dpo`` phases): ``{"prompt": str, "chosen": str, "rejected": str}``, all three
  non-empty, ``chosen != rejected`` -> user turn ``prompt``, assistant turn ``chosen``, and
  ``Example.rejected`` = ``rejected``. A file is either all preference lines or none (a preference task
  is still an instruction task for ``sft``, ``stats`` and ``eval``: its answer is the chosen one).

Why not ``datasets.load_dataset("json", ...)`` directly: its errors name neither the line nor the
field, it accepts lines of mixed shape silently, and it writes an Arrow cache under the home
directory. The lines are validated here, then handed to ``datasets`` in memory.

Must not: split, tokenize, cache anything on disk (the Dataset view is built in memory with
``Dataset.from_list``), or log file contents (the data is private to the party).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import datasets

ROLES = ("system", "user", "assistant")
ALPACA_KEYS = ("instruction", "input", "output")
CHAT_KEYS = ("messages",)
PREFERENCE_KEYS = ("prompt", "chosen", "rejected")
TURN_KEYS = ("role", "content")


class DataError(ValueError):
    """Party data is missing, unreadable or malformed; the message says where and what."""


@dataclass(frozen=True)
class Example:
    """One conversation; the final turn is the assistant answer that is supervised and evaluated."""

    messages: tuple[tuple[str, str], ...]  # ((role, content), ...)
    rejected: str = ""  # preference data: the dispreferred answer to the same prompt ("" = not a pair)

    def __post_init__(self) -> None:
        if not self.messages or self.messages[-1][0] != "assistant":
            raise DataError("an Example must end with an assistant turn")
        if not isinstance(self.rejected, str):
            raise DataError(f"an Example has an invalid rejected answer ({type(self.rejected).__name__})")
        for role, content in self.messages:
            if role not in ROLES or not isinstance(content, str):
                raise DataError(f"an Example has an invalid turn ({role!r}, {type(content).__name__})")

    @property
    def answer(self) -> str:
        """Content of the final assistant turn."""
        return self.messages[-1][1]

    @property
    def prompt_messages(self) -> list[dict[str, str]]:
        """Every turn but the final assistant one, as chat-template dicts."""
        return [{"role": r, "content": c} for r, c in self.messages[:-1]]

    def as_messages(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.messages]

    @property
    def is_pair(self) -> bool:
        """A preference pair (``chosen`` = ``answer``, ``rejected``)."""
        return bool(self.rejected)

    def rejected_example(self) -> Example:
        """The same prompt answered with the rejected answer (a plain Example)."""
        if not self.rejected:
            raise DataError("rejected_example: not a preference pair")
        return Example(messages=self.messages[:-1] + (("assistant", self.rejected),))

    def to_json(self) -> str:
        """Canonical JSON (chat format, plus ``rejected`` for a pair): the identity used for hashing and for writing."""
        obj: dict[str, Any] = {"messages": self.as_messages()}
        if self.rejected:
            obj["rejected"] = self.rejected
        return json.dumps(obj, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    return {dict: "object", list: "list", str: "string"}.get(type(value), type(value).__name__)


def _no_unknown(obj: dict[str, Any], allowed: tuple[str, ...], where: str, what: str, prefix: str = "") -> None:
    unknown = [k for k in obj if k not in allowed]
    if unknown:
        raise DataError(f"{where}: field '{prefix}{unknown[0]}': unknown field in {what} (allowed: "
                        f"{', '.join(allowed)})")


def _parse_alpaca(obj: dict[str, Any], where: str) -> Example:
    _no_unknown(obj, ALPACA_KEYS, where, "an Alpaca line")
    for key in ("instruction", "output"):
        if key not in obj:
            raise DataError(f"{where}: field '{key}': missing (Alpaca lines need instruction and output)")
    for key in ALPACA_KEYS:
        if key in obj and not isinstance(obj[key], str):
            raise DataError(f"{where}: field '{key}': expected a string, got {_kind(obj[key])}")
    if not obj["instruction"]:
        raise DataError(f"{where}: field 'instruction': must not be empty")
    if not obj["output"]:
        raise DataError(f"{where}: field 'output': must not be empty")
    user = obj["instruction"] + ("\n" + obj["input"] if obj.get("input") else "")
    return Example(messages=(("user", user), ("assistant", obj["output"])))


def _parse_chat(obj: dict[str, Any], where: str) -> Example:
    _no_unknown(obj, CHAT_KEYS, where, "a chat line")
    turns = obj["messages"]
    if not isinstance(turns, list):
        raise DataError(f"{where}: field 'messages': expected a list, got {_kind(turns)}")
    if not turns:
        raise DataError(f"{where}: field 'messages': must not be empty")
    out: list[tuple[str, str]] = []
    for i, turn in enumerate(turns):
        field = f"messages[{i}]"
        if not isinstance(turn, dict):
            raise DataError(f"{where}: field '{field}': expected an object, got {_kind(turn)}")
        _no_unknown(turn, TURN_KEYS, where, "a chat turn", prefix=f"{field}.")
        for key in TURN_KEYS:
            if key not in turn:
                raise DataError(f"{where}: field '{field}.{key}': missing")
        role, content = turn["role"], turn["content"]
        if not isinstance(role, str):
            raise DataError(f"{where}: field '{field}.role': expected a string, got {_kind(role)}")
        if role not in ROLES:
            raise DataError(f"{where}: field '{field}.role': {role!r} is not one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise DataError(f"{where}: field '{field}.content': expected a string, got {_kind(content)}")
        out.append((role, content))
    last = len(out) - 1
    if not any(role == "user" for role, _ in out):
        raise DataError(f"{where}: field 'messages': needs at least one user turn")
    if out[-1][0] != "assistant":
        raise DataError(f"{where}: field 'messages[{last}].role': the last turn must be 'assistant', "
                        f"got {out[-1][0]!r}")
    if not out[-1][1]:
        raise DataError(f"{where}: field 'messages[{last}].content': the final assistant turn must not "
                        "be empty")
    return Example(messages=tuple(out))


def _parse_preference(obj: dict[str, Any], where: str) -> Example:
    _no_unknown(obj, PREFERENCE_KEYS, where, "a preference line")
    for key in PREFERENCE_KEYS:
        if key not in obj:
            raise DataError(f"{where}: field '{key}': missing (preference lines need prompt, chosen and rejected)")
        if not isinstance(obj[key], str):
            raise DataError(f"{where}: field '{key}': expected a string, got {_kind(obj[key])}")
        if not obj[key]:
            raise DataError(f"{where}: field '{key}': must not be empty")
    if obj["chosen"] == obj["rejected"]:
        raise DataError(f"{where}: field 'rejected': equals 'chosen' (a preference pair needs two different answers)")
    return Example(messages=(("user", obj["prompt"]), ("assistant", obj["chosen"])), rejected=obj["rejected"])


def parse_line(obj: Any, where: str) -> Example:
    """Validate one decoded JSON value; ``where`` is ``"<file>:<line>"`` for error messages."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {_kind(obj)}")
    alpaca = [k for k in ALPACA_KEYS if k in obj]
    pref = [k for k in PREFERENCE_KEYS if k in obj]
    if pref and (alpaca or "messages" in obj):
        other = alpaca or ["messages"]
        raise DataError(f"{where}: field '{pref[0]}': mixes the preference format with field(s) "
                        f"{', '.join(other)}; use one format per line")
    if pref:
        return _parse_preference(obj, where)
    if "messages" in obj and alpaca:
        raise DataError(f"{where}: field 'messages': mixes the chat format with Alpaca field(s) "
                        f"{', '.join(alpaca)}; use one format per line")
    if "messages" in obj:
        return _parse_chat(obj, where)
    if alpaca:
        return _parse_alpaca(obj, where)
    raise DataError(f"{where}: field 'messages': missing (expected an Alpaca object with "
                    "'instruction' and 'output', a chat object with 'messages', or a preference object with "
                    "'prompt', 'chosen' and 'rejected')")


def read_jsonl(path: Path, errors: list[str] | None = None) -> list[Example]:
    """Read and validate one JSONL file; the first problem raises ``DataError`` naming file:line. With
    ``errors`` (a list), every problem is appended to it instead, and the valid examples are returned."""
    def problem(text: str) -> None:
        if errors is None:
            raise DataError(text) from None
        errors.append(text)

    name = str(path)
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        problem(f"{name}: file not found")
        return []
    except PermissionError:
        problem(f"{name}: cannot read file (permission denied)")
        return []
    except IsADirectoryError:
        problem(f"{name}: is a directory, expected a .jsonl file")
        return []
    except OSError as exc:
        problem(f"{name}: cannot read file ({exc.strerror or exc})")
        return []
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]  # tolerate a UTF-8 byte-order mark
    examples: list[Example] = []
    bad = 0
    for lineno, line_bytes in enumerate(raw.split(b"\n"), start=1):
        where = f"{name}:{lineno}"
        try:
            line = line_bytes.decode("utf-8")
        except UnicodeDecodeError as exc:
            problem(f"{where}: not valid UTF-8 (byte {exc.start} of the line)")
            bad += 1
            continue
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            problem(f"{where}: invalid JSON: {exc.msg} (column {exc.colno})")
            bad += 1
            continue
        try:
            ex = parse_line(obj, where)
        except DataError as exc:
            problem(str(exc))
            bad += 1
            continue
        if examples and ex.is_pair != examples[0].is_pair:
            first = "preference" if examples[0].is_pair else "instruction"
            problem(f"{where}: {'a preference' if ex.is_pair else 'an instruction'} line in a file of {first} "
                    "lines (a task file holds preference pairs only, or none)")
            bad += 1
            continue
        examples.append(ex)
    if not examples and not bad:
        problem(f"{name}: empty file (no examples)")
    return examples


def to_dataset(examples: Sequence[Example] | Iterable[Example]) -> datasets.Dataset:
    """An in-memory ``datasets.Dataset`` with columns ``messages`` (list of role/content) and ``answer``."""
    import datasets  # imported lazily: slow to import and only needed by callers that want a Dataset

    rows = [{"messages": ex.as_messages(), "answer": ex.answer} for ex in examples]
    if not rows:
        raise DataError("to_dataset: no examples")
    return datasets.Dataset.from_list(rows)
