"""The measured sentence of each tour figure: what the shipped model shows, with its numbers and its input.

A tour sentence that states a fact about a model is generated here from measured values, never written by hand, so
it cannot drift from the model; tests/app/tour_claims/test_claims.py and test_claims_induction.py recompute each
value independently (dense float64 circuits, plain forward passes) and fail when a sentence stops being true. Each
function takes the loaded model and the figure's data (figures.py) and returns (sentence, values); the values are
kept in the figure's data (TourData.claim) so the JSON twin carries them, typed (paper_claims.py) and written field
for field.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from app.tour.figure_data import TourData
from app.tour.paper_claims import (
    ChainPatternClaim,
    CopyingScoresClaim,
    CopyingSourceClaim,
    DirectPathBigramsClaim,
    FigureClaim,
    FirstOrderGainsClaim,
    InductionMassClaim,
    KCompositionDiagonalClaim,
    LargestPathTermsClaim,
    LossByOrderClaim,
    NextTokenEffectClaim,
    PathTermsSumClaim,
    PositionalHeadClaim,
    PositiveEigenvaluesClaim,
    PositivityCornerClaim,
    QKTermSpreadClaim,
    QueryRowClaim,
    SecondCopyingHeadClaim,
    StandardInputClaim,
    TokenCopyingClaim,
    TopCompositionPairsClaim,
)
from app.views.shared.basis import basis
from circuits_core.circuits import copying, copying_spectra
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.head_names import parse_head
from circuits_core.prompt.phenomena import HeldOutBigrams, find_eval_data

Claim = tuple[str, FigureClaim]
BASELINE_SAMPLES, BASELINE_TOP_SAMPLES = 200, 2
T = TypeVar("T")


def _set(value: T | None) -> T:
    """A field of the figure's data that its builder (figures.py) sets."""
    assert value is not None, "the figure's builder did not set a field its sentence reads"
    return value


def f6(loaded: LoadedModel, d: TourData) -> Claim:
    entries = _set(d.direct).entries
    pairs = [(e.row.id, e.col.id) for e in entries]
    data = find_eval_data(loaded.path)
    where = f" among tokens seen at least {d.min_count} times in training" if d.min_count else ""
    sentence = f"Basis: {basis(loaded)}. Shown: the {len(pairs)} largest entries{where}."
    if data is None:
        return sentence, DirectPathBigramsClaim(pairs=pairs, min_count=d.min_count)
    bigrams = HeldOutBigrams(data)
    counts = [bigrams.count(a, b) for a, b in pairs]
    seen = sum(c > 0 for c in counts)
    sentence += f" {seen} of them occur as bigrams (current token, next token) in the held-out code."
    return sentence, DirectPathBigramsClaim(pairs=pairs, min_count=d.min_count, held_out_counts=counts, seen=seen)


def f9(loaded: LoadedModel, d: TourData) -> Claim:
    p = _set(d.paths)
    total = sum(t.value for t in p.terms)
    return (
        f"At the last position the {len(p.terms)} listed terms sum to {total:.4f}, the model's logit "
        f"{p.value:.4f} for {p.target_token.text!r}.",
        PathTermsSumClaim(total=total, value=p.value, target=p.target),
    )


def _self_copy_head(loaded: LoadedModel, head: str, k: int = 10) -> tuple[float, float, float]:
    layer, h = parse_head(head, loaded.model.cfg)
    m = copying.ov_copying_metrics(loaded.model, layer, h, k=k)
    return float(copying_spectra.ov_copying_scores(loaded.model)[layer, h]), m.top1, m.topk


def f10(loaded: LoadedModel, d: TourData) -> Claim:
    ov = _set(d.ov)
    score, top1, top10 = _self_copy_head(loaded, _set(ov.head))
    diag = sum(e.row.id == e.col.id for e in ov.entries)
    return (
        f"{ov.head} has the highest eigenvalue copying score ({score:.2f}), yet only {top1:.2%} of its source "
        f"tokens raise their own logit most (top-10: {top10:.2%}), and {diag} of its {len(ov.entries)} largest "
        f"entries are diagonal: the eigenvalue score and token-level copying measure different things.",
        TokenCopyingClaim(head=_set(ov.head), score=score, top1=top1, top10=top10, diagonal=diag),
    )


def f11(loaded: LoadedModel, d: TourData) -> Claim:
    st = _set(d.skip_trigrams)
    src = st.source.text
    if d.min_count is None or d.share is None:  # no training counts: the head's strongest source (the view's pick)
        return (
            f"Source {src!r} of {st.head} (the most-copying head), its strongest source: it is "
            f"{'' if st.copying else 'not '}among its own top-{st.k} outputs.",
            CopyingSourceClaim(head=st.head, copying=st.copying),
        )
    return (
        f"Source {src!r} of {st.head} (the most-copying head), among tokens seen at least {d.min_count} times: "
        f"its largest output is {st.outs[0].token.text!r}, itself -- a copying skip-trigram [b] ... [a] -> [b]. "
        f"Among those tokens, {d.share:.1%} raise their own logit most in this head.",
        CopyingSourceClaim(
            head=st.head, source=st.source.id, top_out=st.outs[0].token.id, share=d.share, min_count=d.min_count
        ),
    )


def f12(loaded: LoadedModel, d: TourData) -> Claim:
    st = _set(d.skip_trigrams)
    return (
        f"Shown: {st.head}, the head with the second-highest eigenvalue copying score, and its strongest source "
        f"{st.source.text!r}. qkov does not detect split tokens: compare the outputs with the source yourself.",
        SecondCopyingHeadClaim(head=st.head),
    )


def f14(loaded: LoadedModel, d: TourData) -> Claim:
    qk = _set(d.qk)
    if qk.token is None:
        return (
            f"Shown: {qk.head}, the most-copying head, largest raw QK entries over all (query, key) pairs. Entries of "
            f"different queries are not comparable (each query's softmax runs over its own row): read each against its "
            f"own row.",
            QueryRowClaim(head=_set(qk.head), query=None),
        )
    keys = ", ".join(repr(e.col.text) for e in qk.entries[:3])
    return (
        f"Shown: the keys that query {qk.token.text!r} scores highest in {qk.head} (the most-copying head), one "
        f"query's row, so the entries compete in one softmax and are comparable: {keys}, ...",
        QueryRowClaim(head=_set(qk.head), query=qk.token.id, keys=[e.col.id for e in qk.entries]),
    )


def f15(loaded: LoadedModel, d: TourData) -> Claim:
    pos = _set(d.positional)
    return (
        f"{d.head} (highest previous-token score): its purely positional pattern puts {pos.previous_token:.2f} "
        f"on the previous position and {pos.current_token:.2f} on the present one, on average over "
        f"{pos.n_positions} positions.",
        PositionalHeadClaim(head=d.head, previous=pos.previous_token, current=pos.current_token),
    )


def f17(loaded: LoadedModel, d: TourData) -> Claim:
    eig = _set(d.eigenvalues)
    positive = {h: sum(p[0] > 0 for p in pts) for h, pts in eig.items()}
    n = len(next(iter(eig.values())))
    listing = ", ".join(f"{h} {c}/{n}" for h, c in positive.items())
    return (
        f"Eigenvalues with a positive real part, per head: {listing}. A copying score near +1 needs most of the "
        f"|λ| mass on the positive side, not most eigenvalues.",
        PositiveEigenvaluesClaim(positive=positive, n=n),
    )


def f18(loaded: LoadedModel, d: TourData) -> Claim:
    scores = {h: s for h, s in _set(d.ov_copying).items() if s is not None}
    base, sc = _set(d.baseline), _set(d.self_copy)
    pos = sum(s > 0 for s in scores.values())
    values = CopyingScoresClaim(
        positive=pos,
        n=len(scores),
        low=min(scores.values()),
        high=max(scores.values()),
        baseline_mean=base["mean"],
        baseline_std=base["std"],
        max_top1=max(sc["top1"].values()),
        max_top10=max(sc["topk"].values()),
    )
    return (
        f"{pos} of {len(scores)} heads have a positive eigenvalue copying score ({values.low:.2f} to "
        f"{values.high:.2f}); random OV weights of the same shapes through this model's embeddings score "
        f"{base['mean']:+.2f} ± {base['std']:.2f} ({BASELINE_SAMPLES} draws). Token by token the copying is weak: "
        f"in no head do more than {values.max_top1:.2%} of source tokens raise their own logit most "
        f"(top-10: {values.max_top10:.2%}).",
        values,
    )


def f19(loaded: LoadedModel, d: TourData) -> Claim:
    p = _set(d.paths)
    top = [t for t in p.terms if t.kind not in ("other", "remainder")][:3]
    listing = ", ".join(f"{'→'.join(t.path) or 'direct'} {t.value:+.2f}" for t in top)
    return (
        f"Largest terms at the last position (logit of {p.target_token.text!r}): {listing}; all terms and the "
        f"remainder sum to the logit {p.value:.3f}.",
        LargestPathTermsClaim(top=[(list(t.path), t.value) for t in top], value=p.value),
    )


def f20(loaded: LoadedModel, d: TourData) -> Claim:
    q = _set(d.qk_paths)
    cells = sorted(
        ((q.std[i][j], f"{a} × {b}") for i, a in enumerate(q.components) for j, b in enumerate(q.components)),
        reverse=True,
    )[:3]
    listing = ", ".join(f"{name} {s:.2f}" for s, name in cells)
    return (
        f"Largest spreads (std over the prompt's causal query-key pairs) of {q.head}'s score terms, query side × key "
        f"side: {listing}.",
        QKTermSpreadClaim(top=[(name, s) for s, name in cells]),
    )


def f21(loaded: LoadedModel, d: TourData) -> Claim:
    tops = {kind: _set(view).top_pairs[0] for kind, view in (("K", d.K), ("Q", d.Q), ("V", d.V))}
    pairs = {kind: (top.source, top.target, top.score) for kind, top in tops.items()}
    parts = [f"{kind} {source} → {target} {score:.2f}" for kind, (source, target, score) in pairs.items()]
    base = _set(d.K).baseline
    return (
        f"Top pair of each kind: {'; '.join(parts)} (random baseline 1/√d_model = {base:.2f}).",
        TopCompositionPairsClaim(K=pairs["K"], Q=pairs["Q"], V=pairs["V"], baseline=base),
    )


def f22(loaded: LoadedModel, d: TourData) -> Claim:
    return (
        f"The figure weighs each attention weight by the norm of the value vector it moves (A·‖v‖). On the repeated "
        f"prompt, {d.induction_head} puts on average {_set(d.induction_weighted_mass):.2f} of each row's "
        f"value-weighted attention on the token after the previous occurrence of the current token, against "
        f"{_set(d.induction_mass):.2f} of its plain attention ({d.induction_rows} such positions).",
        InductionMassClaim(head=d.induction_head, mass=d.induction_mass, weighted_mass=d.induction_weighted_mass),
    )


def f23(loaded: LoadedModel, d: TourData) -> Claim:
    e = _set(d.next_token_effect)
    second = e.effects[e.second_copy_start :]
    if not second:
        return (
            f"{e.head}: the prompt has no repeated segment, so there is no second copy to measure.",
            NextTokenEffectClaim(head=e.head, n=0),
        )
    share = sum(v > 0 for v in second)
    return (
        f"{e.head}'s direct effect on the logit of each position's actual next token: positive at {share} of the "
        f"{len(second)} positions of the second copy ({min(second):+.2f} to {max(second):+.2f}).",
        NextTokenEffectClaim(head=e.head, positive=share, n=len(second), min=min(second), max=max(second)),
    )


def f24(loaded: LoadedModel, d: TourData) -> Claim:
    dv = _set(d.detectors)
    inp = dv.detector_input
    best = max(dv.heads, key=lambda h: h.induction or 0.0)
    return (
        f"On the standard input (BOS + {inp.seq_len} uniform random tokens repeated, batch {inp.batch}, seed "
        f"{inp.seed}; as on the model card and the overview): loss {dv.loss.first_repeat:.2f} nats on the first "
        f"repeat, {dv.loss.second_repeat:.2f} on the second; induction score of {best.head} {best.induction:.3f}.",
        StandardInputClaim(
            rep1=dv.loss.first_repeat, rep2=dv.loss.second_repeat, head=best.head, induction=best.induction
        ),
    )


def f25(loaded: LoadedModel, d: TourData) -> Claim:
    pair = _set(d.pair)
    entries = pair.k_composition.entries
    diag = sum(e.row.id == e.col.id for e in entries)
    return (
        f"{diag} of the {len(entries)} largest entries of the {pair.source} → {pair.target} K-composition token "
        f"circuit are on its diagonal (query token = the key's previous token).",
        KCompositionDiagonalClaim(diagonal=diag, k=len(entries)),
    )


def f26(loaded: LoadedModel, d: TourData) -> Claim:
    pts = sorted(_set(d.points), key=lambda p: -(p.ov_copying or -2) - p.k_composition_positivity)
    listing = ", ".join(f"{p.head} ({p.ov_copying:.2f}, {p.k_composition_positivity:.2f})" for p in pts[:3])
    return (
        f"(OV copying, K-composition positivity with {d.previous_token_head}), the three heads nearest the "
        f"corner: {listing}. Necessary, not sufficient: compare their induction scores.",
        PositivityCornerClaim(points=[(p.head, p.ov_copying, p.k_composition_positivity) for p in pts[:3]]),
    )


def f27(loaded: LoadedModel, d: TourData) -> Claim:
    ti = _set(d.term_importance)
    losses = ti.loss_by_order
    uniform = math.log(loaded.model.cfg.d_vocab)
    return (
        f"On the built-in code snippet: a uniform guess costs ln V = {uniform:.2f} nats; the direct path alone "
        f"{losses[0]:.2f}; with the first-order (single-head) terms {losses[1]:.2f}; with the virtual heads (the "
        f"full model) {losses[-1]:.2f}. The first-order terms carry most of the reduction, the direct path little.",
        LossByOrderClaim(losses=list(losses)),
    )


def f28(loaded: LoadedModel, d: TourData) -> Claim:
    gains = _set(d.first_order_by_layer)
    listing = ", ".join(f"layer {i} {g:.2f}" for i, g in enumerate(gains))
    return (
        f"Loss reduction from the direct path alone when one layer's head terms are added (nats): {listing}.",
        FirstOrderGainsClaim(gains=list(gains)),
    )


def f29(loaded: LoadedModel, d: TourData) -> Claim:
    cv = _set(d.path)
    ids = [t.id for t in cv.tokens]
    pattern = torch.tensor(cv.pattern)  # [n, n] A^{h2} A^{h1}
    mass, rows = induction_mass(ids, pattern)
    mass_shift, _ = induction_mass(ids, pattern, shift=0)  # on the earlier occurrence itself
    chain = " → ".join(cv.heads)
    return (
        f"The chain {chain} on the repeated prompt: its pattern, the product of the two heads' patterns, puts on "
        f"average {mass:.2f} of each query's weight on the token after the previous occurrence of the query's token "
        f"and {mass_shift:.2f} on that occurrence itself ({rows} such positions).",
        ChainPatternClaim(heads=list(cv.heads), mass=mass, mass_on_occurrence=mass_shift, rows=rows),
    )


CLAIMS: dict[str, Callable[[LoadedModel, TourData], Claim]] = {
    "F6": f6,
    "F9": f9,
    "F10": f10,
    "F11": f11,
    "F12": f12,
    "F14": f14,
    "F15": f15,
    "F17": f17,
    "F18": f18,
    "F19": f19,
    "F20": f20,
    "F21": f21,
    "F22": f22,
    "F23": f23,
    "F24": f24,
    "F25": f25,
    "F26": f26,
    "F27": f27,
    "F28": f28,
    "F29": f29,
}


def self_copy_and_baseline(loaded: LoadedModel, k: int = 10) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per-head self-copy shares ({top1, topk, diagonal_positive: {head: value}}) and the random-weights baseline."""
    from circuits_core.model.head_names import head_name

    sc = copying.self_copy(loaded.model, k=k)
    base = copying.random_baseline(loaded.model, n_samples=BASELINE_SAMPLES, n_top_samples=BASELINE_TOP_SAMPLES, k=k)
    L, H = sc.top1.shape
    names = [head_name(layer, h) for layer in range(L) for h in range(H)]
    per = {
        key: dict(zip(names, getattr(sc, key).flatten().tolist(), strict=True))
        for key in ("top1", "topk", "diagonal_positive")
    }
    baseline = {
        "mean": float(base.ov_copying.mean()),
        "std": float(base.ov_copying.std()),
        "top1": float(base.top1.mean()),
        "topk": float(base.topk.mean()),
        "n_samples": BASELINE_SAMPLES,
    }
    return {**per, "k": k}, baseline


def induction_mass(tokens: list[int], pattern: torch.Tensor, shift: int = 1) -> tuple[float, int]:
    """Mean attention of queries whose token occurred before on the positions right after its earlier occurrences
    (shift 1; shift 0: on the earlier occurrences themselves)."""
    total, rows = 0.0, 0
    for i, t in enumerate(tokens):
        keys = [j + shift for j in range(i) if tokens[j] == t]
        if keys:
            total += float(pattern[i, keys].sum())
            rows += 1
    return (total / rows if rows else float("nan")), rows
