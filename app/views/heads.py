"""The heads table (copying scores + behavioural detectors) and the one-head summary.

Detectors run on the standard input of docs/maths.md §2.15: BOS + r + r, r = 50 uniform random tokens,
batch 10, fixed seed (shorter r when the context is short). Copying scores are the eigenvalue statistic
sum(lambda)/sum(|lambda|) of the full OV and token-token QK circuits (docs/maths.md §2.8).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from app import snippets
from app.analysis import Analysis, AnalysisParams, build_cached, cache_key
from app.params import CopyingParams, HeadParams, NoParams
from app.scheduling import is_cached
from app.schemas import CopyingMetricsView, DetectorInput, HeadScores, HeadsView, HeadView, PositionalQK
from app.settings import Limits
from app.views.head_spectra import spectra
from app.views.inputs import check_k, model_ref
from app.views.rotary_reference import is_rotary, reference_means, reference_tokens_bound
from app.views.token_sets import token_set
from circuits_core.circuits import copying, copying_spectra
from circuits_core.circuits import head_circuits as circuits
from circuits_core.circuits.latent_circuits import term_norms
from circuits_core.cost import Cost
from circuits_core.errors import LimitExceededError
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.head_names import head_name, parse_head
from circuits_core.prompt.detectors import (
    HEADS_RULE,
    STANDARD_BATCH,
    STANDARD_SEQ_LEN,
    heads_that_matter,
    repeated_random_tokens,
)
from circuits_core.prompt.head_table import HeadTable, head_table, head_table_cost

STANDARD_SEED = 0  # the standard input's shape (STANDARD_SEQ_LEN, STANDARD_BATCH) is the engine's
POSITIONAL_MAX_N = 128  # positions shown in the positional QK pattern


def num(x: float | Tensor) -> float | None:
    """A JSON-safe float: NaN and infinities become None."""
    value = float(x)
    return value if math.isfinite(value) else None


def bos_id(loaded: LoadedModel) -> int | None:
    tok = loaded.tokenizer
    return tok.bos_token_id if tok is not None and tok.bos_token_id is not None else loaded.model.cfg.bos_token_id


def repeated_input(loaded: LoadedModel, seq_len: int, batch: int, seed: int) -> tuple[Tensor, DetectorInput]:
    """[batch, (1 +) 2 seq_len] BOS + r + r, checked against the context length."""
    cfg, bos = loaded.model.cfg, bos_id(loaded)
    n_tokens = 2 * seq_len + (bos is not None)
    if n_tokens > cfg.n_ctx:
        raise LimitExceededError(
            f"seq_len={seq_len} makes sequences of {n_tokens} tokens (BOS + 2 x seq_len); the model's context is "
            f"{cfg.n_ctx}, so seq_len can be at most {(cfg.n_ctx - (bos is not None)) // 2}"
        )
    tokens = repeated_random_tokens(cfg.d_vocab, seq_len, batch, seed=seed, bos=bos).to(loaded.model.device)
    meta = DetectorInput(kind="repeated_random", seq_len=seq_len, batch=batch, seed=seed, bos=bos, n_tokens=n_tokens)
    return tokens, meta


def standard_input(loaded: LoadedModel) -> tuple[Tensor, DetectorInput]:
    n_ctx, has_bos = loaded.model.cfg.n_ctx, bos_id(loaded) is not None
    seq_len = max(1, min(STANDARD_SEQ_LEN, (n_ctx - has_bos) // 2))
    return repeated_input(loaded, seq_len, STANDARD_BATCH, STANDARD_SEED)


def head_scores(loaded: LoadedModel, detectors: dict[str, Tensor], table: HeadTable | None = None) -> list[HeadScores]:
    """One HeadScores per head, in layer-major order; copying scores and K-composition positivity from the
    heads table when given (else the copying scores are computed here)."""
    model = loaded.model
    cfg = model.cfg
    if cfg.n_layers == 0:
        return []
    ov = copying_spectra.ov_copying_scores(model) if table is None else table.ov_copying  # [L, H]
    qk = copying_spectra.qk_copying_scores(model) if table is None else table.qk_copying  # [L, H]
    iv = table.induction if table is not None else None
    k_comp = {"one_hot": iv.qk_k_composition, "weighted": iv.qk_weighted} if iv is not None else None
    out = []
    for layer in range(cfg.n_layers):
        for h in range(cfg.n_heads):
            det = {name: num(scores[layer, h]) for name, scores in detectors.items()}
            kc = {name: num(scores[layer, h]) for name, scores in (k_comp or {}).items()}
            out.append(
                HeadScores(
                    head=head_name(layer, h),
                    layer=layer,
                    index=h,
                    ov_copying=num(ov[layer, h]),
                    qk_copying=num(qk[layer, h]),
                    previous_token=det.get("previous_token"),
                    current_token=det.get("current_token"),
                    first_token=det.get("first_token"),
                    duplicate_token=det.get("duplicate_token"),
                    induction=det.get("induction"),
                    qk_k_composition=kc.get("one_hot"),
                    qk_k_composition_weighted=kc.get("weighted"),
                )
            )
    return out


def build_heads_view(loaded: LoadedModel, p: NoParams | None = None, limits: Limits | None = None) -> HeadsView:
    """Copying scores and detector scores of every head on the standard repeated-random-token input: one
    detector pass (its previous-token scores also pick the 2-D view's partner), each Gram formed once."""
    tokens, meta = standard_input(loaded)
    rotary_model, reference = is_rotary(loaded), []

    def means() -> Tensor:  # μ [L, d_model] from the result store (else measured there), in the spectra branch
        mu, text = reference_means(loaded)
        reference.append(text)
        return mu

    table = head_table(
        loaded.model,
        tokens,
        budget_bytes=limits.peak_bytes if limits is not None else None,
        means=means if rotary_model else None,
        reference_tokens=reference_tokens_bound(loaded) if rotary_model else None,
        with_loss=True,
    )
    if table.induction is None:
        return HeadsView(model=model_ref(loaded), detector_input=meta, heads=[])
    scores = head_scores(loaded, table.detectors, table)
    peaks = table.kernel_peak_offset  # [L, H] for rotary models: μ from the result store, else measured once
    if peaks is not None:
        scores = [s.model_copy(update={"kernel_peak_offset": int(peaks[s.layer, s.index])}) for s in scores]
    return HeadsView(
        model=model_ref(loaded),
        detector_input=meta,
        heads=scores,
        previous_token_head=table.induction.previous_token_head,
        induction_head=head_name(
            *heads_that_matter(table.detectors["induction"], table.detectors["previous_token"])[1]
        ),
        heads_rule=HEADS_RULE,
        **copy_losses(table, meta),
        kernel_reference=reference[0] if reference else None,
    )


def copy_losses(table: HeadTable, meta: DetectorInput) -> dict[str, Any]:
    """Mean next-token loss on the first and the second copy of r (losses [b, n - 1]: column i predicts token i + 1;
    with a BOS, columns 0 .. T - 1 predict the first copy's tokens 1 .. T and T .. 2T - 1 the second copy's)."""
    if table.losses is None or meta.seq_len is None:
        return {}
    cut = meta.seq_len if meta.bos is not None else meta.seq_len - 1  # the first column predicting the second copy
    first, second = table.losses[:, :cut], table.losses[:, cut:]
    return {
        "loss_first_copy": float(first.mean()),
        "loss_second_copy": float(second.mean()),
        "loss_by_position": table.losses.mean(0).tolist(),
    }


def build_copying_view(loaded: LoadedModel, p: CopyingParams, limits: Limits) -> CopyingMetricsView:
    """Diagonal sign, top-1 and top-k copying of a head's full OV circuit (rows streamed under the byte budget), over
    the token set the OV tables rank (`vocab`: a large vocabulary's stated default set, or every token)."""
    layer, h = parse_head(p.head, loaded.model.cfg)
    ranked = token_set(loaded, None, p.vocab)
    k = check_k(p.k, limits, ranked.n)
    with torch.no_grad():
        m = copying.ov_copying_metrics(
            loaded.model, layer, h, k=k, budget_bytes=limits.matrix_budget_bytes, tokens=ranked.ids
        )
        score = copying_spectra.ov_copying_scores(loaded.model)[layer, h]
    return CopyingMetricsView(
        model=model_ref(loaded),
        head=head_name(layer, h),
        ov_copying=num(score),
        diagonal_positive=m.diagonal_positive,
        diagonal_quantiles=[float(q) for q in m.diagonal_quantiles],
        top1=m.top1,
        topk=m.topk,
        k=m.k,
        n_tokens=ranked.n,
        token_set=ranked.said,
    )


def _positional(loaded: LoadedModel, layer: int, h: int) -> PositionalQK | None:
    cfg = loaded.model.cfg
    if loaded.model.W_pos is None or cfg.positional_embedding_type not in ("standard", "shortformer") or cfg.n_ctx < 2:
        return None
    pos = circuits.positional_qk(loaded.model, layer, h, n=min(cfg.n_ctx, POSITIONAL_MAX_N))
    pattern = pos.pattern.double().nan_to_num(0.0).tolist()
    return PositionalQK(
        n_positions=len(pattern), pattern=pattern, previous_token=pos.previous_token, current_token=pos.current_token
    )


def build_head_view(loaded: LoadedModel, p: HeadParams, limits: Limits) -> HeadView:
    """One head: its scores (from the heads table, cached), OV/QK spectra (eigenvalues by |lambda|, singular
    values) and positional pattern."""
    model = loaded.model
    layer, h = parse_head(p.head, model.cfg)
    name = head_name(layer, h)
    table = build_cached(HEADS, loaded, loaded.path.name, NoParams(), limits)
    scores = next(s for s in table.heads if s.head == name)
    every, index, d_head = spectra(loaded), layer * model.cfg.n_heads + h, model.cfg.d_head
    with torch.no_grad():
        ov_s = circuits.ov_circuit(model, layer, h).S  # [d_head]
        qk_s = circuits.qk_circuit(model, layer, h).S  # [d_head]
        positional = _positional(loaded, layer, h)
    return HeadView(
        model=model_ref(loaded),
        head=name,
        layer=layer,
        index=h,
        scores=scores,
        ov_eigenvalues=every.head("ov", index, d_head),
        qk_eigenvalues=every.head("qk", index, d_head),
        ov_singular_values=[float(s) for s in ov_s],
        qk_singular_values=[float(s) for s in qk_s],
        positional=positional,
        latent=term_norms(model, layer, h) if model.cfg.latent_attention else None,
    )


# -- declarations (app/analysis.py) ----------------------------------------------------------------------
def heads_cost(loaded: LoadedModel, p: AnalysisParams, limits: Limits) -> Cost:
    """The heads table on the standard input (the head view needs it too, when not cached)."""
    meta, rotary_model = standard_input(loaded)[1], is_rotary(loaded)
    return head_table_cost(
        loaded.model,
        meta.n_tokens,
        meta.batch,
        limits.peak_bytes,
        reference_tokens_bound(loaded) if rotary_model else None,
        with_loss=True,
    )


def head_cost(loaded: LoadedModel, p: HeadParams, limits: Limits) -> Cost:
    """The heads table (when not cached), then the head's spectra and positional pattern."""
    n = min(loaded.model.cfg.n_ctx, POSITIONAL_MAX_N)
    own = copying_spectra.head_spectra_cost(loaded.model, n)
    if is_cached(cache_key(HEADS, loaded.path.name, loaded, NoParams())):
        return own
    return heads_cost(loaded, p, limits).then(own)


def copying_cost(loaded: LoadedModel, p: CopyingParams, limits: Limits) -> Cost:
    """The metrics over the token set, then every head's eigenvalue copying score."""
    ranked = token_set(loaded, None, p.vocab)
    metrics = copying.copying_metrics_cost(
        loaded.model, p.k, limits.matrix_budget_bytes, None if ranked.ids is None else ranked.n
    )
    return metrics.then(Cost(0, flops=copying_spectra.ov_copying_scores_flops(loaded.model)))


HEADS = Analysis(
    name="heads",
    path="heads",
    params=NoParams,
    view=HeadsView,
    build=build_heads_view,
    cost=heads_cost,
    summary="Scores of every head",
    snippet=snippets.heads_body,
    tags=["heads"],
)
HEAD = Analysis(
    name="head",
    path="heads/{head}",
    params=HeadParams,
    view=HeadView,
    build=build_head_view,
    cost=head_cost,
    summary="One head: spectra, positional pattern",
    snippet=snippets.head_body,
    tags=["heads"],
)
COPYING = Analysis(
    name="copying",
    weights="attention",
    path="heads/{head}/copying",
    params=CopyingParams,
    view=CopyingMetricsView,
    build=build_copying_view,
    cost=copying_cost,
    summary="Copying metrics of the full OV circuit",
    tags=["heads"],
)
