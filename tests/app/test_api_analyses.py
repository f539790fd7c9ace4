"""API of the composition and prompt analyses: each endpoint's numbers against direct, independent engine computations
on the same tiny model (dense float64 matrices, real forward passes), and every refusal as problem+json.

tiny-2l: 2 layers x 4 heads, d_model 32, shortformer positions, no LayerNorm, no biases (conftest.py), so the
frozen-attention path terms have simple dense forms: x_L = X0 + sum A X0 W_OV + ..., logits = x_L W_U.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from circuits_core.circuits import embedding
from circuits_core.circuits.composition import composition_scores
from circuits_core.circuits.composition_baseline import BASELINE_SAMPLES
from circuits_core.formats.checkpoint import LoadedModel, load_checkpoint
from circuits_core.model.config import ModelConfig
from circuits_core.prompt.ablation import head_ablation, lm_loss, order_logits
from circuits_core.prompt.paths import expand_logits
from circuits_core.prompt.qk_paths import expand_scores
from tests.app.conftest import LIMITS, assert_problem, save_qkov, train_tokenizer

MiB = 1024 * 1024
API = "/api/v1/models/tiny-2l"
PROMPT = "the cat sat on the mat"


def _client(settings: Settings, **limits: int) -> Iterator[TestClient]:
    with TestClient(create_app(settings.model_copy(update={"limits": LIMITS.model_copy(update=limits)}))) as c:
        yield c


@pytest.fixture(scope="module")
def roomy(settings: Settings) -> Iterator[TestClient]:
    """The conftest models with a dense-work budget large enough for every analysis of the tiny models."""
    yield from _client(settings, matrix_budget_bytes=16 * MiB)


@pytest.fixture(scope="module")
def tight(settings: Settings) -> Iterator[TestClient]:
    yield from _client(settings, matrix_budget_bytes=1024, peak_bytes=1024)  # every priced request is over it


def run(tiny: LoadedModel, ids: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logits, cache = tiny.model.run(torch.tensor([ids]), names=lambda n: True)
    return logits[0], {k: v[0] for k, v in cache.items()}


def ids_of(tiny: LoadedModel, text: str = PROMPT) -> list[int]:
    return tiny.tokenizer.encode(text)


def W(tiny: LoadedModel, name: str, layer: int, h: int) -> torch.Tensor:
    return getattr(tiny.model, name)[layer, h]


def W_OV(tiny: LoadedModel, layer: int, h: int) -> torch.Tensor:
    return W(tiny, "W_V", layer, h) @ W(tiny, "W_O", layer, h)  # [d, d]


def close(got: object, want: torch.Tensor, atol: float) -> bool:
    return torch.allclose(torch.tensor(got, dtype=torch.float64), want.double(), atol=atol, rtol=0)


def top_entries(M: torch.Tensor, k: int) -> list[float]:
    return M.flatten().topk(k).values.tolist()


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


# -- term importance ---------------------------------------------------------------------------------------
def test_term_importance_losses(roomy: TestClient, tiny: LoadedModel) -> None:
    ids = ids_of(tiny)
    logits, cache = run(tiny, ids)
    body = roomy.get(f"{API}/term-importance", params={"prompt": PROMPT}).json()
    target = torch.tensor(ids[1:])

    def loss(lg: torch.Tensor) -> float:
        return float(F.cross_entropy(lg[:-1], target))

    model = tiny.model
    X0 = cache["hook_embed"]
    A = [cache[f"blocks.{layer}.attn.hook_pattern"] for layer in range(2)]
    first = [sum(A[layer][h] @ X0 @ W_OV(tiny, layer, h) for h in range(4)) for layer in range(2)]
    assert body["text_source"] == "prompt" and [t["id"] for t in body["tokens"]] == ids
    assert body["clean_loss"] == pytest.approx(loss(logits), abs=1e-9)
    want = [loss(X0 @ model.W_U), loss((X0 + first[0] + first[1]) @ model.W_U), loss(logits)]
    assert body["loss_by_order"] == pytest.approx(want, abs=1e-9)
    assert body["marginal_by_order"] == pytest.approx([want[0] - want[1], want[1] - want[2]], abs=1e-9)
    assert body["first_order_by_layer"] == pytest.approx(
        [want[0] - loss((X0 + f) @ model.W_U) for f in first], abs=1e-9
    )
    # a last-layer head has nothing downstream: ablating it removes exactly its result vector
    result = cache["blocks.1.attn.hook_pattern"][1] @ cache["blocks.1.attn.hook_v"][:, 1] @ W(tiny, "W_O", 1, 1)
    ablated = next(h for h in body["heads"] if h["head"] == "L1H1")
    assert ablated["loss_change"] == pytest.approx(loss(logits - result @ model.W_U) - loss(logits), abs=1e-9)
    assert len(body["heads"]) == 8


def test_term_importance_default_text_and_refusals(roomy: TestClient, tight: TestClient) -> None:
    body = roomy.get(f"{API}/term-importance").json()
    assert body["text_source"] == "builtin" and len(body["tokens"]) == LIMITS.max_prompt_tokens  # clipped to the limit
    assert_problem(roomy.get(f"{API}/term-importance", params={"tokens": "5"}), 422, "at least 2 tokens")
    assert_problem(tight.get(f"{API}/term-importance"), 422, "bytes", "budget")


def test_term_importance_on_an_mlp_model(tmp_path_factory: pytest.TempPathFactory) -> None:
    """MLP models are served (no refusal): each MLP's clean output is an order-0 source kept in every rerun, the
    numbers are the engine's (order reruns, head ablations) and the order-n_layers loss is the real clean loss."""
    root = tmp_path_factory.mktemp("mlp")
    tok = train_tokenizer()
    cfg = ModelConfig(
        n_layers=2,
        d_model=16,
        n_heads=2,
        d_head=8,
        d_vocab=tok.get_vocab_size(),
        n_ctx=32,
        attn_only=False,
        d_mlp=32,
        act_fn="gelu_new",
        normalization_type="LN",
        positional_embedding_type="standard",
    )
    save_qkov(root / "tiny-mlp", cfg, tok, seed=5)
    settings = Settings(
        shipped_dir=root, dtype="float64", limits=LIMITS.model_copy(update={"matrix_budget_bytes": 16 * MiB})
    )
    with TestClient(create_app(settings)) as c:
        response = c.get("/api/v1/models/tiny-mlp/term-importance", params={"prompt": PROMPT})
    assert response.status_code == 200, response.text
    body = response.json()
    loaded = load_checkpoint(root / "tiny-mlp", dtype=torch.float64)
    seq = torch.tensor([[t["id"] for t in body["tokens"]]])
    per_order = order_logits(loaded.model, seq)
    losses = [float(lm_loss(lg, seq)) for lg in per_order]
    assert body["loss_by_order"] == pytest.approx(losses, abs=1e-9)
    assert body["clean_loss"] == pytest.approx(float(lm_loss(loaded.model.run(seq)[0], seq)), abs=1e-9) == losses[-1]
    assert body["marginal_by_order"] == pytest.approx([losses[0] - losses[1], losses[1] - losses[2]], abs=1e-9)
    # the order-0 rerun keeps the MLPs: it is the order-0 total of the path expansion, MLP sources included
    exp = expand_logits(loaded.model, seq[0], 3, positions=None, max_order=0)
    assert any(p == ("mlp:L1",) for p in exp.paths)
    assert close(per_order[0][0, :, 3].tolist(), exp.values.sum(0), 1e-9)
    heads = head_ablation(loaded.model, seq)
    assert [h["loss_change"] for h in body["heads"]] == pytest.approx(heads.flatten().tolist(), abs=1e-9)


# -- tour and OpenAPI ----------------------------------------------------------------------------------------
def test_tour_degrades_without_the_shipped_models(client: TestClient) -> None:
    body = client.get("/api/v1/tour").json()
    assert body["models"] == {"toy-0l": False, "toy-1l": False, "toy-2l": False}
    ids = [f["id"] for f in body["figures"]]
    paper = [f"F{i}" for i in range(6, 31)]  # the paper's figures, in order; chapters (F2-F4, R1-R3) may join them
    assert [i for i in ids if i in paper] == paper and len(set(ids)) == len(ids)
    for fig in body["figures"]:
        assert fig["anchor"].startswith("https://transformer-circuits.pub/2021/framework/index.html#")
        if fig["model"] is not None:
            assert not fig["available"] and fig["model"] in fig["detail"] and fig["data"] is None
        else:
            assert fig["available"] and fig["data"] is None  # static figures


def test_the_smollm2_chapter_is_its_own_page_and_degrades_without_the_model(client: TestClient) -> None:
    paper = [f["id"] for f in client.get("/api/v1/tour").json()["figures"]]
    body = client.get("/api/v1/tour", params={"chapter": "smollm2"}).json()
    assert [f["id"] for f in body["figures"]] == ["R1", "R2", "R3"] and not set(paper) & {"R1", "R2", "R3"}
    assert all(not f["available"] and "make smollm2" in f["detail"] for f in body["figures"])
    page = client.get("/tour", params={"chapter": "smollm2"})
    assert page.status_code == 200 and page.text.count('class="tour-step"') == 3 and "SmolLM2-135M" in page.text
    assert client.get("/api/v1/tour", params={"chapter": "gpt5"}).status_code == 422


@pytest.fixture(scope="module")
def toy_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """Tiny stand-ins for the shipped toy-0l, toy-1l and toy-2l."""
    root = tmp_path_factory.mktemp("toys")
    tok = train_tokenizer()
    for layers in (0, 1, 2):
        cfg = ModelConfig(n_layers=layers, d_model=16, n_heads=2, d_head=8, d_vocab=tok.get_vocab_size(), n_ctx=64)
        save_qkov(root / f"toy-{layers}l", cfg, tok, seed=10 + layers)
    settings = Settings(
        shipped_dir=root, dtype="float64", limits=LIMITS.model_copy(update={"matrix_budget_bytes": 16 * MiB})
    )
    with TestClient(create_app(settings)) as c:
        yield c


def test_tour_on_toy_models_matches_the_full_views(toy_client: TestClient) -> None:
    body = toy_client.get("/api/v1/tour").json()
    assert body["models"] == {"toy-0l": True, "toy-1l": True, "toy-2l": True}
    figs = {f["id"]: f for f in body["figures"]}
    # These toys have random weights: no head of toy-2l reaches the 0.4 induction score, so the figures that name
    # "the induction head" are refused and say which head came closest (its score from the heads table), never drawn.
    heads = toy_client.get("/api/v1/models/toy-2l/heads").json()["heads"]
    best = max((h for h in heads if h["layer"] >= 1), key=lambda h: h["induction"])
    assert best["induction"] < 0.4
    refused = (
        f"no induction head: the strongest, {best['head']}, scores {best['induction']:.2f} (< 0.4) "
        "on the standard input"
    )
    missing = {f["id"]: f["detail"] for f in body["figures"] if not f["available"]}
    assert missing and all(detail == refused for detail in missing.values()), missing
    assert set(missing) <= {"F20", "F22", "F23", "F25", "F26", "F29"}  # the figures of the induction circuit only
    f21 = figs["F21"]
    assert (
        f21["link"] == "/models/toy-2l/composition?kind=K" and f21["api"] == "/api/v1/models/toy-2l/composition?kind=K"
    )
    f9 = figs["F9"]["data"]["paths"]
    assert f9["total"] == pytest.approx(f9["value"], abs=1e-9)
    assert figs["F10"]["link"].startswith("/models/toy-1l/heads/L0H") and "/ov?" in figs["F10"]["api"]
    same = {
        "F6": "direct",
        "F9": "paths",
        "F10": "ov",
        "F11": "skip_trigrams",
        "F14": "qk",
        "F19": "paths",
        "F21": "K",
        "F22": "prompt",
        "F24": "detectors",
        "F25": "pair",
        "F29": "path",
    }
    for fig_id, part in same.items():  # the tour's data is exactly its full view's JSON
        if fig_id in missing:
            continue
        assert figs[fig_id]["data"][part] == toy_client.get(figs[fig_id]["api"]).json(), fig_id
    assert len(set(same) - set(missing)) >= 8


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
