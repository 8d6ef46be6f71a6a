"""Profile: one secure update round, stage by stage, per party and at the server, against the physical limits of
this machine measured in the same run (the cost of the secure stages).

    python bench/secagg_profile.py [--parties 10] [--length 7121683] [--repeats 3] [--ring auto|32|64]
                                   [--threads 1] [--json out.json]

Setup: ``--parties`` SecAgg clients and a server in one process (``distmoe.privacy.secagg``, complete graph,
threshold n // 2 + 1), one update vector of ``--length`` elements (default: the default model's SFT update,
7,121,682 trainable parameters + the weight), as 64 float32 tensors of a random delta clipped to
``privacy.update-clip`` = 10, laid out by ``UpdateLayout`` with ``--ring`` (``auto`` picks 32-bit words when the
bound fits: ``docs/privacy.md``). Every stage runs the library's own function on that data; best of
``--repeats`` (the machine is shared: the fastest call is the closest to the stage's own cost).

Stages of one party: encode (``UpdateLayout.encode``, and inside it the clip's float64 norm pass and the fixed-
point quantisation of each tensor into its words), key agreement (X25519 + HKDF of the n - 1 pair keys and the
self-mask key), pairwise mask expansion (n - 1 PRG streams combined into the vector), self mask, Shamir (split
of b and s_sk to n - 1 holders), encryption (n - 1 ChaCha20-Poly1305 share envelopes), the input copy, the whole
``masked_input`` call, the codec (``MaskedReply`` into Flower records) and the ledger hash (``inspect.digest`` over
those records). Server: ``receive_masked`` (n adds), ``finish`` (reconstruction + n self masks) and the decode.

Limits, measured at the start and at the end of the same process (the better of the two): the PRG's
keystream bytes/s from ``cryptography`` on one core
(``update_into`` of a cache-resident 256 KiB chunk), the memory bandwidth of a numpy in-place add (3 x the
vector bytes moved per add), of a copy (2 x) and SHA-256 bytes/s. Each stage's "limit" is the time its bytes
would take at those rates (mask stages: keystream bytes at the PRG's one-core rate plus one add pass each;
the library expands on ``primitives.MASK_THREADS`` threads, so a stage can beat the one-core limit).

Runs against any version of the library on ``PYTHONPATH`` (the "before" figures in ``docs/results.md`` come
from a commit before the 32-bit ring with this same file). No timing is asserted.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import time

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from distmoe.privacy import ring
from distmoe.privacy import secagg as sa
from distmoe.privacy.secagg import primitives as P
from distmoe.privacy.secagg import shamir
from distmoe.privacy.vectors import UpdateLayout
from distmoe.wire import codec, inspect
from distmoe.wire.schema import TRAIN_METRIC_KEYS, MaskedReply, ModelUpdate

FAST = hasattr(P, "combine_masks")  # the issue-14 expansion; absent in older trees (then the reference loop)
MB = 1e6


def _timed(fn, repeats: int):
    """(best seconds, last result) of ``repeats`` calls: on a shared machine the fastest call is the closest
    to the stage's own cost (the limits are taken the same way)."""
    ts, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t)
    return min(ts), out


# ------------------------------------------------------------------------------------------------ limits
def limits(nbytes: int, repeats: int) -> dict[str, float]:
    """Bytes/s of the masks' PRG keystream (one core: the library's own positioned stream, AES-256-CTR from
    protocol v2; ChaCha20 for an older library), a numpy add, a copy and SHA-256 on this machine now."""
    chunk = 1 << 18
    src, buf = bytes(chunk), bytearray(chunk)
    enc = (P._stream_at(bytes(32), 0) if hasattr(P, "_stream_at")
           else Cipher(algorithms.ChaCha20(bytes(32), bytes(16)), mode=None).encryptor())
    total = 1 << 26

    def keystream():
        for _ in range(total // chunk):
            enc.update_into(src, buf)

    t_cc, _ = _timed(keystream, repeats)
    a = np.ones(nbytes // 8, np.uint64)
    b = np.ones(nbytes // 8, np.uint64)
    t_add, _ = _timed(lambda: np.add(a, b, out=a), repeats)
    t_cp, _ = _timed(lambda: np.copyto(b, a), repeats)
    raw = a.view(np.uint8)
    t_sha, _ = _timed(lambda: hashlib.sha256(raw).digest(), repeats)
    return {"prg_Bps": total / t_cc, "add_Bps": 3 * a.nbytes / t_add, "copy_Bps": 2 * a.nbytes / t_cp,
            "sha256_Bps": a.nbytes / t_sha}


# ------------------------------------------------------------------------------------------------ setup
def _layout(n: int, numel: int, ring_mode: str) -> UpdateLayout:
    shapes = {f"t{i:02d}": (numel // 64 + (1 if i < numel % 64 else 0),) for i in range(64)}
    try:
        return UpdateLayout.build(shapes, n, 10.0, ring=ring_mode)
    except TypeError:  # a tree before the 32-bit ring: always Z_2^64
        return UpdateLayout.build(shapes, n, 10.0)


def _federation(n: int, length: int):
    params = sa.SecAggParams(os.urandom(16), n // 2 + 1, 64, length)
    server = sa.SecAggServer(params)
    clients = {i: sa.SecAggClient(params, i) for i in range(1, n + 1)}
    directory = server.register([c.advertise() for c in clients.values()])
    keys = []
    for i in server.roster:
        clients[i].receive_directory(directory)
        keys.append(clients[i].share_keys(1))
    server.add_share_keys(keys)
    return params, server, clients


def _begin(server, length: int, bits: int):
    try:
        return server.begin_round(1, length, bits)
    except TypeError:
        return server.begin_round(1, length)


def _expand(keys: list[tuple[bytes, int]], x: np.ndarray, bits: int, threads: int) -> np.ndarray:
    """The party's mask arithmetic on a copy of ``x``: the fast path if present, else the reference loop."""
    y = x.copy()
    if FAST:
        return P.combine_masks(y, keys, bits, threads=threads)
    for k, sign in keys:
        m = P.prg(k, len(y), bits)
        if sign > 0:
            y += m
        else:
            y -= m
    return y


# ------------------------------------------------------------------------------------------------ profile
def profile(n: int, length: int, ring_mode: str, repeats: int, threads: int) -> dict:
    numel = length - 1
    lay = _layout(n, numel, ring_mode)
    length = getattr(lay, "length", length)  # + the skipped-step slot where the layout has one (no update noise)
    bits = getattr(lay, "bits", 64)
    rng = np.random.default_rng(0)
    delta = {k: (rng.standard_normal(s, dtype=np.float32) * 1e-3) for k, s in lay.shapes}  # norm ~ 2.7 < clip
    word = np.dtype(np.uint32 if bits == 32 else np.uint64)
    vec_bytes = length * word.itemsize
    lim = limits(vec_bytes, repeats)
    st: dict = {}  # stage -> (seconds, () -> limit seconds at the final limits)

    def streams(k: int):  # k mask streams: keystream at the PRG's rate plus one in-place add pass each
        return lambda: k * (vec_bytes / lim["prg_Bps"] + 3 * vec_bytes / lim["add_Bps"])

    # ---- encode: the whole call, and (where the tree has it) its two passes: the float64 sum of squares of the
    # float32 tensors (clip norm) and the quantisation of each tensor straight into its words
    t_enc, (vec, _) = _timed(lambda: lay.encode(delta, 1), repeats)
    scale = 2.0 ** lay.frac_bits
    st["encode (UpdateLayout.encode)"] = (t_enc, lambda: (numel * 4 + vec_bytes) / lim["copy_Bps"])
    from distmoe.privacy import vectors as V

    if hasattr(V, "_sum_squares") and hasattr(ring, "encode_fixed_into"):
        buf = np.empty(1 << 15, np.float64)
        flats = [np.asarray(delta[k]).reshape(-1) for k, _ in lay.shapes]
        t_norm, _ = _timed(lambda: sum(V._sum_squares(f, buf) for f in flats), repeats)
        out = np.empty(length, word)

        def quantise():
            off = 0
            for f in flats:
                ring.encode_fixed_into(f, scale, out[off:off + f.size], np.random.default_rng(1) if bits == 32
                                       else None, buf=buf, bound=float(np.sqrt(numel)))
                off += f.size

        t_q, _ = _timed(quantise, repeats)
        st["  clip: L2 norm (float64 sum of squares)"] = (t_norm, lambda: numel * 4 / lim["copy_Bps"])
        st["  quantise into words"] = (t_q, lambda: (numel * 4 + vec_bytes) / lim["copy_Bps"])

    # ---- protocol, client 1 of n
    params, server, clients = _federation(n, length)
    starts = _begin(server, length, bits)
    st1 = starts[1]
    peers = [v for v, _ in st1.participants if v != 1]
    s_pks = dict(st1.participants)
    sk, _pk = P.new_keypair(os.urandom)
    b = os.urandom(32)

    def agree():
        ks = [(P.pair_mask_key(params.run_id, 1, 1, v, sk, s_pks[v]), 1 if v > 1 else -1) for v in peers]
        return [(P.self_mask_key(params.run_id, 1, 1, b), 1), *ks]

    t_kx, keys = _timed(agree, repeats)
    st["key agreement (X25519+HKDF)"] = (t_kx, lambda: 0.0)
    x = vec.astype(word, copy=False)
    t_pair, _ = _timed(lambda: _expand(keys[1:], x, bits, threads), repeats)
    if FAST:  # the same stage on 1 and 2 threads, interleaved, so that both see the same load
        t1, t2 = [], []
        for _ in range(repeats):
            t1.append(_timed(lambda: _expand(keys[1:], x, bits, 1), 1)[0])
            t2.append(_timed(lambda: _expand(keys[1:], x, bits, 2), 1)[0])
        threads_cmp = {"1": min(t1), "2": min(t2)}
    else:
        threads_cmp = {}
    t_self, _ = _timed(lambda: _expand(keys[:1], x, bits, threads), repeats)
    t_copy, _ = _timed(lambda: x.copy(), repeats)
    st[f"pairwise masks ({n - 1} streams)"] = (t_pair - t_copy, streams(n - 1))
    st["self mask (1 stream)"] = (t_self - t_copy, streams(1))
    st["input copy"] = (t_copy, lambda: 2 * vec_bytes / lim["copy_Bps"])
    xs = [shamir.holder_x(v) for v in peers + [1]]
    t_sh, _ = _timed(lambda: (shamir.split(b, xs, params.threshold, os.urandom),
                              shamir.split(sk, xs, params.threshold, os.urandom)), repeats)
    st["Shamir split (b, s_sk)"] = (t_sh, lambda: 0.0)
    pt = bytes(2 * shamir.SHARE_BYTES)
    t_seal, _ = _timed(lambda: [P.seal(k, pt, b"ad", os.urandom) for k, _ in keys[1:]], repeats)
    st["share encryption (AEAD)"] = (t_seal, lambda: 0.0)

    t_mi = time.perf_counter()
    masked = {i: clients[i].masked_input(starts[i], vec, share_next=False) for i in sorted(starts)}
    t_mi = (time.perf_counter() - t_mi) / n
    st["masked_input (whole call, mean)"] = (t_mi, streams(n))
    t_codec, rec = _timed(lambda: codec.encode(MaskedReply("model-update", masked[1], None)), repeats)
    st["codec (records)"] = (t_codec, lambda: 2 * vec_bytes / lim["copy_Bps"])
    t_hash, _ = _timed(lambda: inspect.digest(rec), repeats)
    st["ledger hash (sha256)"] = (t_hash, lambda: vec_bytes / lim["sha256_Bps"])
    up_secure = inspect.describe(rec)["bytes"]
    plain = codec.encode(ModelUpdate("p0", delta, 1, {k: 0.0 for k in TRAIN_METRIC_KEYS}))
    up_plain = inspect.describe(plain)["bytes"]

    # ---- server
    t = time.perf_counter()
    checks = server.receive_masked(1, list(masked.values()))
    t_recv = time.perf_counter() - t
    signed = [clients[i].consistency(q) for i, q in checks.items()]
    request = server.receive_consistency(1, signed, min_contributors=2)
    responses = [clients[i].unmask(request, min_contributors=2) for i, _, _ in request.signatures]
    t = time.perf_counter()
    res = server.finish(1, responses)
    t_fin = time.perf_counter() - t
    t_dec, (avg, w) = _timed(lambda: lay.decode(res.total), repeats)
    if abs(w - n) > 1e-6:
        raise RuntimeError(f"decoded weight {w} != {n} parties")
    late = limits(vec_bytes, repeats)  # again at the end: the best of both is the machine's rate
    for k, v in late.items():
        lim[k] = max(lim[k], v)
    st[f"server: receive_masked ({n} adds)"] = (t_recv, lambda: n * 3 * vec_bytes / lim["add_Bps"])
    st[f"server: finish ({n} self masks)"] = (t_fin, streams(n))
    st["server: decode"] = (t_dec, lambda: (vec_bytes + numel * 4) / lim["copy_Bps"])
    st = {k: (t, lo()) for k, (t, lo) in st.items()}
    return {"parties": n, "length": length, "bits": bits, "frac_bits": lay.frac_bits, "fast": FAST,
            "threads": threads, "limits": lim, "stages": st, "up_secure": up_secure, "up_plain": up_plain,
            "pairwise_threads": threads_cmp}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parties", type=int, default=10)
    ap.add_argument("--length", type=int, default=7_121_683, help="update vector length (numel + 1 weight)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ring", default="auto", choices=("auto", "32", "64"))
    ap.add_argument("--threads", type=int, default=1, help="mask-expansion threads (fast path only)")
    ap.add_argument("--json", default="", help="also write the figures here")
    args = ap.parse_args()
    r = profile(args.parties, args.length, args.ring, args.repeats, args.threads)
    lim = r["limits"]
    print(f"# {r['parties']} parties, {r['length']:,} elements in Z_2^{r['bits']} (frac bits {r['frac_bits']}), "
          f"fast expansion: {r['fast']}, threads {r['threads']}")
    print(f"# limits: PRG keystream {lim['prg_Bps'] / MB:.0f} MB/s (1 core), add {lim['add_Bps'] / MB:.0f} MB/s, "
          f"copy {lim['copy_Bps'] / MB:.0f} MB/s, sha256 {lim['sha256_Bps'] / MB:.0f} MB/s")
    print("| stage | s | limit s | x limit |\n|---|---|---|---|")
    for name, (s, lo) in r["stages"].items():
        x = f"{s / lo:.2f}" if lo > 0 else "-"
        print(f"| {name} | {s:.3f} | {lo:.3f} | {x} |")
    print(f"# uplink per party: masked input {r['up_secure'] / MB:.2f} MB vs plaintext float32 update "
          f"{r['up_plain'] / MB:.2f} MB ({r['up_secure'] / r['up_plain']:.3f}x)")
    if r["pairwise_threads"]:
        t = r["pairwise_threads"]
        print(f"# pairwise masks incl. copy: 1 thread {t['1']:.3f} s, 2 threads {t['2']:.3f} s "
              f"({t['1'] / t['2']:.2f}x)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({**r, "stages": {k: list(v) for k, v in r["stages"].items()}}, fh, indent=1)
    if not math.isfinite(r["up_secure"]):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
