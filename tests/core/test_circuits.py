"""Single-head circuits against dense float64 computations and real forward passes of tiny random models."""

from __future__ import annotations

import pytest
import torch

from circuits_core.circuits import copying, copying_spectra, embedding
from circuits_core.circuits import head_circuits as C
from circuits_core.circuits.skip_trigrams import skip_trigrams
from circuits_core.errors import InvalidInputError, NotFoundError
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import random_model

V, D, H, DH, N_CTX = 37, 16, 3, 4, 12


def make_model(n_layers=1, pos="shortformer", norm=None, attn_only=True, bias=False, seed=0):
    cfg = ModelConfig(
        n_layers=n_layers,
        d_model=D,
        n_heads=H,
        d_head=DH,
        d_vocab=V,
        n_ctx=N_CTX,
        d_mlp=None if attn_only else 32,
        attn_only=attn_only,
        act_fn=None if attn_only else "gelu",
        normalization_type=norm,
        positional_embedding_type=pos,
        use_bias=bias,
    )
    model = random_model(cfg, seed=seed, dtype=torch.float64, std_embed=1.0)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():  # non-trivial LayerNorm weights and biases, so that they are tested too
        for name, p in model.named_parameters():
            if name.endswith((".w", ".b")) or (bias and name.split(".")[-1].startswith("b_")):
                p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


def layer_norm(x, ln, eps=1e-5):
    """Independent LayerNorm: centre, divide by the RMS, then the weight and bias if present."""
    x = x - x.mean(-1, keepdim=True)
    x = x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    return x * ln.w + ln.b if hasattr(ln, "w") else x


def dense_embed(model):
    return model.W_E if model.cfg.normalization_type is None else layer_norm(model.W_E, model.blocks[0].ln1)


MODELS = {
    "shortformer": dict(),
    "shortformer_LN": dict(norm="LN", n_layers=2),
    "standard_LNPre_mlp": dict(pos="standard", norm="LNPre", attn_only=False, n_layers=2, bias=True),
}


@pytest.fixture(params=list(MODELS), scope="module")
def model(request):
    return make_model(**MODELS[request.param])


def test_qk_and_ov_circuits_are_W_QK_and_W_OV(model):
    for layer in range(model.cfg.n_layers):
        for head in range(H):
            W_Q, W_K = model.W_Q[layer, head], model.W_K[layer, head]  # [d, d_h]
            W_V, W_O = model.W_V[layer, head], model.W_O[layer, head]
            assert torch.allclose(C.qk_circuit(model, layer, head).AB, W_Q @ W_K.T)
            assert torch.allclose(C.ov_circuit(model, layer, head).AB, W_V @ W_O)


def test_full_circuits_equal_dense_products(model):
    W_E = dense_embed(model)  # [V, d]
    s = DH**0.5
    for layer in range(model.cfg.n_layers):
        for head in range(H):
            W_Q, W_K = model.W_Q[layer, head], model.W_K[layer, head]
            W_V, W_O = model.W_V[layer, head], model.W_O[layer, head]
            qk = C.full_qk_circuit(model, layer, head)
            ov = C.full_ov_circuit(model, layer, head)
            assert qk.mdim == DH and ov.mdim == DH
            assert torch.allclose(qk.AB, W_E @ W_Q @ W_K.T @ W_E.T / s)
            assert torch.allclose(ov.AB, W_E @ W_V @ W_O @ model.W_U)


def test_direct_path_is_the_logits_of_a_zero_layer_model():
    for norm in (None, "LN"):
        model = make_model(n_layers=0, norm=norm, bias=True)
        tokens = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(1))
        logits, _ = model.run(tokens)  # [1, 9, V]
        direct = C.direct_path(model)
        assert torch.allclose(direct.rows(tokens[0]) + model.b_U, logits[0])
        expected = model.W_E if norm is None else layer_norm(model.W_E, model.ln_final)
        assert torch.allclose(direct.AB, expected @ model.W_U)


def test_full_qk_plus_positional_terms_equal_real_attention_scores():
    """1-layer shortformer (LN, no biases): the score of query (token t_q, pos q) on key (t_k, pos k) is
    the W_E_pos overcomplete bilinear form, whose token-token block is the full QK circuit."""
    model = make_model(norm="LN")
    n = 10
    tokens = torch.randint(0, V, (1, n), generator=torch.Generator().manual_seed(2))
    _, cache = model.run(tokens, names={"blocks.0.attn.hook_attn_scores"})
    real = cache["blocks.0.attn.hook_attn_scores"][0]  # [H, q, k]
    X = embedding.embed_pos_basis(model)  # [V + n_ctx, d]
    t = tokens[0]
    pos = torch.arange(n) + V
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for head in range(H):
        W_Q, W_K = model.W_Q[0, head], model.W_K[0, head]
        M = X @ W_Q @ W_K.T @ X.T / DH**0.5  # [V + n_ctx, V + n_ctx], dense reference
        scores = M[t][:, t] + M[t][:, pos] + M[pos][:, t] + M[pos][:, pos]  # [q, k]
        assert torch.allclose(scores[causal], real[head][causal])
        assert torch.allclose(C.full_qk_circuit(model, 0, head).AB, M[:V, :V])


def test_full_ov_reproduces_head_logit_contributions():
    """1-layer shortformer, LN, no biases: head h's result at query i, unembedded, equals
    sum_j A[i, j] full_OV[t_j, :] (the one-layer path term, docs/maths.md §2.3)."""
    model = make_model(norm="LN")
    tokens = torch.randint(0, V, (1, 8), generator=torch.Generator().manual_seed(3))
    _, cache = model.run(tokens, names={"blocks.0.attn.hook_result", "blocks.0.attn.hook_pattern"})
    result = cache["blocks.0.attn.hook_result"][0]  # [pos, H, d]
    pattern = cache["blocks.0.attn.hook_pattern"][0]  # [H, q, k]
    for head in range(H):
        ov_rows = C.full_ov_circuit(model, 0, head).rows(tokens[0])  # [k, V]
        assert torch.allclose(pattern[head] @ ov_rows, result[:, head] @ model.W_U)


def sorted_complex(z):
    key = torch.round(z.real * 1e6) * 1e7 + z.imag
    return z[key.argsort()]


def test_copying_scores_from_small_matrices_equal_dense_spectra(model):
    ov_eig = copying_spectra.ov_eigenvalues(model)  # [L, H, d_h]
    qk_eig = copying_spectra.qk_eigenvalues(model)
    ov_scores, qk_scores = copying_spectra.ov_copying_scores(model), copying_spectra.qk_copying_scores(model)
    assert ov_eig.shape == (model.cfg.n_layers, H, DH) and ov_scores.shape == (model.cfg.n_layers, H)
    W_E = dense_embed(model)
    for layer in range(model.cfg.n_layers):
        for head in range(H):
            W_Q, W_K = model.W_Q[layer, head], model.W_K[layer, head]
            W_V, W_O = model.W_V[layer, head], model.W_O[layer, head]
            for small, score, full in [
                (ov_eig[layer, head], ov_scores[layer, head], W_E @ W_V @ W_O @ model.W_U),
                (qk_eig[layer, head], qk_scores[layer, head], W_E @ W_Q @ W_K.T @ W_E.T / DH**0.5),
            ]:
                dense_eig = torch.linalg.eigvals(full)  # [V]
                top = dense_eig[dense_eig.abs().argsort(descending=True)[:DH]]
                assert torch.allclose(sorted_complex(small), sorted_complex(top), atol=1e-8)
                # Copying score from the full V x V spectrum (zeros add nothing) == from d_h x d_h.
                assert torch.allclose(score, dense_eig.sum().real / dense_eig.abs().sum(), atol=1e-8)
                # Trace identity: sum of eigenvalues == trace == sum of the diagonal.
                assert torch.allclose(small.sum().real, torch.trace(full))
                assert abs(small.sum().imag) < 1e-9
                # The paper's convention (transposed) has the same spectrum.
                paper = torch.linalg.eigvals(full.T)
                assert torch.allclose(paper.sum().real / paper.abs().sum(), score, atol=1e-8)
            fm = C.full_ov_circuit(model, layer, head)
            assert torch.allclose(fm.diag().sum(), ov_eig[layer, head].sum().real)


def test_copying_score_extremes():
    pos = torch.tensor([[1.0 + 0j, 2.0, 0.0]], dtype=torch.complex128)
    mixed = torch.tensor([[1.0 + 0j, -1.0, 1j, -1j]], dtype=torch.complex128)
    assert torch.allclose(copying_spectra.copying_score(pos), torch.tensor([1.0], dtype=torch.float64))
    assert torch.allclose(copying_spectra.copying_score(mixed), torch.tensor([0.0], dtype=torch.float64))
    assert copying_spectra.copying_score(torch.zeros(1, 3, dtype=torch.complex128)).item() == 0.0


def test_positional_qk_equals_the_attention_of_position_only_inputs():
    model = make_model()  # shortformer, no LN, no biases: zero token embeddings leave only W_pos in q, k
    n = 9
    _, cache = model.run(
        torch.zeros(1, n, dtype=torch.long),
        names={"blocks.0.attn.hook_attn_scores", "blocks.0.attn.hook_pattern"},
        embeddings=torch.zeros(1, n, D, dtype=torch.float64),
    )
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for head in range(H):
        pq = C.positional_qk(model, 0, head, n=n)
        assert torch.allclose(pq.scores[causal], cache["blocks.0.attn.hook_attn_scores"][0, head][causal])
        pattern = cache["blocks.0.attn.hook_pattern"][0, head]
        assert torch.allclose(pq.pattern, pattern)
        assert pq.previous_token == pytest.approx(float(pattern.diagonal(-1).mean()))
        assert pq.current_token == pytest.approx(float(pattern.diagonal().mean()))
    assert C.positional_qk(model, 0, 0).scores.shape == (N_CTX, N_CTX)


def test_positional_qk_errors():
    with pytest.raises(InvalidInputError, match="rotary"):
        C.positional_qk(make_model(pos="rotary"), 0, 0)
    model = make_model()
    with pytest.raises(InvalidInputError):
        C.positional_qk(model, 0, 0, n=N_CTX + 1)
    with pytest.raises(NotFoundError, match="1 layers"):
        C.positional_qk(model, 1, 0)
    with pytest.raises(NotFoundError):
        C.full_ov_circuit(model, 0, H)


def test_skip_trigrams_equal_dense_entries(model):
    k = 5
    for layer, head, a in [(0, 0, 3), (model.cfg.n_layers - 1, H - 1, V - 1)]:
        qk = C.full_qk_circuit(model, layer, head).AB  # [V, V] rows query b, cols key a
        ov = C.full_ov_circuit(model, layer, head).AB  # [V, V] rows source a, cols out c
        st = skip_trigrams(model, layer, head, a, k=k)
        ref_dest_v, ref_dest = qk[:, a].topk(k)
        ref_out_v, ref_out = ov[a].topk(k)
        assert torch.equal(st.dest_tokens, ref_dest) and torch.equal(st.out_tokens, ref_out)
        assert torch.allclose(st.dest_scores, qk[st.dest_tokens, a])
        assert torch.allclose(st.out_scores, ov[a, st.out_tokens])
        assert torch.allclose(st.joint, qk[st.dest_tokens, a][:, None] * ov[a, st.out_tokens][None, :])
        joints = [j for _, _, j in st.triples]
        assert len(joints) == k * k and joints == sorted(joints, reverse=True)
        b, c, j = st.triples[0]
        assert j == pytest.approx(float(qk[b, a] * ov[a, c]))
        assert st.copying == (a in ref_out.tolist())
    with pytest.raises(InvalidInputError):
        skip_trigrams(model, 0, 0, V)


def test_ov_copying_metrics_equal_dense(model):
    for k in (1, 4):
        m = copying.ov_copying_metrics(model, 0, 2, k=k, budget_bytes=7 * V * 8)  # 7-row blocks
        M = C.full_ov_circuit(model, 0, 2).AB  # [V, V]
        own = torch.arange(V)
        diag = M.diagonal()
        assert m.diagonal_positive == pytest.approx(float((diag > 0).double().mean()))
        assert torch.allclose(m.diagonal_quantiles[[0, 4]], torch.stack([diag.min(), diag.max()]))
        assert m.top1 == pytest.approx(float((M.argmax(1) == own).double().mean()))
        assert m.topk == pytest.approx(float((M.topk(k, dim=1).indices == own[:, None]).any(1).double().mean()))


def test_chunked_embedding_products_equal_dense(model, monkeypatch):
    monkeypatch.setattr(C, "EMBED_CHUNK", 5)  # several chunks, the last one partial (V = 37)
    W_E = dense_embed(model)  # [V, d]
    W = torch.randn(D, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    assert torch.allclose(embedding.embed_eff(model), W_E)
    assert torch.allclose(embedding.embed_eff_matmul(model, W), W_E @ W)
    assert torch.allclose(copying_spectra.unembed_embed_gram(model), model.W_U @ W_E)
    assert torch.allclose(copying_spectra.embed_gram(model), W_E.T @ W_E)
    layer = model.cfg.n_layers - 1
    for head in range(H):
        qk, ov = C.full_qk_circuit(model, layer, head).AB, C.full_ov_circuit(model, layer, head).AB
        for token in (0, 17, V - 1):
            assert torch.allclose(C.full_ov_row(model, layer, head, token), ov[token])
            assert torch.allclose(C.full_qk_col(model, layer, head, token), qk[:, token])
    with pytest.raises(InvalidInputError):
        C.full_ov_row(model, 0, 0, -1)
