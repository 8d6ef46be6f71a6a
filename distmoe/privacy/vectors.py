"""What a party puts into a secure sum: the declared flat layout of every reply kind, as integers in Z_2^64.

Owns: the layouts (``UpdateLayout`` for model updates, ``StatsLayout`` for router statistics; evaluation
figures are ``distmoe.privacy.metric_noise.EvalSpec``), each derived only from public facts (the
trainable-parameter spec, the number of parties, the privacy config), the encoding of one
party's values into its input vector and the decoding of the *sum* of all inputs back into aggregates.
Every layout has an exact ``length``: the client guard and the server check a masked vector against
it, so nothing else fits into a reply.

Encoding: ``distmoe.privacy.ring`` (fixed point in two's complement mod 2^b, ``round(v * 2^frac_bits)``).
Ring width of an update release (``UpdateLayout.bits``, ``privacy.ring-bits``): 32 bits when the
public bound of the sum fits with at least ``MIN_FRAC_BITS_32`` fractional bits, else 64. The bound, in
fixed-point units at ``f`` fractional bits (:meth:`UpdateLayout.int_bound`)::

    B(f) = n * (max(clip, 1) * 2^f + 1)                     every |entry| <= clip (L2 clip), the weight <= 1,
                                                            stochastic rounding adds < 1 unit per party
         + k * z_u * D2(f) * sqrt(n / t) + n / 2            update noise (private): its tail over the numel
                                                            coordinates, k = sqrt(2 ln(2 numel / 1e-12)),
                                                            plus each party's rounding of its noise share
    D2(f) = clip * 2^f + sqrt(numel)                        L2 sensitivity after stochastic rounding

and ``f`` is the largest (at most 30) with ``B(f) <= 2^30`` (one bit of margin below the 31 magnitude bits);
``ring.check_fits_ring(B(f), 32)`` confirms it. At 32 bits the values are rounded stochastically
(``floor(v * 2^f + U)``, ``U ~ Uniform[0, 1)``): unbiased, error below ``2^-f`` per coordinate and per party,
so the mean over ``w`` contributors is off by at most ``2^-f`` per coordinate with standard deviation at most
``2^-f / (2 sqrt(w))`` (``docs/privacy.md``). At 64 bits ``frac_bits`` is the largest (at most 40) that leaves
one bit of margin for the sum of the largest declared values with a fixed noise headroom
(``ring.check_fits_ring64`` confirms it), rounded to nearest. Router statistics are integers already
(``distmoe.privacy.dp``: per-sequence rounding at scale s, a Skellam noise share, K noise canaries at
positions drawn per release) and stay in Z_2^64.

Uniform weights, bounded metrics (straggle differencing). Two releases whose survivor sets differ by
one party difference to that party's own figures, so nothing data-dependent but the (clipped, under
``private`` also noised) delta block and bounded figures may go into an update: each party's weight is 1 if it
trained on data for the task and 0 otherwise (``sum w`` is then the number of contributing parties, which the
protocol's contributor count reveals anyway: it is never the example count); training metrics travel only as
the ``metric_slots`` last words, each clipped to a public bound (``distmoe.privacy.train_metrics``, which also
owns ``delta_clip``: with ``private`` the delta and the slots share the clip's L2 norm). The aggregate is the unweighted
mean of the contributors' clipped deltas, as in DP-FedAvg (McMahan et al., ICLR 2018) with uniform weights:
a party with 10x the data no longer pulls 10x harder. With client-level DP on updates (``private=True``,
``privacy.update-noise-multiplier > 0``) every included party has weight 1, data or not (a zero delta plus
its noise share), so ``sum w`` is the included count and the L2 sensitivity of the sum is ``clip``.
No stability count is summed either: the number of NaN/Inf steps a party skipped had a slot of its own, an
exact integer outside every DP account, which two straggled releases difference to one party's count; the slot
is gone (``counts_skipped`` is False for every layout) and the count stays in each party's own log.
Evaluation figures are a Skellam-noised per-example sum (``distmoe.privacy.metric_noise.EvalSpec``).

Must not: import ``flwr`` or ``torch``, add noise other than through ``dp``, or accept a value outside
its declared bound (it clips updates to ``update_clip`` in L2 and says so).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from distmoe.privacy import dp, ring
from distmoe.privacy.ring import from_ring64, to_ring64

__all__ = ["BITS", "LayoutError", "StatsLayout", "UpdateLayout", "from_ring64", "to_ring64"]

BITS = ring.RING_BITS  # the widest ring; router statistics and evaluation sums always use it
_MAX_FRAC_BITS = 40
SKIPPED_MAX = 2**16  # bound of one party's skipped-step count (far above any round's optimizer steps); an integer slot
MIN_FRAC_BITS_32 = 20  # an update goes to 32-bit words only with a quantisation step of at most 2^-20
MAX_FRAC_BITS_32 = 30
RING_CHOICES = ("auto", "32", "64")  # privacy.ring-bits
WRAP_FAIL_PROB = 1e-12  # the noise tail of B(f) is exceeded on some coordinate with at most this probability
_NOISE_HEADROOM = 2.0**24  # room for update noise: 10 std of z_u * clip * sqrt(2) at z_u up to 1e6 (the key's bound)
_SCRATCH = 1 << 15  # float64 elements of the encoder's scratch (256 KiB: stays in L2)


def _sum_squares(flat: np.ndarray, buf: np.ndarray) -> float:
    """``sum(x^2)`` of ``[n]`` reals, accumulated in float64 through the scratch ``buf`` (a float32 dot would
    accumulate in float32). numpy's own pairwise sum, not BLAS ``dot``: one BLAS call per chunk wakes its
    thread pool each time, which on a loaded machine cost seconds per update."""
    total = 0.0
    for a in range(0, flat.size, buf.size):
        y = buf[:min(buf.size, flat.size - a)]
        np.copyto(y, flat[a:a + y.size], casting="unsafe")
        np.multiply(y, y, out=y)
        total += float(y.sum())
    return total


class LayoutError(ValueError):
    """Values do not fit the declared layout (keys, shapes, bounds)."""


def _frac_bits(n_parties: int, bound: float) -> int:
    """Largest f with ``n * bound * 2^f <= 2^62`` (one bit of margin below the ring's 63 magnitude bits),
    capped at 40; the rounded sum ``n * (bound * 2^f + 1/2)`` is then checked to fit Z_2^64."""
    n = max(n_parties, 1)
    f = math.floor(ring.RING_BITS - 2 - math.log2(n * max(bound, 1.0)))
    if f < 8:
        raise LayoutError(f"{n_parties} parties x bound {bound:g} leaves {f} fractional bits in Z_2^64 (need 8)")
    f = min(f, _MAX_FRAC_BITS)
    ring.check_fits_ring64(n * (max(bound, 1.0) * 2.0**f + 0.5), f"{n_parties} parties x bound {bound:g}")
    return f


# ------------------------------------------------------------------------------------------- updates
@dataclass(frozen=True)
class UpdateLayout:
    """``[sum_k numel_k]`` w*delta (trainable tensors in sorted key order) | ``[1]`` w. Bounds: ||delta||_2 <= clip,
    w in {0, 1} (module docstring: uniform weights, no metrics, no skipped-step count)."""

    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # sorted trainable (name, shape)
    n_parties: int
    clip: float
    private: bool = False  # client-level DP on: every included party has weight 1, data or not
    noise_multiplier: float = 0.0  # z_u of the update noise (private), part of the 32-bit bound
    threshold: int = 0  # the SecAgg threshold t: each noise share has variance (z_u * D2)^2 / t
    ring: str = "64"  # privacy.ring-bits: "auto" (32 where the bound fits, else 64), "32" or "64"
    metric_slots: int = 0  # training-metric slots after every other slot (``distmoe.privacy.train_metrics``)
    metric_share: float = 0.0  # private: the share of the clip's L2 norm the metric slots get (train_metrics)

    def __post_init__(self) -> None:
        if self.ring not in RING_CHOICES:
            raise LayoutError(f"ring width {self.ring!r} is not one of {RING_CHOICES} (privacy.ring-bits)")
        if self.private and self.noise_multiplier > 0 and self.threshold < 1:
            raise LayoutError("a noised update layout needs the SecAgg threshold (its noise tail bounds the ring)")

    @classmethod
    def build(cls, shapes: Mapping[str, tuple[int, ...]], n_parties: int, clip: float,
              private: bool = False, *, noise_multiplier: float = 0.0, threshold: int = 0,
              ring: str = "64") -> UpdateLayout:
        return cls(tuple(sorted((k, tuple(int(d) for d in v)) for k, v in dict(shapes).items())), int(n_parties),
                   float(clip), bool(private), float(noise_multiplier), int(threshold), str(ring))

    @property
    def weight_bound(self) -> int:
        """The largest weight a party can put in: 1 (uniform weights)."""
        return 1

    @property
    def sensitivity(self) -> float:
        """Add/remove-one-party L2 sensitivity of the ``w*delta`` block (float units): ``weight_bound * clip``."""
        return self.weight_bound * self.clip

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for _, s in self.shapes)

    @property
    def counts_skipped(self) -> bool:
        """Whether the layout has the skipped-step slot: never (an exact, uncharged count; module docstring)."""
        return False

    @property
    def length(self) -> int:
        return self.numel + 1 + int(self.counts_skipped) + self.metric_slots

    @property
    def metric_start(self) -> int:
        """Where the training-metric slots begin: the last ``metric_slots`` words (``train_metrics``)."""
        return self.length - self.metric_slots

    @property
    def delta_clip(self) -> float:
        """The L2 bound the delta itself is clipped to: ``clip``, or with update noise and metric slots
        ``clip * sqrt(1 - metric_share^2)`` (the metric slots get the rest of the clip's norm: ``train_metrics``)."""
        if self.private and self.metric_slots:
            return self.clip * math.sqrt(1.0 - self.metric_share ** 2)
        return self.clip

    def int_sensitivity(self, f: int | None = None) -> float:
        """L2 sensitivity of the rounded ``w*delta`` block in fixed-point units at ``f`` fractional bits:
        ``clip * 2^f + sqrt(numel)`` (stochastic rounding moves each coordinate by < 1) at 32 bits,
        ``clip * 2^f + sqrt(numel) / 2`` (nearest rounding) at 64."""
        bits = self.bits if f is None else 32
        f = self.frac_bits if f is None else f
        return self.sensitivity * 2.0**f + math.sqrt(self.numel) * (1.0 if bits == 32 else 0.5)

    def int_bound(self, f: int) -> float:
        """``B(f)``: bound on ``|sum|`` per coordinate at ``f`` fractional bits, 32-bit encoding (module docstring)."""
        n = max(self.n_parties, 1)
        data = n * (max(self.clip, 1.0) * 2.0**f + 1.0)
        if not (self.private and self.noise_multiplier > 0):
            return data
        k = math.sqrt(2.0 * math.log(2.0 * max(self.numel + self.metric_slots, 1) / WRAP_FAIL_PROB))
        return data + k * self.noise_multiplier * self.int_sensitivity(f) * math.sqrt(n / self.threshold) + n / 2

    def _frac_bits32(self) -> int | None:
        """The largest ``f <= 30`` with ``B(f) <= 2^30``; None below ``MIN_FRAC_BITS_32``."""
        for f in range(MAX_FRAC_BITS_32, MIN_FRAC_BITS_32 - 1, -1):
            if self.int_bound(f) <= 2.0**30:
                ring.check_fits_ring(self.int_bound(f), 32, f"{self.n_parties} parties x clip {self.clip:g}")
                return f
        return None

    @property
    def bits(self) -> int:
        """The ring width of this release: 32 or 64 (module docstring; declared in the round start)."""
        if self.ring == "64":
            return 64
        if self._frac_bits32() is not None:
            return 32
        if self.ring == "32":
            raise ring.WrapError(f"privacy.ring-bits = 32: {self.n_parties} parties x clip {self.clip:g}"
                                 + (f" plus noise z_u = {self.noise_multiplier:g}" if self.private else "")
                                 + f" leave fewer than {MIN_FRAC_BITS_32} fractional bits in Z_2^32 "
                                 f"(B({MIN_FRAC_BITS_32}) = {self.int_bound(MIN_FRAC_BITS_32):.4g} > 2^30); use "
                                 "privacy.ring-bits = auto or 64")
        return 64

    @property
    def frac_bits(self) -> int:
        if self.bits == 32:
            return int(self._frac_bits32())
        return _frac_bits(self.n_parties, max(self.clip, 1.0) * _NOISE_HEADROOM)

    def quantisation_bound(self) -> float:
        """Largest error per coordinate of the decoded mean from rounding alone: ``2^-f`` at 32 bits (stochastic,
        unbiased), ``2^-(f+1)`` at 64 (nearest)."""
        return 2.0 ** -self.frac_bits if self.bits == 32 else 2.0 ** -(self.frac_bits + 1)

    def weight_of(self, num_examples: int) -> int:
        """1 for a party that trained on data (or any party when private), else 0: never the example count."""
        return 1 if self.private or num_examples > 0 else 0

    def encode(self, delta: Mapping[str, np.ndarray], num_examples: int, rng: ring.UniformSource | None = None
               ) -> tuple[np.ndarray, dict[str, float]]:
        """One party's input ``[length]`` (uint32 at 32 bits, stochastically rounded with ``rng`` or a fresh
        ``dp.KeystreamUniform()`` (AES-256-CTR draws); uint64 at 64) and facts for its own log (norm before
        clipping, clipped?); the skipped-step slot, where the layout has one, holds 0 until ``count_skipped``
        fills it."""
        want = dict(self.shapes)
        if set(delta) != set(want):
            raise LayoutError(f"update keys differ from the trainable spec: extra {sorted(set(delta) - set(want))[:3]}"
                              f", missing {sorted(set(want) - set(delta))[:3]}")
        # No float64 copy of the whole update (it was the stage's largest cost): the norm is accumulated in
        # float64 tensor by tensor through a cache-resident scratch, then each tensor is scaled and rounded
        # straight into its words, with the arithmetic of scaling a float64 copy (ring.encode_fixed_into).
        buf = np.empty(_SCRATCH, np.float64)  # [chunk]
        flats, sq = [], 0.0
        for k, shape in self.shapes:
            a = np.asarray(delta[k])
            if a.shape != shape:
                raise LayoutError(f"update tensor {k!r} has shape {a.shape}, declared {shape}")
            flat = np.ascontiguousarray(a).reshape(-1)  # [numel_k] (a view when contiguous)
            s = _sum_squares(flat, buf)
            if not math.isfinite(s) and not np.all(np.isfinite(flat)):  # NaN/Inf: name the tensor
                raise LayoutError(f"update tensor {k!r} contains NaN or Inf")
            sq += s
            flats.append(flat)
        if not math.isfinite(sq):
            raise LayoutError("update norm overflows float64")
        norm = math.sqrt(sq)
        factor = min(1.0, self.delta_clip / norm) if norm > 0 else 1.0
        w = self.weight_of(num_examples)
        facts = {"norm": norm, "clipped": float(factor < 1.0), "weight": float(w)}
        bits = self.bits
        out = np.empty(self.length, np.uint32 if bits == 32 else np.uint64)  # [length]
        if bits == 32 and rng is None:
            rng = dp.KeystreamUniform()
        scale, pre, off = 2.0**self.frac_bits, factor * w, 0
        for flat in flats:  # in layout order; the stochastic draws are consumed in element order
            ring.encode_fixed_into(flat, scale, out[off:off + flat.size], rng if bits == 32 else None, pre=pre,
                                   buf=buf, bound=norm * pre)  # |pre * x_i| <= pre * ||x||: no chunk can wrap
            off += flat.size
        tail = np.zeros(self.length - off, np.float64)  # the weight, the skipped-step slot and metric slots (0)
        tail[0] = float(w)
        ring.encode_fixed_into(tail, scale, out[off:], rng if bits == 32 else None, buf=buf)
        return out, facts

    def decode(self, total: np.ndarray) -> tuple[dict[str, np.ndarray] | None, float]:
        """From the sum: (mean delta over the contributing parties per tensor, or None if the total weight is 0;
        total weight = the number of contributing parties)."""
        want = np.uint32 if self.bits == 32 else np.uint64
        if np.asarray(total).dtype != want:
            raise LayoutError(f"sum in {np.asarray(total).dtype} words, the release declared Z_2^{self.bits}")
        ints = ring.from_ring(total)  # [length] signed view, no copy
        if ints.shape != (self.length,):
            raise LayoutError(f"sum has shape {ints.shape}, layout length {self.length}")
        scale = 2.0**self.frac_bits
        w = float(ints[self.numel]) / scale
        if w < 0.5:
            return None, w
        out, off, inv = {}, 0, 1.0 / (scale * w)
        for k, shape in self.shapes:
            size = math.prod(shape)
            a = np.empty(shape, np.float32)  # one pass: int -> float64 * inv -> float32, chunked inside the ufunc
            np.multiply(ints[off:off + size].reshape(shape), inv, out=a, casting="unsafe")
            out[k] = a
            off += size
        return out, w

    def count_skipped(self, vec: np.ndarray, skipped: int, *, inplace: bool = False) -> np.ndarray:
        """``vec`` (an ``encode`` output, before noise or masks) with the party's skipped NaN/Inf steps, clamped to
        ``[0, SKIPPED_MAX]``, in the count slot; unchanged where the layout has none (``private``). ``inplace``:
        write the slot into ``vec`` itself (its owner's fresh ``encode`` output) instead of a copy."""
        if not self.counts_skipped:
            return vec
        if vec.shape != (self.length,):
            raise LayoutError(f"input has shape {vec.shape}, layout length {self.length}")
        out = vec if inplace else vec.copy()  # the count is an integer: scale 1, exact in either word width
        out[self.numel + 1] = ring.to_ring(np.array([min(max(int(skipped), 0), SKIPPED_MAX)], np.int64), self.bits)[0]
        return out

    def decode_skipped(self, total: np.ndarray) -> float | None:
        """The summed skipped-step count of the included parties, or None where the layout has no slot."""
        if not self.counts_skipped:
            return None
        v = ring.from_ring(np.asarray(total))
        if v.shape != (self.length,):
            raise LayoutError(f"sum has shape {v.shape}, layout length {self.length}")
        return float(v[self.numel + 1])


# ------------------------------------------------------------------------------------------ router stats
@dataclass(frozen=True)
class StatsLayout:
    """``[L*E + K]``: the per-sequence-rounded integer statistic plus its Skellam share on ``L*E`` coordinates
    and ``K`` noise canaries (known zero plus noise) on the others. Built only if the sum cannot wrap in
    Z_2^64 (``SkellamSpec.check_fits_ring64``: all parties at ``num-sequences-max`` plus the noise tail).

    ``canary_seed`` (``dp.canary_seed`` of the round's SecAgg material): the canaries sit at
    ``dp.canary_positions(seed, L*E + K, K)`` and the statistic fills the other coordinates in order; without a
    seed (tests, tools) they are the last ``K``. What the positions buy and what they cannot: ``docs/privacy.md``
    §4.2 (a party builds its own vector, so a modified party knows them; the row-sum test covers that)."""

    spec: dp.SkellamSpec
    canary_seed: bytes | None = None

    def __post_init__(self) -> None:
        self.spec.check_fits_ring64()  # the data bound plus the noise tail must fit the signed ring

    @property
    def length(self) -> int:
        return self.spec.payload_len

    @property
    def canary_positions(self) -> np.ndarray:
        """``[K]`` sorted positions of the canaries in the flat vector."""
        if self.canary_seed is None:
            return np.arange(self.spec.dim, self.length, dtype=np.int64)
        return dp.canary_positions(self.canary_seed, self.length, self.spec.n_canaries)

    def _data_positions(self, canaries: np.ndarray) -> np.ndarray:
        mask = np.ones(self.length, bool)  # [length]
        mask[canaries] = False
        return np.flatnonzero(mask)  # [L*E] in order

    def encode(self, per_seq: np.ndarray, rng: np.random.Generator | None = None) -> np.ndarray:
        """``per_seq``: ``[N, L, E]`` per-sequence mean router distributions -> ``[length]`` uint64."""
        a = np.asarray(per_seq, np.float64)
        if a.ndim != 3 or a.shape[1:] != (self.spec.layers, self.spec.experts):
            raise LayoutError(f"per-sequence statistics {a.shape} do not match [N, {self.spec.layers}, "
                              f"{self.spec.experts}]")
        ints = (dp.encode_per_sequence(a, self.spec.scale, rounding=self.spec.rounding) if len(a)
                else np.zeros(a.shape[1:], np.int64))
        share = dp.client_share(ints, self.spec, len(a), rng)  # [L*E + K] int64, noised, canaries last
        can = self.canary_positions
        out = np.empty_like(share)
        out[self._data_positions(can)] = share[:self.spec.dim]
        out[can] = share[self.spec.dim:]
        return to_ring64(out)

    def decode(self, total: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """From the sum: (noisy ``[L, E]`` sum in sequence units, ``[K]`` canary coordinates, integer units)."""
        ints = self.decode_ints(total)
        noisy = ints[:self.spec.dim].reshape(self.spec.layers, self.spec.experts).astype(np.float64) / self.spec.scale
        return noisy, ints[self.spec.dim:].copy()

    def decode_ints(self, total: np.ndarray) -> np.ndarray:
        """The sum as ``[L*E + K]`` int64 in share order: the ``L*E`` statistic (row-major) then the ``K`` canaries."""
        ints = from_ring64(total)
        if ints.shape != (self.length,):
            raise LayoutError(f"sum has shape {ints.shape}, layout length {self.length}")
        can = self.canary_positions
        return np.concatenate([ints[self._data_positions(can)], ints[can]])
