"""The payload types of the secure-aggregation protocol stages (``privacy.mode = "secagg"``): setup
(``SetupRequest`` / ``KeyAdvertReply``), the key directory (``DirectoryRequest`` / ``ShareKeysReply``), the
consistency check and the unmask exchange. Part of the wire schema: ``distmoe.wire.schema.PAYLOADS`` lists them
with their records (the phase instruction's wrapper ``SecureInstruction`` and its ``MaskedReply`` are the schema's).

Must not: import ``flwr``, or hold anything but these dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SetupRequest:
    """Server -> party, once per run: the public secure-aggregation parameters and the privacy plan the
    server will account with (a party only ever tightens them: it uses the larger noise)."""

    secagg_run: bytes  # 16 random bytes, bound into every key derivation
    threshold: int
    max_length: int
    n_invited: int
    noise_multiplier: float  # router statistics
    update_noise_multiplier: float
    # the logical run (the coordinator's run id, the same across a resume, which may come with a new
    # Flower run id) and the setup epoch (0 at the start, k after the k-th resume): a party keys its
    # privacy accountant by the logical run, so a resumed run never starts a fresh budget
    logical_run: str = ""
    epoch: int = 0


@dataclass(frozen=True)
class KeyAdvertReply:
    party: str
    c_pk: bytes  # X25519 share-encryption key of this run
    ledger_public_key: str  # hex Ed25519 key that signs this party's ledger
    sig_pk: bytes  # Ed25519 key that signs this party's consistency-check answers (SecAgg, this run)
    # the party's own budget cap (node config ``epsilon-max``; 0 = none): configuration, not data. The
    # coordinator refuses to start a schedule whose planned epsilon the cap cannot cover
    epsilon_max: float = 0.0


@dataclass(frozen=True)
class DirectoryRequest:
    directory: object  # secagg.KeyDirectory
    first_round: int
    names: tuple[tuple[int, str], ...]  # (node id, party name) of the roster, for the parties' ledgers


@dataclass(frozen=True)
class ShareKeysReply:
    keys: object  # secagg.ShareKeys


@dataclass(frozen=True)
class ConsistencyRequestMsg:
    request: object  # secagg.ConsistencyRequest


@dataclass(frozen=True)
class ConsistencyResponseMsg:
    response: object  # secagg.ConsistencyResponse


@dataclass(frozen=True)
class UnmaskRequestMsg:
    request: object  # secagg.UnmaskRequest


@dataclass(frozen=True)
class UnmaskResponseMsg:
    response: object  # secagg.UnmaskResponse
