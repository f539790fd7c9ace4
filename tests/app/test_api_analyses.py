"""API of the composition, path-expansion and prompt analyses: each endpoint's numbers against direct, independent
engine computations on the same tiny model (dense float64 matrices, real forward passes), and every refusal as
problem+json. Term importance: test_api_term_importance.py; the tour: test_api_tour.py.

tiny-2l: 2 layers x 4 heads, d_model 32, shortformer positions, no LayerNorm, no biases (conftest.py), so the
frozen-attention path terms have simple dense forms: x_L = X0 + sum A X0 W_OV + ..., logits = x_L W_U.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from circuits_core.circuits import embedding
from circuits_core.circuits.composition import composition_scores
from circuits_core.circuits.composition_baseline import BASELINE_SAMPLES
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.prompt.paths import expand_logits
from circuits_core.prompt.qk_paths import expand_scores
from tests.app.conftest import LIMITS, assert_problem
from tests.app.tiny_dense import API, PROMPT, W_OV, MiB, W, close, ids_of, run, top_entries


# -- composition ----------------------------------------------------------------------------------------
def arena_baseline(d_model: int, d_head: int, n_samples: int = BASELINE_SAMPLES, seed: int = 0) -> tuple[float, float]:
    """(mean, std) of ARENA's random composition score, densely: W_A = A_l A_r^T, W_B = B_l B_r^T [d, d] from the
    same uniform stream (chunks of 32 draws of 4 [d_model, d_head] matrices, seeded), ||W_A W_B|| / (||W_A||
    ||W_B||)."""
    gen = torch.Generator().manual_seed(seed)
    scores = []
    for start in range(0, n_samples, 32):
        W = torch.rand(4, min(32, n_samples - start), d_model, d_head, generator=gen, dtype=torch.float64) - 0.5
        for A_l, A_r, B_l, B_r in zip(*W, strict=True):
            W_A, W_B = A_l @ A_r.T, B_l @ B_r.T
            scores.append((W_A @ W_B).norm() / (W_A.norm() * W_B.norm()))
    t = torch.stack(scores)
    return float(t.mean()), float(t.std())


def test_composition_scores_match_dense_frobenius(client: TestClient, tiny: LoadedModel) -> None:
    d = tiny.model.cfg.d_model
    for kind in ("Q", "K", "V"):
        body = client.get(f"{API}/composition", params={"kind": kind}).json()
        assert body["kind"] == kind and body["sources"] == [f"L0H{h}" for h in range(4)]
        assert body["targets"] == [f"L1H{h}" for h in range(4)]
        for i in range(4):
            for j in range(4):
                A = W_OV(tiny, 0, i)
                W_QK = W(tiny, "W_Q", 1, j) @ W(tiny, "W_K", 1, j).T
                B = {"Q": W_QK, "K": W_QK.T, "V": W_OV(tiny, 1, j)}[kind]
                want = float((A @ B).norm() / (A.norm() * B.norm()))
                assert body["scores"][i][j] == pytest.approx(want, abs=1e-9)
                assert body["minus_baseline"][i][j] == pytest.approx(want - 1 / math.sqrt(d), abs=1e-9)
        assert body["baseline"] == pytest.approx(1 / math.sqrt(d))
        want_mean, want_std = arena_baseline(d, tiny.model.cfg.d_head)
        assert body["sampled_baseline"] == pytest.approx(want_mean, abs=1e-9)
        assert body["sampled_std"] == pytest.approx(want_std, abs=1e-9)
        top = body["top_pairs"][0]
        assert top["score"] == max(max(row) for row in body["scores"])
        i, j = max(((i, j) for i in range(4) for j in range(4)), key=lambda ij: body["scores"][ij[0]][ij[1]])
        assert (top["source"], top["target"]) == (f"L0H{i}", f"L1H{j}")  # the flat index unravelled to its heads


def test_composition_refusals(client: TestClient) -> None:
    assert_problem(client.get(f"{API}/composition", params={"kind": "X"}), 422, "kind")
    assert_problem(client.get("/api/v1/models/tiny-ln/composition"), 422, "at least 2 layers")
    assert_problem(client.get(f"{API}/composition/L1H0/L0H1"), 422, "increasing")
    assert_problem(client.get(f"{API}/composition/L0H0/L0H1"), 422, "increasing")
    assert_problem(client.get(f"{API}/composition/L0H0/L7H1"), 404, "L7H1", "2 layers")
    assert_problem(client.get(f"{API}/composition/L0H0/head"), 422, "L<layer>H<head>")
    assert_problem(client.get(f"{API}/composition/L0H0/L1H1", params={"k": 51}), 422, "k")


def test_composition_pair_circuits_match_dense(client: TestClient, tiny: LoadedModel) -> None:
    body = client.get(f"{API}/composition/L0H2/L1H3", params={"k": 5}).json()
    model = tiny.model
    E = embedding.embed_eff(model)  # no LN: W_E
    assert torch.equal(E, model.W_E)
    scores = composition_scores(model)
    assert body["scores"]["K"] == pytest.approx(float(scores.raw["k"][0, 2, 1, 3]), abs=1e-12)
    K = E @ W(tiny, "W_Q", 1, 3) @ W(tiny, "W_K", 1, 3).T @ W_OV(tiny, 0, 2).T @ E.T / model.cfg.scale  # [V, V]
    virtual = E @ W_OV(tiny, 0, 2) @ W_OV(tiny, 1, 3) @ model.W_U  # [V, V]
    for part, M in (("k_composition", K), (None, virtual)):
        circuit = body[part] if part else body["virtual_head"]["ov"]
        assert [e["value"] for e in circuit["entries"]] == pytest.approx(top_entries(M, 5), abs=1e-9)
        first = circuit["entries"][0]
        assert M[first["row"]["id"], first["col"]["id"]] == pytest.approx(first["value"], abs=1e-9)
        eig = torch.linalg.eigvals(M)
        assert circuit["copying"] == pytest.approx(float(eig.sum().real / eig.abs().sum()), abs=1e-6)
    assert body["virtual_head"]["heads"] == ["L0H2", "L1H3"]


# -- logit path expansion --------------------------------------------------------------------------------
def test_paths_sum_to_the_real_logit(client: TestClient, tiny: LoadedModel) -> None:
    ids = ids_of(tiny)
    logits, _ = run(tiny, ids)
    body = client.get(f"{API}/paths", params={"prompt": PROMPT, "max_order": 2, "k": 50}).json()
    pos, target = len(ids) - 1, int(logits[-1].argmax())
    assert body["position"] == pos and body["target"] == target and body["contrast"] is None
    assert body["tokens"] == [t["id"] for t in body["prompt_tokens"]]  # the contract: ids
    assert body["tokens"] == ids
    assert body["value"] == pytest.approx(float(logits[pos, target]), abs=1e-9)
    assert body["total"] == pytest.approx(float(logits[pos, target]), abs=1e-9)  # against the real forward pass
    assert sum(t["value"] for t in body["terms"]) == pytest.approx(body["value"], abs=1e-9)
    assert not any(t["kind"] == "remainder" for t in body["terms"])  # max_order = n_layers: nothing left over
    by_path = {tuple(t["path"]): t for t in body["terms"]}
    # independent dense terms: direct X0 W_U, head A X0 W_OV W_U, virtual A2 A1 X0 W_OV1 W_OV2 W_U
    _, cache = run(tiny, ids)
    X0, u = cache["hook_embed"], tiny.model.W_U[:, target]
    A = [cache[f"blocks.{layer}.attn.hook_pattern"] for layer in range(2)]  # [H, n, n]
    assert by_path[()]["value"] == pytest.approx(float(X0[pos] @ u), abs=1e-9) and by_path[()]["order"] == 0
    assert by_path[("L1H2",)]["value"] == pytest.approx(float((A[1][2] @ X0 @ W_OV(tiny, 1, 2))[pos] @ u), abs=1e-9)
    want = float((A[1][1] @ A[0][3] @ X0 @ W_OV(tiny, 0, 3) @ W_OV(tiny, 1, 1))[pos] @ u)
    assert (
        by_path[("L0H3", "L1H1")]["value"] == pytest.approx(want, abs=1e-9)
        and by_path[("L0H3", "L1H1")]["kind"] == "head"
    )
    assert body["order_totals"] == pytest.approx(
        [sum(t["value"] for t in body["terms"] if t["order"] == k) for k in range(3)], abs=1e-9
    )


def test_paths_remainder_contrast_position_by_source(client: TestClient, tiny: LoadedModel) -> None:
    ids = ids_of(tiny)
    logits, _ = run(tiny, ids)
    params = {
        "tokens": ",".join(map(str, ids)),
        "position": 2,
        "target": 5,
        "contrast": 7,
        "max_order": 1,
        "by_source": "true",
        "k": 3,
    }
    body = client.get(f"{API}/paths", params=params).json()
    assert body["value"] == pytest.approx(float(logits[2, 5] - logits[2, 7]), abs=1e-9)
    # the remainder term is the order-2 (virtual-head) part, computed densely here: A1 A0 X0 W_OV0 W_OV1 (u5 - u7)
    _, cache = run(tiny, ids)
    X0, u = cache["hook_embed"], tiny.model.W_U[:, 5] - tiny.model.W_U[:, 7]
    A = [cache[f"blocks.{layer}.attn.hook_pattern"] for layer in range(2)]  # [H, n, n]
    order2 = sum(
        float((A[1][h1] @ A[0][h0] @ X0 @ W_OV(tiny, 0, h0) @ W_OV(tiny, 1, h1))[2] @ u)
        for h0 in range(4)
        for h1 in range(4)
    )
    assert body["terms"][-1]["kind"] == "remainder" and body["terms"][-1]["value"] == pytest.approx(order2, abs=1e-9)
    assert abs(order2) > 1e-6
    kinds = [t["kind"] for t in body["terms"]]
    assert kinds[-2:] == ["other", "remainder"] and len(body["terms"]) == 5
    exp = expand_logits(tiny.model, torch.tensor(ids), (5, 7), positions=2, max_order=1, by_source=False)
    assert body["n_terms"] == len(exp.paths)
    assert body["terms"][-1]["value"] == pytest.approx(float(exp.remainder[0]), abs=1e-9)
    assert abs(body["terms"][0]["value"]) == pytest.approx(float(exp.values[:, 0].abs().max()), abs=1e-9)
    for term in body["terms"][:3]:
        assert len(term["by_source"]) == len(ids) and sum(term["by_source"]) == pytest.approx(term["value"], abs=1e-9)
        assert all(v == 0 for v in term["by_source"][3:])  # causal: nothing from after the destination


def test_paths_total_in_float32(settings: Settings, tiny: LoadedModel) -> None:
    s32 = settings.model_copy(
        update={"dtype": "float32", "limits": LIMITS.model_copy(update={"matrix_budget_bytes": 16 * MiB})}
    )
    with TestClient(create_app(s32)) as c:
        body = c.get(f"{API}/paths", params={"prompt": PROMPT, "max_order": 2}).json()
    logits, _ = run(tiny, ids_of(tiny))
    # max_order = n_layers: no remainder (defined as value - terms), so the total is a sum of explicit float32 terms
    assert not any(t["kind"] == "remainder" for t in body["terms"])
    assert body["total"] == pytest.approx(body["value"], abs=1e-5)
    assert body["total"] == pytest.approx(float(logits[-1, body["target"]]), abs=1e-4)
    assert body["value"] == pytest.approx(float(logits[-1, body["target"]]), abs=1e-4)


def test_paths_refusals(client: TestClient, tight: TestClient) -> None:
    url = f"{API}/paths"
    assert_problem(
        client.get(url, params={"prompt": PROMPT, "max_order": LIMITS.max_order + 1}),
        422,
        "max_order",
        f"less than or equal to {LIMITS.max_order}",
    )
    assert_problem(client.get(url, params={"prompt": PROMPT, "position": 30}), 422, "position 30", "tokens")
    assert_problem(client.get(url, params={"prompt": PROMPT, "target": 99999}), 422, "99999")
    assert_problem(client.get(url, params={"prompt": PROMPT, "contrast": "the cat"}), 422)
    assert_problem(client.get(url), 422, "exactly one")
    body = assert_problem(tight.get(url, params={"prompt": PROMPT}), 422, "bytes", "budget", "1024")
    assert body["title"] == "Limit exceeded"


# -- prompt patterns ---------------------------------------------------------------------------------------
def test_prompt_patterns_plain_and_value_weighted(client: TestClient, tiny: LoadedModel) -> None:
    ids = ids_of(tiny)
    logits, cache = run(tiny, ids)
    plain = client.get(f"{API}/prompt", params={"prompt": PROMPT, "heads": "L1H2,L0H0"}).json()
    weighted = client.get(f"{API}/prompt", params={"prompt": PROMPT, "heads": "L1H2,L0H0", "weighted": "true"}).json()
    assert [h["head"] for h in plain["heads"]] == ["L1H2", "L0H0"] and weighted["weighted"] is True
    for i, (layer, h) in enumerate([(1, 2), (0, 0)]):
        A = cache[f"blocks.{layer}.attn.hook_pattern"][h]
        norms = cache[f"blocks.{layer}.attn.hook_v"][:, h].norm(dim=-1)
        assert close(plain["heads"][i]["pattern"], A, 1e-12)
        assert close(weighted["heads"][i]["pattern"], A * norms[None, :], 1e-12)
    assert [t["id"] for t in plain["top_predictions"]] == logits.argmax(-1).tolist()
    default = client.get(f"{API}/prompt", params={"prompt": PROMPT}).json()
    assert [h["head"] for h in default["heads"]] == ["L0H0", "L0H1", "L0H2", "L0H3"]  # the first max_heads = 4


def test_prompt_refusals(client: TestClient) -> None:
    url = f"{API}/prompt"
    assert_problem(
        client.get(url, params={"prompt": PROMPT, "heads": "L0H0,L0H1,L0H2,L0H3,L1H0"}), 422, "5 heads", "at most 4"
    )
    assert_problem(client.get(url, params={"prompt": PROMPT, "heads": "L9H0"}), 404, "L9H0")
    assert_problem(client.get(url, params={"prompt": "the " * 60}), 422, "at most 40")


# -- a chain of heads ----------------------------------------------------------------------------------------
def test_path_chain_pattern_ov_and_contribution(roomy: TestClient, tiny: LoadedModel) -> None:
    ids = ids_of(tiny)
    logits, cache = run(tiny, ids)
    body = roomy.get(f"{API}/path", params={"prompt": PROMPT, "heads": "L0H1,L1H3", "k": 4}).json()
    target = int(logits[-1].argmax())
    assert body["heads"] == ["L0H1", "L1H3"] and body["target"]["id"] == target
    A0, A1 = cache["blocks.0.attn.hook_pattern"][1], cache["blocks.1.attn.hook_pattern"][3]
    assert close(body["pattern"], A1 @ A0, 1e-12)
    X0, u = cache["hook_embed"], tiny.model.W_U[:, target]
    want = A1 @ A0 @ X0 @ W_OV(tiny, 0, 1) @ W_OV(tiny, 1, 3) @ u  # [n]
    assert close(body["contribution"], want, 1e-9)
    assert [s["source"] for s in body["by_source"]] == ["embed"]  # no biases, no MLPs in tiny-2l
    virtual = tiny.model.W_E @ W_OV(tiny, 0, 1) @ W_OV(tiny, 1, 3) @ tiny.model.W_U
    assert [e["value"] for e in body["ov"]["entries"]] == pytest.approx(top_entries(virtual, 4), abs=1e-9)
    one = roomy.get(f"{API}/path", params={"prompt": PROMPT, "heads": "L1H0", "target": 3}).json()
    assert close(
        one["contribution"], cache["blocks.1.attn.hook_pattern"][0] @ X0 @ W_OV(tiny, 1, 0) @ tiny.model.W_U[:, 3], 1e-9
    )


def test_path_refusals(client: TestClient) -> None:
    url = f"{API}/path"
    assert_problem(
        client.get(url, params={"prompt": PROMPT, "heads": "L1H0,L0H1"}), 422, "strictly increasing", "L1H0, L0H1"
    )
    assert_problem(client.get(url, params={"prompt": PROMPT, "heads": "L0H0,L0H1"}), 422, "strictly increasing")
    assert_problem(client.get(url, params={"prompt": PROMPT}), 422, "heads")
    assert_problem(client.get(url, params={"prompt": PROMPT, "heads": ","}), 422, "no heads")


# -- QK paths -------------------------------------------------------------------------------------------
def test_qk_paths_sum_to_real_scores(roomy: TestClient, tiny: LoadedModel) -> None:
    ids = ids_of(tiny)
    _, cache = run(tiny, ids)
    body = roomy.get(f"{API}/qk-paths", params={"prompt": PROMPT, "head": "L1H2", "k": 3}).json()
    real = cache["blocks.1.attn.hook_attn_scores"][2]  # [n, n], -inf above the diagonal
    n = len(ids)
    for i in range(n):
        for j in range(n):
            assert (body["scores"][i][j] is None) == (j > i)
            if j <= i:
                assert body["scores"][i][j] == pytest.approx(float(real[i, j]), abs=1e-9)
    assert body["max_abs_error"] < 1e-9
    assert body["components"][:5] == ["embed", "L0H0", "L0H1", "L0H2", "L0H3"]
    exp = expand_scores(tiny.model, torch.tensor(ids), (1, 2))
    assert close(body["std"], exp.std, 1e-12)
    assert [p["std"] for p in body["top_pairs"]] == sorted(exp.std.flatten().tolist(), reverse=True)[:3]
    # the (embed, L0H1) K-composition term, independently: (X0 W_Q + P W_Q)(A0 X0 W_OV W_K)^T / s
    a, b = body["top_pairs"][0]["query"], body["top_pairs"][0]["key"]
    assert close(body["terms"][f"{a}|{b}"], exp.term(a, b).tril(), 1e-12)
    X0, A0 = cache["hook_embed"], cache["blocks.0.attn.hook_pattern"][1]
    term = (X0 @ W(tiny, "W_Q", 1, 2)) @ (A0 @ X0 @ W_OV(tiny, 0, 1) @ W(tiny, "W_K", 1, 2)).T / tiny.model.cfg.scale
    assert torch.allclose(exp.term("embed", "L0H1"), term, atol=1e-12, rtol=0)


def test_qk_paths_refusals(client: TestClient, tight: TestClient) -> None:
    url = f"{API}/qk-paths"
    assert_problem(client.get(url, params={"prompt": PROMPT, "head": "L0H2"}), 422, "layer >= 1")
    assert_problem(client.get(url, params={"prompt": PROMPT}), 422, "head")
    assert_problem(tight.get(url, params={"prompt": PROMPT, "head": "L1H0"}), 422, "bytes", "budget")


def test_openapi_has_the_limits(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()

    def params(path: str) -> dict:
        return {p["name"]: p["schema"] for p in spec["paths"][path]["get"]["parameters"]}

    paths = params("/api/v1/models/{model}/paths")
    assert paths["max_order"]["maximum"] == LIMITS.max_order and paths["k"]["maximum"] == LIMITS.max_k
    assert params("/api/v1/models/{model}/prompt")["heads"]["anyOf"][0]["maxLength"] == LIMITS.max_heads * 12
    assert params("/api/v1/models/{model}/composition")["kind"]["enum"] == ["Q", "K", "V"]
    for path in (
        "composition",
        "composition/{source}/{target}",
        "paths",
        "prompt",
        "path",
        "qk-paths",
        "term-importance",
    ):
        assert f"/api/v1/models/{{model}}/{path}" in spec["paths"], path
    assert "/api/v1/tour" in spec["paths"]


def test_unknown_model_is_404_everywhere(client: TestClient) -> None:
    for path in ("composition", "paths", "prompt", "path", "qk-paths", "term-importance"):
        assert_problem(
            client.get(f"/api/v1/models/nope/{path}", params={"prompt": "x", "heads": "L0H0", "head": "L1H0"}),
            404,
            "nope",
        )


def test_layernorm_model_paths_and_term_importance(roomy: TestClient, tiny_ln: LoadedModel) -> None:
    """tiny-ln (LayerNorm, standard positions): frozen-LN path terms still sum to the real logit."""
    ids = tiny_ln.tokenizer.encode(PROMPT)
    logits, _ = tiny_ln.model.run(torch.tensor([ids]))
    body = roomy.get("/api/v1/models/tiny-ln/paths", params={"prompt": PROMPT, "max_order": 1, "target": 9}).json()
    assert body["value"] == pytest.approx(float(logits[0, -1, 9]), abs=1e-9)
    assert body["total"] == pytest.approx(body["value"], abs=1e-9)
    ti = roomy.get("/api/v1/models/tiny-ln/term-importance", params={"prompt": PROMPT}).json()
    clean = float(F.cross_entropy(logits[0, :-1], torch.tensor(ids[1:])))
    assert ti["clean_loss"] == pytest.approx(clean, abs=1e-9) and ti["loss_by_order"][-1] == pytest.approx(
        clean, abs=1e-9
    )
