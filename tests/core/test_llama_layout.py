"""The slab-by-slab layout copy of the Llama-family reader (formats_llama.laid_out) against a plain one-pass copy.

The loader's own tests use tiny checkpoints, whose tensors fit one slab; here the slab is made small so every
layout (nn.Linear transpose, per-head Q/K/V, per-head O) is copied in many slabs, uneven last one included.
"""

from __future__ import annotations

import pytest
import torch

from circuits_core.formats import llama as formats_llama
from circuits_core.formats.llama import _T, _output_heads, _per_head, laid_out


@pytest.mark.parametrize("slab", [1, 96, 1 << 16])
@pytest.mark.parametrize("source", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_slab_copy_equals_one_pass_copy(monkeypatch: pytest.MonkeyPatch, slab: int, source: torch.dtype) -> None:
    monkeypatch.setattr(formats_llama, "SLAB_BYTES", slab)
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(6 * 8, 35, generator=gen).to(source)  # [heads * d_head, d_model]: 6 heads of d_head 8
    W_O = torch.randn(35, 6 * 8, generator=gen).to(source)  # o_proj [d_model, heads * d_head]
    cases = [(W, _T), (W, _per_head(6, 8, 35)), (W_O, _output_heads(6, 8, 35)), (W[:, 0], _per_head(6, 8))]
    for stored, layout in cases:
        for dtype in (torch.float32, torch.float64):
            want = torch.empty(layout(stored).shape, dtype=dtype).copy_(layout(stored))  # one pass
            got = laid_out(layout(stored), dtype)
            assert got.is_contiguous() and got.dtype == dtype
            assert torch.equal(got, want)
    # the per-head layouts are the documented reshapes: W_Q[h] = q_proj rows h*dh..(h+1)*dh, transposed
    got = laid_out(_per_head(6, 8, 35)(W), torch.float64)
    for h in range(6):
        assert torch.equal(got[h], W[h * 8 : (h + 1) * 8].double().T)
    got = laid_out(_output_heads(6, 8, 35)(W_O), torch.float64)
    for h in range(6):
        assert torch.equal(got[h], W_O[:, h * 8 : (h + 1) * 8].double().T)


def test_one_thread_restores_the_thread_count() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with formats_llama.one_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(ValueError), formats_llama.one_thread():
            raise ValueError("a failed load")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
