"""API: the heads table, one head, detectors -- each number against an independent engine computation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fastapi.testclient import TestClient

from app.views.shared.head_spectra import Spectra
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.prompt.detectors import detector_scores, repeated_random_tokens
from tests.app.conftest import assert_problem


def dense_copying(M: torch.Tensor) -> float:
    """sum(eig)/sum(|eig|) of a dense square matrix (the [V, V] circuit itself, not its small factors)."""
    eig = torch.linalg.eigvals(M)
    return float(eig.sum().real / eig.abs().sum())


def full_ov_dense(model, layer: int, h: int) -> torch.Tensor:
    return model.W_E @ model.W_V[layer, h] @ model.W_O[layer, h] @ model.W_U  # [V, V]


def full_qk_dense(model, layer: int, h: int) -> torch.Tensor:
    return model.W_E @ model.W_Q[layer, h] @ model.W_K[layer, h].T @ model.W_E.T / model.cfg.scale  # [V, V]


@pytest.fixture(scope="module")
def heads(client: TestClient) -> dict:
    return client.get("/api/v1/models/tiny-2l/heads").json()


def test_heads_table_copying_scores_match_dense_eigenvalues(heads: dict, tiny: LoadedModel) -> None:
    model = tiny.model
    assert [h["head"] for h in heads["heads"]] == model.cfg.head_names
    for row in heads["heads"]:
        layer, h = row["layer"], row["index"]
        assert row["ov_copying"] == pytest.approx(dense_copying(full_ov_dense(model, layer, h)), abs=1e-6)
        assert row["qk_copying"] == pytest.approx(dense_copying(full_qk_dense(model, layer, h)), abs=1e-6)


def test_the_heads_table_keeps_every_heads_spectra_for_the_head_views(
    client: TestClient, heads: dict, tiny: LoadedModel
) -> None:
    """The heads table's copying scores come from every head's OV and QK eigenvalues: it keeps them (one cache entry),
    so a head view reads them instead of forming the Grams and solving the eigenproblems again; each head's kept
    spectrum is the nonzero spectrum of its dense [V, V] circuit."""
    model, d_head = tiny.model, tiny.model.cfg.d_head
    kept = client.app.state.compute.answers.cached(("head-spectra", str(tiny.digest)), Spectra)  # type: ignore[attr-defined]
    assert kept is not None

    def ordered(values: torch.Tensor) -> torch.Tensor:  # [n, 2] (re, im): conjugate pairs share |lambda|, so by all
        key = sorted(
            range(len(values)), key=lambda j: (round(float(values[j].abs()), 4), round(float(values[j].imag), 4))
        )
        return torch.view_as_real(values[key])

    for i, name in enumerate(model.cfg.head_names):
        layer, h = divmod(i, model.cfg.n_heads)
        for which, dense in (("ov", full_ov_dense), ("qk", full_qk_dense)):
            got = torch.tensor([complex(e.re, e.im) for e in kept.head(which, i, d_head)], dtype=torch.complex128)
            eig = torch.linalg.eigvals(dense(model, layer, h))
            top = eig[eig.abs().argsort(descending=True)][:d_head]
            assert torch.allclose(ordered(got), ordered(top), atol=1e-6), (name, which)


def test_heads_table_detectors_on_standard_input(heads: dict, tiny: LoadedModel) -> None:
    model, bos = tiny.model, tiny.tokenizer.bos_token_id
    meta = heads["detector_input"]
    assert (meta["seq_len"], meta["batch"], meta["seed"], meta["bos"], meta["n_tokens"]) == (50, 10, 0, bos, 101)
    tokens = repeated_random_tokens(model.cfg.d_vocab, 50, 10, seed=0, bos=bos)
    expected = detector_scores(model, tokens)
    for row in heads["heads"]:
        for name, scores in expected.items():
            assert row[name] == pytest.approx(float(scores[row["layer"], row["index"]]), abs=1e-9), name


def test_head_summary_spectra(client: TestClient, tiny: LoadedModel) -> None:
    model = tiny.model
    body = client.get("/api/v1/models/tiny-2l/heads/L1H2").json()
    assert (body["head"], body["layer"], body["index"]) == ("L1H2", 1, 2)
    ov = torch.tensor([complex(e["re"], e["im"]) for e in body["ov_eigenvalues"]], dtype=torch.complex128)
    # the d_head eigenvalues given are the nonzero spectrum of the dense [V, V] circuit
    dense = torch.linalg.eigvals(full_ov_dense(model, 1, 2))
    top = dense[dense.abs().argsort(descending=True)][: model.cfg.d_head]
    assert torch.allclose(ov, top, atol=1e-6)
    assert sum(e["re"] for e in body["ov_eigenvalues"]) == pytest.approx(
        float(torch.trace(full_ov_dense(model, 1, 2))), rel=1e-6
    )
    W_OV = model.W_V[1, 2] @ model.W_O[1, 2]  # [d, d]
    assert body["ov_singular_values"] == pytest.approx(
        torch.linalg.svdvals(W_OV)[: model.cfg.d_head].tolist(), abs=1e-9
    )
    assert body["scores"]["head"] == "L1H2"
    pos = body["positional"]
    n = pos["n_positions"]
    assert n == model.cfg.n_ctx
    P = model.W_pos[:n]
    scores = P @ model.W_Q[1, 2] @ model.W_K[1, 2].T @ P.T / model.cfg.scale
    pattern = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    assert torch.allclose(torch.tensor(pos["pattern"], dtype=torch.float64), pattern, atol=1e-12)
    assert pos["previous_token"] == pytest.approx(float(pattern.diagonal(-1).mean()))


def test_head_refusals(client: TestClient) -> None:
    assert_problem(client.get("/api/v1/models/tiny-2l/heads/L9H0"), 404, "L9H0", "2 layers")
    assert_problem(client.get("/api/v1/models/tiny-2l/heads/L0H7"), 404, "4 heads")
    assert_problem(client.get("/api/v1/models/tiny-2l/heads/head3"), 422, "L<layer>H<head>")
    assert_problem(client.get("/api/v1/models/tiny-2l/heads/L9H0/ov"), 404, "L9H0")


def test_detectors_repeated_tokens_patterns_and_loss(client: TestClient, tiny: LoadedModel) -> None:
    model, bos = tiny.model, tiny.tokenizer.bos_token_id
    params = {"seq_len": 12, "batch": 3, "seed": 7, "heads": "L0H1,L1H3"}
    body = client.get("/api/v1/models/tiny-2l/detectors", params=params).json()
    tokens = repeated_random_tokens(model.cfg.d_vocab, 12, 3, seed=7, bos=bos)
    assert [t["id"] for t in body["tokens"]] == tokens[0].tolist()
    expected = detector_scores(model, tokens)
    assert body["heads"][5]["induction"] == pytest.approx(float(expected["induction"][1, 1]), abs=1e-9)
    logits, cache = model.run(tokens, names=lambda n: n.endswith("hook_pattern"))
    assert body["selected"] == ["L0H1", "L1H3"]
    assert torch.allclose(
        torch.tensor(body["patterns"][1]["pattern"], dtype=torch.float64),
        cache["blocks.1.attn.hook_pattern"][0, 3],
        atol=1e-12,
    )
    logprobs = logits.log_softmax(-1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]  # [batch, n-1]
    loss = -logprobs.mean(0)
    assert body["loss"]["loss"][:-1] == pytest.approx(loss.tolist(), abs=1e-9) and body["loss"]["loss"][-1] is None
    assert body["loss"]["first_repeat"] == pytest.approx(float(loss[:12].mean()))
    assert body["loss"]["second_repeat"] == pytest.approx(float(loss[12:24].mean()))


def test_detectors_default_heads_and_prompt(client: TestClient, tiny: LoadedModel) -> None:
    body = client.get("/api/v1/models/tiny-2l/detectors", params={"seq_len": 10, "batch": 2}).json()
    best_prev = max(body["heads"], key=lambda r: r["previous_token"])["head"]
    assert best_prev in body["selected"] and 1 <= len(body["selected"]) <= 5
    prompt = client.get("/api/v1/models/tiny-2l/detectors", params={"prompt": "the cat sat on the mat"}).json()
    ids = tiny.tokenizer.encode("the cat sat on the mat")
    assert [t["id"] for t in prompt["tokens"]] == ids and prompt["detector_input"]["kind"] == "prompt"
    logits = tiny.model.run(torch.tensor([ids]))[0]
    ce = F.cross_entropy(logits[0, :-1], torch.tensor(ids[1:]), reduction="none")
    assert (
        prompt["loss"]["loss"][:-1] == pytest.approx(ce.tolist(), abs=1e-9) and prompt["loss"]["first_repeat"] is None
    )


def test_detector_refusals(client: TestClient) -> None:
    url = "/api/v1/models/tiny-2l/detectors"
    assert_problem(client.get(url, params={"batch": 9}), 422, "batch")
    assert_problem(client.get(url, params={"seq_len": 61}), 422, "seq_len")
    assert_problem(client.get(url, params={"heads": "L0H0,L0H1,L0H2,L0H3,L1H0"}), 422, "at most 4")
    assert_problem(client.get("/api/v1/models/tiny-ln/detectors", params={"seq_len": 20}), 422, "context", "at most 15")


def test_detectors_default_input_fits_a_short_context(client: TestClient, tiny_ln: LoadedModel) -> None:
    """tiny-ln has n_ctx 32: the default (the standard T = 50) is shortened to the longest BOS + r + r that fits
    (T = 15), on the API as on the page, and the answer says so; a T given explicitly is never changed."""
    body = client.get("/api/v1/models/tiny-ln/detectors", params={"batch": 2}).json()
    fits = (tiny_ln.model.cfg.n_ctx - 1) // 2
    assert body["detector_input"]["seq_len"] == fits == 15
    tokens = repeated_random_tokens(tiny_ln.model.cfg.d_vocab, fits, 2, seed=0, bos=tiny_ln.tokenizer.bos_token_id)
    assert [t["id"] for t in body["tokens"]] == tokens[0].tolist()
    expected = detector_scores(tiny_ln.model, tokens)
    assert body["heads"][1]["previous_token"] == pytest.approx(float(expected["previous_token"][0, 1]), abs=1e-9)
    page = client.get("/models/tiny-ln/detectors", params={"batch": 2})
    assert page.status_code == 200 and 'name="seq_len" value="15"' in page.text.replace("'", '"')
    assert_problem(client.get("/api/v1/models/tiny-ln/detectors", params={"seq_len": 50}), 422, "context")


def test_heads_table_k_composition_scatter(heads: dict, tiny: LoadedModel) -> None:
    """y axis of the paper's 2-D view: positivity of the dense K-composition token circuit with the previous-token
    head."""
    model = tiny.model
    layer0 = [r for r in heads["heads"] if r["layer"] == 0]
    prev = max(layer0, key=lambda r: r["previous_token"])
    assert heads["previous_token_head"] == prev["head"]
    p = prev["index"]
    W_OV_p = model.W_V[0, p] @ model.W_O[0, p]  # [d, d]
    for row in heads["heads"]:
        layer, h = row["layer"], row["index"]
        if layer == 0:
            assert row["qk_k_composition"] == 0.0
            continue
        M = model.W_E @ model.W_Q[layer, h] @ model.W_K[layer, h].T @ W_OV_p.T @ model.W_E.T / model.cfg.scale  # [V, V]
        assert row["qk_k_composition"] == pytest.approx(dense_copying(M), abs=1e-6)
        assert -1 <= row["qk_k_composition_weighted"] <= 1


def test_copying_metrics_against_dense(client: TestClient, tiny: LoadedModel) -> None:
    M = full_ov_dense(tiny.model, 0, 1)
    V = M.shape[0]
    body = client.get("/api/v1/models/tiny-2l/heads/L0H1/copying", params={"k": 3}).json()
    own = torch.arange(V)
    assert body["diagonal_positive"] == pytest.approx(float((M.diagonal() > 0).double().mean()))
    assert body["top1"] == pytest.approx(float((M.argmax(1) == own).double().mean()))
    assert body["topk"] == pytest.approx(float((M.topk(3, dim=1).indices == own[:, None]).any(1).double().mean()))
    assert body["diagonal_quantiles"][0] == pytest.approx(float(M.diagonal().min()))
    assert body["ov_copying"] == pytest.approx(dense_copying(M), abs=1e-6) and body["k"] == 3
