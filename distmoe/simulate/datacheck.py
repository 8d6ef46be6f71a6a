"""The one check of party data that ``distmoe data validate`` and ``distmoe simulate --data`` both run.

Owns :func:`check_parties`: for every party directory, every problem at once (the directory, each task
name, each line of each file: ``distmoe.data.party.party_problems``), the party's name, and the same
privacy check of file modes that a run makes before it starts (``distmoe.wire.at_rest.check_isolation``:
no group or other permission bits, with the one ``chmod`` that fixes it); and, on valid data, the length
findings (:func:`length_findings`): answers longer than evaluation generates (``eval.max-new-tokens``)
can never be matched, prompts longer than ``model.max-seq-len`` leaves them are cut from the left, examples
whose answer does not fit ``model.max-seq-len`` at all are left out of training, statistics and evaluation (a
party leaves them out rather than refusing the run, which would tell the coordinator its longest answer); each
finding says the numbers and the key to change. :func:`derived_max_new_tokens` is what ``simulate --data`` sets
``eval.max-new-tokens`` to when the user has not set it (``data validate`` says so).

Token counts use the run's own tokenizer (the tiny default's character tokenizer, or ``model.path``'s) and
its chat template, as training and evaluation encode them.

Must not: write anything, print anything, or import ``flwr``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from distmoe.data.formats import DataError, Example
from distmoe.data.party import PartyData, load_party, party_problems
from distmoe.data.template import chat_ids
from distmoe.wire.at_rest import check_isolation

PARTY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
MAX_NEW_TOKENS_HI = 1024  # the range of eval.max-new-tokens


@dataclass
class DataReport:
    """What :func:`check_parties` found: ``errors`` refuse a run, ``warnings`` do not."""

    parties: dict[str, PartyData] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def raise_errors(self, what: str) -> None:
        if self.errors:
            n = len(self.errors)
            raise DataError(f"{what}: {n} problem{'s' if n > 1 else ''}:\n  " + "\n  ".join(self.errors))


def tokenizer_for(cfg):
    """The run's tokenizer: the tiny default's, or ``model.path``'s (checked as a run checks it)."""
    if not cfg.model.path:
        from distmoe.model.tokenizer import build_default_tokenizer

        return build_default_tokenizer()
    from transformers import AutoTokenizer

    from distmoe.model.build import prepare_tokenizer

    tok = AutoTokenizer.from_pretrained(cfg.model.path, local_files_only=True)
    prepare_tokenizer(tok, cfg.model.path)
    return tok


def answer_tokens(tok, ex: Example) -> int:
    """Tokens of the answer text itself: what greedy generation must produce for an exact match."""
    return len(tok(ex.answer, add_special_tokens=False)["input_ids"])


def prompt_tokens(tok, ex: Example) -> int:
    """Tokens of the prompt as the chat template renders it, generation prompt included."""
    return len(chat_ids(tok, ex.prompt_messages, add_generation_prompt=True))


def completion_tokens(tok, ex: Example) -> int:
    """Tokens of the completion as training encodes it (answer + end token): it must fit whole, with one prompt
    token, in ``model.max-seq-len`` (``distmoe.data.template.encode_example``)."""
    return len(chat_ids(tok, ex.as_messages(), add_generation_prompt=False)) - prompt_tokens(tok, ex)


CANARIES = "canaries.txt"  # a party's planted canary strings (``distmoe data synth``; the audit searches them)


def _examples(party: PartyData) -> dict[str, list[Example]]:
    """Each task's examples, without the planted canaries (answers listed in the party's ``canaries.txt``:
    secrets to find in a leak, not answers to learn; their length says nothing about the task)."""
    try:
        planted = {x.strip() for x in (party.data_dir / CANARIES).read_text(encoding="utf-8").splitlines()}
    except OSError:
        planted = set()
    return {t: [ex for ex in party.train(t) + party.heldout(t) if ex.answer.strip() not in planted]
            for t in party.tasks}


def longest_answer(tok, parties: dict[str, PartyData]) -> int:
    """The longest answer of any task of any party, in tokens."""
    return max((answer_tokens(tok, ex) for p in parties.values() for exs in _examples(p).values() for ex in exs),
               default=1)


def derived_max_new_tokens(tok, parties: dict[str, PartyData], max_seq_len: int) -> int:
    """What ``simulate --data`` sets ``eval.max-new-tokens`` to when the user has not: the longest answer in tokens,
    within the key's range and leaving at least 16 prompt tokens of ``model.max-seq-len`` at evaluation."""
    return min(longest_answer(tok, parties), MAX_NEW_TOKENS_HI, max(1, max_seq_len - 16))


def length_findings(tok, name: str, party: PartyData, max_new_tokens: int, max_seq_len: int) -> list[str]:
    """One warning per task whose answers exceed ``eval.max-new-tokens`` or whose prompts exceed what
    ``model.max-seq-len`` leaves for them at evaluation (the sequence minus the generated tokens)."""
    out = []
    room = max_seq_len - max_new_tokens
    for task, exs in _examples(party).items():
        ans = [answer_tokens(tok, ex) for ex in exs]
        long = [a for a in ans if a > max_new_tokens]
        where = f"party {name}, task {task}"
        if long:
            out.append(f"{where}: {len(long)} of {len(ans)} answers are longer than eval.max-new-tokens = "
                       f"{max_new_tokens} tokens (longest {max(ans)}): evaluation generates {max_new_tokens} tokens, "
                       f"so these can never count as correct; set eval.max-new-tokens = {max(ans)}")
        comp = [completion_tokens(tok, ex) for ex in exs]
        unfit = [c for c in comp if c >= max_seq_len]
        if unfit:
            out.append(f"{where}: {len(unfit)} of {len(comp)} answers need model.max-seq-len = {max_seq_len} tokens or "
                       f"more with the end token (longest {max(comp)}): these examples are left out of training and "
                       f"evaluation; set model.max-seq-len = {max(comp) + 1}")
        prompts = [prompt_tokens(tok, ex) for ex in exs]
        cut = [n for n in prompts if n > room]
        if cut:
            need = max(prompts) + max(max_new_tokens, max(ans))
            out.append(f"{where}: {len(cut)} of {len(prompts)} prompts are longer than model.max-seq-len - "
                       f"eval.max-new-tokens = {max_seq_len} - {max_new_tokens} = {room} tokens (longest "
                       f"{max(prompts)}): they are cut from the left; set model.max-seq-len = {need}")
    return out


def party_dirs_of(root: Path) -> list[Path]:
    """``root`` itself when it is one party's directory (it holds ``*.jsonl``, or nothing else), else its
    non-hidden subdirectories."""
    subdirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    return [root] if any(root.glob("*.jsonl")) or not subdirs else subdirs


def check_parties(dirs: list[Path], cfg, *, names: bool = True, modes: bool = True, lengths: bool = True
                  ) -> DataReport:
    """Every problem of every party directory (module docstring); ``names``: each directory's name must be
    an identifier (it becomes the party's name); ``modes``: the file-mode check (``simulate`` makes it in its
    privacy check before the run, ``distmoe.simulate.prepare.privacy_check``); ``lengths``: the length
    findings, on valid data."""
    rep = DataReport()
    for d in dirs:
        if names and not PARTY_NAME.fullmatch(d.name):
            rep.errors.append(f"{d}: party directory name {d.name!r} must be an identifier (letters, digits, '-', "
                              "'_'): it becomes the party's name")
        problems = party_problems(d)
        rep.errors += problems
        if modes:
            rep.errors += check_isolation({d.name: [d]})  # the check simulate's privacy check makes before a run
        if not problems:
            rep.parties[d.name] = load_party(d, cfg.data)
    if lengths and rep.parties:
        tok = tokenizer_for(cfg)
        for name, party in rep.parties.items():
            rep.warnings += length_findings(tok, name, party, cfg.eval.max_new_tokens, cfg.model.max_seq_len)
    return rep
