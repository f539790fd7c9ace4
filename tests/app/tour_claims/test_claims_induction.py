"""Every tour sentence about the induction circuit is true (F22-F29: the induction head on repeated code, the card's
standard input, K-composition, positivity, losses by order, the chain), and the pages that show them (term
importance, detectors, chain, the tour page and its figures): each value recomputed independently from the shipped
weights in float64 (tests/app/tour_claims_reference.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from app.settings import Settings
from app.tour import paper_claims as pc
from tests.app.tour_claims_reference import (
    ROOT,
    claim,
    copying_scores,
    figure_ids,
    forward,
    twin,
)


def test_f22_f23_induction_head_on_repeated_code(tour, raw):
    m = raw["toy-2l"]
    sentence, values = claim(tour, "F22", pc.InductionMassClaim)
    ids = figure_ids(tour, "F22", "prompt")
    _, cache = forward(m, ids)
    head = int(values.head[3:])
    A = cache["blocks.1.attn.hook_pattern"][head]
    masses = [float(A[i, [j + 1 for j in range(i) if ids[j] == t]].sum()) for i, t in enumerate(ids) if t in ids[:i]]
    assert values.mass == pytest.approx(float(np.mean(masses)), abs=1e-4)
    # the figure is value-weighted (A·‖v‖), so the sentence reads the value-weighted rows, plain beside them
    vnorm = cache["blocks.1.attn.hook_v"][:, head].norm(dim=-1)  # [n] ‖v_j‖ of the head
    W = A * vnorm[None, :]
    W = W / W.sum(1, keepdim=True)
    wm = [float(W[i, [j + 1 for j in range(i) if ids[j] == t]].sum()) for i, t in enumerate(ids) if t in ids[:i]]
    assert values.weighted_mass == pytest.approx(float(np.mean(wm)), abs=1e-4)
    assert f"{np.mean(wm):.2f} of each row's value-weighted attention" in sentence
    assert f"against {np.mean(masses):.2f} of its plain attention" in sentence
    sentence, values = claim(tour, "F23", pc.NextTokenEffectClaim)
    e = twin(tour, "F23")["next_token_effect"]
    ids = [t["id"] for t in e["tokens"]]
    _, cache = forward(m, ids)
    out = cache["blocks.1.attn.hook_pattern"][head] @ cache["blocks.1.hook_resid_pre"] @ m.W_V[1, head] @ m.W_O[1, head]
    effects = [float(out[p] @ m.W_U[:, ids[p + 1]]) for p in range(len(ids) - 1)]
    assert np.allclose(e["effects"], effects, atol=1e-4)
    start, n = e["second_copy_start"], len(ids)
    L = n - start
    assert any(
        ids[j : j + L] == ids[start:] for j in range(n - 2 * L + 1)
    )  # from here on the text repeats an earlier copy
    assert not any(
        ids[j : j + L + 1] == ids[start - 1 :] for j in range(n - 2 * L - 1)
    )  # and it is the longest such suffix
    second = effects[start:]
    assert values.positive == sum(v > 0 for v in second) == len(second) >= 10
    assert f"{min(second):+.2f} to {max(second):+.2f}" in sentence


def test_f24_standard_input_equals_the_card(tour):
    sentence, values = claim(tour, "F24", pc.StandardInputClaim)
    import json

    card = json.loads((ROOT / "toy-2l" / "model_card.json").read_text())["phenomena"]  # checked independently in
    inp = twin(tour, "F24")["detectors"]["detector_input"]  # tests/core/test_shipped_models.py
    assert (inp["seq_len"], inp["batch"], inp["seed"]) == (
        card["detector_input"]["seq_len"],
        card["detector_input"]["batch"],
        card["detector_input"]["seed"],
    )
    assert values.rep1 == pytest.approx(card["rep1_loss"], abs=1e-3)
    assert values.rep2 == pytest.approx(card["rep2_loss"], abs=1e-3)
    assert values.head == card["induction_head"] and values.induction == pytest.approx(
        card["induction_score"], abs=1e-4
    )


def test_f25_k_composition_token_circuit_diagonal(tour, raw):
    sentence, values = claim(tour, "F25", pc.KCompositionDiagonalClaim)
    m = raw["toy-2l"]
    pair = twin(tour, "F25")["pair"]
    s, t = int(pair["source"][3:]), int(pair["target"][3:])
    K = (m.W_E @ m.W_Q[1, t]) @ (
        m.W_E @ m.W_V[0, s] @ m.W_O[0, s] @ m.W_K[1, t]
    ).T  # [V, V] query x key's previous token
    flat = K.flatten().topk(values.k).indices
    assert values.diagonal == int((flat // K.shape[1] == flat % K.shape[1]).sum())


def test_f26_positivity(tour, raw):
    sentence, values = claim(tour, "F26", pc.PositivityCornerClaim)
    m = raw["toy-2l"]
    scores = copying_scores(m)
    prev = int(twin(tour, "F26")["previous_token_head"][3:])
    G = m.W_E.T @ m.W_E
    for head, ov, qk in values.points:
        h = int(head[3:])
        assert ov == pytest.approx(scores[head], abs=1e-4)
        eig = torch.linalg.eigvals(m.W_Q[1, h] @ m.W_K[1, h].T @ (m.W_V[0, prev] @ m.W_O[0, prev]).T @ G)
        eig = eig[eig.abs().argsort(descending=True)[: m.cfg.d_head]]
        assert qk == pytest.approx(float(eig.sum().real / eig.abs().sum()), abs=1e-4), head


def test_f27_f28_losses_by_order(tour, raw):
    m = raw["toy-2l"]
    sentence, values = claim(tour, "F27", pc.LossByOrderClaim)
    ids = twin(tour, "F27")["token_ids"]
    logits, cache = forward(m, ids)
    x0 = cache["hook_embed"]
    A = [cache[f"blocks.{lay}.attn.hook_pattern"] for lay in range(2)]

    def heads_of(layers):
        return sum(A[lay][h] @ x0 @ m.W_V[lay, h] @ m.W_O[lay, h] for lay in layers for h in range(m.cfg.n_heads))

    def loss(resid):
        return float(F.cross_entropy((resid @ m.W_U)[:-1], torch.tensor(ids[1:])))

    l0, l1, l2 = loss(x0), loss(x0 + heads_of([0, 1])), float(F.cross_entropy(logits[:-1], torch.tensor(ids[1:])))
    assert values.losses == pytest.approx([l0, l1, l2], abs=1e-4)
    uniform = math.log(m.cfg.d_vocab)
    assert (uniform - l0) < (l0 - l1) and (l1 - l2) < (
        l0 - l1
    )  # "first-order terms carry most, the direct path little"
    assert f"{l0:.2f}" in sentence and f"{uniform:.2f}" in sentence
    sentence, values = claim(tour, "F28", pc.FirstOrderGainsClaim)
    gains = [l0 - loss(x0 + heads_of([lay])) for lay in range(2)]
    assert values.gains == pytest.approx(gains, abs=1e-4)


def test_term_importance_shows_both_head_ablations(raw):
    """The page's two columns: L0H5 removed with later patterns recomputed == the weight-edited model run plainly."""
    import copy

    from fastapi.testclient import TestClient

    from app.main import create_app

    with TestClient(create_app(Settings(store_url="off"))) as c:
        body = c.get("/api/v1/models/toy-2l/term-importance").json()
        page = c.get("/models/toy-2l/term-importance")
    assert "later patterns recomputed" in page.text and "patterns frozen (Olsson)" in page.text
    ids = torch.tensor([[t["id"] for t in body["tokens"]]])
    m = raw["toy-2l"]
    edited = copy.deepcopy(m)
    with torch.no_grad():
        edited.blocks[0].attn.W_O[5] = 0

    def loss(model) -> float:
        logits = model.run(ids)[0][0]
        return float(F.cross_entropy(logits[:-1], ids[0, 1:]))

    row = next(h for h in body["heads"] if h["head"] == "L0H5")
    assert row["loss_change_recomputed"] == pytest.approx(loss(edited) - loss(m), abs=1e-4)
    assert row["loss_change_recomputed"] > row["loss_change"]


def test_detectors_page_defaults_and_overview_reproduce_the_card():
    """One standard input: the detectors analysis with its default parameters and the heads table (overview) show
    the model card's numbers (which tests/core/test_shipped_models.py re-measures independently)."""
    import json

    from fastapi.testclient import TestClient

    from app.main import create_app

    card = json.loads((ROOT / "toy-2l" / "model_card.json").read_text())["phenomena"]
    with TestClient(create_app(Settings(store_url="off"))) as c:
        det = c.get("/api/v1/models/toy-2l/detectors").json()
        heads = c.get("/api/v1/models/toy-2l/heads").json()
    inp = card["detector_input"]
    assert (det["detector_input"]["seq_len"], det["detector_input"]["batch"], det["detector_input"]["seed"]) == (
        inp["seq_len"],
        inp["batch"],
        inp["seed"],
    )
    assert det["loss"]["first_repeat"] == pytest.approx(card["rep1_loss"], abs=1e-3)
    assert det["loss"]["second_repeat"] == pytest.approx(card["rep2_loss"], abs=1e-3)
    for table in (det["heads"], heads["heads"]):
        by_name = {h["head"]: h for h in table}
        for layer, row in enumerate(card["induction_scores"]):
            for h, value in enumerate(row):
                assert by_name[f"L{layer}H{h}"]["induction"] == pytest.approx(value, abs=2e-4)


def test_chain_page_shows_each_positions_actual_next_token(raw):
    """The chain (virtual head) view plots its path term on each position's own next token, as the paper's figure."""
    from fastapi.testclient import TestClient

    from app.main import create_app
    from app.tour.figures import REPEATED

    with TestClient(create_app(Settings(store_url="off"))) as c:
        body = c.get("/api/v1/models/toy-2l/path", params={"heads": "L0H5,L1H2", "prompt": REPEATED}).json()
        page = c.get("/models/toy-2l/path", params={"heads": "L0H5,L1H2", "prompt": REPEATED})
    assert "actual next token" in page.text
    m = raw["toy-2l"]
    ids = [t["id"] for t in body["tokens"]]
    _, cache = forward(m, ids)
    A0, A1 = cache["blocks.0.attn.hook_pattern"][5], cache["blocks.1.attn.hook_pattern"][2]
    Y = A1 @ A0 @ cache["hook_embed"] @ m.W_V[0, 5] @ m.W_O[0, 5] @ m.W_V[1, 2] @ m.W_O[1, 2]  # [n, d]
    want = [float(Y[p] @ m.W_U[:, ids[p + 1]]) for p in range(len(ids) - 1)]
    assert np.allclose(body["next_token_contribution"], want, atol=1e-4)


def test_tour_page_shows_every_measured_sentence(tour):
    import html

    from fastapi.testclient import TestClient

    from app.main import create_app

    with TestClient(create_app(Settings(store_url="off"))) as c:
        page = html.unescape(c.get("/tour").text)
    measured = [f for f in tour.values() if " Measured: " in f.look_for]
    assert len(measured) >= 19
    for fig in measured:
        assert fig.look_for.split(" Measured: ", 1)[1] in page, fig.id


def test_f29_chain_pattern(tour, raw):
    """F29 had no sentence: the chain's pattern (A^{h2} A^{h1}, recomputed from a plain forward pass) on the
    induction target and on the earlier occurrence."""
    sentence, values = claim(tour, "F29", pc.ChainPatternClaim)
    m = raw["toy-2l"]
    cv = twin(tour, "F29")["path"]
    ids = [t["id"] for t in cv["tokens"]]
    _, cache = forward(m, ids)
    (l1, h1), (l2, h2) = [(int(h[1]), int(h[3:])) for h in values.heads]
    P = cache[f"blocks.{l2}.attn.hook_pattern"][h2] @ cache[f"blocks.{l1}.attn.hook_pattern"][h1]
    rows = [(i, t) for i, t in enumerate(ids) if t in ids[:i]]
    on_next = np.mean([float(P[i, [j + 1 for j in range(i) if ids[j] == t]].sum()) for i, t in rows])
    on_same = np.mean([float(P[i, [j for j in range(i) if ids[j] == t]].sum()) for i, t in rows])
    assert values.mass == pytest.approx(on_next, abs=1e-4) and f"{on_next:.2f} of each query's weight" in sentence
    assert values.mass_on_occurrence == pytest.approx(on_same, abs=1e-4) and f"and {on_same:.2f} on" in sentence
    assert values.rows == len(rows)


def test_tour_figures_draw_what_their_sentences_say(tour):
    """F15's figure shows every position its sentence averages over (it drew 32 of 128); F23's bars each have
    their own label (32 bars had 17 distinct labels, so plotly stacked copies); F26 labels the heads its caption
    names (it left L1H2 unlabelled)."""
    from app.routers.pages_tour import figure_parts

    f15 = figure_parts(tour["F15"])["charts"][0]["data"][0]
    n = twin(tour, "F15")["positional"]["n_positions"]
    assert len(f15["z"]) == len(f15["x"]) == n and f"over {n} positions" in tour["F15"].look_for
    bars = figure_parts(tour["F23"])["charts"][0]["data"][0]
    assert len(set(bars["x"])) == len(bars["x"]) == len(twin(tour, "F23")["next_token_effect"]["effects"])
    scatter = figure_parts(tour["F26"])["charts"][0]["data"][0]
    named = [p[0] for p in twin(tour, "F26")["claim"]["points"]]
    shown = {head for label in scatter["text"] if label for head in label.split(", ")}  # close heads share a label
    assert set(named) <= shown and all(h in tour["F26"].look_for for h in named)
