"""The error replies a party can send, by name: one closed table of fixed reasons, shared by the
ClientApp, the in-process transport, the server guard, the coordinator and the audit.

Owns: ``ErrorCode`` (the ``Error.code`` of a party's error reply; every value lies outside the range
Flower uses for its own codes, ``flwr.common.constant.ErrorCode`` 0-8, so the server can always tell
a party's refusal from Flower's ``MESSAGE_UNAVAILABLE`` or ``NODE_UNAVAILABLE``), ``REASONS`` (the closed
table: each code's fixed name and meaning; the *only* text a party's error reply may carry is
``reason_text(code)``, followed by the ledger-head suffix), ``SERVER_REASONS`` (the closed table of why
the coordinator itself leaves a party out: no reply, a reply its guard rejected, ...), ``FLOWER_LINK_CODES``
(the Flower codes the SuperLink itself writes for an undeliverable message), and the two exceptions a
party raises to answer with an error: ``Refused`` and ``Blocked``. The exception's text is the *detail*:
it stays in the party's own log (``distmoe.wire.party_guard.guarded_error``) and never leaves.

Why a closed table: an error message about a party's data (a line number, a count of its examples, the
token length of one answer) is a release of private data outside every DP account. With fixed texts
the server learns which of sixteen things went wrong, nothing derived from the data. The ``policy-*`` codes
(1009-1016) each name the key of the data owner's policy (``distmoe.party.policy``) that a run config is
below: a fixed fact about the run config and the owner's own settings, never about the data.

Must not: import anything but the standard library.
"""

from __future__ import annotations

from enum import IntEnum


class ErrorCode(IntEnum):
    REFUSED = 1001  # the party refused the instruction (it does not conform to the protocol)
    BLOCKED = 1002  # the party's outbound guard stopped its own reply; nothing of it left
    CONFIG = 1003  # the party rejects the run config or its node config
    INTERNAL = 1004  # a failure outside the party's own checks (a bug, out of memory, ...)
    DATA = 1005  # the party's data is invalid or does not fit the configuration
    MODEL = 1006  # the party's model differs from the run's (base fingerprint, layout, anchor shape)
    BUDGET = 1007  # the release would exceed the party's privacy budget; refused before anything was sent
    SECAGG = 1008  # a secure-aggregation or privacy-session check failed at the party; it aborted
    # the run config is below the data owner's policy (node config ``policy-*``): one code per policy key
    POLICY_PLAINTEXT = 1009  # policy-allow-plaintext: the run turns secure aggregation off
    POLICY_MIN_PARTIES = 1010  # policy-min-parties
    POLICY_NOISE = 1011  # policy-min-noise-multiplier (router statistics)
    POLICY_METRIC_NOISE = 1012  # policy-min-metric-noise-multiplier (evaluation)
    POLICY_UPDATE_NOISE = 1013  # policy-min-update-noise-multiplier (model updates)
    POLICY_PHASES = 1014  # policy-phases
    POLICY_ROUNDS = 1015  # policy-max-rounds
    POLICY_RUNS = 1016  # policy-max-runs


# code -> (name, fixed meaning). Nothing else a party's error reply says may differ from these texts.
REASONS: dict[ErrorCode, tuple[str, str]] = {
    ErrorCode.REFUSED: ("refused", "the party refused the instruction (it does not conform to the protocol): "
                                   "see the party's log"),
    ErrorCode.BLOCKED: ("blocked", "the party's outbound guard stopped its own reply; nothing of it left: "
                                   "see the party's log"),
    ErrorCode.CONFIG: ("config", "the party rejects the run configuration or its node configuration: "
                                 "see the party's log"),
    ErrorCode.INTERNAL: ("internal", "a failure at the party outside its own checks: see the party's log"),
    ErrorCode.DATA: ("data", "the party's data does not fit the configuration: see the party's log"),
    ErrorCode.MODEL: ("model", "the party's model differs from the run's: see the party's log"),
    ErrorCode.BUDGET: ("budget", "the release would exceed the party's privacy budget; nothing was sent: "
                                 "see the party's log"),
    ErrorCode.SECAGG: ("secagg", "a secure-aggregation check failed at the party; it aborted: see the party's log"),
    ErrorCode.POLICY_PLAINTEXT: ("policy-allow-plaintext", "the data owner's policy requires secure aggregation; "
                                 "this run config turns it off: nothing was sent: see the party's log"),
    ErrorCode.POLICY_MIN_PARTIES: ("policy-min-parties", "privacy.min-parties or the SecAgg threshold is below the "
                                   "data owner's floor: nothing was sent: see the party's log"),
    ErrorCode.POLICY_NOISE: ("policy-min-noise-multiplier", "the router-statistics noise multiplier is below the "
                             "data owner's floor: nothing was sent: see the party's log"),
    ErrorCode.POLICY_METRIC_NOISE: ("policy-min-metric-noise-multiplier", "privacy.metric-noise-multiplier is below "
                                    "the data owner's floor: nothing was sent: see the party's log"),
    ErrorCode.POLICY_UPDATE_NOISE: ("policy-min-update-noise-multiplier", "the model-update noise multiplier is "
                                    "below the data owner's floor: nothing was sent: see the party's log"),
    ErrorCode.POLICY_PHASES: ("policy-phases", "the schedule has a phase kind the data owner's policy does not "
                              "allow: nothing was sent: see the party's log"),
    ErrorCode.POLICY_ROUNDS: ("policy-max-rounds", "the run has more rounds than the data owner's policy allows: "
                              "nothing was sent: see the party's log"),
    ErrorCode.POLICY_RUNS: ("policy-max-runs", "the data owner's cap on runs is reached: nothing was sent: "
                            "see the party's log"),
}

# why the coordinator itself leaves a party out (its detail goes to the coordinator's own output and ledger)
SERVER_REASONS: dict[str, str] = {
    "no-reply": "no reply in time (the node is down, dropped out or was late): see the coordinator's log",
    "rejected": "the party's reply failed the server guard; its content is not kept: see the coordinator's log",
    "withheld": "an error reply that did not pass a party guard or the reason table; its text is not kept",
    "unavailable": "Flower could not deliver the message (the SuperLink reports the node unavailable)",
    "screened": "the party's update failed the server's screening (federation.max-norm-ratio, shapes)",
}


def reason_text(code: int) -> str:
    """The only text a party's error reply with ``code`` may carry (before its ledger-head suffix)."""
    name, meaning = REASONS[ErrorCode(code)]
    return f"{name}: {meaning}"


def server_reason_text(name: str) -> str:
    return f"{name}: {SERVER_REASONS[name]}"


REASON_TEXTS = frozenset(reason_text(c) for c in ErrorCode)
SERVER_REASON_TEXTS = frozenset(server_reason_text(n) for n in SERVER_REASONS)
# every reason a ``party_error`` row of metrics.jsonl may hold: name -> text
ALL_REASONS: dict[str, str] = {**{REASONS[c][0]: reason_text(c) for c in ErrorCode},
                               **{n: server_reason_text(n) for n in SERVER_REASONS}}


def code_of(text: str) -> ErrorCode | None:
    """The code whose fixed text is exactly ``text``, or None."""
    for c in ErrorCode:
        if reason_text(c) == text:
            return c
    return None


class Reason(str):
    """Why a party was left out of a stage, as the coordinator holds it: the string is the detail for the
    coordinator's own output (never derived from party data: a party's own text is only ever a table entry),
    ``name`` its entry in ``ALL_REASONS`` (what ``metrics.jsonl`` records)."""

    name: str

    def __new__(cls, name: str, detail: str = "") -> Reason:
        if name not in ALL_REASONS:
            raise ValueError(f"{name!r} is not in the closed reason table")
        obj = super().__new__(cls, detail or ALL_REASONS[name])
        obj.name = name
        return obj


def reason_name(reason: str) -> str:
    """The table name of a reason the coordinator holds (a plain string is a server-side screening)."""
    return reason.name if isinstance(reason, Reason) else "screened"


# flwr.common.constant.ErrorCode MESSAGE_UNAVAILABLE, REPLY_MESSAGE_UNAVAILABLE, NODE_UNAVAILABLE
FLOWER_LINK_CODES = frozenset({3, 4, 5})


class Refused(RuntimeError):
    """The party refuses to answer. ``str(exc)`` is the detail for the party's own log; only
    ``reason_text(exc.code)`` leaves (``party_guard.guarded_error``)."""

    code = ErrorCode.REFUSED

    def __init__(self, detail: str = "", code: int | None = None):
        super().__init__(detail)
        if code is not None:
            self.code = ErrorCode(code)


class Blocked(Refused):
    """The outbound guard stopped a nonconforming reply; nothing of it left."""

    code = ErrorCode.BLOCKED
