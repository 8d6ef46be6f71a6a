"""Unit tests: the per-tensor divergence check of an aggregate update (``distmoe.coordinator.divergence``)."""

from __future__ import annotations

import numpy as np

from distmoe.coordinator.divergence import divergence_warning, diverging


def test_tensors_above_the_threshold_are_flagged_largest_first():
    delta = {"a": np.array([0.1, -0.2]), "b": np.array([[0.0, -3.0], [1.0, 0.5]]), "c": np.array([0.6, 0.0]),
             "d": np.zeros((2, 2))}
    assert diverging(delta, 0.5) == [("b", 3.0), ("c", 0.6)]
    assert diverging(delta, 5.0) == []
    assert diverging(delta, 0.0) == []  # off
    assert diverging({"n": np.array([np.nan, 0.0])}, 1.0)[0][0] == "n"  # a non-finite maximum is flagged


def test_the_warning_names_the_tensors_and_is_short_ascii():
    flagged = [(f"model.layers.{i}.mlp.experts.gate_up_proj.lora_A.weight", 10.0 - i) for i in range(8)]
    text = divergence_warning(flagged, 0.5, 40, "train")
    assert text.startswith("train update diverges: max|delta| above federation.divergence-max = 0.5 in 8 of 40")
    assert "model.layers.0.mlp.experts.gate_up_proj.lora_A.weight 10" in text and text.endswith("+3 more")
    assert text.isascii() and text.isprintable() and len(text) < 480
