"""Composition between heads (docs/maths.md §2.9) and the token circuits of one (earlier, later) pair (2.10, 2.12).

Scores come from circuits_core.circuits.composition (all pairs from d_head-sized factors). For one pair we read two
[d_vocab, d_vocab] token circuits as factored matrices with inner dimension d_head, never dense:
  K-composition   qk_paths.k_composition_circuit: W_E W_Q^t W_K^tT (W_V^s W_O^s)^T W_E^T / s, rows query
                  token, cols the token the source head reads at the key's position; its eigenvalue
                  statistic is the "same-token matching" of the Id (x) A^s (x) W term of docs/maths.md §2.12
  virtual head    W_E W_V^{h1} W_O^{h1} ... W_V^{hk} W_O^{hk} W_U                   (docs/maths.md §2.10)
W_E is the LN-applied embedding of circuits_core.circuits.head_circuits (row convention, x @ W).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from app import snippets
from app.analysis import Analysis
from app.params import CompositionPairParams, CompositionParams
from app.schemas.analyses import (
    CompositionKindName,
    CompositionPair,
    CompositionPairView,
    CompositionView,
    VirtualHeadCircuit,
)
from app.settings import Limits
from app.views.shared.basis import basis, raw_copy_cost, with_basis
from app.views.shared.inputs import model_ref, qk_form_fields
from app.views.shared.rotary_reference import rotary_offset
from app.views.shared.token_circuits import VIRTUAL_LABELS, parse_chain, token_circuit, virtual_ov_circuit
from app.views.shared.token_sets import token_set
from circuits_core.circuits import composition
from circuits_core.circuits import head_circuits as circuits
from circuits_core.circuits.composition import CompositionKind, composition_scores
from circuits_core.circuits.composition_rotary import composition_at, composition_at_cost
from circuits_core.circuits.global_topk import topk_global_flops
from circuits_core.circuits.head_composition import head_compositions, pair_composition, pair_composition_flops
from circuits_core.cost import Cost, itemsize
from circuits_core.errors import InvalidInputError
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.head_names import head_name, parse_head
from circuits_core.prompt import qk_paths
from circuits_core.prompt.qk_paths import k_composition_circuit
from circuits_core.ranking import top_k

TOP_PAIRS = 10
ENGINE_KIND: dict[CompositionKindName, CompositionKind] = {"Q": "q", "K": "k", "V": "v"}  # API name -> engine key


def check_layers(loaded: LoadedModel) -> None:
    """Composition pairs a head with a later layer's: a model needs two layers (the first fault named, before any
    other check of the request)."""
    if loaded.model.cfg.n_layers < 2:
        raise InvalidInputError(
            f"composition needs at least 2 layers; model {loaded.path.name!r} has {loaded.model.cfg.n_layers}"
        )


def head_partners(loaded: LoadedModel, name: str, top: int) -> list[dict[str, Any]]:
    """The `top` pairs naming head `name` with the largest score minus baseline, over Q, K and V composition (the
    rows of the composition views that name it, computed alone: head_composition.head_compositions)."""
    layer, h = parse_head(name, loaded.model.cfg)
    cfg = loaded.model.cfg
    baseline = 1.0 / math.sqrt(cfg.d_model)  # composition.composition_scores's baseline
    rows = []
    every = head_compositions(loaded.model, layer, h, tuple(ENGINE_KIND[kind] for kind in ("Q", "K", "V")))
    for kind in ("Q", "K", "V"):
        reads, writes = every[ENGINE_KIND[kind]]  # [layer, H], [L - layer - 1, H]
        pairs = [(head_name(l1, h1), name, float(reads[l1, h1])) for l1 in range(layer) for h1 in range(cfg.n_heads)]
        pairs += [
            (name, head_name(layer + 1 + i, h2), float(writes[i, h2]))
            for i in range(cfg.n_layers - layer - 1)
            for h2 in range(cfg.n_heads)
        ]
        rows += [
            {
                "kind": kind,
                "source": src,
                "target": dst,
                "score": score,
                "minus_baseline": score - baseline,
                "partner": dst if src == name else src,
                "role": "writes to" if src == name else "reads from",
            }
            for src, dst, score in pairs
        ]
    return sorted(rows, key=lambda r: -float(r["minus_baseline"]))[:top]


def build_composition_view(loaded: LoadedModel, p: CompositionParams, limits: Limits | None = None) -> CompositionView:
    """Raw and baseline-subtracted `kind`-composition scores: rows earlier heads, columns later heads."""
    kind = p.kind
    loaded = with_basis(loaded, p.basis)
    check_layers(loaded)
    cfg = loaded.model.cfg
    L, H = cfg.n_layers, cfg.n_heads
    key = ENGINE_KIND[kind]
    offset = rotary_offset(loaded, key, p.offset)  # None unless a rotary model's Q/K
    with torch.no_grad():
        budget = limits.peak_bytes if limits is not None else None  # the fewest chunks within it (composition.cost)
        comp = composition_scores(loaded.model, kinds=(key,), budget_bytes=budget)  # only the kind asked for
    raw, minus, mask = comp.raw[key].double(), comp.minus_baseline[key].double(), comp.mask  # [L, H, L, H]
    if offset:  # Q/K at δ: Ω_B(δ) = W_Q R(δ) W_K^T in place of W_QK (the same baseline: rotation-invariant)
        raw = composition_at(loaded.model, key, offset, budget).double()
        minus = torch.where(mask, raw - comp.baseline, torch.zeros_like(raw))
    src = [(l1, h1) for l1 in range(L - 1) for h1 in range(H)]
    dst = [(l2, h2) for l2 in range(1, L) for h2 in range(H)]
    shown = (slice(0, L - 1), slice(None), slice(1, L), slice(None))  # earlier-layer rows x later-layer columns
    as_table = lambda t: torch.where(mask, t, torch.nan)[shown].reshape(len(src), len(dst)).tolist()  # noqa: E731
    scores = [[None if math.isnan(x) else x for x in row] for row in as_table(raw)]  # null unless l1 < l2
    minus_bl = [[None if math.isnan(x) else x for x in row] for row in as_table(minus)]
    flat = torch.where(mask, raw, torch.full_like(raw, -1.0)).flatten()
    n_valid = int(mask.sum())
    pairs = []
    for i in top_k(flat, min(TOP_PAIRS, n_valid))[1].tolist():  # equal scores: (source, target) in head order
        l1, h1, l2, h2 = (int(x) for x in np.unravel_index(i, raw.shape))  # torch's imports sympy on its first call
        pairs.append(
            CompositionPair(
                source=head_name(l1, h1),
                target=head_name(l2, h2),
                score=float(raw[l1, h1, l2, h2]),
                minus_baseline=float(minus[l1, h1, l2, h2]),
            )
        )
    form = qk_form_fields(loaded, "weight") if kind in ("Q", "K") else None  # V-composition reads no QK numbers
    return CompositionView(
        model=model_ref(loaded),
        kind=kind,
        qk_form=form["qk_form"] if form else None,
        qk_form_note=form["qk_form_note"] if form else None,
        basis=basis(loaded),
        sources=[head_name(*s) for s in src],
        targets=[head_name(*d) for d in dst],
        scores=scores,
        minus_baseline=minus_bl,
        baseline=comp.baseline,
        sampled_baseline=comp.sampled_baseline,
        sampled_std=comp.sampled_std,
        top_pairs=pairs,
        offset=offset,
    )


K_LABELS = ("query token (destination)", "token read by the source head at the key position")


def build_composition_pair_view(loaded: LoadedModel, p: CompositionPairParams, limits: Limits) -> CompositionPairView:
    """One pair: the three scores, the K-composition token circuit and the virtual head source -> target."""
    k = p.k
    loaded = with_basis(loaded, p.basis)
    chain = parse_chain(loaded, [p.source, p.target], max(2, limits.max_heads))
    (l1, h1), (l2, h2) = chain
    baseline = 1.0 / math.sqrt(loaded.model.cfg.d_model)  # composition.composition_scores's baseline
    ranked = token_set(loaded, None, p.vocab)  # the OV tables' token set: a large vocabulary's stated default
    with torch.no_grad():
        raw = pair_composition(loaded.model, chain[0], chain[1])  # the pair's three scores alone, not every pair's
        k_fm = k_composition_circuit(loaded.model, chain[1], chain[0], ranked.ids)
        k_circuit = token_circuit(loaded, k_fm, k, limits, K_LABELS, ranked.ids)
        virtual = token_circuit(
            loaded, virtual_ov_circuit(loaded, chain, ranked.ids), k, limits, VIRTUAL_LABELS, ranked.ids
        )
    return CompositionPairView(
        model=model_ref(loaded),
        **qk_form_fields(loaded, "weight"),  # its Q and K scores and its K-composition token circuit
        source=head_name(l1, h1),
        target=head_name(l2, h2),
        basis=basis(loaded),
        scores={kind.upper(): score for kind, score in raw.items()},
        minus_baseline={kind.upper(): score - baseline if l1 < l2 else 0.0 for kind, score in raw.items()},
        baseline=baseline,
        token_set=ranked.said,
        k_composition=k_circuit,
        virtual_head=VirtualHeadCircuit(heads=[head_name(l1, h1), head_name(l2, h2)], ov=virtual),
    )


def composition_cost(loaded: LoadedModel, p: CompositionParams, limits: Limits) -> Cost:
    check_layers(loaded)
    key = ENGINE_KIND[p.kind]
    cost = composition.cost(loaded.model, (key,), limits.peak_bytes)
    if rotary_offset(loaded, key, p.offset):  # then Q/K at δ (composition_rotary.composition_at), the scores held
        held = Cost(3 * 8 * (loaded.model.cfg.n_layers * loaded.model.cfg.n_heads) ** 2)  # raw, minus, mask tables
        cost = cost.then(composition_at_cost(loaded.model, key, limits.peak_bytes) + held)
    return cost + raw_copy_cost(loaded, p.basis)


def pair_cost(loaded: LoadedModel, p: CompositionPairParams, limits: Limits) -> Cost:
    """The scores, then the two token circuits' top k over the token set (their factors on those tokens: the K
    circuit's qk_paths.k_composition_flops, the virtual circuit's W_E rows W_OV^{h1} W_OV^{h2} and W_U columns; each
    circuit's B A for its eigenvalues)."""
    model = loaded.model
    cfg = model.cfg
    ranked = token_set(loaded, None, p.vocab)
    n = ranked.n
    search = circuits.top_cost(model, p.k, limits.matrix_budget_bytes, line=False, n_tokens=n)
    search = Cost(search.peak_bytes, search.answer_bytes, topk_global_flops(n, cfg.d_head, n))
    d, dh = cfg.d_model, cfg.d_head
    chain = 2 * dh * d * dh + 2 * d * dh * dh  # W_OV^{h1} W_OV^{h2}: (A1 B1 A2) then its product with B2's side
    eigenvalues = 2 * dh * n * dh  # B A of each circuit, for its eigenvalue statistic
    virtual = Cost(0, flops=chain + 2 * n * d * dh + 2 * dh * d * n + eigenvalues)
    k_circuit = Cost(0, flops=qk_paths.k_composition_flops(model, n) + eigenvalues)
    d_bytes = itemsize(model.compute_dtype)
    scores = Cost(6 * cfg.n_heads * d * dh * d_bytes, flops=pair_composition_flops(model))  # two layers' factors
    return scores.then(k_circuit.then(search)).then(virtual.then(search)) + raw_copy_cost(loaded, p.basis)


COMPOSITION = Analysis(
    name="composition",
    weights="attention",
    path="composition",
    params=CompositionParams,
    view=CompositionView,
    build=build_composition_view,
    cost=composition_cost,
    summary="Q/K/V composition scores of every head pair",
    tags=["composition"],
    needs_layers=2,
)
COMPOSITION_PAIR = Analysis(
    name="composition-pair",
    weights="attention",
    path="composition/{source}/{target}",
    params=CompositionPairParams,
    view=CompositionPairView,
    build=build_composition_pair_view,
    cost=pair_cost,
    summary="One head pair: K-composition circuit and virtual head",
    snippet=snippets.composition_pair_body,
    tags=["composition"],
)
