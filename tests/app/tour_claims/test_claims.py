"""Every tour sentence about a shipped model is true: each measured value is recomputed here independently. This file:
the zero- and one-layer figures and composition (F6-F21); the induction circuit and the pages: test_claims_induction.py.

The tour (app/tour/tour.py) is built as the app serves it (float32, the registry's processing) on the shipped
toy models in checkpoints/. The references below read the raw safetensors in float64 and use dense matrices
and plain forward passes -- none of the engine's factored circuits, path expansion or detectors. A sentence
whose value changes (retrained weights, a changed figure, a bug) fails here.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from app.tour import paper_claims as pc
from circuits_core.prompt.phenomena import MIN_TRAIN_COUNT
from tests.app.tour_claims_reference import (
    ROOT,
    TOYS,
    claim,
    copying_scores,
    dense_ov,
    figure_ids,
    forward,
    frequent,
    path_term,
    twin,
)


# -- one basis ------------------------------------------------------------------------------------------------
def test_the_three_toys_are_served_on_the_raw_basis(served, raw):
    _, registry = served
    for name in TOYS:
        served_model = registry.get(name).model
        for attr in ("W_E", "W_U") + (("W_Q", "W_K", "W_V", "W_O") if raw[name].cfg.n_layers else ()):
            torch.testing.assert_close(
                getattr(served_model, attr).double(), getattr(raw[name], attr), atol=1e-6, rtol=0
            )


# -- zero and one layer ---------------------------------------------------------------------------------------
def test_f6_direct_path_top_entries_and_held_out_bigrams(tour, raw, data):
    sentence, values = claim(tour, "F6", pc.DirectPathBigramsClaim)
    m, vocab = raw["toy-0l"], frequent(data)
    block = m.W_E[vocab] @ m.W_U[:, vocab]  # [F, F] dense, frequent tokens only
    top = block.flatten().topk(len(values.pairs)).indices
    want = [(int(vocab[i // len(vocab)]), int(vocab[i % len(vocab)])) for i in top.tolist()]
    assert [tuple(p) for p in values.pairs] == want
    a, b = data.val[:-1].astype(np.int64), data.val[1:].astype(np.int64)
    counts = [int(((a == x) & (b == y) & (a != data.eot)).sum()) for x, y in want]
    assert values.held_out_counts == counts
    assert f"{sum(c > 0 for c in counts)} of them occur as bigrams" in sentence and "raw weights" in sentence


def test_f9_terms_sum_to_the_real_logit(tour, raw):
    sentence, values = claim(tour, "F9", pc.PathTermsSumClaim)
    paths = twin(tour, "F9")["paths"]
    logits, _ = forward(raw["toy-1l"], paths["tokens"])
    assert values.value == pytest.approx(float(logits[-1, values.target]), abs=1e-4)
    assert values.total == pytest.approx(float(logits[-1, values.target]), abs=1e-4)
    assert f"{values.value:.4f}" in sentence


def test_f10_f12_f14_heads_and_token_level_copying(tour, raw):
    m = raw["toy-1l"]
    scores = copying_scores(m)
    ranked = sorted(scores, key=lambda h: -scores[h])
    sentence, values = claim(tour, "F10", pc.TokenCopyingClaim)
    assert values.head == ranked[0] and claim(tour, "F14", pc.QueryRowClaim)[1].head == ranked[0]
    f14 = claim(tour, "F14", pc.QueryRowClaim)[1]  # one query's row of the full QK circuit, among frequent tokens
    counts = np.load(ROOT / "toy-1l" / "token_counts.npy")
    vocab = torch.from_numpy(np.flatnonzero(counts >= MIN_TRAIN_COUNT)).long()
    h = int(ranked[0][3:])
    row = (m.W_E[f14.query] @ m.W_Q[0, h]) @ (m.W_E[vocab] @ m.W_K[0, h]).T / math.sqrt(m.cfg.d_head)
    assert f14.keys == vocab[row.topk(len(f14.keys)).indices].tolist()
    assert claim(tour, "F12", pc.SecondCopyingHeadClaim)[1].head == ranked[1]
    M = dense_ov(m, 0, int(ranked[0][3:]))
    own = torch.arange(M.shape[0])
    top1 = float((M.argmax(1) == own).double().mean())
    top10 = float((M.topk(10, dim=1).indices == own[:, None]).any(1).double().mean())
    assert values.top1 == pytest.approx(top1, abs=1e-9) and values.top10 == pytest.approx(top10, abs=1e-9)
    flat = M.flatten().topk(10).indices
    assert values.diagonal == int((flat // M.shape[1] == flat % M.shape[1]).sum())
    assert f"only {top1:.2%}" in sentence and f"top-10: {top10:.2%}" in sentence
    assert values.score == pytest.approx(scores[ranked[0]], abs=1e-4)


def test_f11_copying_source(tour, raw, data):
    sentence, values = claim(tour, "F11", pc.CopyingSourceClaim)
    vocab = frequent(data)
    m = raw["toy-1l"]
    block = dense_ov(m, 0, int(values.head[3:]))[vocab][:, vocab]  # [F, F]
    row = int((vocab == values.source).nonzero()[0, 0])
    assert int(vocab[int(block[row].argmax())]) == values.source == values.top_out  # it copies
    share = float((block.argmax(1) == torch.arange(len(vocab))).double().mean())
    assert values.share == pytest.approx(share, abs=1e-9) and f"{share:.1%}" in sentence


def test_f15_positional_head(tour, raw):
    sentence, values = claim(tour, "F15", pc.PositionalHeadClaim)
    m = raw["toy-1l"]
    tokens = torch.cat(
        [
            torch.zeros(10, 1, dtype=torch.long),
            (r := torch.randint(0, m.cfg.d_vocab, (10, 50), generator=torch.Generator().manual_seed(0))),
            r,
        ],
        dim=1,
    )  # the standard input
    _, cache = m.run(tokens, names=lambda n: n.endswith("hook_pattern"))
    A = cache["blocks.0.attn.hook_pattern"]
    prev = torch.stack([A[:, :, i, i - 1] for i in range(1, tokens.shape[1])], -1).mean((0, 2))
    head = int(prev.argmax())
    assert values.head == f"L0H{head}"
    n = m.cfg.n_ctx
    scores = m.W_pos @ m.W_Q[0, head] @ m.W_K[0, head].T @ m.W_pos.T / math.sqrt(m.cfg.d_head)
    pattern = torch.softmax(scores.masked_fill(torch.ones(n, n).triu(1).bool(), -math.inf), -1)
    assert values.previous == pytest.approx(float(pattern.diagonal(-1).mean()), abs=1e-4)
    assert values.current == pytest.approx(float(pattern.diagonal().mean()), abs=1e-4)


def test_f17_positive_eigenvalues(tour, raw):
    sentence, values = claim(tour, "F17", pc.PositiveEigenvaluesClaim)
    m = raw["toy-1l"]
    for h in range(m.cfg.n_heads):
        eig = torch.linalg.eigvals(m.W_V[0, h] @ m.W_O[0, h] @ m.W_U @ m.W_E)
        eig = eig[eig.abs().argsort(descending=True)[: m.cfg.d_head]]
        count = int((eig.real > 0).sum())
        assert values.positive[f"L0H{h}"] == count and f"L0H{h} {count}/{m.cfg.d_head}" in sentence


def test_f18_copying_scores_baseline_and_self_copy(tour, raw):
    sentence, values = claim(tour, "F18", pc.CopyingScoresClaim)
    m = raw["toy-1l"]
    scores = copying_scores(m)
    assert values.positive == sum(s > 0 for s in scores.values()) and values.n == len(scores)
    assert values.low == pytest.approx(min(scores.values()), abs=1e-4)
    assert values.high == pytest.approx(max(scores.values()), abs=1e-4)
    gen = torch.Generator().manual_seed(0)  # copying.random_ov_weights' documented stream
    W_V = torch.randn(200, m.cfg.d_model, m.cfg.d_head, generator=gen, dtype=torch.float64)
    W_O = torch.randn(200, m.cfg.d_head, m.cfg.d_model, generator=gen, dtype=torch.float64)
    base = []
    for i in range(200):
        eig = torch.linalg.eigvals(W_V[i] @ W_O[i] @ m.W_U @ m.W_E)
        eig = eig[eig.abs().argsort(descending=True)[: m.cfg.d_head]]
        base.append(float(eig.sum().real / eig.abs().sum()))
    assert values.baseline_mean == pytest.approx(float(np.mean(base)), abs=1e-3)
    assert values.baseline_std == pytest.approx(float(np.std(base, ddof=1)), abs=1e-3)
    own = torch.arange(m.cfg.d_vocab)
    top1 = max(float((dense_ov(m, 0, h).argmax(1) == own).double().mean()) for h in range(m.cfg.n_heads))
    assert values.max_top1 == pytest.approx(top1, abs=1e-9) and f"{top1:.2%}" in sentence
    assert abs(values.baseline_mean) + 2 * values.baseline_std < values.high


def test_f19_largest_terms(tour, raw):
    sentence, values = claim(tour, "F19", pc.LargestPathTermsClaim)
    m = raw["toy-2l"]
    paths = twin(tour, "F19")["paths"]
    logits, cache = forward(m, paths["tokens"])
    pos, target = paths["position"], paths["target"]
    assert values.value == pytest.approx(float(logits[pos, target]), abs=1e-4)
    for path, value in values.top:
        assert value == pytest.approx(path_term(m, cache, path, pos, target), abs=1e-4), path


def test_f20_qk_terms(tour, raw):
    sentence, values = claim(tour, "F20", pc.QKTermSpreadClaim)
    m = raw["toy-2l"]
    ids = figure_ids(tour, "F20", "qk_paths")
    _, cache = forward(m, ids)
    n = len(ids)
    causal = torch.ones(n, n).tril().bool()
    head = int(twin(tour, "F20")["qk_paths"]["head"][3:])
    sides = {"pos_embed": m.W_pos[:n], "embed": cache["hook_embed"]}
    for h in range(m.cfg.n_heads):
        sides[f"L0H{h}"] = cache["blocks.0.attn.hook_pattern"][h] @ cache["hook_embed"] @ m.W_V[0, h] @ m.W_O[0, h]
    for name, std in values.top:
        q_name, k_name = name.split(" × ")
        term = (sides[q_name] @ m.W_Q[1, head]) @ (sides[k_name] @ m.W_K[1, head]).T / math.sqrt(m.cfg.d_head)
        assert std == pytest.approx(float(term[causal].std()), rel=1e-3), name


def test_f21_top_composition_pairs(tour, raw):
    sentence, values = claim(tour, "F21", pc.TopCompositionPairsClaim)
    m = raw["toy-2l"]
    OV = [[m.W_V[lay, h] @ m.W_O[lay, h] for h in range(m.cfg.n_heads)] for lay in range(2)]
    QK = [m.W_Q[1, h] @ m.W_K[1, h].T for h in range(m.cfg.n_heads)]
    for kind in ("K", "Q", "V"):  # row convention, as tests/app/test_api_analyses.py: A = W_OV of layer 0
        best = max(
            (float((OV[0][i] @ B).norm() / (OV[0][i].norm() * B.norm())), f"L0H{i}", f"L1H{j}")
            for i in range(m.cfg.n_heads)
            for j in range(m.cfg.n_heads)
            for B in [{"Q": QK[j], "K": QK[j].T, "V": OV[1][j]}[kind]]
        )
        source, target, score = getattr(values, kind)
        assert (source, target) == (best[1], best[2]) and score == pytest.approx(best[0], abs=1e-4), kind
    assert values.baseline == pytest.approx(1 / math.sqrt(m.cfg.d_model))
