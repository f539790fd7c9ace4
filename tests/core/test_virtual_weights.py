"""Virtual weights (float64): factored products and all-pairs Gram scores vs dense matrices built here from the
parameters, head -> head scores vs composition.py, the random baseline vs sampled random matrices."""

import copy
import math

import pytest
import torch

from circuits_core.circuits import stream_chains
from circuits_core.circuits import stream_components as sc
from circuits_core.circuits import virtual_weight_table as vwt
from circuits_core.circuits import virtual_weights as vw
from circuits_core.circuits.composition import BASELINE_SAMPLES, composition_scores
from circuits_core.errors import CancelledError, InvalidInputError, NotFoundError
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import random_model
from tests.core.rotary_models import rotary_model

CONFIGS = {
    "attn-only-shortformer": dict(n_layers=3, attn_only=True, positional_embedding_type="shortformer"),
    "ln-standard-mlp-bias": dict(
        n_layers=2,
        attn_only=False,
        d_mlp=24,
        act_fn="gelu",
        normalization_type="LN",
        positional_embedding_type="standard",
        use_bias=True,
    ),
    "parallel-lnpre-none": dict(
        n_layers=2,
        attn_only=False,
        d_mlp=20,
        act_fn="relu",
        normalization_type="LNPre",
        positional_embedding_type="none",
        parallel_attn_mlp=True,
    ),
    "zero-layer": dict(n_layers=0, positional_embedding_type="standard"),
    "moe-sinks-rms": dict(
        n_layers=2,
        attn_only=False,
        d_mlp=12,
        act_fn="silu",
        gated_mlp=True,
        normalization_type="RMS",
        positional_embedding_type="none",
        use_bias=True,
        attn_sinks=True,
        num_experts=3,
        experts_per_token=2,
    ),
}


def _model(name, seed=0):
    if name == "llama-gqa":
        return rotary_model(seed=seed, n_key_value_heads=2)
    fields = dict(d_model=16, n_heads=2, d_head=4, d_vocab=30, n_ctx=10)
    fields.update(CONFIGS[name])
    return random_model(ModelConfig(**fields), seed=seed, dtype=torch.float64, std_embed=0.5)


ALL = [*CONFIGS, "llama-gqa"]


# -- dense references, written from the parameters without the engine's chains -----------------------
def _norm_rows(model, X):
    """Layer 0's first norm applied to each row of X, by hand."""
    kind = model.cfg.normalization_type
    if model.cfg.n_layers == 0 or kind is None:
        return X
    ln = model.blocks[0].ln1
    if kind in ("RMS", "RMSPre"):
        out = X / (X.pow(2).mean(-1, keepdim=True) + model.cfg.eps).sqrt()
    else:
        Xc = X - X.mean(-1, keepdim=True)
        out = Xc / (Xc.pow(2).mean(-1, keepdim=True) + model.cfg.eps).sqrt()
    return out * ln.w + (ln.b if kind == "LN" else 0) if kind in ("LN", "RMS") else out


def _kv(model, layer, name):
    """Per-query-head K or V weights [H, d, dh], expanding grouped-query weights by hand."""
    attn = model.blocks[layer].attn
    W = getattr(attn, f"_{name}") if model.cfg.n_key_value_heads else getattr(attn, name)
    return W.repeat_interleave(model.cfg.n_heads // W.shape[0], dim=0)


def dense_writer(model, w):
    if w.kind == "embed":
        return _norm_rows(model, model.embed.W_E)
    if w.kind == "pos":
        return model.pos_embed.W_pos
    if w.kind == "head":
        attn = model.blocks[w.layer].attn
        return _kv(model, w.layer, "W_V")[w.head] @ attn.W_O[w.head]
    W_out = model.blocks[w.layer].mlp.W_out
    W_out = W_out[w.expert] if w.expert >= 0 else W_out  # an expert's [d_mlp, d] of [n_experts, d_mlp, d]
    return W_out if w.neurons is None else W_out[list(w.neurons)]


def dense_reader(model, r, offset=0):
    if r.role == "unembed":
        return model.unembed.W_U
    if r.role == "router":
        return model.blocks[r.layer].mlp.W_router
    if r.role in ("in", "up", "gate"):
        W = model.blocks[r.layer].mlp.W_gate if r.role == "gate" else model.blocks[r.layer].mlp.W_in
        W = W[r.expert] if r.expert >= 0 else W
        return W if r.neurons is None else W[:, list(r.neurons)]
    attn = model.blocks[r.layer].attn
    W_Q, W_K = attn.W_Q[r.head], _kv(model, r.layer, "W_K")[r.head]
    R = torch.eye(model.cfg.d_head, dtype=torch.float64)
    if offset:
        R = model.rotate(torch.eye(model.cfg.d_head, dtype=torch.float64), torch.tensor(offset))
    if r.role == "Q":
        return W_Q @ R @ W_K.T
    if r.role == "K":
        return W_K @ R.T @ W_Q.T
    return _kv(model, r.layer, "W_V")[r.head] @ attn.W_O[r.head]


def _dense_score(W, R):
    return float((W @ R).norm() / (W.norm() * R.norm()))


# -- tests ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block", [None, 8], ids=["default-block", "block-8"])  # (8: several column blocks)
@pytest.mark.parametrize("name", ALL)
def test_every_virtual_weight_and_score_equals_the_dense_product(name, block):
    model = _model(name)
    scores = vwt.all_scores(model, block=block)
    assert [w.name for w in scores.writers] == [w.name for w in sc.writers(model)]
    checked = 0
    for i, w in enumerate(scores.writers):
        for j, r in enumerate(scores.readers):
            if not scores.mask[i, j]:
                assert scores.raw[i, j] == 0 and scores.minus_baseline[i, j] == 0
                with pytest.raises(InvalidInputError):
                    vw.virtual_weight(model, w, r)
                continue
            W, R = dense_writer(model, w), dense_reader(model, r)
            fm = vw.virtual_weight(model, w, r)
            torch.testing.assert_close(fm.AB, W @ R, rtol=1e-10, atol=1e-12)
            low_rank = w.kind == "head" or r.role in ("Q", "K", "V")  # through d_head, else d_model
            assert fm.mdim == (model.cfg.d_head if low_rank else model.cfg.d_model)
            assert scores.raw[i, j].item() == pytest.approx(_dense_score(W, R), rel=1e-9, abs=1e-12)
            checked += 1
    assert checked > 0


def test_experts_are_writers_and_readers_and_the_router_a_reader():
    model = _model("moe-sinks-rms")
    names_w, names_r = [w.name for w in sc.writers(model)], [r.name for r in sc.readers(model)]
    assert [n for n in names_w if n.startswith("L0.mlp")] == ["L0.mlp.e0", "L0.mlp.e1", "L0.mlp.e2"]
    assert "L1.mlp.e2.gate" in names_r and "L1.mlp.e0.up" in names_r and "L1.mlp.router" in names_r
    assert sc.parse_reader(model, "L1.mlp.router") == sc.Reader("router", 1)
    assert sc.parse_writer(model, "L0.mlp.e1[2,5]") == sc.Writer("mlp", 0, neurons=(2, 5), expert=1)
    for bad_writer in ("L0.mlp", "L0.mlp.e3"):  # a mixture of experts: name an expert that exists
        with pytest.raises(NotFoundError):
            sc.parse_writer(model, bad_writer)
    for bad_reader in ("L1.mlp.gate", "L1.mlp.e3.up", "L1.mlp.e0.router"):
        with pytest.raises(NotFoundError):
            sc.parse_reader(model, bad_reader)
    with pytest.raises(NotFoundError, match="dense"):
        sc.parse_reader(_model("ln-standard-mlp-bias"), "L1.mlp.router")
    rep = vw.pair_report(model, sc.Writer("embed"), sc.Reader("router", 1), k=1, n_top=2)
    assert rep.output_space == "experts"


def test_who_reads_whom():
    m = _model("attn-only-shortformer")
    names = {(w.name, r.name) for w in sc.writers(m) for r in sc.readers(m) if sc.reaches(m, w, r)}
    assert ("pos", "L0H0.Q") in names and ("pos", "L2H1.K") in names  # added at every layer's Q/K input
    assert ("pos", "L1H0.V") not in names and ("pos", "unembed") not in names  # never in the stream
    assert ("L0H1", "L0H0.Q") not in names and ("L0H1", "L1H0.Q") in names
    p = _model("parallel-lnpre-none")
    pn = {(w.name, r.name) for w in sc.writers(p) for r in sc.readers(p) if sc.reaches(p, w, r)}
    assert ("L0H0", "L0.mlp.in") not in pn and ("L0.mlp", "L1H0.V") in pn  # parallel block: MLP reads resid_pre
    s = _model("ln-standard-mlp-bias")
    sn = {(w.name, r.name) for w in sc.writers(s) for r in sc.readers(s) if sc.reaches(s, w, r)}
    assert ("L0H0", "L0.mlp.in") in sn and ("pos", "L1.mlp.in") in sn and ("L1.mlp", "unembed") in sn
    assert [w.name for w in sc.writers(p)][:2] == ["embed", "L0H0"]  # no learned positions, no pos writer


def test_gated_mlp_has_gate_and_up_inputs():
    m = _model("llama-gqa")
    names = [r.name for r in sc.readers(m)]
    assert "L0.mlp.gate" in names and "L0.mlp.up" in names and "L0.mlp.in" not in names
    with pytest.raises(NotFoundError):
        sc.parse_reader(m, "L0.mlp.in")


@pytest.mark.parametrize("offset", [3, 7])
def test_rotary_query_reader_at_an_offset_gives_the_attention_score(offset):
    """x_i W_QK(i - j) x_j^T equals the model's rotated q_i . k_j (hook_q / hook_k of a real run)."""
    m = _model("llama-gqa")
    tokens = torch.randint(0, m.cfg.d_vocab, (1, 9), generator=torch.Generator().manual_seed(3))
    _, cache = m.run(tokens, names={"blocks.1.attn.hook_q", "blocks.1.attn.hook_k", "blocks.1.ln1.hook_normalized"})
    x = cache["blocks.1.ln1.hook_normalized"][0]  # [n, d]: the query/key input, RMS gain applied
    i, j, h = 8, 8 - offset, 3
    fm = vw.virtual_weight(m, sc.Writer("head", 0, 1), sc.Reader("Q", 1, h), offset=offset)
    W_QK = vw.factored(m, stream_chains.reader_chain(m, sc.Reader("Q", 1, h), offset)).AB
    score = cache["blocks.1.attn.hook_q"][0, i, h] @ cache["blocks.1.attn.hook_k"][0, j, h]
    assert float(x[i] @ W_QK @ x[j]) == pytest.approx(float(score), rel=1e-9)
    assert not torch.allclose(fm.AB, vw.virtual_weight(m, sc.Writer("head", 0, 1), sc.Reader("Q", 1, h)).AB)
    dense = dense_writer(m, sc.Writer("head", 0, 1)) @ dense_reader(m, sc.Reader("Q", 1, h), offset)
    torch.testing.assert_close(fm.AB, dense, rtol=1e-10, atol=1e-12)
    with pytest.raises(InvalidInputError):
        vw.virtual_weight(_model("attn-only-shortformer"), sc.Writer("embed"), sc.Reader("Q", 0, 0), offset=2)


def test_head_to_head_scores_are_the_composition_scores():
    model = _model("attn-only-shortformer")
    scores = vwt.all_scores(model)
    comp = composition_scores(model, n_samples=8)
    H = model.cfg.n_heads
    wi = {w.name: i for i, w in enumerate(scores.writers)}
    ri = {r.name: j for j, r in enumerate(scores.readers)}
    for kind in "qkv":
        for l1 in range(model.cfg.n_layers):
            for l2 in range(l1 + 1, model.cfg.n_layers):
                for h1 in range(H):
                    for h2 in range(H):
                        got = scores.raw[wi[f"L{l1}H{h1}"], ri[f"L{l2}H{h2}.{kind.upper()}"]]
                        assert got.item() == pytest.approx(comp.raw[kind][l1, h1, l2, h2].item(), rel=1e-10)
    assert scores.baseline == comp.baseline
    # the sampled baseline against dense products of ARENA-style uniform factors drawn here (W_A = A_l A_r^T, ...)
    d, dh, n = model.cfg.d_model, model.cfg.d_head, 600
    gen = torch.Generator().manual_seed(12)
    f = torch.rand(4, n, d, dh, generator=gen, dtype=torch.float64) - 0.5
    W_A, W_B = f[0] @ f[1].transpose(-2, -1), f[2] @ f[3].transpose(-2, -1)  # [n, d, d]
    s = (W_A @ W_B).flatten(1).norm(dim=1) / (W_A.flatten(1).norm(dim=1) * W_B.flatten(1).norm(dim=1))
    se = (s.var() / n + scores.sampled_std**2 / BASELINE_SAMPLES) ** 0.5
    assert abs(scores.sampled_baseline - s.mean().item()) < 4 * se
    assert scores.sampled_std == pytest.approx(s.std().item(), rel=0.3)  # 64 samples


@pytest.mark.parametrize("shapes", [(30, 4), (30, 16), (4, 64)])
def test_the_baseline_matches_sampled_random_matrices_of_the_pair_shapes(shapes):
    """E score ~ 1/sqrt(d_model) for a random writer [n_in, d] and reader [d, n_out] of any ranks."""
    n_in, n_out = shapes
    d, n = 16, 400
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(n, n_in, d, generator=gen, dtype=torch.float64)
    R = torch.randn(n, d, n_out, generator=gen, dtype=torch.float64)
    s = (W @ R).flatten(1).norm(dim=1) / (W.flatten(1).norm(dim=1) * R.flatten(1).norm(dim=1))
    model = _model("ln-standard-mlp-bias")
    baseline = vw.analytic_baseline(model)
    assert baseline == 1 / math.sqrt(d)
    # E[score^2] = 1/d exactly; the mean of the square root sits just below, within a few standard errors
    assert s.pow(2).mean().item() == pytest.approx(1 / d, abs=4 * s.pow(2).std().item() / math.sqrt(n))
    assert abs(s.mean().item() - baseline) < 0.08 * baseline


def test_factored_svd_matches_the_dense_svd():
    model = _model("ln-standard-mlp-bias")
    for w, r in [("embed", "unembed"), ("embed", "L1H0.Q"), ("L0.mlp", "unembed"), ("L0H1", "L1.mlp.in")]:
        W, R = sc.parse_writer(model, w), sc.parse_reader(model, r)
        fm = vw.virtual_weight(model, W, R)
        dense = dense_writer(model, W) @ dense_reader(model, R)
        svd = vw.factored_svd(fm, k=3)
        S = torch.linalg.svdvals(dense)
        torch.testing.assert_close(svd.S[: S.shape[0]], S[: svd.S.shape[0]], rtol=1e-9, atol=1e-10)
        for i in range(3):
            torch.testing.assert_close(dense @ svd.V[:, i], S[i] * svd.U[:, i], rtol=1e-8, atol=1e-10)
            torch.testing.assert_close(svd.U[:, i].norm(), torch.tensor(1.0, dtype=torch.float64))


def test_pair_report_tokens_are_the_extremes_of_the_dense_singular_vectors():
    model = _model("ln-standard-mlp-bias")
    rep = vw.pair_report(model, sc.Writer("embed"), sc.Reader("unembed"), k=2, n_top=4)
    dense = dense_writer(model, sc.Writer("embed")) @ model.unembed.W_U
    U, S, Vh = torch.linalg.svd(dense)
    assert rep.input_space == rep.output_space == "tokens"
    assert rep.score == pytest.approx(
        _dense_score(dense_writer(model, sc.Writer("embed")), model.unembed.W_U), rel=1e-9
    )
    for i, d in enumerate(rep.directions):
        sign = 1.0 if U[d.input_top[0][0], i] > 0 else -1.0  # the pair (u, v) is defined up to one sign
        assert [t for t, _ in d.input_top] == (sign * U[:, i]).topk(4).indices.tolist()
        assert [t for t, _ in d.output_bottom] == (-sign * Vh[i]).topk(4).indices.tolist()
    mid = vw.pair_report(model, sc.Writer("head", 0, 0), sc.Reader("Q", 1, 1))
    assert mid.input_space == "d_model" and mid.directions[0].input_top is None


def test_neuron_readouts():
    model = _model("ln-standard-mlp-bias")
    mlp = model.blocks[1].mlp
    logits = vw.virtual_weight(model, sc.Writer("mlp", 1, neurons=(5,)), sc.Reader("unembed")).rows([0])[0]
    torch.testing.assert_close(logits, mlp.W_out[5] @ model.unembed.W_U)
    reads = vw.virtual_weight(model, sc.Writer("embed"), sc.Reader("in", 1, neurons=(7,))).cols([0])[0]
    torch.testing.assert_close(reads, _norm_rows(model, model.embed.W_E) @ mlp.W_in[:, 7])
    sel = vw.pair_report(model, sc.parse_writer(model, "L0.mlp[3,9,11]"), sc.Reader("unembed"), k=1, n_top=3)
    assert sel.input_space == "neurons" and {n for n, _ in sel.directions[0].input_top} <= {3, 9, 11}
    g = _model("llama-gqa")
    torch.testing.assert_close(
        vw.virtual_weight(g, sc.Writer("embed"), sc.Reader("gate", 0, neurons=(2,))).cols([0])[0],
        _norm_rows(g, g.embed.W_E) @ g.blocks[0].mlp.W_gate[:, 2],
    )


@pytest.mark.parametrize("bad", ["L9H0", "L0H7", "L0.mlp[99]", "L0.mlp[1,1]"])
def test_components_out_of_range_are_not_found(bad):
    with pytest.raises(NotFoundError):
        sc.parse_writer(_model("ln-standard-mlp-bias"), bad)


@pytest.mark.parametrize("bad", ["", "mlp", "L0H0.X", "L0.mlp.out", "embed ", "L0H0.Q;", None])
def test_malformed_reader_names_are_invalid(bad):
    with pytest.raises(InvalidInputError):
        sc.parse_reader(_model("ln-standard-mlp-bias"), bad if bad != "embed " else "embed")


def test_attention_only_and_position_free_refusals():
    with pytest.raises(NotFoundError):
        sc.parse_writer(_model("attn-only-shortformer"), "L0.mlp")
    with pytest.raises(NotFoundError):
        sc.parse_writer(_model("parallel-lnpre-none"), "pos")


def test_all_scores_can_be_cancelled():
    with pytest.raises(CancelledError):
        vwt.all_scores(_model("ln-standard-mlp-bias"), should_stop=lambda: True)


def test_cost_counts_the_factor_copies():
    small, big = _model("attn-only-shortformer"), _model("ln-standard-mlp-bias")
    assert 0 < vwt.all_scores_cost(small).peak_bytes
    assert vwt.all_scores_cost(big).answer_bytes > 0


def _graded_float32_model():
    """A float32 model (d_model 64) whose W_U and layer-0 MLP output have singular values spread over three decades:
    the small ones are genuine (exact float32 matrices), well above float32 rounding of the products."""
    fields = dict(CONFIGS["ln-standard-mlp-bias"], d_model=64, d_head=8, n_heads=4, d_vocab=200, d_mlp=96)
    model = random_model(ModelConfig(**{**dict(n_ctx=10), **fields}), seed=1, dtype=torch.float32, std_embed=0.5)
    gen = torch.Generator().manual_seed(2)
    s = torch.logspace(0, -3, 64, dtype=torch.float64)
    with torch.no_grad():
        for W in (model.unembed.W_U, model.blocks[0].mlp.W_out):
            P = torch.linalg.qr(torch.randn(W.shape[0], 64, generator=gen, dtype=torch.float64))[0]
            Q = torch.linalg.qr(torch.randn(W.shape[1], 64, generator=gen, dtype=torch.float64))[0]
            W.copy_(((P * s) @ Q.T).float())
    return model


@pytest.mark.parametrize("pair", [("embed", "unembed"), ("L0.mlp", "unembed"), ("L0.mlp", "L1.mlp.in")])
def test_pair_singular_values_in_float32_are_every_dense_float64_one(pair):
    """On float32 weights every singular value of the pair (not only the top few) matches a dense float64 SVD of the
    same float32 matrices, and the pair score matches the all-pairs table: a cut at r sqrt(eps_32) s_max zeroed
    every value below 2 % of the largest."""
    model = _graded_float32_model()
    W, R = sc.parse_writer(model, pair[0]), sc.parse_reader(model, pair[1])
    rep = vw.pair_report(model, W, R, k=3)
    m64 = copy.deepcopy(model).double()  # the same float32 values, exactly, in float64
    writer, reader = dense_writer(m64, W), dense_reader(m64, R)
    dense = writer @ reader
    S = torch.linalg.svdvals(dense)
    got = torch.tensor(rep.singular_values, dtype=torch.float64)
    n = min(S.shape[0], got.shape[0])
    assert int(((S[:n] < 0.02 * S[0]) & (S[:n] > 1e-4 * S[0])).sum()) >= 10  # genuine values the old cut zeroed
    torch.testing.assert_close(got[:n], S[:n], rtol=0, atol=1e-5 * float(S[0]))
    assert rep.score == pytest.approx(_dense_score(writer, reader), rel=1e-5)
    table = vwt.all_scores(model)
    i = [w.name for w in table.writers].index(W.name)
    j = [r.name for r in table.readers].index(R.name)
    assert rep.score == pytest.approx(float(table.raw[i, j]), rel=1e-4)


@pytest.mark.parametrize("role, through", [("V", "W_U"), ("K", "W_E"), ("Q", "W_E")])
def test_head_to_head_directions_read_in_tokens(role, through):
    """A head -> head virtual weight lives in d_model on both sides; its singular directions are read in tokens:
    the writer's input side through W_E, a V reader's output through W_U, a Q/K reader's other side through W_E
    (dense SVD and dense products here; one common sign per direction)."""
    model = _model("attn-only-shortformer")
    writer, reader = sc.Writer("head", 0, 1), sc.Reader(role, 2, 0)
    rep = vw.pair_report(model, writer, reader, k=3, n_top=5)
    assert rep.input_read == "W_E" and rep.output_read == through
    U, S, Vh = torch.linalg.svd(dense_writer(model, writer) @ dense_reader(model, reader))
    W_E, W_U = model.embed.W_E, model.unembed.W_U
    for i, d in enumerate(rep.directions):
        assert d.input_top is None and d.output_top is None  # d_model sides: no entries of their own
        ins = W_E @ U[:, i]  # [d_vocab]
        outs = Vh[i] @ W_U if through == "W_U" else W_E @ Vh[i]
        first, value = d.input_tokens_top[0]
        sign = 1.0 if float(ins[first]) * value > 0 else -1.0
        assert [t for t, _ in d.input_tokens_top] == (sign * ins).topk(5).indices.tolist()
        assert [t for t, _ in d.input_tokens_bottom] == (-sign * ins).topk(5).indices.tolist()
        assert [t for t, _ in d.output_tokens_top] == (sign * outs).topk(5).indices.tolist()
        assert [v for _, v in d.output_tokens_top] == pytest.approx((sign * outs).topk(5).values.tolist(), rel=1e-6)
    mixed = vw.pair_report(model, sc.Writer("embed"), sc.Reader("V", 1, 0))  # a token side needs no reading
    assert mixed.input_read is None and mixed.output_read == "W_U"


def test_a_pair_read_by_a_large_float32_unembedding_is_scored_from_float64_norms():
    """||W_U||_F summed in float32 over 65,536 x 64 entries is about 1e-4 off (0.17 % over SmolLM2's 49,152 x 576),
    so a pair read by the unembedding is scored against the float64 Gram identity to 1e-5, on float32 weights."""
    fields = dict(CONFIGS["ln-standard-mlp-bias"], d_model=64, d_head=8, n_heads=4, d_vocab=65_536, d_mlp=96)
    model = random_model(ModelConfig(**{**dict(n_ctx=10), **fields}), seed=3, dtype=torch.float32)
    rep = vw.pair_report(model, sc.parse_writer(model, "L0.mlp"), sc.parse_reader(model, "unembed"), k=1)
    W, R = model.blocks[0].mlp.W_out.double(), model.W_U.double()  # the same float32 values, exactly
    G, H = W.T @ W, R @ R.T  # [d, d] each
    expected = float((G * H).sum().sqrt() / (G.trace().sqrt() * H.trace().sqrt()))
    assert rep.score == pytest.approx(expected, rel=1e-5)
