"""Composition scores: factored all-pairs computation vs the dense Frobenius formula (float64)."""

import math

import pytest
import torch

from circuits_core.circuits.composition import composition_scores
from circuits_core.circuits.composition_baseline import random_baseline
from circuits_core.errors import CancelledError
from circuits_core.formats.processing import process_weights
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import random_model


def _cfg(**kw):
    base = dict(n_layers=3, d_model=32, n_heads=3, d_head=8, d_vocab=50, n_ctx=16)
    base.update(kw)
    return ModelConfig(**base)


def _dense_scores(model):
    """Brute force, paper's column convention: W_OV = W_O W_V, W_QK = W_Q^T W_K ([d, d] dense)."""
    L, H = model.cfg.n_layers, model.cfg.n_heads
    WQ, WK, WV, WO = (w.transpose(-2, -1) for w in (model.W_Q, model.W_K, model.W_V, model.W_O))  # paper shapes
    OV = WO @ WV  # [L, H, d, d]
    QK = WQ.transpose(-2, -1) @ WK
    out = {k: torch.zeros(L, H, L, H, dtype=torch.float64) for k in "qkv"}
    for l1 in range(L):
        for h1 in range(H):
            for l2 in range(l1 + 1, L):
                for h2 in range(H):
                    a, qk, ov2 = OV[l1, h1], QK[l2, h2], OV[l2, h2]
                    out["q"][l1, h1, l2, h2] = (qk.T @ a).norm() / (qk.norm() * a.norm())
                    out["k"][l1, h1, l2, h2] = (qk @ a).norm() / (qk.norm() * a.norm())
                    out["v"][l1, h1, l2, h2] = (ov2 @ a).norm() / (ov2.norm() * a.norm())
    return out


def _scaled_centred(model):
    """A processed-like variant: LN-gain-like per-dimension scaling of readers, centred writers."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for block in model.blocks:
            gain = 0.5 + torch.rand(model.cfg.d_model, generator=gen, dtype=torch.float64)
            for name in ("W_Q", "W_K", "W_V"):
                w = getattr(block.attn, name)
                w.mul_(gain[None, :, None])
                w.sub_(w.mean(1, keepdim=True))
            block.attn.W_O.sub_(block.attn.W_O.mean(-1, keepdim=True))
    return model


@pytest.mark.parametrize("variant", ["raw", "scaled_centred", "processed"])
def test_factored_scores_match_dense(variant):
    model = random_model(_cfg(), seed=1, dtype=torch.float64)
    if variant == "scaled_centred":
        model = _scaled_centred(model)
    if variant == "processed":
        model = random_model(_cfg(normalization_type="LN", use_bias=True), seed=1, dtype=torch.float64)
        with torch.no_grad():
            for block in model.blocks:
                block.ln1.w.uniform_(0.5, 1.5)
        model = process_weights(model)
    scores = composition_scores(model, n_samples=8)
    dense = _dense_scores(model)
    for kind in "qkv":
        torch.testing.assert_close(scores.raw[kind], dense[kind], atol=1e-12, rtol=0)
        assert scores.raw[kind].max() <= 1 and scores.raw[kind].min() >= 0
        expected = torch.where(scores.mask, dense[kind] - 1 / math.sqrt(32), torch.zeros(()))
        torch.testing.assert_close(scores.minus_baseline[kind], expected, atol=1e-12, rtol=0)
    # the three kinds differ on a random model (catches a swapped right factor)
    assert not torch.allclose(scores.raw["q"], scores.raw["k"])


def test_mask_and_invariance_under_scaling():
    model = random_model(_cfg(), seed=2, dtype=torch.float64)
    before = composition_scores(model, n_samples=4).raw
    with torch.no_grad():
        model.blocks[0].attn.W_O.mul_(3.0)
    after = composition_scores(model, n_samples=4)
    for kind in "qkv":
        torch.testing.assert_close(after.raw[kind], before[kind], atol=1e-12, rtol=0)
        assert (after.raw[kind][~after.mask] == 0).all()
    assert after.mask[0, 0, 1, 0] and not after.mask[1, 0, 1, 0] and not after.mask[2, 0, 1, 0]


def test_random_baseline_matches_analytic():
    mean, std = random_baseline(256, 32, n_samples=64, seed=0)
    assert abs(mean - 1 / math.sqrt(256)) < 0.1 / math.sqrt(256)
    assert 0 < std < 0.2 * mean
    # dense brute force for one sample of the same generator semantics
    gen = torch.Generator().manual_seed(3)
    W = (torch.rand(4, 64, 8, generator=gen, dtype=torch.float64) * 2 - 1) / math.sqrt(8)
    A, B = W[0] @ W[1].T, W[2] @ W[3].T
    from circuits_core.circuits.composition_factors import left_collapsed, pair_scores, right_collapsed

    got = pair_scores(left_collapsed(W[0], W[1].T)[None], right_collapsed(W[2], W[3].T)[None])[0, 0]
    assert abs(float(got) - float((A @ B).norm() / (A.norm() * B.norm()))) < 1e-12


def test_should_stop_cancels():
    model = random_model(_cfg(), seed=0, dtype=torch.float64)
    with pytest.raises(CancelledError):
        composition_scores(model, n_samples=2, should_stop=lambda: True)


@pytest.mark.parametrize(("d_model", "block", "size"), [(48, 16, 16), (50, 16, 10), (31, 16, 31)])
def test_gram_blocks_match_dense(d_model, block, size):
    """The block-triangular Gram computation (several blocks, a divisor block, one full block) vs dense."""
    from circuits_core.circuits.composition import raw_composition_scores
    from circuits_core.circuits.gram_pair_sums import gram_block_size

    assert gram_block_size(d_model, block) == size
    model = random_model(_cfg(d_model=d_model, n_layers=4), seed=3, dtype=torch.float64)
    raw = raw_composition_scores(model.W_Q, model.W_K, model.W_V, model.W_O, block=block)
    dense = _dense_scores(model)
    for i, kind in enumerate("qkv"):
        torch.testing.assert_close(raw[i], dense[kind], atol=1e-12, rtol=0)


@pytest.mark.parametrize("n_kv_heads", [None, 1])
def test_one_heads_composition_is_its_row_and_column_of_the_dense_scores(n_kv_heads):
    """head_compositions (only the pairs naming one head, through collapsed factors) against the dense brute force:
    the earlier heads into it and it into the later heads, for every kind (and a grouped-query model's K and V),
    every kind at once and each kind alone."""
    from circuits_core.circuits.head_composition import head_compositions

    kw = {} if n_kv_heads is None else {"n_key_value_heads": n_kv_heads}
    model = random_model(_cfg(n_layers=4, **kw), seed=3, dtype=torch.float64)
    dense = _dense_scores(model)
    for layer, h in [(0, 1), (2, 0), (3, 2)]:
        every = head_compositions(model, layer, h)  # every kind from one stacking (the head page's partners)
        for kind in "qkv":
            for reads, writes in (every[kind], head_compositions(model, layer, h, (kind,))[kind]):
                torch.testing.assert_close(reads, dense[kind][:layer, :, layer, h], atol=1e-12, rtol=0)
                torch.testing.assert_close(writes, dense[kind][layer, h, layer + 1 :, :], atol=1e-12, rtol=0)


@pytest.mark.parametrize("n_kv_heads", [None, 1])
def test_one_pairs_composition_is_its_entry_of_the_dense_scores(n_kv_heads):
    """pair_composition (the pair page's three scores, from the two layers' factors alone) against the dense brute
    force, for forward, same-layer and backward pairs (0), and a grouped-query model's K and V; its price is torch's
    count of its products."""
    from torch.utils.flop_counter import FlopCounterMode

    from circuits_core.circuits.head_composition import pair_composition, pair_composition_flops

    kw = {} if n_kv_heads is None else {"n_key_value_heads": n_kv_heads}
    model = random_model(_cfg(n_layers=4, **kw), seed=5, dtype=torch.float64)
    dense = _dense_scores(model)
    for (l1, h1), (l2, h2) in [((0, 1), (3, 2)), ((1, 0), (2, 1)), ((2, 2), (2, 0)), ((3, 1), (1, 1))]:
        got = pair_composition(model, (l1, h1), (l2, h2))
        want = {kind: float(dense[kind][l1, h1, l2, h2]) if l1 < l2 else 0.0 for kind in "qkv"}
        assert got == pytest.approx(want, abs=1e-12)
    with FlopCounterMode(display=False) as counter:
        pair_composition(model, (0, 1), (3, 2))
    assert counter.get_total_flops() == pair_composition_flops(model)
