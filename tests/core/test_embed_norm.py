"""The cached per-token norm statistics behind W_E_eff products (circuits.embed_norm) and the group-aware copying
spectra, against dense float64 computations on small rotary/GQA models (RMS, LN, and the Pre variants)."""

from __future__ import annotations

import pytest
import torch

from circuits_core import schedule
from circuits_core.circuits import copying_spectra, embedding
from circuits_core.circuits import head_circuits as C
from circuits_core.model.transformer import random_model
from tests.core.rotary_models import rotary_model

NORMS = {
    "rms-gqa": dict(n_key_value_heads=2),
    "rmspre-mqa": dict(normalization_type="RMSPre", n_key_value_heads=1),
    "ln": dict(normalization_type="LN", gated_mlp=False, act_fn="gelu_new"),
    "lnpre-gqa": dict(normalization_type="LNPre", gated_mlp=False, act_fn="gelu_new", n_key_value_heads=2),
}


def dense_ln1(model):
    """Layer 0's ln1 on every row of W_E, written out independently (float64)."""
    x = model.W_E.double()
    ln, kind = model.blocks[0].ln1, model.cfg.normalization_type
    if kind in ("LN", "LNPre"):
        x = x - x.mean(-1, keepdim=True)
    x = x / (x.pow(2).mean(-1, keepdim=True) + model.cfg.eps).sqrt()
    if kind in ("LN", "RMS"):
        x = x * ln.w
    return x + ln.b if kind == "LN" else x


@pytest.fixture(params=list(NORMS))
def model(request):
    m = rotary_model(seed=3, **NORMS[request.param])
    with torch.no_grad():  # row means far from 0, so that centring is exercised
        m.W_E.add_(torch.linspace(-2, 3, m.cfg.d_vocab, dtype=torch.float64)[:, None])
    return m


def test_embed_eff_products_equal_dense_ln(model, monkeypatch):
    monkeypatch.setattr(C, "EMBED_CHUNK", 7)  # several chunks, the last one partial (d_vocab = 40)
    W_E = dense_ln1(model)
    W = torch.randn(model.cfg.d_model, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(embedding.embed_eff_matmul(model, W), W_E @ W, rtol=0, atol=1e-12)
    torch.testing.assert_close(embedding.embed_eff(model), W_E, rtol=0, atol=1e-12)
    torch.testing.assert_close(copying_spectra.embed_gram(model), W_E.T @ W_E, rtol=0, atol=1e-10)
    torch.testing.assert_close(copying_spectra.unembed_embed_gram(model), model.W_U @ W_E, rtol=0, atol=1e-10)
    torch.testing.assert_close(embedding.embed_eff_rows(model, [0, 17, 39]), W_E[[0, 17, 39]], rtol=0, atol=1e-12)


def test_cached_statistics_follow_weight_changes(model):
    W = torch.randn(model.cfg.d_model, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    before = embedding.embed_eff_matmul(model, W)
    assert embedding.embed_norm(model) is embedding.embed_norm(model)  # formed once
    with torch.no_grad():
        model.W_E[5].add_(torch.arange(model.cfg.d_model, dtype=torch.float64))  # in place: a new weights version
        if model.cfg.normalization_type in ("LN", "RMS"):
            model.blocks[0].ln1.w.mul_(0.5)
    after = embedding.embed_eff_matmul(model, W)
    torch.testing.assert_close(after, dense_ln1(model) @ W, rtol=0, atol=1e-12)
    assert not torch.allclose(after, before)
    model.embed.W_E = torch.nn.Parameter(model.W_E.detach() * 2)  # replaced
    torch.testing.assert_close(embedding.embed_eff_matmul(model, W), dense_ln1(model) @ W, rtol=0, atol=1e-12)


def test_copying_spectra_under_gqa_equal_dense(model):
    cfg = model.cfg
    W_E = dense_ln1(model)
    ov, qk = copying_spectra.ov_eigenvalues(model), copying_spectra.qk_eigenvalues(model)  # [L, H, d_head]
    for layer in range(cfg.n_layers):
        for h in range(cfg.n_heads):
            g = h // cfg.group_size
            W_Q, W_K = model.blocks[layer].attn.W_Q[h], model.blocks[layer].attn.grouped("W_K")[g]
            W_V, W_O = model.blocks[layer].attn.grouped("W_V")[g], model.blocks[layer].attn.W_O[h]
            for small, full in [
                (ov[layer, h], W_E @ W_V @ W_O @ model.W_U),
                (qk[layer, h], W_E @ W_Q @ W_K.T @ W_E.T / cfg.scale),
            ]:
                dense = torch.linalg.eigvals(full)
                top = dense[dense.abs().argsort(descending=True)[: cfg.d_head]]
                key = lambda z: (round(z.real.item(), 6), round(z.imag.item(), 6))  # noqa: E731
                assert torch.allclose(torch.stack(sorted(small, key=key)), torch.stack(sorted(top, key=key)), atol=1e-8)


def test_no_norm_model_uses_W_E_directly():
    m = random_model(
        rotary_model().cfg.__class__(**{**rotary_model().cfg.__dict__, "normalization_type": None}),
        seed=0,
        dtype=torch.float64,
    )
    W = torch.randn(m.cfg.d_model, 2, dtype=torch.float64)
    torch.testing.assert_close(embedding.embed_eff_matmul(m, W), m.W_E @ W, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models_within_their_rounding(dtype):
    """A half-precision model's W_E_eff products and Grams come back in its dtype, within its rounding of float64."""
    ref = rotary_model(seed=4, n_key_value_heads=2)
    m = rotary_model(seed=4, n_key_value_heads=2).to(dtype)
    W_E = dense_ln1(ref)
    W = torch.randn(ref.cfg.d_model, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    eps = torch.finfo(dtype).eps
    for got, want in [
        (embedding.embed_eff_matmul(m, W.to(dtype)), W_E @ W),
        (copying_spectra.embed_gram(m), W_E.T @ W_E),
        (copying_spectra.unembed_embed_gram(m), ref.W_U @ W_E),
    ]:
        assert got.dtype == dtype
        assert (got.double() - want).abs().max() < 4 * eps * want.abs().max()  # measured <= 0.83 eps


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_reused_chunk_buffer_gives_the_fresh_chunks(dtype):
    """W_E_eff's chunks written over one buffer (the Gram pass's reuse=True; uneven chunks 16, 16, 8) equal each
    chunk normalised afresh, bit for bit; a half-precision model keeps fresh chunks (normalised in float32, rounded
    once), since rounding at every step inside a half-precision buffer doubled their error."""
    m = rotary_model(seed=4, n_key_value_heads=2).to(dtype)
    norm = embedding.embed_norm(m)
    seen = []
    for rows, X in embedding.embed_rows(m, schedule.shared_chunks(m.cfg.d_vocab, 16), reuse=True):
        assert torch.equal(X, embedding._normalised(m, norm, rows)), rows
        seen.append((rows, X))  # kept alive: a fresh chunk's memory cannot come back as the next one
    assert [r for r, _ in seen] == [slice(0, 16), slice(16, 32), slice(32, 40)]
    shared = len({X.data_ptr() for _, X in seen}) == 1  # one buffer for every chunk
    assert shared == (dtype in (torch.float64, torch.float32))


def test_a_larger_chunk_after_a_smaller_one_gets_its_own_buffer():
    """Chunks handed out smallest first (8, then 16, 16 rows): the 8-row buffer cannot hold the next chunk, which is
    normalised afresh and becomes the buffer; every chunk equals a fresh one."""
    m = rotary_model(seed=4, n_key_value_heads=2).to(torch.float32)
    norm = embedding.embed_norm(m)
    order = iter([slice(32, 40), slice(0, 16), slice(16, 32)])
    seen = []
    for rows, X in embedding.embed_rows(m, lambda: next(order, None), reuse=True):
        assert torch.equal(X, embedding._normalised(m, norm, rows)), rows
        seen.append(X)
    assert seen[0].data_ptr() != seen[1].data_ptr() == seen[2].data_ptr()
