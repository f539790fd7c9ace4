"""Every view that reads keys, on a grouped-query rotary model at a query-key offset, in float32 and float64, against
dense matrices built here: keys from the stored key heads with query head h reading group h // group_size (by hand,
not through the model's per-head expansion), rotations from rotating the identity at two absolute positions.

A key reader is W_K R(δ)^T W_Q^T (the transpose of the query reader W_Q R(δ) W_K^T); a flipped rotation, or the
query heads mapped to the wrong key group, changes every one of these numbers by far more than the tolerances.

The views: the all-pairs table and the pair page at an offset, reader spectra, K-composition at an offset and its
profiles over offsets (the composition page's curves and one pair's, two more code paths), the token QK
table at offset 0 and at an offset, QK copying at an offset, the QK circuit norms, the positional kernel, and the
"cosine" token tables of a QK-norm model and the direct-path scores of a model with attention sinks (the sink
threshold's view), both checked against the model's own attention scores."""

from __future__ import annotations

import copy

import pytest
import torch

from circuits_core.circuits import residual_stream as rs
from circuits_core.circuits import rotary, sinks
from circuits_core.circuits import stream_components as sc
from circuits_core.circuits import virtual_weight_table as vwt
from circuits_core.circuits import virtual_weights as vw
from circuits_core.circuits.composition_rotary import composition_at, composition_profiles, pair_profile
from circuits_core.circuits.copying_spectra import copying_score
from circuits_core.circuits.head_circuits import full_qk_circuit
from circuits_core.circuits.qk_circuit_norm import qk_circuit_norms
from tests.core.rotary_models import CASES, rotary_model

OFFSET = 3
TOL = {torch.float64: 1e-9, torch.float32: 2e-4}  # relative


@pytest.fixture(scope="module", params=[torch.float64, torch.float32], ids=["float64", "float32"])
def models(request):
    """(model in the dtype under test, float64 copy of exactly its values)."""
    base = rotary_model(n_layers=3, n_key_value_heads=2, seed=4)  # 4 query heads, 2 key/value groups
    model = base if request.param == torch.float64 else copy.deepcopy(base).float()
    return model, copy.deepcopy(model).double()


def _key_group(ref, layer, name):
    """[H, d, dh]: query head h gets stored key/value head h // group_size."""
    attn, cfg = ref.blocks[layer].attn, ref.cfg
    stored = getattr(attn, f"_{name}")  # [n_kv, d, dh]
    return torch.stack([stored[h // (cfg.n_heads // cfg.n_key_value_heads)] for h in range(cfg.n_heads)])


def _rotation(ref, offset):
    """R(δ) with rotate(q, p + δ) . rotate(k, p) = q R(δ) k^T, from the identity rotated at p + δ and p."""
    eye = torch.eye(ref.cfg.d_head, dtype=torch.float64)
    p = 7
    return ref.rotate(eye, torch.tensor(p + offset)) @ ref.rotate(eye, torch.tensor(p)).T


def _readers(ref, layer, offset):
    """{role: [H, d, d]} dense Q and K readers of a layer at `offset`."""
    W_Q, W_K = ref.blocks[layer].attn.W_Q, _key_group(ref, layer, "W_K")
    R = _rotation(ref, offset)
    return {"Q": W_Q @ R @ W_K.transpose(-2, -1), "K": W_K @ R.T @ W_Q.transpose(-2, -1)}


def _ov(ref, layer):
    return _key_group(ref, layer, "W_V") @ ref.blocks[layer].attn.W_O  # [H, d, d]


def _score(W, R):
    return float((W @ R).norm() / (W.norm() * R.norm()))


def test_all_pairs_table_key_and_query_readers_at_an_offset(models):
    model, ref = models
    table = vwt.all_scores(model, offset=OFFSET)
    writers = {w.name: w for w in table.writers}
    checked = 0
    for j, r in enumerate(table.readers):
        if r.role not in ("Q", "K"):
            continue
        R = _readers(ref, r.layer, OFFSET)[r.role][r.head]
        for i, w in enumerate(table.writers):
            if not table.mask[i, j] or writers[w.name].kind != "head":
                continue
            expected = _score(_ov(ref, w.layer)[w.head], R)
            assert float(table.raw[i, j]) == pytest.approx(expected, rel=TOL[model.dtype]), (w.name, r.name)
            checked += 1
    assert checked >= 2 * 4 * 4 * 3  # every head writer into every later Q and K reader


def test_pair_page_key_reader_at_an_offset(models):
    model, ref = models
    for writer, reader in (("L0H1", "L2H3.K"), ("L1H2", "L2H1.K"), ("L0H3", "L1H0.Q")):
        w, r = sc.parse_writer(model, writer), sc.parse_reader(model, reader)
        rep = vw.pair_report(model, w, r, k=2, offset=OFFSET)
        dense = _ov(ref, w.layer)[w.head] @ _readers(ref, r.layer, OFFSET)[r.role][r.head]
        S = torch.linalg.svdvals(dense)[: model.cfg.d_head]
        torch.testing.assert_close(
            torch.tensor(rep.singular_values[: model.cfg.d_head], dtype=torch.float64),
            S,
            rtol=0,
            atol=TOL[model.dtype] * float(S[0]),
        )
        expected = _score(_ov(ref, w.layer)[w.head], _readers(ref, r.layer, OFFSET)[r.role][r.head])
        assert rep.score == pytest.approx(expected, rel=TOL[model.dtype])


def test_reader_spectra_of_keys_at_an_offset(models):
    model, ref = models
    _, readers = rs.spectra(model, offset=OFFSET)
    for layer in range(model.cfg.n_layers):
        dense = _readers(ref, layer, OFFSET)
        for h in range(model.cfg.n_heads):
            for role in ("Q", "K"):
                # the stream side a reader reads: left singular vectors of W_r; compare the projectors
                U, S, _ = torch.linalg.svd(dense[role][h])
                spec = readers[f"L{layer}H{h}.{role}"]
                k = model.cfg.d_head
                torch.testing.assert_close(spec.S.double()[:k], S[:k], rtol=0, atol=TOL[model.dtype] * float(S[0]))
                top = spec.basis[:, :2].double()  # the two leading directions (distinct values on a random model)
                torch.testing.assert_close(top @ top.T, U[:, :2] @ U[:, :2].T, rtol=0, atol=50 * TOL[model.dtype])


def test_key_composition_at_an_offset(models):
    model, ref = models
    got = composition_at(model, "k", OFFSET)  # [L, H, L, H]
    H = model.cfg.n_heads
    for l1 in range(model.cfg.n_layers):
        for l2 in range(l1 + 1, model.cfg.n_layers):
            for h1 in range(H):
                for h2 in range(H):
                    expected = _score(_ov(ref, l1)[h1], _readers(ref, l2, OFFSET)["K"][h2])
                    assert float(got[l1, h1, l2, h2]) == pytest.approx(expected, rel=TOL[model.dtype])


def test_query_and_key_composition_profiles_over_offsets(models):
    model, ref = models
    offsets = [0, OFFSET, 7]
    prof = composition_profiles(model, offsets, n_samples=4)  # [L, H, L, H, n] each
    H = model.cfg.n_heads
    for l1 in range(model.cfg.n_layers):
        for l2 in range(l1 + 1, model.cfg.n_layers):
            for n, delta in enumerate(offsets):
                readers = _readers(ref, l2, delta)
                for h1 in range(H):
                    for h2 in range(H):
                        for role, got in (("Q", prof.q), ("K", prof.k)):
                            expected = _score(_ov(ref, l1)[h1], readers[role][h2])
                            assert float(got[l1, h1, l2, h2, n]) == pytest.approx(expected, rel=TOL[model.dtype])
                            one = pair_profile(model, f"L{l1}H{h1}", f"L{l2}H{h2}", role.lower(), offsets)  # pair page
                            assert float(one[n]) == pytest.approx(expected, rel=TOL[model.dtype])


def test_full_qk_circuit_reads_its_own_key_group(models):
    model, ref = models
    tokens = torch.arange(12)
    W_E = ref.embed.W_E[tokens]
    x = W_E / (W_E.pow(2).mean(-1, keepdim=True) + ref.cfg.eps).sqrt() * ref.blocks[0].ln1.w  # W_E_eff: RMS by hand
    for h in range(model.cfg.n_heads):
        dense = x @ ref.blocks[0].attn.W_Q[h] @ _key_group(ref, 0, "W_K")[h].T @ x.T / ref.cfg.scale
        got = full_qk_circuit(model, 0, h, tokens).AB.double()
        torch.testing.assert_close(got, dense, rtol=0, atol=TOL[model.dtype] * float(dense.abs().max()))


def test_positional_kernel_reads_its_own_key_group(models):
    model, ref = models
    mu = torch.randn(
        model.cfg.n_layers, model.cfg.d_model, generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )
    offsets = torch.tensor([0, 5, 2, 9])
    kernel = rotary.positional_kernel(model, mu, offsets)
    for layer in range(model.cfg.n_layers):
        for n, delta in enumerate(offsets.tolist()):
            dense = mu[layer] @ _readers(ref, layer, delta)["Q"] @ mu[layer] / ref.cfg.scale  # [H]
            torch.testing.assert_close(kernel[layer, :, n].double(), dense, rtol=TOL[model.dtype], atol=1e-7)


def _embedding(ref):
    """[V, d] W_E_eff: W_E through layer 0's RMS norm, by hand (the token tables' embedding at every layer)."""
    W_E = ref.embed.W_E
    return W_E / (W_E.pow(2).mean(-1, keepdim=True) + ref.cfg.eps).sqrt() * ref.blocks[0].ln1.w


def test_token_qk_tables_at_an_offset_read_their_own_key_group(models):
    model, ref = models
    for layer in range(model.cfg.n_layers):
        x = _embedding(ref)
        for h in range(model.cfg.n_heads):
            dense = x @ _readers(ref, layer, OFFSET)["Q"][h] @ x.T / ref.cfg.scale  # [V, V]
            got = rotary.full_qk_circuit_at(model, layer, h, OFFSET).AB.double()
            atol = TOL[model.dtype] * float(dense.abs().max())
            torch.testing.assert_close(got, dense, rtol=0, atol=atol)
            row = rotary.full_qk_row_at(model, layer, h, 7, OFFSET)  # one query token's row
            col = rotary.full_qk_col_at(model, layer, h, 5, OFFSET)  # one key token's column
            torch.testing.assert_close(row.double(), dense[7], rtol=0, atol=atol)
            torch.testing.assert_close(col.double(), dense[:, 5], rtol=0, atol=atol)


def test_qk_copying_at_an_offset_reads_its_own_key_group(models):
    model, ref = models
    got = rotary.qk_copying_scores_at(model, OFFSET)  # [L, H]
    for layer in range(model.cfg.n_layers):
        x = _embedding(ref)
        for h in range(model.cfg.n_heads):
            dense = x @ _readers(ref, layer, OFFSET)["Q"][h] @ x.T / ref.cfg.scale
            expected = float(copying_score(torch.linalg.eigvals(dense)))
            assert float(got[layer, h]) == pytest.approx(expected, rel=50 * TOL[model.dtype], abs=1e-6)


def test_qk_circuit_norms_read_their_own_key_group(models):
    model, ref = models
    got = qk_circuit_norms(model)  # [L, H]
    for layer in range(model.cfg.n_layers):
        W_Q, W_K = ref.blocks[layer].attn.W_Q, _key_group(ref, layer, "W_K")
        expected = (W_Q @ W_K.transpose(-2, -1)).flatten(1).norm(dim=-1)  # [H]
        torch.testing.assert_close(got[layer].double(), expected, rtol=TOL[model.dtype], atol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_cosine_token_tables_scale_keys_by_their_own_group(dtype):
    """A QK-norm model with two key/value groups (Qwen3's per-head norm): every head's token table at an offset is
    the score the model's own forward pass gives (its key scale 1 / rho_k is the key group's)."""
    model = rotary_model(n_layers=1, seed=2, **CASES["qwen3"]).to(dtype)
    delta, (a, b) = 2, (7, 11)  # key token a at position 0, query token b at position delta
    tokens = torch.full((1, delta + 1), a)
    tokens[0, delta] = b
    _, cache = model.run(tokens, names={"blocks.0.attn.hook_attn_scores"})
    real = cache["blocks.0.attn.hook_attn_scores"][0, :, delta, 0]  # [H]
    for h in range(model.cfg.n_heads):
        table = rotary.full_qk_circuit_at(model, 0, h, delta).AB  # [V, V]
        assert float(table[b, a]) == pytest.approx(float(real[h]), rel=TOL[dtype], abs=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_sink_heads_direct_scores_read_their_own_key_group(dtype):
    """Learned sinks (gpt-oss) with two key/value groups: every head's direct-path score of a query token on a key
    token at an offset (the sink threshold's s) is the layer-0 score the model's own forward pass gives."""
    model = rotary_model(n_layers=1, seed=3, n_key_value_heads=2, attn_sinks=True).to(dtype)
    delta, (a, b) = 3, (5, 9)  # key token a at position 0, query token b at position delta
    tokens = torch.full((1, delta + 1), a)
    tokens[0, delta] = b
    _, cache = model.run(tokens, names={"blocks.0.attn.hook_attn_scores"})
    real = cache["blocks.0.attn.hook_attn_scores"][0, :, delta, 0]  # [H]
    for h in range(model.cfg.n_heads):
        got = sinks.direct_scores(model, 0, h, torch.tensor([b]), torch.tensor([a]), delta)[0]
        assert float(got) == pytest.approx(float(real[h]), rel=TOL[dtype], abs=TOL[dtype])
