"""Every sentence of the tour's SmolLM2 chapter (app/tour/rotary.py) recomputed independently on the real
model: detector scores from a plain forward pass's patterns, kernel peaks from rotations at absolute positions
with μ normalised by hand, K-composition from explicit d_model x d_model products, the logit and its order-0 /
order <= 1 parts from plain and order-ablation runs (ablation.py, not paths.py), the induction score and its
largest QK term from the cached activations. Skipped when models/smollm2-135m is not fetched (make smollm2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.settings import Limits
from app.tour import rotary as tr
from app.tour.rotary_claims import InductionHeadsClaim
from app.views.shared.heads_table import standard_input
from app.views.shared.rotary_reference import reference_tokens
from circuits_core.formats.checkpoint import LoadedModel, load_checkpoint
from circuits_core.model.head_names import parse_head
from circuits_core.prompt.ablation import order_logits

FOLDER = Path(__file__).resolve().parents[2] / "models" / tr.TOUR_MODEL
pytestmark = pytest.mark.skipif(not any(FOLDER.glob("*.gguf")), reason="SmolLM2 not fetched (make smollm2)")


@pytest.fixture(scope="module")
def smol() -> LoadedModel:
    torch.set_num_threads(1)
    return load_checkpoint(FOLDER)


@pytest.fixture(scope="module")
def r1(smol: LoadedModel) -> InductionHeadsClaim:
    return tr.induction_circuit(smol, Limits())[1]


def test_r1_detector_scores(smol: LoadedModel, r1: InductionHeadsClaim):
    """Previous-token and induction scores of every head recomputed from the patterns of a plain forward pass."""
    model = smol.model
    tokens, _ = standard_input(smol)  # [b, n]
    L = model.cfg.n_layers
    with torch.no_grad():
        _, cache = model.run(tokens, names={f"blocks.{lay}.attn.hook_pattern" for lay in range(L)})
    b, n = tokens.shape
    same = tokens[:, :, None] == tokens[:, None, :]  # [b, i, j]
    earlier = torch.ones(n, n, dtype=torch.bool).tril(-1)
    prev_occ = same & earlier  # key j' < i holds the query's token
    target = torch.zeros_like(prev_occ)
    target[:, :, 1:] = prev_occ[:, :, :-1]  # induction target j = j' + 1
    rows = target.any(-1)  # [b, i] rows with a target
    prev, ind = {}, {}
    for lay in range(L):
        A = cache[f"blocks.{lay}.attn.hook_pattern"].double()  # [b, H, n, n]
        for h in range(model.cfg.n_heads):
            name = f"L{lay}H{h}"
            prev[name] = float(torch.stack([A[:, h, i, i - 1] for i in range(1, n)], 1).mean())
            mass = (A[:, h] * target).sum(-1)  # [b, n]
            ind[name] = float(mass[rows].mean())
    want_ind = sorted(((h, v) for h, v in ind.items() if v > tr.THRESHOLD), key=lambda x: -x[1])
    want_prev = sorted(((h, v) for h, v in prev.items() if v > tr.THRESHOLD), key=lambda x: -x[1])
    assert [h for h, _ in r1.induction] == [h for h, _ in want_ind]
    assert [h for h, _ in r1.previous_token] == [h for h, _ in want_prev]
    for (_, got), (_, want) in zip(r1.induction + r1.previous_token, want_ind + want_prev, strict=True):
        assert abs(got - want) < 2e-3  # float32 model: sentences show 2 decimals


def test_r1_kernel_peaks(smol: LoadedModel, r1: InductionHeadsClaim):
    """f(δ) = (μ W_Q rotated at p + δ) . (μ W_K rotated at p) / s with μ the hand-normalised mean residual."""
    model = smol.model
    tokens, _ = reference_tokens(smol)
    with torch.no_grad():
        _, cache = model.run(tokens, names=lambda name: name.endswith("hook_resid_pre"))
    for head, _ in r1.previous_token:
        layer, h = parse_head(head, model.cfg)
        x = cache[f"blocks.{layer}.hook_resid_pre"][0, 1:].double()
        w = getattr(model.blocks[layer].ln1, "w", None)  # processed checkpoints fold it into W_Q, W_K
        x = x / (x.pow(2).mean(-1, keepdim=True) + model.cfg.eps).sqrt()
        mu = (x * w.double() if w is not None else x).mean(0)
        attn = model.blocks[layer].attn
        q, k = mu @ attn.W_Q[h].double(), mu @ attn.W_K[h].double()
        f = [float(model.rotate(q, torch.tensor(7 + d)) @ model.rotate(k, torch.tensor(7))) for d in range(65)]
        assert r1.kernel_peaks[head] == max(range(65), key=lambda d: f[d]) == 1


def dense_k_profile(model, source: str, target: str, offsets) -> torch.Tensor:
    (l1, h1), (l2, h2) = parse_head(source, model.cfg), parse_head(target, model.cfg)
    a, b = model.blocks[l1].attn, model.blocks[l2].attn
    W_OV = a.W_V[h1].double() @ a.W_O[h1].double()  # [d, d]
    W_Q, W_K = b.W_Q[h2].double(), b.W_K[h2].double()
    eye = torch.eye(model.cfg.d_head, dtype=torch.float64)
    out = []
    for d in offsets:
        Om = W_Q @ model.rotate(eye, torch.tensor(d)) @ W_K.T  # [d, d], rows of R(δ) = rotated basis vectors
        out.append((W_OV @ Om.T).norm() / (W_OV.norm() * Om.norm()))
    return torch.stack(out)


def test_r1_k_composition_sources(smol: LoadedModel, r1: InductionHeadsClaim):
    """The stated source's whole profile (65 offsets) densely; every other earlier previous-token head's dense
    scores on offsets 0, 8, .., 64 stay below the stated source's maximum."""
    model = smol.model
    for s in r1.k_sources:
        prof = dense_k_profile(model, s.source, s.target, range(65))
        assert abs(float(prof.min()) - s.min) < 1e-4 and abs(float(prof.max()) - s.max) < 1e-4
        assert float(prof.max()) > 2 * r1.baseline
        lt = parse_head(s.target, model.cfg)[0]
        for other, _ in r1.previous_token:
            if other != s.source and parse_head(other, model.cfg)[0] < lt:
                assert float(dense_k_profile(model, other, s.target, range(0, 65, 8)).max()) < s.max


def test_r2_repeated_logit(smol: LoadedModel):
    sentence, v = tr.repeated_logit(smol)
    model = smol.model
    tokens = torch.tensor(v.tokens)
    p, t = v.position, v.target
    assert t == v.tokens[p + 1 - tr.REPEAT] and v.tokens[p] == v.tokens[p - tr.REPEAT]  # a repeat
    with torch.no_grad():
        logits, cache = model.run(
            tokens[None], names=lambda name: name.endswith(("hook_mlp_out", "hook_embed", "ln_final.hook_scale"))
        )
        by_order = order_logits(model, tokens[None])  # ablation.py reruns: paths of order <= k
    assert abs(float(logits[0, p, t]) - v.value) < 1e-4
    assert int((logits[0, p] > logits[0, p, t]).sum()) + 1 == v.rank
    x = cache["hook_embed"][0, p] + sum(cache[f"blocks.{lay}.hook_mlp_out"][0, p] for lay in range(model.cfg.n_layers))
    order0 = float(x / cache["ln_final.hook_scale"][0, p, 0] @ model.W_U[:, t])  # RMS final norm, gain folded in W_U
    assert abs(order0 - v.order0) < 1e-3
    assert abs(float(by_order[0][0, p, t]) - v.order0) < 1e-3
    assert abs(float(by_order[1][0, p, t]) - (v.order0 + v.order1)) < 1e-3
    assert abs(v.order0 + v.order1 + v.remainder - v.value) < 1e-3
    assert f"{v.value:.2f}" in sentence and f"rank {v.rank} " in sentence


def test_r3_induction_score_terms(smol: LoadedModel, r1: InductionHeadsClaim):
    head = r1.induction[0][0]
    sentence, v = tr.induction_score_terms(smol, head)
    model = smol.model
    layer, h = parse_head(head, model.cfg)
    tokens = torch.tensor(tr.repeated_tokens(smol).tolist())
    p, j = v.query, v.key
    assert tokens[j - 1] == tokens[p] and j - 1 < p  # j follows the previous occurrence of the query's token
    with torch.no_grad():
        _, cache = model.run(
            tokens[None],
            names=lambda name: name.endswith(
                ("hook_attn_scores", "hook_pattern", "hook_mlp_out", "hook_result", "ln1.hook_scale", "hook_embed")
            ),
        )
    assert abs(float(cache[f"blocks.{layer}.attn.hook_attn_scores"][0, h, p, j]) - v.score) < 1e-3
    assert abs(float(cache[f"blocks.{layer}.attn.hook_pattern"][0, h, p, j]) - v.attention) < 1e-4
    scale = cache[f"blocks.{layer}.ln1.hook_scale"][0, :, 0]  # [n]
    attn = model.blocks[layer].attn

    def component(name: str, pos: int) -> torch.Tensor:
        if name == "embed":
            return cache["hook_embed"][0, pos]
        if name.startswith("mlp:L"):
            return cache[f"blocks.{int(name[5:])}.hook_mlp_out"][0, pos]
        lay, hh = parse_head(name, model.cfg)
        return cache[f"blocks.{lay}.attn.hook_result"][0, pos, hh]

    for qc, kc, value in v.top_terms:
        q = model.rotate(component(qc, p) / scale[p] @ attn.W_Q[h], torch.tensor(p))
        k = model.rotate(component(kc, j) / scale[j] @ attn.W_K[h], torch.tensor(j))
        assert abs(float(q @ k) / model.cfg.scale - value) < 1e-3
    assert v.top_terms[0][1] in {name for name, _ in r1.previous_token}  # key side: a previous-token head
    assert f"{v.score:.2f}" in sentence


def test_virtual_head_on_smollm2(smol: LoadedModel, r1: InductionHeadsClaim):
    """Virtual heads under GQA on the real model: the factored virtual OV circuit of (strongest source, strongest
    induction head) equals the dense product with each head's group W_V, and its copying score equals the
    spectrum of the dense d_model x d_model matrix W_OV1 W_OV2 W_U W_E."""
    from circuits_core.prompt.virtual import factors_copying_score, virtual_ov

    model = smol.model
    s = r1.k_sources[0]
    (l1, h1), (l2, h2) = parse_head(s.source, model.cfg), parse_head(s.target, model.cfg)
    a, b = model.blocks[l1].attn, model.blocks[l2].attn
    gs = model.cfg.group_size
    dense = (a._W_V[h1 // gs] @ a.W_O[h1] @ b._W_V[h2 // gs] @ b.W_O[h2]).double()  # [d, d]
    fm = virtual_ov(model, (l1, h1), (l2, h2))
    assert float((fm.AB.double() - dense).abs().max()) < 1e-5 * float(dense.abs().max())
    G = (model.W_U @ model.W_E).double()  # [d, d]
    lam = torch.linalg.eigvals(dense @ G)  # nonzero eigenvalues of W_E W_OV1 W_OV2 W_U
    score = float(lam.sum().real / lam.abs().sum())
    assert abs(float(factors_copying_score(fm.A.double(), fm.B.double(), G)) - score) < 1e-6


def test_chapter_links_and_figures(smol: LoadedModel, r1: InductionHeadsClaim):
    """R1 links to the pair page of its strongest (previous-token source, induction head) pair, not the overview;
    R3's numbers are on its linked page (the QK paths page at the link's query and key lists the score, the
    attention and the terms the sentence names); each figure draws the values its sentence states (checked
    against the model in the tests above)."""
    from urllib.parse import parse_qs, urlsplit

    from app.params import QKPathsParams
    from app.routers.pages_tour import CLAIM_CHARTS
    from app.views.qk_paths import build_qk_paths_view

    limits = Limits()
    first = r1.k_sources[0]
    _, _, link, _ = tr._measure("R1", smol, limits, None)
    assert urlsplit(link).path == f"/models/{tr.TOUR_MODEL}/composition/{first.source}/{first.target}"
    head = r1.induction[0][0]
    sentence, v, link, _ = tr._measure("R3", smol, limits, head)
    q = {k: x[0] for k, x in parse_qs(urlsplit(link).query).items()}
    assert urlsplit(link).path.endswith("/qk-paths") and int(q["query"]) == v.query and int(q["key"]) == v.key
    page = build_qk_paths_view(
        smol, QKPathsParams(head=q["head"], tokens=q["tokens"], query=int(q["query"]), key=int(q["key"])), limits
    )
    assert page.at is not None
    assert f"{page.at.score:.2f}" in sentence and f"attention {page.at.attention:.2f}" in sentence
    for (qc, kc, value), term in zip(v.top_terms, page.at.terms, strict=False):
        assert (term.query, term.key) == (qc, kc) and f"{term.value:+.2f}" == f"{value:+.2f}"
    figs: list = []
    CLAIM_CHARTS[tr.FIGURE_CHARTS["R1"]](r1.model_dump(), figs.append)
    bars = figs[0]["data"][0]
    assert bars["y"] == [s for _, s in r1.induction] + [s for _, s in r1.previous_token]
    lines = {t["name"]: t["y"] for t in figs[1]["data"]}
    assert lines[f"{first.source} → {first.target}"] == first.profile
    assert max(first.profile) == first.max and min(first.profile) == first.min
    figs = []
    CLAIM_CHARTS[tr.FIGURE_CHARTS["R3"]](v.model_dump(), figs.append)
    assert figs[0]["data"][0]["y"] == [t for _, _, t in v.top_terms]
