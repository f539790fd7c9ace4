"""The data of each tour figure (app/tour/tour.py), composed from the view builders of the full views.

Each function takes (loaded, limits) and returns (data, API path under /api/v1/models/{model}, query
parameters), so the tour links the exact JSON view its data came from (and the page showing it, see tour.py). Heads are
picked from the model's own scores: the most-copying head (OV copying score), the previous-token head and the induction
head (detector scores on repeated random tokens).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from app.params import (
    ChainParams,
    CompositionPairParams,
    CompositionParams,
    DetectorParams,
    DirectParams,
    HeadParams,
    NoParams,
    OVParams,
    PathsParams,
    PromptParams,
    QKParams,
    QKPathsParams,
    SkipTrigramParams,
    TermImportanceParams,
)
from app.settings import Limits
from app.tour.claims import induction_mass, self_copy_and_baseline
from app.tour.figure_data import NextTokenEffect, TourData
from app.views.circuits import build_direct_view, build_ov_view, build_qk_view
from app.views.composition import build_composition_pair_view, build_composition_view
from app.views.detectors import build_detectors_view
from app.views.heads import build_head_view
from app.views.path import build_path_view
from app.views.positivity import build_positivity_view, heads_seen, induction_pair
from app.views.prompt import build_paths_view, build_prompt_view
from app.views.qk_paths import build_qk_paths_view
from app.views.shared.default_prompt import BUILTIN_TEXT
from app.views.shared.inputs import resolve_prompt, token_refs
from app.views.shared.page_claims import strongest
from app.views.shared.token_sets import frequent_tokens, has_token_counts
from app.views.skip_trigrams import build_skip_trigrams_view
from app.views.term_importance import build_term_importance_view
from circuits_core.circuits import copying_spectra
from circuits_core.circuits import head_circuits as circuits
from circuits_core.errors import InvalidInputError
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.head_names import head_name, parse_head
from circuits_core.model.transformer import Transformer
from circuits_core.prompt.frozen import readout
from circuits_core.prompt.phenomena import MIN_TRAIN_COUNT

Result = tuple[TourData, str, dict[str, Any]]
K = 10
# Repeated code: the second copy is predictable by induction.
REPEATED = "def add(self, name, value):\n    self.name = name\n" * 2


def _k(limits: Limits) -> int:
    return min(K, limits.max_k)


def _copying_heads(loaded: LoadedModel) -> list[str]:
    heads = sorted(heads_seen(loaded), key=lambda h: -(h.ov_copying or -2.0))
    return [h.head for h in heads]


def _prompt(limits: Limits, text: str) -> str:
    return text[: limits.max_prompt_tokens]  # a token is at least one character: never over the token limit


# -- one layer and zero layers -----------------------------------------------------------------------
def _min_count(loaded: LoadedModel) -> int | None:
    """Frequent tokens by default where the model has training counts (rare tokens dominate raw top entries)."""
    return MIN_TRAIN_COUNT if has_token_counts(loaded) else None


def direct_path(loaded: LoadedModel, limits: Limits) -> Result:
    k, mc = _k(limits), _min_count(loaded)
    view = build_direct_view(loaded, DirectParams(k=k, min_count=mc), limits)
    return TourData(direct=view, min_count=mc), "/direct", {"k": k, "min_count": mc}


def paths_order1(loaded: LoadedModel, limits: Limits) -> Result:
    prompt = _prompt(limits, BUILTIN_TEXT)
    view = build_paths_view(
        loaded, PathsParams(prompt=prompt, max_order=min(1, limits.max_order), k=_k(limits)), limits
    )
    return TourData(paths=view), "/paths", {"prompt": prompt, "max_order": view.max_order, "k": _k(limits)}


def ov_circuit(loaded: LoadedModel, limits: Limits) -> Result:
    head, k = _copying_heads(loaded)[0], _k(limits)
    return TourData(ov=build_ov_view(loaded, OVParams(head=head, k=k), limits)), f"/heads/{head}/ov", {"k": k}


def qk_circuit(loaded: LoadedModel, limits: Limits) -> Result:
    """The most-copying head's QK row of one query token (its keys compete in one softmax, so they are comparable;
    entries of different queries are not): F11's copying source among frequent tokens, else the global top-k."""
    head, k, mc = _copying_heads(loaded)[0], _k(limits), _min_count(loaded)
    if mc is None:
        return (
            TourData(
                qk=build_qk_view(loaded, QKParams(head=head, k=k), limits),
                ov=build_ov_view(loaded, OVParams(head=head, k=k), limits),
            ),
            f"/heads/{head}/qk",
            {"k": k},
        )
    vocab = frequent_tokens(loaded, mc)
    assert vocab is not None
    query, _ = copying_source(loaded, head, vocab)
    qk = build_qk_view(loaded, QKParams(head=head, token=str(query), k=k, side="query", min_count=mc), limits)
    ov = build_ov_view(loaded, OVParams(head=head, token=str(query), k=k, min_count=mc), limits)
    return TourData(qk=qk, ov=ov), f"/heads/{head}/qk", {"token": query, "k": k, "side": "query", "min_count": mc}


def _skip(loaded: LoadedModel, limits: Limits, rank: int) -> Result:
    heads = _copying_heads(loaded)
    head = heads[min(rank, len(heads) - 1)]
    return (
        TourData(skip_trigrams=build_skip_trigrams_view(loaded, SkipTrigramParams(head=head, k=_k(limits)), limits)),
        f"/heads/{head}/skip-trigrams",
        {"k": _k(limits)},
    )


def copying_source(loaded: LoadedModel, head: str, vocab: Tensor) -> tuple[int, float]:
    """(the source token among `vocab` whose own logit is the largest of its OV row, by the widest margin over the
    runner-up; the share of `vocab` tokens that raise their own logit most) for `head`'s full OV circuit."""
    layer, h = parse_head(head, loaded.model.cfg)
    M = circuits.full_ov_circuit(loaded.model, layer, h)
    block = (M.A[vocab] @ M.B[:, vocab]).double()  # [n, n] among the frequent tokens
    top2 = block.topk(2, dim=1)
    own = torch.arange(len(vocab))
    copies = top2.indices[:, 0] == own
    if not bool(copies.any()):
        raise InvalidInputError(f"no frequent source token of {head} raises its own logit most")
    margin = torch.where(copies, top2.values[:, 0] - top2.values[:, 1], torch.tensor(-math.inf, dtype=torch.float64))
    return int(vocab[int(margin.argmax())]), float(copies.double().mean())


def skip_trigrams(loaded: LoadedModel, limits: Limits) -> Result:
    """The most-copying head at a source token that copies (frequent tokens, where the model has counts)."""
    head, k, mc = _copying_heads(loaded)[0], _k(limits), _min_count(loaded)
    if mc is None:
        return _skip(loaded, limits, 0)
    vocab = frequent_tokens(loaded, mc)
    assert vocab is not None
    source, share = copying_source(loaded, head, vocab)
    view = build_skip_trigrams_view(loaded, SkipTrigramParams(head=head, token=str(source), k=k, min_count=mc), limits)
    return (
        TourData(skip_trigrams=view, min_count=mc, share=share),
        f"/heads/{head}/skip-trigrams",
        {"token": source, "k": k, "min_count": mc},
    )


def skip_trigrams_second(loaded: LoadedModel, limits: Limits) -> Result:
    return _skip(loaded, limits, 1)


def positional(loaded: LoadedModel, limits: Limits) -> Result:
    best = strongest(heads_seen(loaded), "previous_token")
    if best is None:
        raise InvalidInputError("no head with a previous_token score")
    head = best.head
    view = build_head_view(loaded, HeadParams(head=head), limits)
    return TourData(head=head, positional=view.positional), f"/heads/{head}", {}


def ov_spectra(loaded: LoadedModel, limits: Limits) -> Result:
    eig = copying_spectra.ov_eigenvalues(loaded.model)  # [L, H, d_head] complex
    cfg = loaded.model.cfg
    data = {
        head_name(layer, h): [(float(z.real), float(z.imag)) for z in eig[layer, h].tolist()]
        for layer in range(cfg.n_layers)
        for h in range(cfg.n_heads)
    }
    return TourData(eigenvalues=data), "/heads", {}


def copying_scores(loaded: LoadedModel, limits: Limits) -> Result:
    self_copy, baseline = self_copy_and_baseline(loaded)
    return (
        TourData(ov_copying={h.head: h.ov_copying for h in heads_seen(loaded)}, self_copy=self_copy, baseline=baseline),
        "/heads",
        {},
    )


# -- two layers ----------------------------------------------------------------------------------------
def paths_order2(loaded: LoadedModel, limits: Limits) -> Result:
    prompt = _prompt(limits, REPEATED)
    view = build_paths_view(
        loaded, PathsParams(prompt=prompt, max_order=min(2, limits.max_order), k=_k(limits)), limits
    )
    return TourData(paths=view), "/paths", {"prompt": prompt, "max_order": view.max_order, "k": _k(limits)}


def qk_decomposition(loaded: LoadedModel, limits: Limits) -> Result:
    _, induction = induction_pair(loaded)
    prompt = _prompt(limits, REPEATED)
    view = build_qk_paths_view(loaded, QKPathsParams(head=induction, prompt=prompt, k=min(6, limits.max_k)), limits)
    return TourData(qk_paths=view.model_copy(update={"terms": {}})), "/qk-paths", {"head": induction, "prompt": prompt}


def composition(loaded: LoadedModel, limits: Limits) -> Result:
    Q, K, V = (build_composition_view(loaded, CompositionParams(kind=kind)) for kind in ("Q", "K", "V"))
    return TourData(Q=Q, K=K, V=V), "/composition", {"kind": "K"}


def value_weighted(loaded: LoadedModel, limits: Limits) -> Result:
    prompt = _prompt(limits, REPEATED)
    prev, induction = induction_pair(loaded)
    heads = list(dict.fromkeys([prev, induction]))[: limits.max_heads]
    view = build_prompt_view(loaded, PromptParams(prompt=prompt, heads=",".join(heads), weighted=True), limits)
    plain = build_prompt_view(loaded, PromptParams(prompt=prompt, heads=induction), limits)
    ids = [t.id for t in plain.tokens]
    mass, rows = induction_mass(ids, torch.tensor(plain.heads[0].pattern))
    weighted = torch.tensor(next(hp.pattern for hp in view.heads if hp.head == induction))  # [n, n] A·‖v‖
    share = weighted / weighted.sum(-1, keepdim=True).clamp_min(1e-30)  # each row's share of the drawn weight
    weighted_mass, _ = induction_mass(ids, share)
    return (
        TourData(
            prompt=view,
            induction_head=induction,
            induction_mass=mass,
            induction_weighted_mass=weighted_mass,
            induction_rows=rows,
        ),
        "/prompt",
        {"prompt": prompt, "heads": ",".join(heads), "weighted": "true"},
    )


def induction_effect(loaded: LoadedModel, limits: Limits) -> Result:
    """The paper's figure: the induction head's direct effect on the logit of each position's actual next token,
    (r^h W_U)[p, t_{p+1}] with r^h = z^h W_O^h the head's output (through the frozen final LayerNorm, if any)."""
    _, induction = induction_pair(loaded)
    prompt = _prompt(limits, REPEATED)
    model = loaded.model
    ids = resolve_prompt(loaded, prompt, None, limits)  # the prompt views' tokens (BOS first when the model has one)
    effects = head_next_token_effect(model, torch.tensor([ids], device=model.device), *parse_head(induction, model.cfg))
    effect = NextTokenEffect(
        head=induction,
        tokens=token_refs(loaded, ids),
        effects=effects.tolist(),
        second_copy_start=second_copy_start(ids),
    )
    return TourData(next_token_effect=effect), "/path", {"heads": induction, "prompt": prompt, "k": _k(limits)}


def repeated_tokens(loaded: LoadedModel, limits: Limits) -> Result:
    """The standard detector input (the overview's and the model card's), shortened only for a short context."""
    fitted = DetectorParams().normalised(loaded).seq_len  # the standard length, fitted to the context
    assert fitted is not None
    seq_len = min(fitted, limits.max_seq_len)
    batch = min(DetectorParams().batch, limits.max_batch)
    view = build_detectors_view(loaded, DetectorParams(seq_len=seq_len, batch=batch, seed=0), limits)
    return TourData(detectors=view), "/detectors", {"seq_len": seq_len, "batch": batch}


def k_composition(loaded: LoadedModel, limits: Limits) -> Result:
    prev, induction = induction_pair(loaded)
    view = build_composition_pair_view(
        loaded, CompositionPairParams(source=prev, target=induction, k=_k(limits)), limits
    )
    return TourData(pair=view), f"/composition/{prev}/{induction}", {"k": _k(limits)}


def positivity_scatter(loaded: LoadedModel, limits: Limits) -> Result:
    view = build_positivity_view(loaded, NoParams(), limits)
    return TourData(previous_token_head=view.previous_token_head, points=view.points), "/positivity", {}


def term_importance(loaded: LoadedModel, limits: Limits) -> Result:
    view = build_term_importance_view(loaded, TermImportanceParams(), limits)
    return (
        TourData(term_importance=view.model_copy(update={"tokens": []}), token_ids=[t.id for t in view.tokens]),
        "/term-importance",
        {},
    )


def term_importance_by_layer(loaded: LoadedModel, limits: Limits) -> Result:
    view = build_term_importance_view(loaded, TermImportanceParams(), limits)
    return (
        TourData(first_order_by_layer=view.first_order_by_layer, loss_by_order=view.loss_by_order),
        "/term-importance",
        {},
    )


def virtual_head(loaded: LoadedModel, limits: Limits) -> Result:
    prev, induction = induction_pair(loaded)
    prompt = _prompt(limits, REPEATED)
    view = build_path_view(loaded, ChainParams(heads=f"{prev},{induction}", prompt=prompt, k=_k(limits)), limits)
    return TourData(path=view), "/path", {"heads": f"{prev},{induction}", "prompt": prompt, "k": _k(limits)}


def second_copy_start(ids: list[int]) -> int:
    """First index p (of the per-position effects: p predicts ids[p + 1]) of the second copy: the longest suffix
    ids[n-L:] that also occurs earlier, ending before it starts; from p = n - L on, the current token and the
    next one both repeat the earlier copy (the induction positions). n - 1 (none) when nothing repeats."""
    n = len(ids)
    for L in range(n // 2, 1, -1):
        suffix = ids[n - L :]
        if any(ids[j : j + L] == suffix for j in range(n - 2 * L + 1)):
            return n - L
    return n - 1


def head_next_token_effect(model: Transformer, tokens: Tensor, layer: int, head: int) -> Tensor:
    """[n - 1]: the head's output at position p dotted with the unembedding of tokens[p + 1] (final LN frozen)."""
    with torch.no_grad():
        _, cache = model.run(tokens, names=lambda nm: nm in (f"blocks.{layer}.attn.hook_z", "ln_final.hook_scale"))
        out = cache[f"blocks.{layer}.attn.hook_z"][0, :, head] @ model.W_O[layer, head]  # [n, d_model]
        scale = (
            cache["ln_final.hook_scale"][0, :, 0]
            if "ln_final.hook_scale" in cache
            else torch.ones(out.shape[0], dtype=out.dtype)
        )
        nxt = tokens[0, 1:]
        effects = torch.stack([(out[p] @ readout(model, int(nxt[p]))[0]) / scale[p] for p in range(len(nxt))])
    return effects.double()
