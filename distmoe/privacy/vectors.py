"""What a party puts into a secure sum: the declared flat layout of every reply kind, as integers in Z_2^64.

Owns: the layouts (``UpdateLayout`` for model updates, ``StatsLayout`` for router statistics,
``EvalLayout`` for evaluation numbers), each derived only from public facts (the trainable-parameter
spec, the metric keys, the task list, the number of parties, the privacy config), the encoding of one
party's values into its input vector and the decoding of the *sum* of all inputs back into aggregates.
Every layout has an exact ``length``: the client guard and the server check a masked vector against
it, so nothing else fits into a reply.

Encoding: ``distmoe.privacy.ring`` (fixed point in two's complement mod 2^64, ``round(v * 2^frac_bits)``),
with ``frac_bits`` the largest (at most 40) that leaves one bit of margin below the ring's 63 magnitude
bits for the sum over all parties of the largest declared values (``ring.check_fits_ring64`` confirms it
whenever ``frac_bits`` is computed). Router statistics are integers already (``distmoe.privacy.dp``:
per-sequence rounding at scale s, a Skellam noise share, K noise canaries at positions drawn per release).

Why weights and metrics go inside the sum: a plaintext ``num_examples`` or per-party loss would reveal
dataset size and data-dependent numbers to the server. Each update is multiplied by its weight
``w = min(examples, privacy.max-weight)`` and the weight is summed alongside, so the server learns only
``sum w*delta`` and ``sum w``; each metric is summed as ``w*m`` with ``w*[m finite]`` beside it.

With client-level DP on updates (``private=True``, i.e. ``privacy.update-noise-multiplier > 0``) the whole
release must be covered by the noise, so it carries nothing else that depends on data: every weight is 1
(``sum w`` is the number of included parties, which the server knows anyway: the standard DP-FedAvg
estimator with uniform weights), and every metric slot is encoded as "no value" (0 and 0). The L2
sensitivity of the sum is then ``clip`` (add/remove one party), and the noise covers every coordinate that
varies. Training metrics stay in each party's own log.

Must not: import ``flwr`` or ``torch``, add noise other than through ``dp``, or accept a value outside
its declared bound (it clips updates to ``update_clip`` in L2 and metrics to ``METRIC_BOUND``, and says so).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from distmoe.privacy import dp, ring
from distmoe.privacy.ring import from_ring64, to_ring64

__all__ = ["BITS", "METRIC_BOUND", "SUM_KEYS", "EvalLayout", "LayoutError", "StatsLayout", "UpdateLayout",
           "from_ring64", "to_ring64"]

BITS = ring.RING_BITS  # every secure sum of this project lives in Z_2^64
SUM_KEYS = ("steps", "skipped_steps")  # update metrics summed over parties, not averaged
METRIC_BOUND = 1e6  # |metric| is clipped to this before encoding (losses, rewards, counts are far below)
_MAX_FRAC_BITS = 40


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


def _weighted_metrics(keys: Sequence[str], values: Mapping[str, float], weights: Mapping[str, float] | float
                      ) -> tuple[np.ndarray, np.ndarray]:
    """``[k]`` w*m (non-finite m -> 0) and ``[k]`` w*[m finite], metrics clipped to +-METRIC_BOUND."""
    if set(values) != set(keys):
        raise LayoutError(f"metric keys {sorted(values)} != declared {sorted(keys)}")
    wv, wn = np.zeros(len(keys)), np.zeros(len(keys))
    for i, k in enumerate(keys):
        v = float(values[k])
        w = float(weights if isinstance(weights, (int, float)) else weights[k])
        if math.isfinite(v):
            wv[i] = w * min(max(v, -METRIC_BOUND), METRIC_BOUND)
            wn[i] = w
    return wv, wn


def _metric_means(keys: Sequence[str], wv: np.ndarray, wn: np.ndarray) -> dict[str, float]:
    return {k: (float(wv[i] / wn[i]) if wn[i] > 1e-9 else math.nan) for i, k in enumerate(keys)}


# ------------------------------------------------------------------------------------------- updates
@dataclass(frozen=True)
class UpdateLayout:
    """``[sum_k numel_k]`` w*delta (trainable tensors in sorted key order) | ``[1]`` w | ``[M]`` w*metric |
    ``[M]`` w*[metric finite]. Bounds: ||delta||_2 <= clip, w <= max_weight, |metric| <= METRIC_BOUND."""

    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # sorted trainable (name, shape)
    metric_keys: tuple[str, ...]
    n_parties: int
    clip: float
    max_weight: int
    private: bool = False  # client-level DP on: uniform weights, no metrics (see the module docstring)

    @classmethod
    def build(cls, shapes: Mapping[str, tuple[int, ...]], metric_keys: Sequence[str], n_parties: int, clip: float,
              max_weight: int, private: bool = False) -> UpdateLayout:
        return cls(tuple(sorted((k, tuple(int(d) for d in v)) for k, v in dict(shapes).items())), tuple(metric_keys),
                   int(n_parties), float(clip), int(max_weight), bool(private))

    @property
    def weight_bound(self) -> int:
        """The largest weight a party can put in: 1 when private, else ``max_weight``."""
        return 1 if self.private else self.max_weight

    @property
    def sensitivity(self) -> float:
        """Add/remove-one-party L2 sensitivity of the ``w*delta`` block (float units): ``weight_bound * clip``."""
        return self.weight_bound * self.clip

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for _, s in self.shapes)

    @property
    def length(self) -> int:
        return self.numel + 1 + 2 * len(self.metric_keys)

    @property
    def frac_bits(self) -> int:
        return _frac_bits(self.n_parties, self.max_weight * max(self.clip, METRIC_BOUND))

    def weight_of(self, num_examples: int) -> int:
        return 1 if self.private else int(min(max(num_examples, 0), self.max_weight))

    def encode(self, delta: Mapping[str, np.ndarray], num_examples: int, metrics: Mapping[str, float]
               ) -> tuple[np.ndarray, dict[str, float]]:
        """One party's input ``[length]`` uint64 and facts for its own log (norm before clipping, clipped?)."""
        want = dict(self.shapes)
        if set(delta) != set(want):
            raise LayoutError(f"update keys differ from the trainable spec: extra {sorted(set(delta) - set(want))[:3]}"
                              f", missing {sorted(set(want) - set(delta))[:3]}")
        parts = []
        for k, shape in self.shapes:
            a = np.asarray(delta[k], np.float64)
            if a.shape != shape:
                raise LayoutError(f"update tensor {k!r} has shape {a.shape}, declared {shape}")
            if not np.all(np.isfinite(a)):
                raise LayoutError(f"update tensor {k!r} contains NaN or Inf")
            parts.append(a.ravel())
        flat = np.concatenate(parts) if parts else np.zeros(0)  # [numel]
        norm = float(np.linalg.norm(flat))
        factor = min(1.0, self.clip / norm) if norm > 0 else 1.0
        w = self.weight_of(num_examples)
        if self.private:  # nothing data-dependent outside the noised block
            metrics = {k: math.nan for k in self.metric_keys}
        wv, wn = _weighted_metrics(self.metric_keys, metrics,
                                   {k: (1.0 if k in SUM_KEYS else float(w)) for k in self.metric_keys})
        vec = np.concatenate([flat * (factor * w), [float(w)], wv, wn])  # [length]
        facts = {"norm": norm, "clipped": float(factor < 1.0), "weight": float(w)}
        return ring.encode_fixed(vec, 2.0**self.frac_bits), facts

    def decode(self, total: np.ndarray) -> tuple[dict[str, np.ndarray] | None, float, dict[str, float]]:
        """From the sum: (weighted-average delta per tensor, or None if the total weight is 0; total weight;
        weighted-mean metrics)."""
        v = ring.decode_fixed(total, 2.0**self.frac_bits)
        if v.shape != (self.length,):
            raise LayoutError(f"sum has shape {v.shape}, layout length {self.length}")
        n, m = self.numel, len(self.metric_keys)
        w = float(v[n])
        metrics = _metric_means(self.metric_keys, v[n + 1:n + 1 + m], v[n + 1 + m:])
        for i, k in enumerate(self.metric_keys):
            if k in SUM_KEYS and not self.private:
                metrics[k] = float(round(v[n + 1 + i]))
        if w < 0.5:
            return None, w, metrics
        out, off = {}, 0
        for k, shape in self.shapes:
            size = math.prod(shape)
            out[k] = (v[off:off + size] / w).reshape(shape).astype(np.float32)
            off += size
        return out, w, metrics


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


# ----------------------------------------------------------------------------------------------- eval
@dataclass(frozen=True)
class EvalLayout:
    """``[M]`` w*metric | ``[M]`` w*[finite]: ``acc|loss/<task>`` weighted by ``n/<task>``; ``n/<task>``
    summed as is; routing metrics weighted by the party's evaluated sequences."""

    keys: tuple[str, ...]
    n_parties: int
    num_sequences_max: int

    @property
    def length(self) -> int:
        return 2 * len(self.keys)

    @property
    def frac_bits(self) -> int:
        return _frac_bits(self.n_parties, self.num_sequences_max * METRIC_BOUND)

    def _weights(self, metrics: Mapping[str, float]) -> dict[str, float]:
        def n(key: str) -> float:
            v = float(metrics.get(key, 0.0))
            return min(max(v, 0.0), float(self.num_sequences_max)) if math.isfinite(v) else 0.0
        total = sum(n(k) for k in self.keys if k.startswith("n/"))
        out = {}
        for k in self.keys:
            head, _, task = k.partition("/")
            out[k] = 1.0 if head == "n" else (n(f"n/{task}") if task else total)
        return out

    def encode(self, metrics: Mapping[str, float]) -> np.ndarray:
        wv, wn = _weighted_metrics(self.keys, metrics, self._weights(metrics))
        return ring.encode_fixed(np.concatenate([wv, wn]), 2.0**self.frac_bits)

    def decode(self, total: np.ndarray) -> dict[str, float]:
        v = ring.decode_fixed(total, 2.0**self.frac_bits)
        m = len(self.keys)
        out = _metric_means(self.keys, v[:m], v[m:])
        for i, k in enumerate(self.keys):  # counts are sums, not means
            if k.startswith("n/"):
                out[k] = float(round(v[i]))
        return out
