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


def test_the_carried_probes_weights_are_loaded_once_and_never_reused_after_a_change(synth_dirs, tiny, tmp_path,
                                                                                   monkeypatch):
    """The probe a phase instruction carries runs on the instruction's own weights and only reads the model; the
    phase work of the same message then finds them loaded (one copy and finite check fewer). The skip needs the very
    same weights object on the same model and is consumed by the next call: a changed model (training) or other
    weights are always loaded, and the phase work trains from exactly the instruction's weights. The note is the
    message's (``work.Loaded``): a call without it always loads."""
    import numpy as np
    import torch

    from distmoe.party import work

    cfg = parse_run_config(dict(tiny))
    node = parse_node_config({"data-path": str(synth_dirs[0]), "work-dir": str(tmp_path / "w")}, SimConfig())
    model, _ = build_model(cfg.model)
    model = apply_trainable(model, cfg.model)
    w = {k: v.numpy() + 0.25 for k, v in trainable_state(model).items()}
    loads = []
    real = work.load_trainable
    monkeypatch.setattr(work, "load_trainable", lambda m, s, sp: loads.append(1) or real(m, s, sp))
    msg = work.Loaded()  # one message's note
    m1, _, _ = work.prepare_model(cfg, node, w, "", msg, read_only=True)  # the probe
    m2, _, _ = work.prepare_model(cfg, node, w, "", msg)  # the phase work: the same weights, already loaded
    assert m1 is m2 and len(loads) == 1
    assert all(np.array_equal(v.numpy(), w[k]) for k, v in trainable_state(m2).items())
    with torch.no_grad():  # training changes the model: the skip was consumed, the next call loads again
        next(p for p in m2.parameters() if p.requires_grad).add_(1.0)
    m3, _, _ = work.prepare_model(cfg, node, w, "", msg)
    assert len(loads) == 2 and all(np.array_equal(v.numpy(), w[k]) for k, v in trainable_state(m3).items())
    work.prepare_model(cfg, node, w, "", msg, read_only=True)
    other = {k: v + 1 for k, v in w.items()}  # equal keys, another object: loaded
    m4, _, _ = work.prepare_model(cfg, node, other, "", msg)
    assert len(loads) == 4 and all(np.array_equal(v.numpy(), other[k]) for k, v in trainable_state(m4).items())
    work.prepare_model(cfg, node, w, "", msg, read_only=True)
    work.prepare_model(cfg, node, w, "")  # without the message's note (another message): loaded
    assert len(loads) == 6


def test_what_one_messages_probe_left_loaded_is_never_seen_by_another_message_or_run(synth_dirs, tiny, tmp_path,
                                                                                    monkeypatch):
    """Two messages in one process (the Simulation Engine keeps its processes), the first cut short right after its
    carried probe (an error, a run stopped): the second, with the very same weights object on the cached model, finds
    nothing of the first's note and loads its weights, so the model holds exactly them and not what the first left;
    a second run in the process with other weights likewise."""
    import numpy as np
    import torch

    from distmoe.party import work

    cfg = parse_run_config(dict(tiny))
    node = parse_node_config({"data-path": str(synth_dirs[0]), "work-dir": str(tmp_path / "w")}, SimConfig())
    model, _ = build_model(cfg.model)
    w = {k: v.numpy() + 0.25 for k, v in trainable_state(apply_trainable(model, cfg.model)).items()}
    loads = []
    real = work.load_trainable
    monkeypatch.setattr(work, "load_trainable", lambda m, s, sp: loads.append(1) or real(m, s, sp))
    first, _, _ = work.prepare_model(cfg, node, w, "", work.Loaded(), read_only=True)  # message 1: its probe only
    with torch.no_grad():  # what the rest of the process did to the cached model meanwhile (another message)
        next(p for p in first.parameters() if p.requires_grad).add_(1.0)
    second, _, _ = work.prepare_model(cfg, node, w, "", work.Loaded())  # message 2: its own note
    assert second is first and len(loads) == 2
    assert all(np.array_equal(v.numpy(), w[k]) for k, v in trainable_state(second).items())
    work.prepare_model(cfg, node, w, "", work.Loaded(), read_only=True)  # a run cut short after a probe
    w2 = {k: v + 1 for k, v in w.items()}  # the next run's first message, its own weights
    run2, _, _ = work.prepare_model(cfg, node, w2, "", work.Loaded())
    assert len(loads) == 4 and all(np.array_equal(v.numpy(), w2[k]) for k, v in trainable_state(run2).items())
