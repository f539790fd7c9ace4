"""nonfinite_tensors (formats/checkpoint.py) on every float dtype a checkpoint stores: the names and counts it reports
equal an element-wise count (isnan / isinf), for NaN, +inf and -inf alone, and the largest finite values of each
dtype are not reported."""

from __future__ import annotations

import pytest
import torch

from circuits_core.formats.checkpoint import nonfinite_tensors


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_nonfinite_tensors_match_an_elementwise_count(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    big = torch.finfo(dtype).max
    state = {f"w{i}": torch.randn(40, 30, generator=gen).to(dtype) for i in range(6)}
    state["w1"].view(-1)[torch.randperm(1200, generator=gen)[:3]] = float("nan")
    state["w2"].view(-1)[7] = float("inf")
    state["w3"].view(-1)[1199] = -float("inf")
    state["w4"].view(-1)[[0, 5]] = torch.tensor([big, -big], dtype=dtype)  # extreme but finite
    state["w5"].view(-1)[[2, 3]] = torch.tensor([float("nan"), -float("inf")], dtype=dtype)
    state["empty"] = torch.empty(0, dtype=dtype)
    state["ids"] = torch.arange(4)  # not floating point: never reported
    expected = [
        f"{k} ({int(torch.isnan(t).sum())} NaN, {int(torch.isinf(t).sum())} inf of {t.numel()})"
        for k, t in state.items()
        if t.is_floating_point() and bool((torch.isnan(t) | torch.isinf(t)).any())
    ]
    assert expected == ["w1 (3 NaN, 0 inf of 1200)", "w2 (0 NaN, 1 inf of 1200)", "w3 (0 NaN, 1 inf of 1200)",
                        "w5 (1 NaN, 1 inf of 1200)"]  # fmt: skip
    assert nonfinite_tensors(state) == expected
