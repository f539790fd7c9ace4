"""The heads table's shared work: both Grams from one pass (G_E from its upper blocks, mirrored) against W_E_eff
written out in float64, G_E W_Q shared by the QK spectra and the K-composition positivities against their own
products, and the table's byte price against the bytes it holds."""

import copy

import pytest
import torch
from biased_models import small_model

from circuits_core.circuits import copying_spectra
from circuits_core.circuits import head_circuits as C
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import random_model
from circuits_core.prompt.detectors import standard_tokens
from circuits_core.prompt.head_table import head_table, head_table_cost, table_chunk
from circuits_core.prompt.qk_paths import k_composition_positivity
from circuits_core.schedule import available_cores
from tests.held_bytes import HeldBytes


def _ln_model(normalization_type: str | None) -> torch.nn.Module:
    # d_model 30: GRAM_BLOCKS = 4 column blocks of unequal widths (7, 8, 7, 8); rows far from zero mean
    cfg = ModelConfig(
        n_layers=2,
        d_model=30,
        n_heads=3,
        d_head=10,
        d_vocab=37,
        n_ctx=16,
        normalization_type=normalization_type,
        positional_embedding_type="shortformer",
    )
    model = random_model(cfg, seed=7, dtype=torch.float64, std_embed=0.8)
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        model.W_E.add_(torch.linspace(-2, 3, cfg.d_vocab, dtype=torch.float64)[:, None])
        if normalization_type == "LN":
            model.blocks[0].ln1.w.copy_(1 + 0.3 * torch.randn(30, generator=gen, dtype=torch.float64))
            model.blocks[0].ln1.b.copy_(0.3 * torch.randn(30, generator=gen, dtype=torch.float64))
    return model


def _W_E_eff(model: torch.nn.Module) -> torch.Tensor:
    """Layer 0's ln1 applied to each row of W_E, written out (no norm: W_E itself)."""
    if model.cfg.normalization_type is None:
        return model.W_E
    x = model.W_E - model.W_E.mean(-1, keepdim=True)
    x = x / (x.pow(2).mean(-1, keepdim=True) + model.cfg.eps).sqrt()
    return x * model.blocks[0].ln1.w + model.blocks[0].ln1.b


@pytest.mark.parametrize("norm", ["LN", None])
def test_both_grams_from_one_pass_equal_dense_products(norm: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(C, "EMBED_CHUNK", 5)  # 8 chunks, the last one partial (d_vocab = 37)
    model = _ln_model(norm)
    W_E = _W_E_eff(model)  # [V, d]
    G, G_E = copying_spectra.embed_grams(model)
    torch.testing.assert_close(G, model.W_U @ W_E, rtol=0, atol=1e-10)
    torch.testing.assert_close(G_E, W_E.T @ W_E, rtol=0, atol=1e-10)
    assert torch.equal(G_E, G_E.T)  # the mirror is exact
    # the single-Gram entry points against the dense products too (each forms its Gram through its own pass)
    torch.testing.assert_close(copying_spectra.embed_gram(model), W_E.T @ W_E, rtol=0, atol=1e-10)
    torch.testing.assert_close(copying_spectra.unembed_embed_gram(model), model.W_U @ W_E, rtol=0, atol=1e-10)


def test_grams_of_two_workers_sharing_the_vocabulary_add_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """head_table's step 2: two workers taking the vocabulary's row chunks from one queue form partial Grams that add
    up to the dense products (float64)."""
    from circuits_core.schedule import shared_chunks

    monkeypatch.setattr(C, "EMBED_CHUNK", 5)
    model = _ln_model("LN")
    W_E = _W_E_eff(model)
    take = shared_chunks(model.cfg.d_vocab, 5)
    handed = [take(), take(), take()]  # the first worker's rows 0..14; the second takes the rest
    G_a, G_E_a = copying_spectra.embed_grams(model, lambda: handed.pop(0) if handed else None)
    G_b, G_E_b = copying_spectra.embed_grams(model, take)
    torch.testing.assert_close(G_a, model.W_U[:, :15] @ W_E[:15], rtol=0, atol=1e-10)
    torch.testing.assert_close(G_a + G_b, model.W_U @ W_E, rtol=0, atol=1e-10)
    torch.testing.assert_close(G_E_a + G_E_b, W_E.T @ W_E, rtol=0, atol=1e-10)


def test_float32_grams_keep_float64_totals_over_many_chunks() -> None:
    """A float32 model's Grams over 40,000 vocabulary rows in 4,000 chunks: each chunk's product is float32, the
    totals float64, so G and G_E stay within float32 rounding of the same weights' products in float64 (measured
    1.0e-7 and 2.3e-9 of their largest entries; a float32 running sum over the chunks drifts to 1.4e-6 and 2.7e-6).
    W_U is zero-mean and uncorrelated with W_E, so G (~sqrt(V)) is far smaller than its terms' sizes add up to."""
    from circuits_core.schedule import shared_chunks

    cfg = ModelConfig(
        n_layers=1, d_model=16, n_heads=2, d_head=8, d_vocab=40_000, n_ctx=8, normalization_type="LN",
        positional_embedding_type="shortformer",
    )  # fmt: skip
    model = random_model(cfg, seed=3, dtype=torch.float32, std_embed=0.8)
    W_E = _W_E_eff(copy.deepcopy(model).double())  # [V, d] float64, from the same float32 weights
    G, G_E = copying_spectra.embed_grams(model, shared_chunks(cfg.d_vocab, 10))
    want_G, want_G_E = model.W_U.double() @ W_E, W_E.T @ W_E
    assert G.dtype == G_E.dtype == torch.float64  # the totals, for head_table to add up and round once
    assert (G - want_G).abs().max() <= 3e-7 * want_G.abs().max()
    assert (G_E - want_G_E).abs().max() <= 1e-7 * want_G_E.abs().max()
    # the single-Gram entry points round their totals to the model's dtype
    assert copying_spectra.unembed_embed_gram(model).dtype == copying_spectra.embed_gram(model).dtype == torch.float32


def test_shared_gram_queries_give_the_same_spectra_and_positivities() -> None:
    """qk_eigenvalues and the dense K-composition route fed G_E W_Q from gram_queries equal those forming their own
    products from W_E_eff written out (G_E = W_E_eff^T W_E_eff, float64)."""
    model = small_model(n_layers=3, ln="LN", seed=3)
    W_E = _W_E_eff(model)
    G_E = W_E.T @ W_E
    GQ = copying_spectra.gram_queries(model, G_E)  # [L, H, d, dh]
    torch.testing.assert_close(GQ[2, 1], G_E @ model.W_Q[2, 1], rtol=0, atol=1e-12)
    dense_qk = (
        torch.stack(
            [
                torch.stack([torch.linalg.eigvals(model.W_K[layer, h].T @ G_E @ model.W_Q[layer, h]) for h in range(3)])
                for layer in range(3)
            ]
        )
        / model.cfg.scale
    )
    key = lambda e: e.real * 1e3 + e.imag  # noqa: E731 - a total order on each head's d_head eigenvalues
    got = copying_spectra.qk_eigenvalues(model, G_E, GQ)
    torch.testing.assert_close(
        got.gather(-1, key(got).argsort()), dense_qk.gather(-1, key(dense_qk).argsort()), rtol=0, atol=1e-9
    )
    w = torch.rand(3, 3, generator=torch.Generator().manual_seed(4), dtype=torch.float64)  # dense route
    torch.testing.assert_close(
        k_composition_positivity(model, w, G_E, GQ), k_composition_positivity(model, w, G_E), rtol=0, atol=1e-12
    )


@pytest.mark.parametrize("budget", [None, 200_000])
def test_head_table_price_covers_the_measured_peak(budget: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bytes head_table holds (run in turn, so every operation is seen by this thread) stay within
    head_table_cost, which counts two detector chunks at once; the small budget forces one-sequence chunks."""
    model = small_model(n_layers=3, ln="LN", mlp=True)
    tokens = standard_tokens(model, seed=1)
    b, n = tokens.shape
    if budget is not None:
        assert table_chunk(model, n, b, budget) == 1
    before = torch.get_num_threads()
    monkeypatch.setattr("circuits_core.schedule.available_cores", lambda: 1)
    torch.set_num_threads(1)  # one core: the branches run in turn, in this thread
    try:
        with torch.no_grad(), HeldBytes([*model.parameters(), *model.buffers(), tokens]) as held:
            head_table(model, tokens, budget_bytes=budget)
    finally:
        torch.set_num_threads(before)
    priced = head_table_cost(model, n, b, budget).peak_bytes
    assert 0 < held.peak <= priced, (held.peak, priced)


@pytest.mark.parametrize("one_hot", [True, False])
def test_positivity_split_by_layers_adds_up_to_the_whole(one_hot: bool) -> None:
    """induction_view's two threads: the positivity of layers [1, k) plus that of [k, L) equals the whole (dense
    route: each half runs its own S_l chain; factored route: one-hot), and each half is 0 outside its layers."""
    from circuits_core.errors import InvalidInputError

    model = small_model(n_layers=4, ln="LN", seed=6)
    if one_hot:
        w = torch.zeros(4, 3, dtype=torch.float64)
        w[0, 2] = 1.0
    else:
        w = torch.rand(4, 3, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    whole = k_composition_positivity(model, w)
    low, high = (
        k_composition_positivity(model, w, layers=range(1, 3)),
        k_composition_positivity(model, w, layers=range(3, 4)),
    )
    assert (low[3] == 0).all() and (high[:3] == 0).all() and (whole[1:] != 0).all()
    torch.testing.assert_close(low + high, whole, rtol=0, atol=1e-12)
    with pytest.raises(InvalidInputError, match="consecutive"):
        k_composition_positivity(model, w, layers=range(1, 5))


def test_positivity_without_an_earlier_weighted_head_is_zero() -> None:
    """One layer (nothing earlier), or weights only on the last layer: every positivity is 0, as is the heads
    table's 2-D view of a one-layer model."""
    one = small_model(n_layers=1, ln="LN")
    assert (k_composition_positivity(one, torch.ones(1, 3, dtype=torch.float64)) == 0).all()
    two = small_model(n_layers=2, ln="LN")
    last = torch.zeros(2, 3, dtype=torch.float64)
    last[1] = 1.0
    assert (k_composition_positivity(two, last) == 0).all()
    table = head_table(one, standard_tokens(one))
    assert table.induction is not None and (table.induction.qk_k_composition == 0).all()
    assert (table.induction.qk_weighted == 0).all()


def test_head_table_raises_instead_of_waiting_when_G_E_W_Q_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The helper thread waits for G_E W_Q from this thread: when forming it fails, head_table raises that error
    (in both thread modes) instead of leaving the helper waiting."""
    import threading

    import circuits_core.prompt.head_table as HT

    def boom(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("G_E W_Q failed")

    monkeypatch.setattr(HT, "gram_queries", boom)
    model = small_model(n_layers=2, ln="LN")
    tokens = standard_tokens(model)
    before = torch.get_num_threads()
    try:
        for threads in sorted({1, available_cores()}):
            torch.set_num_threads(threads)
            got: list[BaseException] = []

            def run(got: list[BaseException]) -> None:
                try:
                    HT.head_table(model, tokens)
                except BaseException as error:  # noqa: BLE001 - the test inspects it
                    got.append(error)

            worker = threading.Thread(target=run, args=(got,), daemon=True)
            worker.start()
            worker.join(60)
            assert not worker.is_alive() and len(got) == 1 and "G_E W_Q failed" in str(got[0])
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(available_cores() < 2, reason="needs two cores")
def test_threads_spanning_the_cores_run_the_halves_side_by_side(monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller whose torch threads span the cores (the bench, a computation alone in the app) gets the two halves
    side by side on half the threads each, not one after the other: both threads run detector chunks, the table is
    the one the halves give in turn (detector scores bitwise, the spectra's scores to rounding), and the caller's
    thread count is restored."""
    import threading

    import circuits_core.prompt.head_table as HT

    model = small_model(n_layers=3, ln="LN", mlp=True)
    tokens = standard_tokens(model, seed=2)
    ran: list[tuple[str, int]] = []
    real_sums = HT.detector_sums

    def recording(*args: object, **kwargs: object) -> object:
        ran.append((threading.current_thread().name, torch.get_num_threads()))
        return real_sums(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(HT, "detector_sums", recording)
    before, cores = torch.get_num_threads(), available_cores()
    try:
        torch.set_num_threads(cores)
        split = head_table(model, tokens)
        assert torch.get_num_threads() == cores
        names = {name for name, _ in ran}
        assert len(names) == 2 and {threads for _, threads in ran} == {cores // 2}, ran
        ran.clear()
        with monkeypatch.context() as patch:  # one core: the halves in turn, in this thread
            patch.setattr("circuits_core.schedule.available_cores", lambda: 1)
            in_turn = head_table(model, tokens)
        assert {name for name, _ in ran} == {threading.current_thread().name}
    finally:
        torch.set_num_threads(before)
    for name, scores in in_turn.detectors.items():
        assert torch.equal(split.detectors[name], scores), name
    for got, want in ((split.ov_copying, in_turn.ov_copying), (split.qk_copying, in_turn.qk_copying)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
    assert split.induction is not None and in_turn.induction is not None
    torch.testing.assert_close(split.induction.qk_weighted, in_turn.induction.qk_weighted, rtol=0, atol=1e-9)


def _score(eigenvalues: torch.Tensor) -> torch.Tensor:
    return eigenvalues.sum(-1).real / eigenvalues.abs().sum(-1)


def test_table_spectra_from_one_eigen_queue_equal_the_dense_circuits() -> None:
    """The heads table's four spectra, their matrices formed by two threads and every eigenproblem solved by whichever
    thread takes it (host_linalg.EigenQueue), against the full [d_vocab, d_vocab] circuits written out in float64:
    each OV and QK copying score from the eigenvalues of W_E_eff W_V W_O W_U and W_E_eff W_Q W_K^T W_E_eff^T / s (the
    zero ones add nothing), the positivities from k_composition_positivity's own route."""
    model = small_model(n_layers=3, ln="LN", mlp=True, seed=5)
    table = head_table(model, standard_tokens(model, seed=3))
    W_E = _W_E_eff(model)  # [V, d]
    for layer in range(3):
        for h in range(3):
            ov = W_E @ model.W_V[layer, h] @ model.W_O[layer, h] @ model.W_U  # [V, V]
            qk = W_E @ model.W_Q[layer, h] @ model.W_K[layer, h].T @ W_E.T / model.cfg.scale
            torch.testing.assert_close(table.ov_copying[layer, h], _score(torch.linalg.eigvals(ov)), rtol=0, atol=1e-9)
            torch.testing.assert_close(table.qk_copying[layer, h], _score(torch.linalg.eigvals(qk)), rtol=0, atol=1e-9)
    assert table.induction is not None and table.ov_eigenvalues is not None
    iv = table.induction
    one_hot = torch.zeros(3, 3, dtype=torch.float64)
    layer, head = (int(part) for part in iv.previous_token_head[1:].split("H"))  # "L1H2"
    one_hot[layer, head] = 1.0
    torch.testing.assert_close(iv.qk_k_composition, k_composition_positivity(model, one_hot), rtol=0, atol=1e-9)
    torch.testing.assert_close(
        iv.qk_weighted, k_composition_positivity(model, iv.previous_token_scores), rtol=0, atol=1e-9
    )
    assert (iv.qk_weighted[0] == 0).all() and (iv.qk_weighted[1:] != 0).all()  # both halves of the layers filled
