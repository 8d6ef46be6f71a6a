"""Secure aggregation (Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving Machine Learning",
CCS 2017, https://eprint.iacr.org/2017/281), transport-agnostic.

Owns: the protocol. ``SecAggClient`` and ``SecAggServer`` are state machines whose inputs and outputs
are the frozen dataclasses of ``messages`` (ints, bytes, numpy arrays); ``local.LocalFederation`` runs the
schedule in process. Turning reals into Z_2^32 / Z_2^64 and checking that a sum cannot wrap is
``distmoe.privacy.ring``.

Must not: import ``flwr`` (``distmoe/wire`` maps the messages onto records), do I/O, or use
non-cryptographic randomness (``os.urandom`` unless a test injects a seeded byte source).

Why hand-written on ``cryptography`` and not Flower 1.42's SecAgg+ (``docs/privacy.md`` §9): SecAgg+
only runs in the legacy ``LegacyContext`` workflow; its mask PRG is MT19937 seeded with a 32-bit fold
of the key (flwrlabs/flower#7522); a dropout before key sharing kills the round; its clients reveal
both shares of a peer when asked (unmasking that peer); metrics and ``num_examples`` travel in clear.

Primitives: X25519 (share-encryption key c once per run; mask key s fresh every round), HKDF-SHA256
with info bound to (run, round, ordered ids, purpose), AES-256-CTR keystream as PRG (exactly uniform
over Z_{2^bits}), ChaCha20-Poly1305 for the shares with associated data binding run, round, sender,
recipient and the sender's mask key, Shamir over GF(2^521 - 1) with threshold t (2t > holders).

The sum, for client u with input ``x_u: [length]`` in Z_{2^bits} (bits = the round's declared width,
``RoundStart.bits``: 32 or 64 in a run, at most ``params.bits``), peers v of u in U1 (every other client of U1
with the complete graph), U2 the clients whose masked input arrived::

    s_uv = HKDF(X25519(s_sk_u, s_pk_v), info = ("pair-mask", run, round, min(u,v), max(u,v)))  same for u and v
    y_u  = x_u + PRG(b_u) + sum_{v > u} PRG(s_uv) - sum_{v < u} PRG(s_uv)   mod 2^bits    [length]
    sum_{u in U2} x_u = sum_{u in U2} y_u - sum_{u in U2} PRG(b_u)                          [length]
                        -/+ the pairwise masks of U2 members with dropped peers (from their s_sk)

The pairwise masks of two survivors cancel; the server rebuilds ``b_u`` of survivors and ``s_sk_v`` of dropped
peers from t Shamir shares each. Every mask is expanded chunk by chunk straight into the output words and
added in place (``primitives.combine_masks``, equal word for word to ``primitives.prg``): no per-mask vector.

Schedule (the caller's exchanges; each reaches every online client at once):

  setup A   client: KeyAdvert(c_pk)                 server: register -> KeyDirectory
  setup B   directory down; client: ShareKeys(r0)   server: add_share_keys
  round r   1. RoundStart (+ the training request) down; client trains and sends
               MaskedInput(y_r, next_keys=ShareKeys(r+1), count shares of c_u)
                                                             server: receive_masked -> ConsistencyRequest each
            2. ConsistencyRequest(U2, count shares) down; client: ConsistencyResponse (signed U2, share of
               sum c);                                       server: receive_consistency -> UnmaskRequest
            3. UnmaskRequest (+ the signatures) down; client checks them, UnmaskResponse;
                                                             server: finish -> AggregateResult

So a round is always three exchanges, with or without dropouts: the share-keys stage of round r+1 rides
on the masked input of round r (``docs/architecture.md`` §2; shares for the first round go in
setup B). A client that missed the previous round's masked input is outside U1 of round r; it answers
exchange 1 with ``share_keys(r + 1)`` only and rejoins at r+1. Dropouts are recovered in exchange 2:
survivors reveal b-shares of U2 members and s-shares of U1 minus U2, never both for one peer.

Deviation from "mask keys once per run": the s key pair is fresh per round, the c key is per run. If
s were per run, reconstructing a dropped client's s_sk in round r (which piggybacking makes routine:
a client that goes offline after sending round r-1 is in U1 of round r) would let the server recompute
that client's pairwise masks of every earlier round, whose self masks it already removed: all its past
inputs would be exposed. A fresh s_pk costs 32 bytes per round and no extra exchange.

State between messages: ``SecAggClient.to_state()`` / ``SecAggClient.from_state(params, blob)`` (and the
same on the server) save and restore a state machine as a checksummed canonical-JSON blob (``state``),
because a Flower SuperNode runs each message in a new process. A client blob is secret material: it
stays in the party's own node state or work directory and is saved before each reply is sent.

Peer graph: complete (Bonawitz et al.) by default; ``privacy.secagg-graph = "harary"`` selects the SecAgg+
sparse graph of Bell et al., "Secure Single-Server Aggregation with (Poly)Logarithmic Overhead", CCS 2020,
https://eprint.iacr.org/2020/704 (``graph.peer_graph``: a Harary graph over a public permutation keyed by
the run id, degree from ``graph.harary_degree``, threshold per neighbourhood). With its default bounds
it equals the complete graph up to 25 parties (``bench/scale.py``, ``docs/results.md``).

Consistency check (Bonawitz et al. CCS 2017 §4, ConsistencyCheck; ``SecAggClient.consistency``): each
party signs the survivor set U2 it was told with a per-run Ed25519 key pinned in the key directory, and
reveals shares only for the set it signed and with ``required_signatures`` (max(t, n//2 + 1)) valid
signatures over it. The signatures carry each signer's share of the contributor count sum_{u in U2} c_u
(c_u = 1 iff u's input holds any of its data, Shamir-shared pairwise-encrypted with the masked input);
party and server refuse to unmask below ``privacy.min-parties`` contributors without learning who.

Not covered yet: authentication of c_pk/sig_pk by a key the coordinator did not relay (a coordinator
that substitutes keys at setup is caught only if owners compare ``SecAggClient.fingerprint`` out of
band), bit-packing of y below 32 bits.

Example, 3 of 4 clients survive, t = 3:

    params = SecAggParams(run_id=os.urandom(16), threshold=3, bits=64, length=n)
    fed = LocalFederation(params, [1, 2, 3, 4]); fed.setup()
    ring.check_fits_ring64(3 * (64 * max_abs + 0.5))   # three summands of |x| <= max_abs at scale 64
    res = fed.round(1, {i: ring.encode_fixed(x[i], 64) for i in (1, 2, 3, 4)}, drop_before_masked={4})
    # (three exchanges: masked input, consistency check, unmask)
    ring.decode_fixed(res.total, 64)    # == x[1] + x[2] + x[3] to 3/128
"""

from distmoe.privacy.secagg.client import SecAggClient
from distmoe.privacy.secagg.errors import (
    AlreadyDead,
    BelowThreshold,
    BothSharesRequested,
    ConsistencyFailure,
    DuplicateClient,
    InconsistentLists,
    InsecureThreshold,
    KeySubstitution,
    ListedAsDead,
    ProtocolViolation,
    ReconstructionFailed,
    RepeatedRequest,
    RepeatedUnmask,
    SecAggAbort,
    StateCorrupt,
    StateError,
    StateMismatch,
    TamperedShare,
    TooFewContributors,
    TooFewSurvivors,
    UnknownClient,
)
from distmoe.privacy.secagg.graph import (
    GRAPHS,
    PeerGraph,
    check_graph,
    complete_graph,
    graph_degree,
    graph_threshold,
    harary_degree,
    harary_graph,
    peer_graph,
)
from distmoe.privacy.secagg.local import LocalFederation
from distmoe.privacy.secagg.messages import (
    AggregateResult,
    ConsistencyRequest,
    ConsistencyResponse,
    CountShare,
    EncryptedShares,
    KeyAdvert,
    KeyDirectory,
    MaskedInput,
    RoundStart,
    SecAggParams,
    ShareKeys,
    UnmaskRequest,
    UnmaskResponse,
    payload_bytes,
)
from distmoe.privacy.secagg.rounds import Phase, PreMask
from distmoe.privacy.secagg.server import SecAggServer

__all__ = [
    "GRAPHS", "AggregateResult", "AlreadyDead", "BelowThreshold", "BothSharesRequested", "ConsistencyFailure",
    "ConsistencyRequest", "ConsistencyResponse", "CountShare", "DuplicateClient",
    "EncryptedShares", "InconsistentLists", "InsecureThreshold", "KeyAdvert", "KeyDirectory", "KeySubstitution",
    "ListedAsDead", "LocalFederation", "MaskedInput", "PeerGraph", "Phase", "PreMask", "ProtocolViolation",
    "ReconstructionFailed", "RepeatedRequest", "RepeatedUnmask", "RoundStart", "SecAggAbort", "SecAggClient",
    "SecAggParams", "SecAggServer", "ShareKeys", "StateCorrupt", "StateError", "StateMismatch",
    "TamperedShare", "TooFewContributors", "TooFewSurvivors", "UnknownClient",
    "UnmaskRequest", "UnmaskResponse", "check_graph", "complete_graph", "graph_degree", "graph_threshold",
    "harary_degree", "harary_graph", "payload_bytes", "peer_graph",
]
