"""The train / held-out split and the caps against the privacy accounting (``distmoe.data.party``).

The guarantee is per sequence under add/remove neighbours: one example of one party's data added or removed. The
router statistics are charged at ``D2 = s·sqrt(L)``, ``D1 = s·L`` (one sequence's mass-preserving rows) and the
evaluation release at ``s·sqrt(3)``, ``3s``. The attack on the old split: it ranked a task's examples by a content
hash and cut at ``round(n·f)``, so adding one example could move another between train and held-out, a
replace-one change on the training split (sqrt(2)·D2 on the statistic), uncharged. These tests build neighbouring
data sets, load them through the real ``load_party`` (split and caps), encode what each release would sum
(``encode_per_sequence``, ``EvalSpec.sums``) and check the difference against the sensitivities the accountant uses.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from distmoe.config import DataConfig, parse_run_config
from distmoe.data.party import load_party
from distmoe.privacy.dp import encode_per_sequence
from distmoe.privacy.releases.evaluate import spec as eval_spec
from distmoe.privacy.releases.stats import spec as stats_spec

L, E, S = 4, 8, 64
CFG = DataConfig(eval_fraction=0.2, max_train_examples=10, max_eval_examples=5, synth_examples=60, seed=0)


def _row(ex, salt: str) -> bytes:
    return hashlib.sha256((ex.to_json() + salt).encode()).digest()


def _routing(examples) -> np.ndarray:
    """``[N, L, E]`` one-hot rows per example (the worst case: two examples differ by s·sqrt(2) per row)."""
    out = np.zeros((len(examples), L, E))
    for i, ex in enumerate(examples):
        h = _row(ex, "route")
        for layer in range(L):
            out[i, layer, h[layer] % E] = 1.0
    return out


def _scores(examples) -> dict[str, list[tuple[bool, float]]]:
    return {"t": [(_row(ex, "c")[0] % 2 == 0, _row(ex, "l")[0] / 16.0) for ex in examples]}


def _party(root: Path, rows: list[dict]) -> Path:
    root.mkdir(parents=True)
    (root / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _releases(d: Path):
    data = load_party(d, CFG)
    return data, encode_per_sequence(_routing(data.stats_train("t")), S, rounding="mass-preserving"), data.heldout("t")


@pytest.fixture(scope="module")
def charged(tiny_run):
    """The sensitivities the accountant charges, from the real plan's specs (L x E of the default tiny model)."""
    p = parse_run_config(dict(tiny_run)).privacy
    st = stats_spec(p, 1.0, L, E, 3, 2)
    ev = eval_spec(p, CFG.max_eval_examples, ("t",), 3, 2)
    return st, ev


def test_neighbouring_data_sets_stay_within_the_charged_sensitivity(tmp_path, charged):
    st, ev = charged
    rows = [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(60)]
    base, base_stats, base_held = _releases(_party(tmp_path / "base", rows))
    assert len(base.train("t")) == CFG.max_train_examples and len(base_held) == CFG.max_eval_examples  # caps bind
    worst2 = worst_eval = 0.0
    for k in range(40):  # 20 examples added, 20 removed: each a neighbour of the base under add/remove
        nb = rows + [{"instruction": f"new{k}", "output": "x"}] if k < 20 else rows[:k - 20] + rows[k - 19:]
        data, stats, held = _releases(_party(tmp_path / f"n{k}", nb))
        diff = (stats - base_stats).astype(float)
        worst2 = max(worst2, float(np.linalg.norm(diff)))
        assert np.linalg.norm(diff) <= st.delta2_int + 1e-9 and np.abs(diff).sum() <= st.delta1_int + 1e-9
        de = (ev.sums(_scores(held)) - ev.sums(_scores(base_held))).astype(float)
        worst_eval = max(worst_eval, float(np.linalg.norm(de)))
        assert np.linalg.norm(de) <= ev.delta2_int + 1e-9 and np.abs(de).sum() <= ev.delta1_int + 1e-9
        a, b = set(base.stats_train("t")), set(data.stats_train("t"))
        assert len(a ^ b) <= 1, "another example changed side in the split read by the router statistics"
        h = set(base_held) ^ set(held)  # the capped held-out examples: one added or removed, or one replaced
        assert len(h) <= 2 and not (h and a ^ b), "the neighbour changed both sides of the split"
    assert worst2 > 0 and worst_eval > 0  # some neighbours did change each release
