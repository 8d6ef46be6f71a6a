"""The party's own work (``distmoe.party.work``) against a coordinator that probes its data size through run configs.

The attack: a coordinator varies ``privacy.num-sequences-max`` over runs and reads whether the party answers its
router statistics or refuses with the ``data`` code (``N training sequences ... above privacy.num-sequences-max``):
a binary search gave one party's exact training-sequence count, with no epsilon charged. Now a party above the bound
takes part with no rows (contributor bit 0, as a party without data for the task): it answers whatever the bound.
"""

from __future__ import annotations

import shutil

from distmoe.config import SimConfig, parse_node_config, parse_run_config
from distmoe.data.party import load_party
from distmoe.model.base import base_fingerprint
from distmoe.model.build import build_model
from distmoe.model.trainable import apply_trainable, spec_of, trainable_state
from distmoe.party.work import router_stats_per_sequence
from distmoe.wire.schema import StatsInstruction


def test_num_sequences_max_binary_search_learns_nothing(synth_dirs, tiny, tmp_path):
    cfg = parse_run_config(dict(tiny))
    model, _ = build_model(cfg.model)
    model = apply_trainable(model, cfg.model)
    spec = spec_of(model, cfg.model.trainable, base_fingerprint(cfg.model))
    weights = {k: v.numpy() for k, v in trainable_state(model).items()}
    instr = StatsInstruction(round=1, task="arith", weights=weights, base_hash=spec.base_hash)
    small = tmp_path / "small"
    shutil.copytree(synth_dirs[0], small)
    lines = (small / "arith.jsonl").read_text().splitlines()
    (small / "arith.jsonl").write_text("\n".join(lines[:8]) + "\n")
    sizes = {}
    for name, data in (("small", small), ("large", synth_dirs[0])):
        sizes[name] = len(load_party(data, cfg.data).stats_train("arith"))
    assert sizes["small"] < sizes["large"]
    seen, rows = {}, {}
    # a binary search's probes: below both sizes, between them (it told them apart), above both
    for bound in (sizes["small"] - 1, (sizes["small"] + sizes["large"]) // 2, sizes["large"]):
        for name, data in (("small", small), ("large", synth_dirs[0])):
            node = parse_node_config({"data-path": str(data), "work-dir": str(tmp_path / f"w-{name}")}, SimConfig())
            try:
                per_seq = router_stats_per_sequence(cfg, node, instr, bound)  # [N, L, E]
            except Exception as exc:  # noqa: BLE001 -- any refusal is what the coordinator would see
                seen[name, bound] = type(exc).__name__
                continue
            seen[name, bound] = "answer"
            rows[name, bound] = per_seq.shape[0]
    assert set(seen.values()) == {"answer"}, seen  # the reply kind is the same whatever the private size
    for (name, bound), n in rows.items():  # every row or none: never a cut (replace-one)
        assert n == (sizes[name] if sizes[name] <= bound else 0), (name, bound, n)
