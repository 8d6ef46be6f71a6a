"""The allow-list of a run whose shapes change (wire/stages.py): merged per stage, checked per stage."""

from __future__ import annotations

from distmoe.wire.server_guard import build_policy, check_against_policy
from distmoe.wire.stages import merge_policies


def _policy(experts: int) -> dict:
    shapes = {"model.layers.0.mlp.gate.weight": (experts, 8), "model.layers.0.mlp.experts.down_proj": (experts, 8, 4)}
    n = sum(a * b * (c if c else 1) for a, b, *rest in shapes.values() for c in (rest[0] if rest else 0,))
    return build_policy(secure=True, n_parties=3, trainable=shapes, layers=1, experts=experts, update_length=n + 2,
                        stats_length=experts + 2, rl_update_length=n + 2, tasks=("a",), eval_length=3)


def test_merged_policy_allows_each_stage_shape_and_nothing_else():
    one, two = _policy(4), _policy(6)
    assert merge_policies([one]) is one  # a run without expansion signs the policy it always did
    merged = merge_policies([one, two])
    ent = merged["masked-input:model-update"]
    assert ent["shape_choices"] == {"masked_y.y": [one["masked-input:model-update"]["shapes"]["masked_y.y"],
                                                   two["masked-input:model-update"]["shapes"]["masked_y.y"]]}
    assert "masked_y.y" not in ent["shapes"]
    assert ent["max_bytes"] == max(one["masked-input:model-update"]["max_bytes"],
                                   two["masked-input:model-update"]["max_bytes"])
    assert "shape_choices" not in merged["masked-input:eval"]  # the same in both stages
    for length in (ent["shape_choices"]["masked_y.y"][0][0], ent["shape_choices"]["masked_y.y"][1][0]):
        desc = {"keys": ent["required"], "shapes": {"masked_y.y": [length]}, "bytes": 100}
        assert check_against_policy(merged, "masked-input:model-update", desc) is None
    bad = {"keys": ent["required"], "shapes": {"masked_y.y": [5]}, "bytes": 100}
    assert "declared specs" in check_against_policy(merged, "masked-input:model-update", bad)
