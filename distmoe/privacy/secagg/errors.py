"""Exceptions of the secure-aggregation protocol.

Owns: the abort taxonomy. Every refusal by a client or the server is a ``SecAggAbort`` subclass whose
message names the round, the stage and the offending client, so the caller can log it and answer with
an error instead of a payload.

Must not: carry secrets (keys, seeds, shares) in a message or attribute; they end up in logs.
"""

from __future__ import annotations


class SecAggAbort(Exception):
    """The round (or run) cannot go on safely; nothing more may be sent for it."""


class BelowThreshold(SecAggAbort):
    """Fewer than ``t`` parties are left at some stage (server side, or the client's own check)."""


class TooFewSurvivors(BelowThreshold):
    """Client side: the server's lists leave fewer than ``t`` parties the client shares with."""


class InsecureThreshold(SecAggAbort):
    """``t`` is not above half of a holder set: a server telling parties different stories could
    collect both shares of one party."""


class ProtocolViolation(SecAggAbort):
    """A message that is out of order, malformed, or inconsistent with what was sent before."""


class ListedAsDead(ProtocolViolation):
    """The server lists this client as dropped (or omits it from the survivors) while it is alive."""


class UnknownClient(ProtocolViolation):
    """The server names a client that is not in the run's key directory."""


class AlreadyDead(ProtocolViolation):
    """The server lists as dropped-in-this-round a client that never shared keys this round."""


class InconsistentLists(ProtocolViolation):
    """The server's alive/dead lists disagree with the participant list it sent earlier."""


class DuplicateClient(ProtocolViolation):
    """The same client appears twice in one list (or sends twice)."""


class BothSharesRequested(ProtocolViolation):
    """The server asks for both the self-mask share and the mask-key share of one peer."""


class RepeatedRequest(ProtocolViolation):
    """A stage of a round is requested a second time (masked input, share keys, setup)."""


class RepeatedUnmask(RepeatedRequest):
    """A second unmask request in the same round."""


class KeySubstitution(ProtocolViolation):
    """The directory relayed by the server does not hold this client's own key, or repeats a key."""


class ConsistencyFailure(ProtocolViolation):
    """The consistency check failed (Bonawitz et al. CCS 2017 §4): the survivor set in the unmask request
    is not the one this client signed, a signature is missing, forged, repeated or over another set, fewer
    than the required number of survivors signed, or the signed share-sums do not lie on one polynomial.
    A server showing different survivor sets to different clients (a split view) ends here."""


class TooFewContributors(SecAggAbort):
    """The securely summed contributor count of the round is below ``privacy.min-parties``: the release
    would be the data of fewer parties than the run promises; nothing is unmasked."""


class TamperedShare(SecAggAbort):
    """An encrypted share failed authentication (AEAD tag), so it was altered or misaddressed."""

    def __init__(self, message: str, *, sender: int, round: int):
        super().__init__(message)
        self.sender = sender
        self.round = round


class ReconstructionFailed(SecAggAbort):
    """Shamir reconstruction produced a value that does not match the owner's commitment."""

    def __init__(self, message: str, *, owner: int, round: int):
        super().__init__(message)
        self.owner = owner
        self.round = round


class StateError(SecAggAbort):
    """A saved client or server state (``to_state`` blob) cannot be restored."""


class StateCorrupt(StateError):
    """The blob is torn, truncated, altered or malformed: its checksum or its structure is wrong."""


class StateMismatch(StateError):
    """An intact blob of another run, other parameters, another client, peer graph, kind or format
    version than the one restoring it."""
