"""The heads table (copying scores + behavioural detectors of every head), shared: the heads page shows it, and the
analyses derived from it (the head page, the detectors, the model summary, positivity, the tour) read its answer
(through `build_cached(HEADS, ...)`) or its standard input.

Detectors run on the standard input of docs/maths.md §2.15: BOS + r + r, r = 50 uniform random tokens,
batch 10, fixed seed (shorter r when the context is short). Copying scores are the eigenvalue statistic
sum(lambda)/sum(|lambda|) of the full OV and token-token QK circuits (docs/maths.md §2.8).
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

from app import snippets
from app.analysis import Analysis, AnalysisParams
from app.params import NoParams
from app.schemas import DetectorInput, HeadScores, HeadsView
from app.settings import Limits
from app.views.shared.head_spectra import keep_spectra
from app.views.shared.inputs import model_ref, qk_form_fields
from app.views.shared.rotary_reference import is_rotary, reference_means, reference_tokens_bound
from circuits_core.circuits import copying_spectra
from circuits_core.cost import Cost
from circuits_core.errors import LimitExceededError
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.head_names import head_name
from circuits_core.prompt.detectors import (
    HEADS_RULE,
    STANDARD_BATCH,
    STANDARD_SEQ_LEN,
    heads_that_matter,
    repeated_random_tokens,
)
from circuits_core.prompt.head_table import HeadTable, head_table, head_table_cost

STANDARD_SEED = 0  # the standard input's shape (STANDARD_SEQ_LEN, STANDARD_BATCH) is the engine's


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
        return HeadsView(model=model_ref(loaded), detector_input=meta, heads=[], **qk_form_fields(loaded, "weight"))
    if table.ov_eigenvalues is not None and table.qk_eigenvalues is not None:  # every head view reads them
        keep_spectra(loaded, table.ov_eigenvalues, table.qk_eigenvalues)
    scores = head_scores(loaded, table.detectors, table)
    peaks = table.kernel_peak_offset  # [L, H] for rotary models: μ from the result store, else measured once
    if peaks is not None:
        scores = [s.model_copy(update={"kernel_peak_offset": int(peaks[s.layer, s.index])}) for s in scores]
    return HeadsView(
        model=model_ref(loaded),
        **qk_form_fields(loaded, "weight"),  # the QK copying and K-composition columns
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
