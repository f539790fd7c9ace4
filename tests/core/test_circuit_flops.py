"""The FLOP prices of the token-circuit tables are what torch counts.

Each engine FLOP function (head_circuits.circuit_flops and the functions it adds up, global_topk.topk_global_flops)
is compared with torch.utils.flop_counter.FlopCounterMode run over the very call it prices, on small float64 models
of every layout the tables meet: learned positions with and without a biased LayerNorm, and the rotary variants
(QK-norm per head and per layer, multi-query, output-only norms). FlopCounterMode counts every matrix product torch
runs, independently of the engine's formulas.
"""

from __future__ import annotations

import pytest
import torch
from biased_models import small_model
from rotary_models import CASES, rotary_model
from torch.utils.flop_counter import FlopCounterMode

from circuits_core.circuits import (
    composition,
    composition_rotary,
    copying,
    copying_spectra,
    global_topk_bounds,
    global_topk_folded,
    rotary,
    rotary_bands,
    rotary_baseline,
)
from circuits_core.circuits import erasure as stream_erasure
from circuits_core.circuits import head_circuits as hc
from circuits_core.circuits import residual_stream as rs
from circuits_core.circuits import stream_components as sc
from circuits_core.circuits import stream_flops as sf
from circuits_core.circuits import virtual_weight_table as vwt
from circuits_core.circuits import virtual_weights as vw
from circuits_core.circuits.factored import FactoredMatrix
from circuits_core.circuits.folded import circuit_weight, head_weights
from circuits_core.circuits.global_topk import SCREEN_MIN_ENTRIES, topk_global_flops
from circuits_core.model.half_products import half_products_fast
from circuits_core.prompt import qk_paths
from circuits_core.schedule import available_cores

MODELS = {
    "layernorm-biased": lambda: small_model(ln="LN"),
    "no-norm": lambda: small_model(),
    **{name: (lambda overrides=overrides: rotary_model(**overrides)) for name, overrides in CASES.items()},
}
IDS = torch.tensor([1, 5, 7, 9, 11, 30])
LAYER, HEAD, TOKEN, OFFSET = 1, 2, 3, 4


# torch's counter registers the out-of-place matrix products; the engine also accumulates in place (addmm_: the
# Gram of the vocabulary, copying_spectra.embed_gram), counted by the same formula,
def _addmm_flops(bias_shape, a_shape, b_shape, out_shape=None, **kwargs) -> int:
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


def _mv_flops(a_shape, x_shape, out_shape=None, **kwargs) -> int:
    return 2 * a_shape[0] * a_shape[1]


# and the matrix-vector products (a direction read in tokens: W_E u)
IN_PLACE = {torch.ops.aten.addmm_: _addmm_flops, torch.ops.aten.mv: _mv_flops}


def counted(call) -> int:
    """The FLOPs torch counts over call(). FlopCounterMode sees the calling thread only, so the call runs with every
    core's torch threads: schedule.side_by_side then runs both branches here, one after the other (as in a process
    whose torch threads fill the cores), and none is missed in a helper thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(available_cores())
    try:
        with FlopCounterMode(display=False, custom_mapping=IN_PLACE) as counter:
            call()
    finally:
        torch.set_num_threads(before)
    return counter.get_total_flops()


def _formed(fm: FactoredMatrix) -> None:
    """Reads both factors (a circuit kept as its products forms them on first read)."""
    fm.A, fm.B  # noqa: B018


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return MODELS[request.param]()


def test_factors_and_lines(model) -> None:
    """Factors on every token and on a token subset, and each line, priced as counted."""
    m = model
    n = int(IDS.numel())
    checks = {
        "ov factors": (lambda: _formed(hc.full_ov_circuit(m, LAYER, HEAD)), hc.full_ov_flops(m)),
        "ov factors on ids": (lambda: hc.full_ov_circuit(m, LAYER, HEAD, IDS), hc.full_ov_flops(m, n)),
        "qk factors": (lambda: hc.full_qk_circuit(m, LAYER, HEAD), hc.full_qk_flops(m)),
        "qk factors on ids": (lambda: hc.full_qk_circuit(m, LAYER, HEAD, IDS), hc.full_qk_flops(m, n)),
        "ov row": (lambda: hc.full_ov_row(m, LAYER, HEAD, TOKEN), hc.line_flops(m, "ov-row")),
        "direct row": (lambda: hc.direct_row(m, TOKEN), hc.line_flops(m, "direct-row")),
        "qk column": (lambda: hc.full_qk_col(m, LAYER, HEAD, TOKEN), hc.line_flops(m, "qk-column")),
    }
    if m.cfg.positional_embedding_type == "rotary":
        checks |= {
            "qk row at δ": (
                lambda: rotary.full_qk_row_at(m, LAYER, HEAD, TOKEN, OFFSET),
                hc.line_flops(m, "qk-row-at"),
            ),
            "qk column at δ": (
                lambda: rotary.full_qk_col_at(m, LAYER, HEAD, TOKEN, OFFSET),
                hc.line_flops(m, "qk-column-at"),
            ),
        }
    for what, (call, priced) in checks.items():
        assert counted(call) == priced, what


def test_the_tables_as_the_view_reads_them(model) -> None:
    """circuit_flops of each table == the count over the calls app/views/circuits.py makes for it: a token's line,
    else the factors on the token set (every token's for a rotary QK circuit) and a global top-k that computes every
    tile (k = every entry: nothing is bounded out; below the screening size: nothing is screened)."""
    m = model
    n = int(IDS.numel())
    rotary_model_ = m.cfg.positional_embedding_type == "rotary"
    assert n * n < SCREEN_MIN_ENTRIES

    def ov_table() -> None:
        hc.full_ov_circuit(m, LAYER, HEAD, IDS).topk_global(n * n)

    def qk_table() -> None:
        if rotary_model_:
            rotary.full_qk_circuit_at(m, LAYER, HEAD, OFFSET, tokens=IDS).topk_global(n * n)
        else:
            hc.full_qk_circuit(m, LAYER, HEAD, IDS).topk_global(n * n)

    def direct_table() -> None:
        fm = hc.direct_path(m)
        FactoredMatrix(fm.A[IDS], fm.B[:, IDS]).topk_global(n * n)

    def qk_query_row() -> None:
        if rotary_model_:
            rotary.full_qk_row_at(m, LAYER, HEAD, TOKEN, OFFSET)
        else:
            hc.full_qk_circuit(m, LAYER, HEAD).rows([TOKEN])

    def qk_key_column() -> None:
        if rotary_model_:
            rotary.full_qk_col_at(m, LAYER, HEAD, TOKEN, OFFSET)
        else:
            hc.full_qk_col(m, LAYER, HEAD, TOKEN)

    assert counted(ov_table) == hc.circuit_flops(m, "ov", False, n)
    assert counted(qk_table) == hc.circuit_flops(m, "qk", False, n)
    assert counted(direct_table) == hc.circuit_flops(m, "direct", False, n)
    assert counted(qk_query_row) == hc.circuit_flops(m, "qk", True, side="row")
    assert counted(qk_key_column) == hc.circuit_flops(m, "qk", True, side="column")
    assert counted(lambda: hc.full_ov_row(m, LAYER, HEAD, TOKEN)) == hc.circuit_flops(m, "ov", True)


def test_the_top_k_search_never_counts_more_than_its_price() -> None:
    """topk_global_flops is exact when every tile is computed, and bounds the count when the norm bound skips tiles
    (a small k on a matrix of tiles: it stops early) or the search screens tiles in bfloat16 (a matrix over
    SCREEN_MIN_ENTRIES entries)."""
    gen = torch.Generator().manual_seed(0)
    A, B = torch.randn(300, 8, generator=gen), torch.randn(8, 40_000, generator=gen)
    A[:3] *= 50  # a few large rows: their entries win, the rest is bounded out
    fm = FactoredMatrix(A, B)
    small = counted(lambda: fm.topk_global(5))
    assert 0 < small < topk_global_flops(300, 8, 40_000)
    big = FactoredMatrix(torch.randn(5000, 8, generator=gen), torch.randn(8, 5000, generator=gen))
    assert 5000 * 5000 >= SCREEN_MIN_ENTRIES
    half_products_fast(
        torch.device("cpu"), torch.bfloat16
    )  # the once-per-process probe's products are not the search's
    assert counted(lambda: big.topk_global(20)) <= topk_global_flops(5000, 8, 5000)
    every = FactoredMatrix(torch.randn(30, 8, generator=gen), torch.randn(8, 50, generator=gen))
    assert counted(lambda: every.topk_global(30 * 50)) == topk_global_flops(30, 8, 50)


def test_copying_metrics(model) -> None:
    """copying_metrics_cost's FLOPs == the count over ov_copying_metrics (the factors, then every row block) when no
    row can be settled early (k = every token), and bound it when rows are (own_rank.count_above), on every token and
    on a token set; every head's eigenvalue copying score (the copying page's other number) likewise; and the
    K-composition token circuit of the composition pair page, on every token and on a token set."""
    n, V = int(IDS.numel()), model.cfg.d_vocab
    on_ids = lambda: copying.ov_copying_metrics(model, LAYER, HEAD, k=n, budget_bytes=4096, tokens=IDS)  # noqa: E731
    assert counted(on_ids) == copying.copying_metrics_cost(model, n, 4096, n).flops
    whole = lambda: copying.ov_copying_metrics(model, LAYER, HEAD, k=V, budget_bytes=4096)  # noqa: E731
    assert counted(whole) == copying.copying_metrics_cost(model, V, 4096).flops
    assert counted(lambda: copying_spectra.ov_copying_scores(model)) == copying_spectra.ov_copying_scores_flops(model)
    k_all = lambda: qk_paths.k_composition_circuit(model, (1, 2), (0, 1))  # noqa: E731
    k_ids = lambda: qk_paths.k_composition_circuit(model, (1, 2), (0, 1), IDS)  # noqa: E731
    assert counted(k_ids) == qk_paths.k_composition_flops(model, n)
    assert counted(k_all) == qk_paths.k_composition_flops(model, model.cfg.d_vocab)  # W_E_eff: elementwise norms
    call = lambda: copying.ov_copying_metrics(model, LAYER, HEAD, k=3, budget_bytes=4096)  # noqa: E731
    assert counted(call) <= copying.copying_metrics_cost(model, 3, 4096).flops


ROTARY = [name for name in MODELS if name in CASES]


@pytest.mark.parametrize("name", ROTARY)
def test_the_rotary_views(name) -> None:
    """The positional kernel (its reference forward pass on n tokens, then the kernel), the band energies, a pair's
    composition profile and the QK eigenvalue copying over offsets: each priced as counted, on 3 layers."""
    m = rotary_model(n_layers=3, **CASES[name])
    tokens = torch.randint(0, m.cfg.d_vocab, (1, 9), generator=torch.Generator().manual_seed(0))
    offsets = torch.arange(7)

    def kernel() -> None:
        rotary.positional_kernel(m, rotary.reference_means(m, tokens), offsets)

    assert counted(kernel) == rotary.kernel_cost(m, 7, 9).flops
    assert counted(lambda: rotary_bands.band_energies(m)) == rotary_bands.bands_cost(m).flops
    for kind in ("q", "k"):
        profile = lambda kind=kind: composition_rotary.pair_profile(m, "L0H1", "L2H3", kind, offsets)  # noqa: E731
        assert counted(profile) == composition_rotary.pair_profile_cost(m, 7).flops, kind
    eigenvalues = lambda: rotary.head_qk_eigenvalues_at(m, 1, 2, offsets)  # noqa: E731
    assert counted(eigenvalues) == rotary.qk_copying_at_cost(m, 7).flops


@pytest.mark.parametrize(("d_model", "d_head", "group_size"), [(64, 8, 1), (64, 16, 4), (20, 16, 1), (20, 16, 3)])
def test_the_sampled_baselines(d_model: int, d_head: int, group_size: int) -> None:
    """The rotary baseline (reduced route, and the dense one where d_model < 2 d_head) and the composition baseline:
    their first (uncached) call priced as counted."""
    rotary_baseline.random_baseline.cache_clear()
    call = lambda: rotary_baseline.random_baseline(d_model, d_head, group_size, n_samples=40)  # noqa: E731
    assert counted(call) == rotary_baseline.baseline_cost(d_model, d_head, group_size, 40).flops
    composition.random_baseline.cache_clear()
    call = lambda: composition.random_baseline(d_model, d_head, n_samples=40)  # noqa: E731
    assert counted(call) == composition.random_baseline_cost(d_model, d_head, 40).flops


@pytest.mark.parametrize("name", ["layernorm-mlp", "attn-only", "standard-mlp", *ROTARY])
def test_the_residual_scores(name: str) -> None:
    """vwt.all_scores (the /residual page's table): the head factors, the Gram inner products and the
    sampled baseline, priced as counted (its baseline uncached)."""
    extra = {
        "layernorm-mlp": lambda: small_model(ln="LN", mlp=True),
        "attn-only": lambda: small_model(),
        "standard-mlp": lambda: small_model(pos="standard", mlp=True),
    }
    m = extra[name]() if name in extra else rotary_model(**CASES[name])
    composition.random_baseline.cache_clear()
    assert counted(lambda: vwt.all_scores(m)) == vwt.all_scores_cost(m).flops


PAIRS = [
    ("embed", "unembed"),
    ("embed", "L1H0.Q"),
    ("embed", "L1H2.K"),
    ("L0H1", "L1H0.V"),
    ("L0H1", "unembed"),
    ("L0H1", "L1H1.K"),
    ("pos", "L1H0.K"),
    ("L0.mlp", "L1H0.Q"),
    ("embed", "L1.mlp.in"),
    ("L0.mlp", "unembed"),
]


@pytest.mark.parametrize("name", ["layernorm-mlp", "gemma3", "qwen3"])
def test_a_residual_pair(name: str) -> None:
    """virtual_weights.pair_cost's FLOPs == the count over pair_report (/residual/{writer}/{reader}): the factored
    virtual weight, its SVD through the Grams, the chain norms and the directions read in tokens, for writers and
    readers of every kind the model has."""
    m = small_model(ln="LN", mlp=True, pos="shortformer") if name == "layernorm-mlp" else rotary_model(**CASES[name])
    names = {w.name for w in sc.writers(m)} | {r.name for r in sc.readers(m)}
    asked = [(w, r) for w, r in PAIRS if w in names and r in names]
    assert len(asked) >= 7
    for w, r in asked:
        writer, reader = sc.parse_writer(m, w), sc.parse_reader(m, r)
        composition.random_baseline.cache_clear()
        report = lambda writer=writer, reader=reader: vw.pair_report(m, writer, reader, k=3, n_top=4)  # noqa: E731
        assert counted(report) == vw.pair_cost(m, writer, reader, 3, 4).flops, (w, r)


@pytest.mark.parametrize("name", ["layernorm-mlp", "standard-mlp", "attn-only", "gemma3", "olmo2"])
def test_the_stream_usage(name: str) -> None:
    """residual_stream's spectra, then stream_usage and erasure on them (the /residual/usage page): usage_flops with
    the subspace dimensions and candidates the run found == the count; the price (every dimension at its most, every
    pair a candidate) is never below it, and the page's cost (usage, then erasure) prices the spectra once."""
    extra = {
        "layernorm-mlp": lambda: small_model(ln="LN", mlp=True),
        "standard-mlp": lambda: small_model(pos="standard", mlp=True),
        "attn-only": lambda: small_model(),
    }
    m = extra[name]() if name in extra else rotary_model(**CASES[name])
    assert counted(lambda: rs.spectra(m)) == sf.spectra_flops(m)
    for energy in (0.5, 0.9, 1.0):
        spec = rs.spectra(m)
        found = {}

        def scans(energy: float = energy, spec=spec, found=found) -> None:
            found["usage"] = rs.stream_usage(m, energy=energy, spec=spec)
            found["erasure"] = stream_erasure.erasure(m, energy=energy, spec=spec)

        scanned = counted(scans)
        writers = [c.writer for c in found["erasure"].candidates]
        exact = sf.usage_flops(m, found["usage"].dims.__getitem__, writers) - sf.spectra_flops(m)
        assert scanned == exact, energy
        assert scanned <= sf.usage_flops(m) - sf.spectra_flops(m)
    assert rs.usage_cost(m).then(stream_erasure.erasure_cost(m, 5)).flops == sf.usage_flops(m)  # the page's price


@pytest.mark.parametrize("name", list(CASES))
def test_one_heads_folded_weights_are_its_rows_of_the_layers(name: str) -> None:
    """folded.head_weights (one head's gains applied to its weights only) == circuit_weight's layer-wide folds indexed
    at the head and its key/value group, exactly, on every rotary layout (QK-norm per head and per layer, GQA and
    multi-query, output norms)."""
    m = rotary_model(**CASES[name])
    for layer in range(m.cfg.n_layers):
        for head in range(m.cfg.n_heads):
            group = head // m.cfg.group_size
            layer_wide = (
                circuit_weight(m, layer, "W_Q")[head],
                circuit_weight(m, layer, "W_K")[group],
                circuit_weight(m, layer, "W_V")[group],
                circuit_weight(m, layer, "W_O")[head],
            )
            for mine, theirs in zip(head_weights(m, layer, head), layer_wide, strict=True):
                torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("name", list(CASES))
def test_a_rotary_qk_circuit_on_a_token_set_is_the_submatrix(name: str) -> None:
    """rotary.full_qk_circuit_at on a token set (the factors of those tokens only, their QK-norm scales included) ==
    the whole vocabulary's circuit restricted to those rows and columns, float64."""
    m = rotary_model(**CASES[name])
    whole = rotary.full_qk_circuit_at(m, LAYER, HEAD, OFFSET).AB[IDS][:, IDS]
    part = rotary.full_qk_circuit_at(m, LAYER, HEAD, OFFSET, tokens=IDS).AB
    torch.testing.assert_close(part, whole, rtol=0, atol=1e-12)


def test_the_whole_vocabulary_top_k_on_products_within_its_price(monkeypatch) -> None:
    """A full OV circuit on every token, kept as its products (RMSNorm, float64): its global top-k takes the folded
    search (global_topk_folded, its size thresholds lowered to reach this model) and counts no more than
    circuit_flops prices the view's whole-vocabulary table, that search's own bound (folded_flops) included; it
    returns the dense product's top k."""
    m = rotary_model(**CASES[next(iter(CASES))])
    assert hc.ov_unformed(m)
    monkeypatch.setattr(global_topk_bounds, "MIN_ENTRIES", 100)
    monkeypatch.setattr(global_topk_bounds, "MIN_INNER", 4)
    monkeypatch.setattr(global_topk_bounds, "SEED", 4)
    called = []
    real = global_topk_folded.topk_folded
    monkeypatch.setattr(global_topk_folded, "topk_folded", lambda *a: called.append(1) or real(*a))
    fm = hc.full_ov_circuit(m, LAYER, HEAD)
    k = 7
    flops = counted(lambda: fm.topk_global(k))
    assert called and 0 < flops <= hc.circuit_flops(m, "ov", False)
    V = m.cfg.d_vocab
    assert hc.circuit_flops(m, "ov", False) == hc.full_ov_flops(m) + global_topk_folded.folded_flops(
        V, m.cfg.d_model, m.cfg.d_head, V, m.cfg.d_model
    ) + topk_global_flops(V, m.cfg.d_head, V)
    values, rows, cols = fm.topk_global(k)
    dense = (fm.A @ fm.B).flatten().topk(k)
    torch.testing.assert_close(values, dense.values, rtol=1e-12, atol=1e-12)
    assert torch.equal(rows * V + cols, dense.indices)
