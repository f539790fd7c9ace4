"""The measured sentences of the page introductions (app/views/shared/page_claims.py) on the shipped toys, against
independent computations: dense float64 products of the stored weights, plain forward passes written out here,
and the model cards (which tests/core/test_shipped_models.py re-measures). A page sentence that stops saying what
these show fails here; so does the paper's claim on toy-2l (its induction head K-composes with its previous-token
head), which the composition page's sentence must report.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.prompt.detectors import repeated_random_tokens
from tests.app.conftest import until_done
from tests.app.tour_claims_reference import copying_scores

ROOT = Path(__file__).resolve().parents[2] / "checkpoints"
SMOLLM2 = ROOT.parent / "models" / "smollm2-135m"
NUM = r"([+-]?\d+\.\d+)"


@pytest.fixture(scope="module")
def client():
    torch.set_num_threads(1)
    with TestClient(create_app(Settings(store_url="off"))) as c:
        yield c


@pytest.fixture(scope="module")
def toy2l():
    return load_checkpoint(ROOT / "toy-2l", dtype=torch.float64, process=False).model


@pytest.fixture(scope="module")
def card2l() -> dict:
    return json.loads((ROOT / "toy-2l" / "model_card.json").read_text())["phenomena"]


def sentence(page: str, element_id: str) -> str:
    found = re.search(rf'id="{element_id}">(.*?)</p>', page, re.S)
    assert found, f"no #{element_id} on the page"
    return html.unescape(found.group(1))


def k_composition_minus_baseline(m, src: tuple[int, int], dst: tuple[int, int]) -> tuple[float, float]:
    """‖W_OV W_QKᵀ‖_F / (‖W_OV‖_F ‖W_QK‖_F) (row convention) and the same minus 1/√d_model, dense float64."""
    W_OV = m.W_V[src] @ m.W_O[src]
    W_QK = m.W_Q[dst] @ m.W_K[dst].T
    score = float(torch.linalg.norm(W_OV @ W_QK.T) / (torch.linalg.norm(W_OV) * torch.linalg.norm(W_QK)))
    return score, score - m.cfg.d_model**-0.5


def test_composition_page_names_the_induction_head_and_its_partner(client, toy2l, card2l):
    page = client.get("/models/toy-2l/composition", params={"kind": "V"}).text  # the K sentence on every kind's page
    said = sentence(page, "composition-claim")
    ind = card2l["induction_scores"]
    layer1 = [float(x) for x in ind[1]]
    head = max(range(len(layer1)), key=layer1.__getitem__)
    partners = {h: k_composition_minus_baseline(toy2l, (0, h), (1, head)) for h in range(toy2l.cfg.n_heads)}
    partner = max(partners, key=lambda h: partners[h][1])
    prev = card2l["previous_token_scores"][0]
    best_prev = max(range(len(prev)), key=lambda h: prev[h])
    assert (head, partner, best_prev) == (2, 5, 5)  # the paper's induction circuit, as the card says
    m = re.search(
        rf"strongest induction head is L1H{head} \(induction score {NUM} on 10 sequences of BOS \+ r \+ r\); "
        rf"its strongest K-composition partner is L0H{partner} \({NUM}, {NUM} over the baseline\), the strongest "
        rf"previous-token head of the earlier layers \(score {NUM}\)\.",
        said,
    )
    assert m, said
    assert float(m.group(1)) == pytest.approx(layer1[head], abs=0.006)
    assert float(m.group(2)) == pytest.approx(partners[partner][0], abs=6e-4)
    assert float(m.group(3)) == pytest.approx(partners[partner][1], abs=6e-4)
    assert float(m.group(4)) == pytest.approx(prev[best_prev], abs=0.006)
    assert "In the paper, induction heads K-compose with a previous-token head" in page
    assert (
        'id="composition-claim"'
        not in client.get("/models/toy-2l/composition", params={"kind": "K", "offset": 0}).text.split(
            "composition_panel"
        )[0]
    )  # the sentence sits in the panel, under the heat map


def bias(obj, name: str):  # noqa: ANN001, ANN201
    """A bias of the stored weights, or 0 where the model has none (the toys have no biases)."""
    b = getattr(obj, name, None)
    return 0.0 if b is None else b


def next_token_loss(m, tokens: torch.Tensor) -> torch.Tensor:
    """[batch, n - 1] losses of a plain forward pass of an attention-only, LayerNorm-free shortformer model, written
    out: q/k read the residual plus W_pos, v the residual; softmax(causal(q k^T / √d_head))."""
    b, n = tokens.shape
    resid = m.W_E[tokens]  # [b, n, d]
    pos = m.W_pos[:n]
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    for layer in range(m.cfg.n_layers):
        blk = m.blocks[layer].attn
        qk_in = resid + pos
        q = torch.einsum("bnd,hde->bhne", qk_in, blk.W_Q) + (bias(blk, "b_Q")[None, :, None] if m.cfg.use_bias else 0.0)
        k = torch.einsum("bnd,hde->bhne", qk_in, blk.W_K) + (bias(blk, "b_K")[None, :, None] if m.cfg.use_bias else 0.0)
        v = torch.einsum("bnd,hde->bhne", resid, blk.W_V) + (bias(blk, "b_V")[None, :, None] if m.cfg.use_bias else 0.0)
        scores = (q @ k.transpose(-1, -2)) / m.cfg.d_head**0.5
        A = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        resid = resid + torch.einsum("bhne,hed->bnd", A @ v, blk.W_O) + bias(blk, "b_O")
    logits = resid @ m.W_U + bias(m, "b_U")
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none")


@pytest.mark.parametrize("name", ["toy-1l", "toy-2l"])
def test_detectors_page_says_whether_the_loss_drops(client, name):
    m = load_checkpoint(ROOT / name, dtype=torch.float64, process=False).model
    page = client.get(f"/models/{name}/detectors").text
    said = sentence(page, "loss-claim")
    T = 50
    bos = json.loads(client.get(f"/api/v1/models/{name}").text)["bos_token_id"]
    tokens = repeated_random_tokens(
        m.cfg.d_vocab, T, 10, seed=0, bos=bos
    )  # the standard input (its draw, not its maths)
    losses = next_token_loss(m, tokens).mean(0)  # [2T]: with BOS, [0:T] predict the first copy
    first, second = float(losses[:T].mean()), float(losses[T : 2 * T].mean())
    if name == "toy-2l":
        assert second < first - 5  # an induction head: the second copy is predicted
    if second < first:
        found = re.search(rf"drops by {NUM} nats", said)
        assert found and float(found.group(1)) == pytest.approx(first - second, abs=2e-3), said
    else:
        assert "does not drop" in said
    assert "the loss drops on the second copy." not in page  # no longer stated of every model


def test_term_importance_page_reports_the_previous_token_head_ablation(client, toy2l, card2l):
    body = client.get("/api/v1/models/toy-2l/term-importance").json()
    said = sentence(client.get("/models/toy-2l/term-importance").text, "ablation-claim")
    ids = torch.tensor([[t["id"] for t in body["tokens"]]])
    prev = card2l["previous_token_scores"][0]
    h = max(range(len(prev)), key=lambda i: prev[i])
    m = toy2l
    clean = next_token_loss(m, ids).mean()
    # frozen: layer 0 without head h; layer 1 keeps its clean patterns, its values read the ablated stream
    n = ids.shape[1]
    resid0 = m.W_E[ids[0]]
    pos = m.W_pos[:n]
    mask = torch.ones(n, n, dtype=torch.bool).tril()

    def layer(l_: int, qk_in: torch.Tensor, v_in: torch.Tensor, drop: int | None, A_fixed=None):  # noqa: ANN001, ANN202
        blk = m.blocks[l_].attn
        q = torch.einsum("nd,hde->hne", qk_in, blk.W_Q) + (bias(blk, "b_Q")[:, None] if m.cfg.use_bias else 0.0)
        k = torch.einsum("nd,hde->hne", qk_in, blk.W_K) + (bias(blk, "b_K")[:, None] if m.cfg.use_bias else 0.0)
        A = (q @ k.transpose(-1, -2) / m.cfg.d_head**0.5).masked_fill(~mask, float("-inf")).softmax(-1)
        A = A if A_fixed is None else A_fixed
        z = A @ (
            torch.einsum("nd,hde->hne", v_in, blk.W_V) + (bias(blk, "b_V")[:, None] if m.cfg.use_bias else 0.0)
        )  # [H, n, d_head]
        keep = torch.ones(m.cfg.n_heads, dtype=z.dtype)
        if drop is not None:
            keep[drop] = 0
        return torch.einsum("hne,hed,h->nd", z, blk.W_O, keep) + bias(blk, "b_O"), A

    out0_clean, _ = layer(0, resid0 + pos, resid0, None)
    _, A1_clean = layer(1, resid0 + out0_clean + pos, resid0 + out0_clean, None)
    out0, _ = layer(0, resid0 + pos, resid0, h)
    out1, _ = layer(1, resid0 + out0 + pos, resid0 + out0, None, A1_clean)
    logits = (resid0 + out0 + out1) @ m.W_U + bias(m, "b_U")
    frozen = float(F.cross_entropy(logits[:-1], ids[0, 1:])) - float(clean)
    out1r, _ = layer(1, resid0 + out0 + pos, resid0 + out0, None)
    recomputed = float(F.cross_entropy(((resid0 + out0 + out1r) @ m.W_U + bias(m, "b_U"))[:-1], ids[0, 1:])) - float(
        clean
    )
    found = re.search(
        rf"removing the previous-token head L0H{h} changes the loss by {NUM} nats with every other pattern "
        rf"frozen and by {NUM} with the later patterns recomputed",
        said,
    )
    assert found, said
    assert float(found.group(1)) == pytest.approx(frozen, abs=2e-3)
    assert float(found.group(2)) == pytest.approx(recomputed, abs=2e-3)
    assert recomputed > 10 * abs(frozen)  # the intro's point, on this model: frozen, the head looks unimportant


def test_overview_scatter_places_the_induction_head(client, toy2l, card2l):
    said = sentence(client.get("/models/toy-2l").text, "scatter-claim")
    prev = card2l["previous_token_scores"][0]
    p = max(range(len(prev)), key=lambda i: prev[i])
    m = toy2l
    ov = copying_scores(m)
    G = m.W_E.T @ m.W_E
    pos = {}
    for h in range(m.cfg.n_heads):  # K-composition positivity with the previous-token head, dense eigenvalues
        eig = torch.linalg.eigvals(m.W_Q[1, h] @ m.W_K[1, h].T @ (m.W_V[0, p] @ m.W_O[0, p]).T @ G)
        eig = eig[eig.abs().argsort(descending=True)[: m.cfg.d_head]]
        pos[h] = float(eig.sum().real / eig.abs().sum())
    ind = card2l["induction_scores"][1]
    i = max(range(len(ind)), key=lambda h: ind[h])
    rank_pos = 1 + sum(pos[h] > pos[i] for h in pos)
    rank_ov = 1 + sum(ov[f"L1H{h}"] > ov[f"L1H{i}"] for h in pos)
    assert rank_pos == 1  # top on the paper's vertical axis
    assert (
        f"The strongest induction head, L1H{i} (induction score {ind[i]:.2f}), ranks {rank_pos} of {m.cfg.n_heads} on "
        f"K-composition positivity and {rank_ov} on OV copying."
    ) == said


def test_positivity_analysis_equals_dense_eigenvalues_and_fits_its_price(client, toy2l, card2l):
    """GET .../positivity (the overview's scatter): every layer-1 head's K-composition positivity with the
    previous-token head equals the dense [d_model, d_model] eigenvalue computation, and the answer fits its price."""
    from app.analysis import BoundAnalyses
    from app.views.positivity import POSITIVITY

    answer = client.get("/api/v1/models/toy-2l/positivity")
    assert answer.status_code == 200, answer.text
    got = answer.json()
    prev = card2l["previous_token_scores"][0]
    p = max(range(len(prev)), key=lambda i: prev[i])
    assert got["previous_token_head"] == f"L0H{p}"
    m = toy2l
    G = m.W_E.T @ m.W_E  # toy-2l has no LayerNorm: W_E_eff = W_E
    for point in got["points"]:
        h = int(point["head"].split("H")[1])
        eig = torch.linalg.eigvals(m.W_Q[1, h] @ m.W_K[1, h].T @ (m.W_V[0, p] @ m.W_O[0, p]).T @ G)
        eig = eig[eig.abs().argsort(descending=True)[: m.cfg.d_head]]
        assert point["k_composition_positivity"] == pytest.approx(float(eig.sum().real / eig.abs().sum()), abs=1e-4)
    assert [pt["head"] for pt in got["points"]] == [f"L1H{h}" for h in range(m.cfg.n_heads)]
    app = client.app
    declared: BoundAnalyses = app.state.analyses
    loaded = app.state.registry.get("toy-2l")
    cost = POSITIVITY.cost(loaded, declared.bound(POSITIVITY).model_validate({}), app.state.settings.limits)
    assert len(answer.content) <= cost.answer_bytes and cost.peak_bytes > 0 and cost.flops > 0


@pytest.mark.skipif(not SMOLLM2.exists(), reason="SmolLM2-135M not fetched (make smollm2)")
def test_smollm2_detectors_page_loss_sentence():
    """The fetched model: the detectors page's sentence agrees with its measured summary (model_summary.json,
    checked against transformers in tests/core/test_smollm2.py)."""
    summary = json.loads((SMOLLM2 / "model_summary.json").read_text())
    with TestClient(create_app(Settings(store_url="off", models_dir=SMOLLM2.parent))) as c:
        said = sentence(until_done(c, "/models/smollm2-135m/detectors").text, "loss-claim")
    found = re.search(rf"drops by {NUM} nats", said)
    assert found, said
    assert float(found.group(1)) == pytest.approx(summary["loss_first_copy"] - summary["loss_second_copy"], abs=0.02)


def test_direct_page_counts_the_rare_tokens_of_its_table(client):
    """All tokens ranked on toy-0l: the sentence counts the table's tokens seen < 50 times in training, checked with
    the dense float64 W_E W_U of the stored weights and the counts file."""
    import numpy as np

    from circuits_core.prompt.phenomena import MIN_TRAIN_COUNT

    m = load_checkpoint(ROOT / "toy-0l", dtype=torch.float64, process=False).model
    k = 20
    flat = (m.W_E @ m.W_U).flatten().topk(k).indices
    tokens = {int(i) for i in flat // m.cfg.d_vocab} | {int(i) for i in flat % m.cfg.d_vocab}
    counts = np.load(ROOT / "toy-0l" / "token_counts.npy")
    rare = sum(int(counts[t]) < MIN_TRAIN_COUNT for t in tokens)
    assert 0 < rare < len(tokens)  # some, not all: the sentence's count is not 0 (or all) by default
    said = html.unescape(
        re.search(
            r'id="rare-claim">(.*?)</span>',
            client.get("/models/toy-0l/direct", params={"k": k, "min_count": "all"}).text,
        ).group(1)
    )
    assert (
        said
        == f"Of the {len(tokens)} distinct tokens in this table, {rare} were seen fewer than {MIN_TRAIN_COUNT} times "
        f"in training."
    )
    assert (
        'id="rare-claim"' not in client.get("/models/toy-0l/direct", params={"k": k}).text
    )  # frequent tokens: no such line
