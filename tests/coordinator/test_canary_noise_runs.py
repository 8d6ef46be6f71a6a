"""Noise that is present only where the audit looks, in whole in-process runs: three parties
over ``LocalTransport`` (the real party code path: session, ``StatsLayout``, outbound guard, ledger) and the real
coordinator.

- The canary-only clone: every party's ``dp.client_share`` is patched the way an attacker's fork (e.g. a ClientApp
  the coordinator ships) would do it: the noise share goes to the canary coordinates only. ``noise-presence``
  passes (the canaries carry all the noise); every row sum is exactly N*s, the coordinator flags the release and
  the audit's ``row-noise`` check fails with exit 1.
- Honest runs: canary positions differ between releases, every party recorded the seed the coordinator recorded,
  and the audit recomputes the positions (``canary-positions`` passes).
"""

from __future__ import annotations

import pytest

from distmoe.audit import audit_run
from distmoe.cli import main
from distmoe.privacy import dp

pytestmark = pytest.mark.integration  # whole in-process runs

LAYERS4 = {"model.layers": 4}  # the tiny model with 4 MoE layers: 3 row-sum differences per release


def _canary_only_share(int_stats, spec, num_sequences, rng=None):
    """The fork of ``dp.client_share``: the full noise share, on the canaries only (the share's last K entries,
    which ``StatsLayout`` places at the drawn canary positions)."""
    flat = dp.pack(int_stats, spec.n_canaries)
    flat[spec.dim :] += dp.skellam_noise(spec.n_canaries, spec.party_variance, rng)
    return flat


def test_canary_only_noise_clone_fails_the_audit(tmp_path, monkeypatch, make_run, releases, failed_checks, capsys):
    """Exercises the row-noise test (defence of item 4). With it removed the audit passes: ``noise-presence`` on the
    canaries is asserted to pass below."""
    coord, _, run_dir, _, lines = make_run(tmp_path, {"schedule.phases": "stats:arith", **LAYERS4})
    monkeypatch.setattr(dp, "client_share", _canary_only_share)
    coord.run()
    (rel,) = releases(run_dir, "router-stats")
    rows = rel["info"]["row_sums"]
    assert len(rows) == 4 and len(set(rows)) == 1  # exact equalities: N*s in every layer
    assert rel["info"]["row_noise"]["flag"] is True
    assert any("WARNING" in ln and "rows disagree less" in ln for ln in lines)
    result = audit_run(run_dir)
    assert failed_checks(result) == {"row-noise"}
    assert result.check("noise-presence").status == "pass"
    assert any("exactly equal" in f for f in result.check("row-noise").findings)
    capsys.readouterr()
    assert main(["audit", str(run_dir)]) == 1
    assert "row-noise" in capsys.readouterr().out


def test_honest_run_draws_fresh_canary_positions_per_release(tmp_path, make_run, releases):
    coord, _, run_dir, _, _ = make_run(tmp_path, {"schedule.phases": "stats:arith, stats:arith", **LAYERS4})
    coord.run()
    rels = releases(run_dir, "router-stats")
    assert len(rels) == 2
    seeds = [r["info"]["canary"]["seed"] for r in rels]
    digests = [r["info"]["canary"]["positions_sha256"] for r in rels]
    assert seeds[0] != seeds[1] and digests[0] != digests[1]
    for r in rels:
        assert r["info"]["row_noise"]["flag"] is False
        assert len(r["info"]["canary"]["u1"]) == 3
    result = audit_run(run_dir)
    assert result.verdict == "pass", [(c.name, c.findings) for c in result.checks if c.status == "fail"]
    pos = result.check("canary-positions")
    assert pos.status == "pass" and sum("3 party ledgers agree" in d for d in pos.details) == 2
    assert result.check("row-noise").status == "pass"
