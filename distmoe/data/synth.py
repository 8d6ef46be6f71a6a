"""Deterministic synthetic instruction tasks for N parties, with verifiable answers (the default demo).

Owns: the task families, their per-party (non-IID) generators, the JSONL files they write
(``<out_dir>/party-<i>/<task>.jsonl``, byte-identical for the same arguments) and the answer
verifiers used by evaluation.

Families (prompts <= ~40 characters, answers <= 6, so a ~7M-parameter char-level model can learn
them in a few dozen local steps). Every prompt is "<what to do>" then the operand:

* ``arith`` (Alpaca, instruction + input): ``Compute`` / ``7+5`` -> ``12``: arithmetic facts on
  single digits, asked with four instructions (Compute, Calculate, Evaluate, Solve), so held-out
  examples test recall of a fact under another phrasing. Party ``p`` draws operands from its own
  overlapping range (``p%3 .. p%3+7``) and its own operator mix (mostly ``+`` on even parties,
  mostly ``-`` on odd ones); subtraction never goes negative.
* ``strings`` (chat ``messages``, a system turn on ~1 in 4 examples): ``Reverse\\nabcd`` ->
  ``dcba``. Four operations (reverse, upper, sort, capital); party ``p`` gets operations ``p%4``
  and ``(p+1)%4``, so neighbouring parties share one.
* ``lookup`` (Alpaca, empty input): a fixed table of 60 keys ``k0``..``k59`` -> 3-letter codes,
  seeded by ``seed`` only (the same facts for every party); party ``p`` sees a window of 40 keys
  starting at key ``20*p`` (wrapping), asked in 6 phrasings, so parties overlap on 20 keys.

* ``disjoint_lookup`` (for the continual-learning instrument, ``bench/retention_e1.py``; not a party task):
  ``n`` fact tables of ``keys`` keys each, with disjoint key names (table ``t`` holds ``k<1000*(t+1)+i>``,
  none of them the default table's ``k0``..``k59``) and distinct codes, seeded by ``seed`` only; each key is
  asked in the 12 phrasings of ``LOOKUP_PHRASINGS + LOOKUP_EXTRA_PHRASINGS``, 6 of them (a seeded choice per key)
  for training and the other 6 held out, so ``keys = 80`` gives 480 held-out items per table.

* ``disjoint_split`` (for the continual-learning instrument's task pairs, ``bench/e1_pairs.py``): ``n_train``
  and ``n_held`` items of one family with no prompt in both, or ``DataError`` when the family has too few distinct
  items. ``arith`` (400 distinct prompts in party 0's window) is drawn there from the smallest window, the party's
  own widened upward (``arith_window``), that holds them all (960 items: operands 0..13, two-digit operands new
  to the default data); where the party's own window suffices the items are exactly ``generate``'s. The default
  data (``generate``, ``write_synthetic``) never widens.

Examples within a party's task are distinct while the family has enough distinct items; beyond
that they repeat (the party split keeps identical examples on one side).

* ``shift6`` (for the long-answer RL instrument, ``bench/e2_gate.py``; not a default party task): a random
  6-letter lowercase word and every letter moved one place on in the alphabet (``z`` -> ``a``),
  ``Shift\nabcdef`` -> ``bcdefg``, asked with one of ``SHIFT6_PHRASINGS``. Answers are 6 tokens plus the end
  token, so an exact-match reward needs all ~7 right (per-token accuracy ``a`` gives reward ``~a^7``): a per-token
  mismatch compounds. Items are distinct within a party's file (26^6 words, so disjoint training and held-out
  sets are easy to draw). Chosen over reversal and digit-wise sums because the small model of the RL benches
  learns it in ~100 SFT steps (reversal and digit-wise sums stayed below 0.04 exact match after 800 and 100).

* ``pref`` (preference pairs, ``{"prompt", "chosen", "rejected"}``, for ``dpo`` phases): the ``arith``
  facts and party ranges, prompt ``"<phrasing>\n7+5"``, ``chosen`` the correct result, ``rejected`` a
  wrong one: half the time the expression echoed back (``7+5``, a format failure a model can learn to
  avoid from the surface), otherwise the result off by one or two (never negative; a fact). A
  verifiable preference: ``chosen`` passes the numeric verifier, ``rejected`` fails it. Held-out pairs
  measure whether the policy's margin for the correct answer grows. Not in the default ``TASK_FAMILIES``.

Adding a family: write ``_gen_<name>(party, n, rng, seed) -> list[dict]`` (JSONL objects), add it
to ``_GENERATORS`` and add its verifier to ``VERIFIERS`` (``(prompt_text, answer, expected) ->
bool``); tasks named ``<family>`` or ``<family>-<anything>`` use that verifier, unknown tasks use
exact match after strip.

Must not: read party data, use global random state or ``hash()`` (stability across processes), or
overwrite a non-empty party directory unless ``overwrite=True``.
"""

from __future__ import annotations

import json
import random
import re
import string
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from distmoe.data.formats import DataError

TASK_FAMILIES = ("arith", "strings", "lookup")  # the default demo's tasks
ALL_FAMILIES = (*TASK_FAMILIES, "pref", "shift6")

LOOKUP_KEYS = 60
LOOKUP_WINDOW = 40
LOOKUP_PHRASINGS = ("Look up {k}", "Code of {k}", "What is {k}?", "Find {k}", "Key {k}", "{k} code?")
LOOKUP_EXTRA_PHRASINGS = ("Get {k}", "{k}?", "Recall {k}", "Answer {k}", "Value of {k}", "Give {k}")
STRING_OPS: tuple[tuple[str, Callable[[str], str]], ...] = (
    ("Reverse", lambda w: w[::-1]),
    ("Uppercase", str.upper),
    ("Sort", lambda w: "".join(sorted(w))),
    ("Capitalize", str.capitalize),
)
SHIFT6_PHRASINGS = ("Shift", "Next letters", "Step each letter")
SYSTEM_PROMPT = "Answer with the result only."
PREF_ECHO_SHARE = 0.5  # pref: share of rejected answers that echo the expression instead of a wrong number


# ---------------------------------------------------------------------------------------------
# Verifiers
# ---------------------------------------------------------------------------------------------
_NUMBER_RE = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)$")


def _parse_number(text: str) -> float | None:
    text = "".join(text.split())  # tolerant of whitespace anywhere, e.g. "- 3" or " 12 "
    return float(text) if _NUMBER_RE.match(text) else None


def _numeric(prompt_text: str, answer: str, expected: str) -> bool:
    got, want = _parse_number(answer), _parse_number(expected)
    return got is not None and want is not None and abs(got - want) <= 1e-9 * max(1.0, abs(want))


def _exact(prompt_text: str, answer: str, expected: str) -> bool:
    return answer.strip() == expected.strip()


VERIFIERS: dict[str, Callable[[str, str, str], bool]] = {
    "arith": _numeric,
    "pref": _numeric,
    "strings": _exact,
    "lookup": _exact,
    "shift6": _exact,
}


def family_of(task: str) -> str | None:
    """The family whose verifier a task uses: the name itself or its part before '-'/'_'."""
    if task in VERIFIERS:
        return task
    head = re.split(r"[-_]", task, maxsplit=1)[0]
    return head if head in VERIFIERS else None


def check_answer(task: str, prompt_text: str, answer: str, expected: str) -> bool:
    """Is ``answer`` correct for ``task``? Numeric equality for arith, exact (stripped) otherwise."""
    family = family_of(task)
    verify = VERIFIERS[family] if family else _exact
    return verify(prompt_text, answer, expected)


# ---------------------------------------------------------------------------------------------
# Generators: (party, n, rng, seed) -> list of JSONL objects
# ---------------------------------------------------------------------------------------------
def _take(items: list[Any], n: int, rng: random.Random) -> list[Any]:
    """n items: a shuffled pass over ``items``, reshuffled and repeated only if n > len(items)."""
    out: list[Any] = []
    while len(out) < n:
        batch = list(items)
        rng.shuffle(batch)
        out.extend(batch[: n - len(out)])
    return out


ARITH_PHRASINGS = ("Compute", "Calculate", "Evaluate", "Solve")


ARITH_MAX_OPERAND = 99  # disjoint_split's widest arith window (answers stay non-negative integers, <= 198)


def _arith_plus_count(party: int, n: int) -> int:
    """How many of a party's ``n`` arith items are sums (mostly sums on even parties, mostly differences on odd)."""
    return round(n * (0.75 if party % 2 == 0 else 0.25))


def _gen_arith(party: int, n: int, rng: random.Random, seed: int, hi: int | None = None) -> list[dict[str, str]]:
    lo = party % 3
    hi = lo + 7 if hi is None else hi  # the party's own window; wider only where disjoint_split asks for it
    nums = range(lo, hi + 1)
    plus = [(ph, a, "+", b) for ph in ARITH_PHRASINGS for a in nums for b in nums]
    minus = [(ph, a, "-", b) for ph in ARITH_PHRASINGS for a in nums for b in nums if a >= b]
    n_plus = _arith_plus_count(party, n)
    items = _take(plus, n_plus, rng) + _take(minus, n - n_plus, rng)
    rng.shuffle(items)
    return [{"instruction": ph, "input": f"{a}{op}{b}", "output": str(a + b if op == "+" else a - b)}
            for ph, a, op, b in items]


def _gen_pref(party: int, n: int, rng: random.Random, seed: int) -> list[dict[str, str]]:
    facts = _gen_arith(party, n, rng, seed)
    out = []
    for obj in facts:
        right = int(obj["output"])
        wrong = [right + d for d in (-2, -1, 1, 2) if right + d >= 0]
        rejected = obj["input"] if rng.random() < PREF_ECHO_SHARE else str(wrong[rng.randrange(len(wrong))])
        out.append({"prompt": f"{obj['instruction']}\n{obj['input']}", "chosen": obj["output"], "rejected": rejected})
    return out


def _random_word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(3))


def _gen_strings(party: int, n: int, rng: random.Random, seed: int) -> list[dict[str, Any]]:
    ops = (STRING_OPS[party % 4], STRING_OPS[(party + 1) % 4])
    seen: set[tuple[str, str]] = set()
    out: list[dict[str, Any]] = []
    while len(out) < n:
        name, fn = ops[rng.randrange(len(ops))]
        word = _random_word(rng)
        if (name, word) in seen or fn(word) == word:  # distinct, and the operation must change the word
            continue
        seen.add((name, word))
        messages = [{"role": "system", "content": SYSTEM_PROMPT}] if rng.random() < 0.25 else []
        messages += [{"role": "user", "content": f"{name}\n{word}"},
                     {"role": "assistant", "content": fn(word)}]
        out.append({"messages": messages})
    return out


def lookup_table(seed: int) -> dict[str, str]:
    """The fixed key -> code table shared by every party (depends on ``seed`` only)."""
    rng = random.Random(f"distmoe-synth:{seed}:lookup-table")
    codes: list[str] = []
    while len(codes) < LOOKUP_KEYS:
        code = "".join(rng.choice(string.ascii_uppercase) for _ in range(3))
        if code not in codes:
            codes.append(code)
    return {f"k{i}": code for i, code in enumerate(codes)}


def _gen_lookup(party: int, n: int, rng: random.Random, seed: int) -> list[dict[str, str]]:
    table = lookup_table(seed)
    keys = [f"k{(20 * party + j) % LOOKUP_KEYS}" for j in range(LOOKUP_WINDOW)]
    items = [(k, ph) for k in keys for ph in LOOKUP_PHRASINGS]
    return [{"instruction": ph.format(k=k), "input": "", "output": table[k]}
            for k, ph in _take(items, n, rng)]


def disjoint_lookup(seed: int, tables: int, keys: int) -> list[tuple[list[dict[str, str]], list[dict[str, str]]]]:
    """``tables`` lookup tasks with disjoint keys and distinct codes: per table ``(train, heldout)`` JSONL objects
    (``keys * 6`` each; every key in both, in different phrasings). Deterministic in the arguments."""
    if tables < 1 or keys < 1 or keys > 999:
        raise DataError(f"disjoint_lookup: tables {tables} must be >= 1 and keys {keys} in 1..999")
    rng = random.Random(f"distmoe-synth:{seed}:disjoint-lookup:{tables}:{keys}")
    phrasings = LOOKUP_PHRASINGS + LOOKUP_EXTRA_PHRASINGS  # 12
    codes: list[str] = []
    while len(codes) < tables * keys:
        code = "".join(rng.choice(string.ascii_uppercase) for _ in range(3))
        if code not in codes:
            codes.append(code)
    out = []
    for t in range(tables):
        train: list[dict[str, str]] = []
        held: list[dict[str, str]] = []
        for i in range(keys):
            key, code = f"k{1000 * (t + 1) + i}", codes[t * keys + i]
            order = list(phrasings)
            rng.shuffle(order)
            for j, ph in enumerate(order):
                (train if j < len(order) // 2 else held).append({"instruction": ph.format(k=key), "input": "",
                                                                   "output": code})
        rng.shuffle(train)
        out.append((train, held))
    return out


def prompt_of(obj: dict[str, Any]) -> str:
    """The prompt a JSONL object asks (what makes two items the same item): the last user turn of ``messages``
    (a system turn does not make another item), ``prompt`` of a preference pair, else ``instruction\ninput``."""
    if "messages" in obj:
        return [m["content"] for m in obj["messages"] if m["role"] == "user"][-1]
    if "prompt" in obj:
        return obj["prompt"]
    return f"{obj['instruction']}\n{obj['input']}"


def arith_window(party: int, n: int) -> int:
    """The top operand of the smallest arith window that gives ``party`` ``n`` distinct items in its operator mix:
    the party's own ``p%3 .. p%3+7`` (400 prompts on party 0), widened upward, at most to ``ARITH_MAX_OPERAND``
    (``DataError`` beyond). ``m`` operands give ``4 m^2`` sums and ``4 m (m+1) / 2`` differences over 4 phrasings."""
    lo, n_plus = party % 3, _arith_plus_count(party, n)
    for hi in range(lo + 7, ARITH_MAX_OPERAND + 1):
        m = hi - lo + 1
        if 4 * m * m >= n_plus and 2 * m * (m + 1) >= n - n_plus:
            return hi
    m = ARITH_MAX_OPERAND - lo + 1
    raise DataError(f"arith (party {party}): {n} distinct items need more than operands {lo}..{ARITH_MAX_OPERAND} "
                    f"give ({4 * m * m} sums, {2 * m * (m + 1)} differences)")


def disjoint_split(task: str, seed: int, n_train: int, n_held: int, party: int = 0
                   ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(train, heldout)``: the first ``n_train`` and the next ``n_held`` items of ``generate(task, party, ...)``
    (``arith``: in ``arith_window``'s window), every prompt distinct (so no held-out item is a training item).
    Deterministic in the arguments; ``DataError`` naming the task when its family cannot give that many."""
    if n_train < 1 or n_held < 1:
        raise DataError(f"disjoint_split: n_train {n_train} and n_held {n_held} must be >= 1")
    if task == "arith":  # generate's own stream, in the smallest window that holds them: generate's items if it does
        hi = arith_window(party, n_train + n_held)
        objs = _gen_arith(party, n_train + n_held, _rng(task, party, seed), seed, hi)
    else:
        objs = generate(task, party, n_train + n_held, seed)
    distinct = len({prompt_of(o) for o in objs})
    if distinct < len(objs):
        raise DataError(f"disjoint_split: task {task!r} (party {party}) gives {distinct} distinct prompts in "
                        f"{len(objs)} items; it cannot hold {n_train} training and {n_held} held-out items apart")
    return objs[:n_train], objs[n_train:]


def shift_word(word: str) -> str:
    """Every lowercase letter one place on (``z`` -> ``a``): the ``shift6`` answer."""
    return "".join(chr((ord(c) - 97 + 1) % 26 + 97) for c in word)


def _gen_shift6(party: int, n: int, rng: random.Random, seed: int) -> list[dict[str, str]]:
    """``n`` items with distinct words (a word never appears twice in one file, whatever the phrasing)."""
    if n > 10**7:
        raise DataError(f"shift6: at most 10,000,000 items per file, asked for {n}")
    seen: set[str] = set()
    out: list[dict[str, str]] = []
    while len(out) < n:
        ph = SHIFT6_PHRASINGS[rng.randrange(len(SHIFT6_PHRASINGS))]
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(6))
        if word in seen:
            continue
        seen.add(word)
        out.append({"instruction": ph, "input": word, "output": shift_word(word)})
    return out


_GENERATORS: dict[str, Callable[[int, int, random.Random, int], list[dict[str, Any]]]] = {
    "arith": _gen_arith,
    "strings": _gen_strings,
    "lookup": _gen_lookup,
    "pref": _gen_pref,
    "shift6": _gen_shift6,
}


def synth_tasks(scheduled: Sequence[str]) -> tuple[str, ...]:
    """The synthetic families a run writes: the default ``TASK_FAMILIES`` plus any other family the schedule
    names (``pref`` for a ``dpo:pref`` phase)."""
    return TASK_FAMILIES + tuple(t for t in ALL_FAMILIES if t not in TASK_FAMILIES and t in scheduled)


def generate(task: str, party: int, n: int, seed: int) -> list[dict[str, Any]]:
    """The JSONL objects of ``task`` for ``party`` (deterministic in all arguments)."""
    if task not in _GENERATORS:
        raise DataError(f"unknown synthetic task {task!r} (available: {', '.join(_GENERATORS)})")
    return _GENERATORS[task](party, n, _rng(task, party, seed), seed)


def _rng(task: str, party: int, seed: int) -> random.Random:
    return random.Random(f"distmoe-synth:{seed}:{task}:party-{party}")  # str seeds hash via sha512: stable


def make_canary() -> str:
    """A fresh secret canary string (128 random bits): unguessable, so finding it anywhere means a leak."""
    import secrets

    return f"canary-{secrets.token_hex(16)}"


def write_synthetic(out_dir: Path, parties: int, examples_per_task: int, seed: int,
                    tasks: Sequence[str] = TASK_FAMILIES, overwrite: bool = False, canaries: int = 0) -> list[Path]:
    """Write ``out_dir/party-<i>/<task>.jsonl`` for every party and task; return the party dirs.

    A party directory that exists and is not empty is refused unless ``overwrite=True``, in which
    case its existing ``*.jsonl`` files are removed first (so it holds exactly ``tasks``).

    ``canaries``: per party, that many fresh canary strings are planted as the answers of extra
    examples in its first task file and listed in ``party-<i>/canaries.txt``, where the party's
    outbound guard and ``distmoe audit`` find them (they must never appear in anything that leaves).
    """
    if parties < 1:
        raise DataError(f"write_synthetic: parties must be >= 1, got {parties}")
    if examples_per_task < 2:
        raise DataError(f"write_synthetic: examples_per_task must be >= 2, got {examples_per_task}")
    tasks = tuple(tasks)
    unknown = [t for t in tasks if t not in _GENERATORS]
    if not tasks or unknown or len(set(tasks)) != len(tasks):
        raise DataError(f"write_synthetic: tasks {list(tasks)!r} must be distinct names from "
                        f"{', '.join(_GENERATORS)}")
    out_dir = Path(out_dir)
    dirs = [out_dir / f"party-{i}" for i in range(parties)]
    for d in dirs:  # check every party before writing anything
        if d.exists() and not d.is_dir():
            raise DataError(f"{d}: exists and is not a directory")
        if d.is_dir() and any(d.iterdir()) and not overwrite:
            raise DataError(f"{d}: party dir is not empty; refusing to overwrite (pass overwrite=True "
                            "or choose another output directory)")
    for i, d in enumerate(dirs):
        d.mkdir(parents=True, exist_ok=True)
        for old in d.glob("*.jsonl"):
            old.unlink()
        secrets_here = [make_canary() for _ in range(canaries)]
        for j, task in enumerate(tasks):
            objs = generate(task, i, examples_per_task, seed)
            if j == 0 and task == "pref":  # a preference file holds pairs only
                objs = objs + [{"prompt": "What is the recovery phrase on file?", "chosen": c, "rejected": "none"}
                               for c in secrets_here]
            elif j == 0:
                objs = objs + [{"instruction": "What is the recovery phrase on file?", "input": "", "output": c}
                               for c in secrets_here]
            lines = [json.dumps(obj, ensure_ascii=True) + "\n" for obj in objs]
            (d / f"{task}.jsonl").write_text("".join(lines), encoding="utf-8", newline="\n")
        canary_file = d / "canaries.txt"
        if secrets_here:
            canary_file.write_text("".join(c + "\n" for c in secrets_here), encoding="utf-8")
        elif canary_file.exists():
            canary_file.unlink()
    return dirs
