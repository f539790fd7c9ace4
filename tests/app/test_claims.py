"""Every tour sentence about a shipped model is true: each measured value is recomputed here independently.

The tour (app/tour/tour.py) is built as the app serves it (float32, the registry's processing) on the shipped
toy models in checkpoints/. The references below read the raw safetensors in float64 and use dense matrices
and plain forward passes -- none of the engine's factored circuits, path expansion or detectors. A sentence
whose value changes (retrained weights, a changed figure, a bug) fails here.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from app.registry import ModelRegistry
from app.settings import Settings
from app.tour import paper_claims as pc
from app.tour.tour import build_tour_view
from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.prompt.phenomena import MIN_TRAIN_COUNT, EvalData

ROOT = Path(__file__).resolve().parents[2] / "checkpoints"
TOYS = ("toy-0l", "toy-1l", "toy-2l")
C = TypeVar("C", bound=pc.FigureClaim)


@pytest.fixture(scope="module")
def served() -> tuple[dict[str, Any], ModelRegistry]:
    torch.set_num_threads(1)
    settings = Settings(store_url="off")
    registry = ModelRegistry(settings)
    view = build_tour_view(registry, settings.limits)
    return {f.id: f for f in view.figures}, registry


@pytest.fixture(scope="module")
def tour(served):
    return served[0]


@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    """The shipped weights exactly as stored, float64, no processing."""
    return {name: load_checkpoint(ROOT / name, dtype=torch.float64, process=False).model for name in TOYS}


@pytest.fixture(scope="module")
def data() -> EvalData:
    return EvalData.load(ROOT / "eval_data.npz")


def twin(tour, fig_id: str) -> dict[str, Any]:
    """The figure's data as its JSON twin serves it."""
    return tour[fig_id].data.model_dump(mode="json")


def claim(tour, fig_id: str, kind: type[C]) -> tuple[str, C]:
    """The figure's sentence and its measured values, read back from the figure's data as its claim type."""
    fig = tour[fig_id]
    assert fig.available, fig.detail
    return fig.look_for, kind.model_validate(fig.data.claim)


def frequent(data: EvalData) -> torch.Tensor:
    return torch.from_numpy(np.flatnonzero(data.train_counts >= MIN_TRAIN_COUNT)).long()


def dense_ov(m, layer: int, h: int) -> torch.Tensor:
    return m.W_E @ m.W_V[layer, h] @ m.W_O[layer, h] @ m.W_U  # [V, V] (no LayerNorm in the toys)


def copying_scores(m) -> dict[str, float]:
    """Eigenvalue copying score of every head from the dense [d, d] W_V W_O W_U W_E (its d_head largest eigenvalues)."""
    out = {}
    for layer in range(m.cfg.n_layers):
        for h in range(m.cfg.n_heads):
            eig = torch.linalg.eigvals(m.W_V[layer, h] @ m.W_O[layer, h] @ m.W_U @ m.W_E)
            eig = eig[eig.abs().argsort(descending=True)[: m.cfg.d_head]]
            out[f"L{layer}H{h}"] = float(eig.sum().real / eig.abs().sum())
    return out


def forward(m, ids: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logits, cache = m.run(torch.tensor([ids]), names=lambda n: True)
    return logits[0], {k: v[0] for k, v in cache.items()}


# -- one basis ------------------------------------------------------------------------------------------------
def test_the_three_toys_are_served_on_the_raw_basis(served, raw):
    _, registry = served
    for name in TOYS:
        served_model = registry.get(name).model
        for attr in ("W_E", "W_U") + (("W_Q", "W_K", "W_V", "W_O") if raw[name].cfg.n_layers else ()):
            torch.testing.assert_close(
                getattr(served_model, attr).double(), getattr(raw[name], attr), atol=1e-6, rtol=0
            )


# -- zero and one layer ---------------------------------------------------------------------------------------
def test_f6_direct_path_top_entries_and_held_out_bigrams(tour, raw, data):
    sentence, values = claim(tour, "F6", pc.DirectPathBigramsClaim)
    m, vocab = raw["toy-0l"], frequent(data)
    block = m.W_E[vocab] @ m.W_U[:, vocab]  # [F, F] dense, frequent tokens only
    top = block.flatten().topk(len(values.pairs)).indices
    want = [(int(vocab[i // len(vocab)]), int(vocab[i % len(vocab)])) for i in top.tolist()]
    assert [tuple(p) for p in values.pairs] == want
    a, b = data.val[:-1].astype(np.int64), data.val[1:].astype(np.int64)
    counts = [int(((a == x) & (b == y) & (a != data.eot)).sum()) for x, y in want]
    assert values.held_out_counts == counts
    assert f"{sum(c > 0 for c in counts)} of them occur as bigrams" in sentence and "raw weights" in sentence


def test_f9_terms_sum_to_the_real_logit(tour, raw):
    sentence, values = claim(tour, "F9", pc.PathTermsSumClaim)
    paths = twin(tour, "F9")["paths"]
    logits, _ = forward(raw["toy-1l"], paths["tokens"])
    assert values.value == pytest.approx(float(logits[-1, values.target]), abs=1e-4)
    assert values.total == pytest.approx(float(logits[-1, values.target]), abs=1e-4)
    assert f"{values.value:.4f}" in sentence


def test_f10_f12_f14_heads_and_token_level_copying(tour, raw):
    m = raw["toy-1l"]
    scores = copying_scores(m)
    ranked = sorted(scores, key=lambda h: -scores[h])
    sentence, values = claim(tour, "F10", pc.TokenCopyingClaim)
    assert values.head == ranked[0] and claim(tour, "F14", pc.QueryRowClaim)[1].head == ranked[0]
    f14 = claim(tour, "F14", pc.QueryRowClaim)[1]  # one query's row of the full QK circuit, among frequent tokens
    counts = np.load(ROOT / "toy-1l" / "token_counts.npy")
    vocab = torch.from_numpy(np.flatnonzero(counts >= MIN_TRAIN_COUNT)).long()
    h = int(ranked[0][3:])
    row = (m.W_E[f14.query] @ m.W_Q[0, h]) @ (m.W_E[vocab] @ m.W_K[0, h]).T / math.sqrt(m.cfg.d_head)
    assert f14.keys == vocab[row.topk(len(f14.keys)).indices].tolist()
    assert claim(tour, "F12", pc.SecondCopyingHeadClaim)[1].head == ranked[1]
    M = dense_ov(m, 0, int(ranked[0][3:]))
    own = torch.arange(M.shape[0])
    top1 = float((M.argmax(1) == own).double().mean())
    top10 = float((M.topk(10, dim=1).indices == own[:, None]).any(1).double().mean())
    assert values.top1 == pytest.approx(top1, abs=1e-9) and values.top10 == pytest.approx(top10, abs=1e-9)
    flat = M.flatten().topk(10).indices
    assert values.diagonal == int((flat // M.shape[1] == flat % M.shape[1]).sum())
    assert f"only {top1:.2%}" in sentence and f"top-10: {top10:.2%}" in sentence
    assert values.score == pytest.approx(scores[ranked[0]], abs=1e-4)


def test_f11_copying_source(tour, raw, data):
    sentence, values = claim(tour, "F11", pc.CopyingSourceClaim)
    vocab = frequent(data)
    m = raw["toy-1l"]
    block = dense_ov(m, 0, int(values.head[3:]))[vocab][:, vocab]  # [F, F]
    row = int((vocab == values.source).nonzero()[0, 0])
    assert int(vocab[int(block[row].argmax())]) == values.source == values.top_out  # it copies
    share = float((block.argmax(1) == torch.arange(len(vocab))).double().mean())
    assert values.share == pytest.approx(share, abs=1e-9) and f"{share:.1%}" in sentence


def test_f15_positional_head(tour, raw):
    sentence, values = claim(tour, "F15", pc.PositionalHeadClaim)
    m = raw["toy-1l"]
    tokens = torch.cat(
        [
            torch.zeros(10, 1, dtype=torch.long),
            (r := torch.randint(0, m.cfg.d_vocab, (10, 50), generator=torch.Generator().manual_seed(0))),
            r,
        ],
        dim=1,
    )  # the standard input
    _, cache = m.run(tokens, names=lambda n: n.endswith("hook_pattern"))
    A = cache["blocks.0.attn.hook_pattern"]
    prev = torch.stack([A[:, :, i, i - 1] for i in range(1, tokens.shape[1])], -1).mean((0, 2))
    head = int(prev.argmax())
    assert values.head == f"L0H{head}"
    n = m.cfg.n_ctx
    scores = m.W_pos @ m.W_Q[0, head] @ m.W_K[0, head].T @ m.W_pos.T / math.sqrt(m.cfg.d_head)
    pattern = torch.softmax(scores.masked_fill(torch.ones(n, n).triu(1).bool(), -math.inf), -1)
    assert values.previous == pytest.approx(float(pattern.diagonal(-1).mean()), abs=1e-4)
    assert values.current == pytest.approx(float(pattern.diagonal().mean()), abs=1e-4)


def test_f17_positive_eigenvalues(tour, raw):
    sentence, values = claim(tour, "F17", pc.PositiveEigenvaluesClaim)
    m = raw["toy-1l"]
    for h in range(m.cfg.n_heads):
        eig = torch.linalg.eigvals(m.W_V[0, h] @ m.W_O[0, h] @ m.W_U @ m.W_E)
        eig = eig[eig.abs().argsort(descending=True)[: m.cfg.d_head]]
        count = int((eig.real > 0).sum())
        assert values.positive[f"L0H{h}"] == count and f"L0H{h} {count}/{m.cfg.d_head}" in sentence


def test_f18_copying_scores_baseline_and_self_copy(tour, raw):
    sentence, values = claim(tour, "F18", pc.CopyingScoresClaim)
    m = raw["toy-1l"]
    scores = copying_scores(m)
    assert values.positive == sum(s > 0 for s in scores.values()) and values.n == len(scores)
    assert values.low == pytest.approx(min(scores.values()), abs=1e-4)
    assert values.high == pytest.approx(max(scores.values()), abs=1e-4)
    gen = torch.Generator().manual_seed(0)  # copying.random_ov_weights' documented stream
    W_V = torch.randn(200, m.cfg.d_model, m.cfg.d_head, generator=gen, dtype=torch.float64)
    W_O = torch.randn(200, m.cfg.d_head, m.cfg.d_model, generator=gen, dtype=torch.float64)
    base = []
    for i in range(200):
        eig = torch.linalg.eigvals(W_V[i] @ W_O[i] @ m.W_U @ m.W_E)
        eig = eig[eig.abs().argsort(descending=True)[: m.cfg.d_head]]
        base.append(float(eig.sum().real / eig.abs().sum()))
    assert values.baseline_mean == pytest.approx(float(np.mean(base)), abs=1e-3)
    assert values.baseline_std == pytest.approx(float(np.std(base, ddof=1)), abs=1e-3)
    own = torch.arange(m.cfg.d_vocab)
    top1 = max(float((dense_ov(m, 0, h).argmax(1) == own).double().mean()) for h in range(m.cfg.n_heads))
    assert values.max_top1 == pytest.approx(top1, abs=1e-9) and f"{top1:.2%}" in sentence
    assert abs(values.baseline_mean) + 2 * values.baseline_std < values.high


# -- two layers -----------------------------------------------------------------------------------------------
def _ids(tour, fig_id: str, key: str) -> list[int]:
    return [t["id"] for t in twin(tour, fig_id)[key]["tokens"]]


def _term(m, cache, path: list[str], pos: int, target: int) -> float:
    """A path term of an attention-only model without LayerNorm or biases, densely: A_k ... A_1 X0 W_OV_1 ... W_U."""
    X = cache["hook_embed"]
    for name in path:
        layer, h = int(name[1]), int(name[3:])
        X = cache[f"blocks.{layer}.attn.hook_pattern"][h] @ X @ m.W_V[layer, h] @ m.W_O[layer, h]
    return float(X[pos] @ m.W_U[:, target])


def test_f19_largest_terms(tour, raw):
    sentence, values = claim(tour, "F19", pc.LargestPathTermsClaim)
    m = raw["toy-2l"]
    paths = twin(tour, "F19")["paths"]
    logits, cache = forward(m, paths["tokens"])
    pos, target = paths["position"], paths["target"]
    assert values.value == pytest.approx(float(logits[pos, target]), abs=1e-4)
    for path, value in values.top:
        assert value == pytest.approx(_term(m, cache, path, pos, target), abs=1e-4), path


def test_f20_qk_terms(tour, raw):
    sentence, values = claim(tour, "F20", pc.QKTermSpreadClaim)
    m = raw["toy-2l"]
    ids = _ids(tour, "F20", "qk_paths")
    _, cache = forward(m, ids)
    n = len(ids)
    causal = torch.ones(n, n).tril().bool()
    head = int(twin(tour, "F20")["qk_paths"]["head"][3:])
    sides = {"pos_embed": m.W_pos[:n], "embed": cache["hook_embed"]}
    for h in range(m.cfg.n_heads):
        sides[f"L0H{h}"] = cache["blocks.0.attn.hook_pattern"][h] @ cache["hook_embed"] @ m.W_V[0, h] @ m.W_O[0, h]
    for name, std in values.top:
        q_name, k_name = name.split(" × ")
        term = (sides[q_name] @ m.W_Q[1, head]) @ (sides[k_name] @ m.W_K[1, head]).T / math.sqrt(m.cfg.d_head)
        assert std == pytest.approx(float(term[causal].std()), rel=1e-3), name


def test_f21_top_composition_pairs(tour, raw):
    sentence, values = claim(tour, "F21", pc.TopCompositionPairsClaim)
    m = raw["toy-2l"]
    OV = [[m.W_V[lay, h] @ m.W_O[lay, h] for h in range(m.cfg.n_heads)] for lay in range(2)]
    QK = [m.W_Q[1, h] @ m.W_K[1, h].T for h in range(m.cfg.n_heads)]
    for kind in ("K", "Q", "V"):  # row convention, as tests/app/test_api_analyses.py: A = W_OV of layer 0
        best = max(
            (float((OV[0][i] @ B).norm() / (OV[0][i].norm() * B.norm())), f"L0H{i}", f"L1H{j}")
            for i in range(m.cfg.n_heads)
            for j in range(m.cfg.n_heads)
            for B in [{"Q": QK[j], "K": QK[j].T, "V": OV[1][j]}[kind]]
        )
        source, target, score = getattr(values, kind)
        assert (source, target) == (best[1], best[2]) and score == pytest.approx(best[0], abs=1e-4), kind
    assert values.baseline == pytest.approx(1 / math.sqrt(m.cfg.d_model))


def test_f22_f23_induction_head_on_repeated_code(tour, raw):
    m = raw["toy-2l"]
    sentence, values = claim(tour, "F22", pc.InductionMassClaim)
    ids = _ids(tour, "F22", "prompt")
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
