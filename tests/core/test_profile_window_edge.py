"""On a sliding layer (Gemma 3's local layers) a profile's maximum at δ = window − 1, the last offset the layer
attends, is read as an edge; on the global layer the same profile, which ends at the model's last position, is not."""

from __future__ import annotations

import torch
from rotary_models import CASES, rotary_config

from circuits_core.circuits.profile_shape import profile_shape
from circuits_core.model.window import defined_offsets


def test_a_maximum_at_the_last_offset_of_a_sliding_window_is_an_edge():
    cfg = rotary_config(**{**CASES["gemma3"], "n_layers": 3})  # window 3 on the local layers (0, 1), layer 2 global
    local, global_ = 0, 2
    window = cfg.layer_window(local)
    assert window == 3 and cfg.layer_window(global_) is None
    offsets = torch.arange(cfg.n_ctx)
    seen = offsets[defined_offsets(cfg, local, offsets)].tolist()  # the offsets the local layer attends: 0..2
    assert seen[-1] == window - 1
    rising = [1.0, 2.0, 3.0]
    shape = profile_shape(rising, seen, open_end=False, window=cfg.layer_window(local))
    assert shape.at_edge and shape.label == "edge" and shape.peak_offset == window - 1
    assert f"edge of the layer's {window}-token window" in shape.describe()
    # the same values on a global layer over offsets that end at the model's last position: a real peak
    last = cfg.n_ctx - 1
    plain = profile_shape(rising, [last - 2, last - 1, last], open_end=False, window=cfg.layer_window(global_))
    assert not plain.at_edge and plain.label == ""
    # a maximum inside the window, and a flat profile, are not edges
    assert not profile_shape([1.0, 3.0, 2.0], seen, open_end=False, window=window).at_edge
    flat = profile_shape([1.0, 1.01, 1.02], seen, open_end=False, window=window)
    assert flat.flat and not flat.at_edge
