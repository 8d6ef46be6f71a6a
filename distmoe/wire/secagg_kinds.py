"""The field kinds of the secure-aggregation protocol messages (``privacy.mode = "secagg"``): key
directory (with the signing keys), roster, share keys, round start, masked input (with the
contributor-bit shares), late keys, consistency request and response, unmask request (with the
signatures) and response, each written into Flower records and read back strictly. Part of the codec
(``distmoe.wire.codec``).

Owns: ``SECAGG_KINDS`` and the encrypted envelopes (peer ids ``[n]`` uint64, nonces ``[n, 12]`` and
ciphertexts ``[n, 148]`` uint8 for the mask shares, ``[n, 82]`` for the contributor-bit shares).

Must not: do any cryptography (``distmoe.privacy.secagg`` does), or be used outside ``distmoe.wire``.
"""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord

from distmoe.privacy import secagg as sa
from distmoe.wire.records import In, Kind, Out, WireError, _arrays, _party, _read_arrays

_SA_ENVELOPES = {"ids": "uint64", "nonces": "uint8", "cts": "uint8"}


def _u64(values) -> np.ndarray:
    return np.asarray(list(values), dtype=np.uint64).reshape(-1)


def _u8(rows: list[bytes], width: int) -> np.ndarray:
    if not rows:
        return np.zeros((0, width), np.uint8)
    return np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(len(rows), width).copy()


def _rows(a: np.ndarray, width: int, what: str) -> list[bytes]:
    if a.dtype != np.uint8 or a.ndim != 2 or a.shape[1] != width:
        raise WireError(f"{what}: expected uint8 [n, {width}], got {a.dtype} {a.shape}")
    return [bytes(r) for r in a]


def _ids(a: np.ndarray, what: str) -> tuple[int, ...]:
    if a.dtype != np.uint64 or a.ndim != 1:
        raise WireError(f"{what}: expected uint64 [n], got {a.dtype} {a.shape}")
    return tuple(int(v) for v in a)


_CT = sa.messages.SHARE_CIPHERTEXT_BYTES
_COUNT_CT = sa.messages.COUNT_CIPHERTEXT_BYTES


def _envelopes(shares, peer_of, width: int = _CT) -> ArrayRecord:
    """EncryptedShares / CountShare -> arrays: peer ids [n], nonces [n, 12], ciphertexts [n, width]."""
    return _arrays({"ids": _u64(peer_of(e) for e in shares), "nonces": _u8([e.nonce for e in shares], 12),
                    "cts": _u8([e.ciphertext for e in shares], width)})


def _read_envelopes(rec: ArrayRecord, what: str, make, width: int = _CT) -> tuple:
    arrays = _read_arrays(rec, what)
    if set(arrays) != set(_SA_ENVELOPES):
        raise WireError(f"{what}: arrays {sorted(arrays)} != {sorted(_SA_ENVELOPES)}")
    ids = _ids(arrays["ids"], what)
    nonces = _rows(arrays["nonces"], 12, what)
    cts = _rows(arrays["cts"], width, what)
    if not len(ids) == len(nonces) == len(cts):
        raise WireError(f"{what}: {len(ids)} ids, {len(nonces)} nonces, {len(cts)} ciphertexts")
    return tuple(make(i, n, c) for i, n, c in zip(ids, nonces, cts, strict=True))


# ------------------------------------------------------------------------------------------------
# Secure aggregation protocol messages (privacy.mode = "secagg") as field kinds
# ------------------------------------------------------------------------------------------------
def _put_share_keys(out: Out, prefix: str, k) -> None:
    out.recs[prefix] = ConfigRecord({"round": k.round, "sender": k.sender, "s_pk": k.s_pk, "b_commit": k.b_commit})
    out.recs[f"{prefix}_shares"] = _envelopes(k.shares, lambda e: e.recipient)


def _take_share_keys(inp: In, prefix: str):
    sender, rnd = int(inp.value(f"{prefix}.sender")), int(inp.value(f"{prefix}.round"))
    s_pk, b_commit = bytes(inp.value(f"{prefix}.s_pk")), bytes(inp.value(f"{prefix}.b_commit"))
    shares = _read_envelopes(inp.record(f"{prefix}_shares"), f"{inp.tag}: {prefix}_shares",
                             lambda i, n, c: sa.EncryptedShares(sender, i, rnd, n, c))
    return sa.ShareKeys(sender, rnd, s_pk, b_commit, shares)


def _share_key_strings(at: str) -> dict[str, set[str]]:
    return {at: {"s_pk", "b_commit"}}


def _put_directory(out: Out, at: str, d) -> None:
    out.config("meta")["secagg_run"] = d.run_id
    if [v for v, _ in d.sig_keys] != [v for v, _ in d.keys]:
        raise WireError(f"{out.tag}: signing keys and share keys name different parties")
    out.recs[at] = _arrays({"ids": _u64(cid for cid, _ in d.keys), "keys": _u8([k for _, k in d.keys], 32),
                            "sig_keys": _u8([k for _, k in d.sig_keys], 32)})


def _take_directory(inp: In, at: str, got: dict):
    run = bytes(inp.value("meta.secagg_run"))
    arrays = inp.arrays(at, {"ids", "keys", "sig_keys"})
    ids, keys = _ids(arrays["ids"], inp.tag), _rows(arrays["keys"], 32, inp.tag)
    sig = _rows(arrays["sig_keys"], 32, inp.tag)
    if not len(ids) == len(keys) == len(sig):
        raise WireError(f"{inp.tag}: {len(ids)} ids, {len(keys)} keys, {len(sig)} signing keys")
    return sa.KeyDirectory(run, tuple(zip(ids, keys, strict=True)), tuple(zip(ids, sig, strict=True)))


def _put_roster(out: Out, at: str, names) -> None:
    by_id = dict(names)
    out.config("meta")[at.split(".", 1)[1]] = [_party(by_id[cid]) for cid, _ in out.payload.directory.keys]


def _take_roster(inp: In, at: str, got: dict):
    names = [_party(str(n)) for n in inp.value(at)]
    ids = [cid for cid, _ in got["directory"].keys]
    if len(ids) != len(names):
        raise WireError(f"{inp.tag}: {len(ids)} ids, {len(names)} names")
    return tuple(zip(ids, names, strict=True))


def _put_start(out: Out, at: str, st) -> None:
    meta = out.config(at)
    meta["has_start"] = st is not None
    if st is not None:
        meta.update(round=int(st.round), recipient=int(st.recipient), length=int(st.length), bits=int(st.bits))
        out.recs["sa_parts"] = _arrays({"ids": _u64(v for v, _ in st.participants),
                                        "s_pks": _u8([k for _, k in st.participants], 32)})
        out.recs["sa_shares"] = _envelopes(st.shares, lambda e: e.sender)


def _take_start(inp: In, at: str, got: dict):
    if not bool(inp.value(f"{at}.has_start")):
        return None
    rnd, rcpt = int(inp.value(f"{at}.round")), int(inp.value(f"{at}.recipient"))
    parts = inp.arrays("sa_parts", {"ids", "s_pks"})
    ids, pks = _ids(parts["ids"], inp.tag), _rows(parts["s_pks"], 32, inp.tag)
    if len(ids) != len(pks):
        raise WireError(f"{inp.tag}: {len(ids)} participants, {len(pks)} keys")
    shares = _read_envelopes(inp.record("sa_shares"), f"{inp.tag}: sa_shares",
                             lambda i, n, c: sa.EncryptedShares(i, rcpt, rnd, n, c))
    bits = int(inp.value(f"{at}.bits"))
    if bits not in (0, 32, 64):
        raise WireError(f"{inp.tag}: ring width {bits} is not 32 or 64")
    return sa.RoundStart(rnd, rcpt, tuple(zip(ids, pks, strict=True)), shares, int(inp.value(f"{at}.length")), bits)


def _put_masked(out: Out, at: str, m) -> None:
    out.config("meta")["has_masked"] = m is not None
    if m is None:
        return
    if m.y.dtype not in (np.uint32, np.uint64):
        raise WireError(f"{out.tag}: y must be uint32 (Z_2^32) or uint64 (Z_2^64)")
    out.recs[at] = ConfigRecord({"round": int(m.round), "sender": int(m.sender)})
    out.recs[f"{at}_y"] = _arrays({"y": m.y})
    out.recs[f"{at}_count"] = _envelopes(m.count_shares, lambda e: e.recipient, _COUNT_CT)
    if m.next_keys is not None:
        _put_share_keys(out, "next", m.next_keys)


def _take_masked(inp: In, at: str, got: dict):
    if not bool(inp.value("meta.has_masked")):
        return None
    sender, rnd = int(inp.value(f"{at}.sender")), int(inp.value(f"{at}.round"))
    y = inp.arrays(f"{at}_y", {"y"}, copy=False)["y"]  # [length] read-only: summed and checked, never written
    if y.dtype not in (np.uint32, np.uint64) or y.ndim != 1:
        raise WireError(f"{inp.tag}: y must be uint32 or uint64 [length], got {y.dtype} {y.shape}")
    nxt = _take_share_keys(inp, "next") if inp.has("next") else None
    counts = _read_envelopes(inp.record(f"{at}_count"), f"{inp.tag}: {at}_count",
                             lambda i, n, c: sa.CountShare(sender, i, rnd, n, c), _COUNT_CT)
    return sa.MaskedInput(sender, rnd, y, nxt, counts)


def _put_late_keys(out: Out, at: str, keys) -> None:
    if (out.payload.masked is None) == (keys is None):
        raise WireError(f"{out.tag}: exactly one of a masked input and late share keys")
    if keys is not None:
        _put_share_keys(out, at, keys)


def _take_late_keys(inp: In, at: str, got: dict):
    return _take_share_keys(inp, at) if got["masked"] is None else None


def _put_consistency_request(out: Out, at: str, q) -> None:
    out.config("meta").update(round=int(q.round), recipient=int(q.recipient))
    out.recs[at] = _arrays({"survivors": _u64(q.survivors)})
    out.recs[f"{at}_shares"] = _envelopes(q.count_shares, lambda e: e.sender, _COUNT_CT)


def _take_consistency_request(inp: In, at: str, got: dict):
    rnd, rcpt = int(inp.value("meta.round")), int(inp.value("meta.recipient"))
    survivors = _ids(inp.arrays(at, {"survivors"})["survivors"], inp.tag)
    shares = _read_envelopes(inp.record(f"{at}_shares"), f"{inp.tag}: {at}_shares",
                             lambda i, n, c: sa.CountShare(i, rcpt, rnd, n, c), _COUNT_CT)
    return sa.ConsistencyRequest(rnd, rcpt, survivors, shares)


def _put_consistency_response(out: Out, at: str, r) -> None:
    out.config("meta").update(round=int(r.round), sender=int(r.sender))
    out.recs[at] = _arrays({"share_sum": _u8([r.share_sum], sa.shamir.SHARE_BYTES),
                            "signature": _u8([r.signature], sa.primitives.SIG_BYTES)})


def _take_consistency_response(inp: In, at: str, got: dict):
    a = inp.arrays(at, {"share_sum", "signature"})
    (share_sum,) = _one(_rows(a["share_sum"], sa.shamir.SHARE_BYTES, inp.tag), inp.tag)
    (sig,) = _one(_rows(a["signature"], sa.primitives.SIG_BYTES, inp.tag), inp.tag)
    return sa.ConsistencyResponse(int(inp.value("meta.sender")), int(inp.value("meta.round")), share_sum, sig)


def _one(rows: list[bytes], tag: str) -> list[bytes]:
    if len(rows) != 1:
        raise WireError(f"{tag}: expected exactly one row, got {len(rows)}")
    return rows


def _put_unmask_request(out: Out, at: str, r) -> None:
    out.config("meta")["round"] = int(r.round)
    out.recs[at] = _arrays({"alive": _u64(r.alive), "dead": _u64(r.dead),
                            "signers": _u64(v for v, _, _ in r.signatures),
                            "share_sums": _u8([s for _, s, _ in r.signatures], sa.shamir.SHARE_BYTES),
                            "sigs": _u8([g for _, _, g in r.signatures], sa.primitives.SIG_BYTES)})


def _take_unmask_request(inp: In, at: str, got: dict):
    a = inp.arrays(at, {"alive", "dead", "signers", "share_sums", "sigs"})
    signers = _ids(a["signers"], inp.tag)
    sums = _rows(a["share_sums"], sa.shamir.SHARE_BYTES, inp.tag)
    sigs = _rows(a["sigs"], sa.primitives.SIG_BYTES, inp.tag)
    if not len(signers) == len(sums) == len(sigs):
        raise WireError(f"{inp.tag}: {len(signers)} signers, {len(sums)} share-sums, {len(sigs)} signatures")
    return sa.UnmaskRequest(int(inp.value("meta.round")), _ids(a["alive"], inp.tag), _ids(a["dead"], inp.tag),
                            tuple(zip(signers, sums, sigs, strict=True)))


def _put_unmask_response(out: Out, at: str, r) -> None:
    w = sa.shamir.SHARE_BYTES
    out.config("meta").update(round=int(r.round), sender=int(r.sender))
    out.recs[at] = _arrays({"b_owner": _u64(o for o, _ in r.b_shares), "b_share": _u8([s for _, s in r.b_shares], w),
                            "s_owner": _u64(o for o, _ in r.s_shares), "s_share": _u8([s for _, s in r.s_shares], w)})


def _take_unmask_response(inp: In, at: str, got: dict):
    rnd, sender = int(inp.value("meta.round")), int(inp.value("meta.sender"))
    a = inp.arrays(at, {"b_owner", "b_share", "s_owner", "s_share"})
    w = sa.shamir.SHARE_BYTES
    bo, bs = _ids(a["b_owner"], inp.tag), _rows(a["b_share"], w, inp.tag)
    so, ss = _ids(a["s_owner"], inp.tag), _rows(a["s_share"], w, inp.tag)
    if len(bo) != len(bs) or len(so) != len(ss):
        raise WireError(f"{inp.tag}: owners and shares differ in number")
    return sa.UnmaskResponse(sender, rnd, tuple(zip(bo, bs, strict=True)), tuple(zip(so, ss, strict=True)))


SECAGG_KINDS: dict[str, Kind] = {
    "key-directory": Kind(_put_directory, _take_directory),
    "roster": Kind(_put_roster, _take_roster, lambda at: {"meta": {"names"}}),
    "share-keys": Kind(lambda out, at, k: _put_share_keys(out, at, k), lambda inp, at, got: _take_share_keys(inp, at),
                       _share_key_strings),
    "round-start": Kind(_put_start, _take_start),
    "masked-input": Kind(_put_masked, _take_masked, lambda at: _share_key_strings("next")),
    "late-keys": Kind(_put_late_keys, _take_late_keys, _share_key_strings),
    "consistency-request": Kind(_put_consistency_request, _take_consistency_request),
    "consistency-response": Kind(_put_consistency_response, _take_consistency_response),
    "unmask-request": Kind(_put_unmask_request, _take_unmask_request),
    "unmask-response": Kind(_put_unmask_response, _take_unmask_response),
}
