"""A SecAgg client's per-round state: the stage it reached, the round's secrets and the shares it holds, and a
round's mask expanded ahead of its input.

Owns: :class:`Phase` (SHARED -> MASKED -> CHECKED -> DONE, or ABORTED), :class:`ClientRound` (wiped as soon as its
secrets are no longer needed), :class:`PreMask` and the digest that binds a premask to its round's mask terms.

Must not: import ``flwr``, do I/O, or decide anything of the protocol (``client.py`` and its stages do).
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field

import numpy as np


class Phase(enum.Enum):
    SHARED = "shared"
    MASKED = "masked"
    CHECKED = "checked"
    DONE = "done"
    ABORTED = "aborted"


@dataclass
class ClientRound:
    round: int
    s_sk: bytes  # this round's mask key (wiped once the masked input is computed)
    s_pk: bytes
    b: bytes  # this round's self-mask seed (wiped once the masked input is computed)
    phase: Phase = Phase.SHARED
    u1: tuple[int, ...] = ()  # participants as the server announced them in RoundStart
    held: dict[int, tuple[int, int]] = field(default_factory=dict)  # owner -> (b-share, s-share)
    own_count: int | None = None  # this client's share of its own contributor bit (until the consistency stage)
    u2: tuple[int, ...] = ()  # the survivor set this client signed (consistency stage)
    share_sum: int | None = None  # its share of sum_{u in U2} c_u

    def wipe(self) -> None:
        self.s_sk = self.b = b""
        self.held.clear()
        self.own_count = None


@dataclass(frozen=True)
class PreMask:
    """A round's combined mask, expanded ahead of the input (``SecAggClient.premask``): ``words`` ``[length]``
    in Z_2^bits; ``digest`` binds it to the round's mask terms (keys and signs), so ``masked_input`` can check
    that it is the mask that round needs."""

    round: int
    bits: int
    digest: bytes
    words: np.ndarray


def terms_digest(terms: list[tuple[bytes, int]]) -> bytes:
    h = hashlib.sha256(b"distmoe-premask")
    for key, sign in terms:
        h.update(key + sign.to_bytes(1, "big", signed=True))
    return h.digest()
