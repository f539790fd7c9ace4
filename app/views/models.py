"""Model listing, model summary (config + card) and tokenisation."""

from __future__ import annotations

from typing import Any

from app.analysis import Analysis
from app.params import PromptInput
from app.registry import ModelEntry, ModelRegistry
from app.schemas import ModelListView, ModelSummary, TokenizeView, UnavailableModel
from app.schemas.models import DefaultedValue
from app.settings import Limits
from app.views.shared.inputs import model_ref, resolve_prompt, token_refs
from circuits_core.cost import Cost
from circuits_core.errors import CheckpointError, QkovError
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.config import ModelConfig


def _card(loaded: LoadedModel) -> dict[str, Any] | None:
    card = loaded.card
    if card is None:
        return None
    if isinstance(card, dict):
        return card
    to_dict = getattr(card, "to_dict", None)
    return to_dict() if callable(to_dict) else dict(vars(card))


def exactness(cfg: ModelConfig) -> list[str]:
    """What is exact and what is frozen in the circuits of a model with the newest attention (docs/maths.md §7.1-7.3,
    §7.8), one sentence per feature it has."""
    out = []
    if cfg.qk_norm is not None:
        over = "each head" if cfg.qk_norm == "head" else "all heads of a layer at once"
        out.append(
            f"QK-norm (over {over}): token tables are exact in the cosine form (each token's own scale); "
            "weight-level circuits (composition, virtual weights, eigenvalue scores) are bilinear, the per-token "
            "scales left out; path expansions are frozen-norm, the run's scales frozen, and sum exactly."
        )
    caps = [f"scores at {cfg.attn_scores_soft_cap:g}"] if cfg.attn_scores_soft_cap is not None else []
    caps += [f"logits at {cfg.output_logits_soft_cap:g}"] if cfg.output_logits_soft_cap is not None else []
    if caps:
        out.append(
            f"Soft caps ({' and '.join(caps)}): values are capped, rankings and top-k exact; path expansions freeze "
            "each entry's cap factor and sum exactly to the capped value."
        )
    local = [layer for layer in range(cfg.n_layers) if cfg.layer_window(layer) is not None]
    if local:
        out.append(
            f"Sliding windows ({len(local)} of {cfg.n_layers} layers, {cfg.window_size} tokens): on those layers "
            "the circuits at an offset are defined only below the window, and each layer uses its own rope base."
        )
    if cfg.post_norms:
        out.append(
            "Output norms: OV tables and virtual weights are exact up to the layer's per-token output scale; path "
            "expansions freeze it and sum exactly."
        )
    return out


def build_model_view(loaded: LoadedModel, entry: ModelEntry) -> ModelSummary:
    cfg = loaded.model.cfg
    tok = loaded.tokenizer
    return ModelSummary(
        id=entry.id,
        format=str(loaded.format),
        shipped=entry.shipped,
        digest=str(loaded.digest),
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        d_model=cfg.d_model,
        d_head=cfg.d_head,
        d_vocab=cfg.d_vocab,
        n_ctx=cfg.n_ctx,
        d_mlp=cfg.d_mlp,
        attn_only=cfg.attn_only,
        positional_embedding_type=cfg.positional_embedding_type,
        normalization_type=cfg.normalization_type,
        act_fn=cfg.act_fn,
        use_bias=cfg.use_bias,
        processing=dict(getattr(loaded.model, "processing", {}) or {}),
        has_tokenizer=tok is not None,
        bos_token_id=tok.bos_token_id if tok is not None else cfg.bos_token_id,
        heads=cfg.head_names,
        card=_card(loaded),
        defaulted=[DefaultedValue(field=d.field, value=str(d.value), source=d.source) for d in loaded.defaulted],
        exactness=exactness(cfg),
        nonfinite_weights=list(loaded.nonfinite),
        computed_on=loaded.provenance(),
    )


LOADING = "still loading (its load goes on in the background: ask again shortly)"


def build_models_view(registry: ModelRegistry, deadline: float | None = None) -> ModelListView:
    """Every model folder (rescanned now), loading each once; failures are listed, not raised, and a folder still
    loading at `deadline` (by default the registry's listing wait from now) is listed as loading
    (ModelRegistry.settle)."""
    models, unavailable = [], []
    deadline = registry.deadline() if deadline is None else deadline
    entries = registry.entries(deadline)
    states = registry.settle(entries, deadline)
    for entry in entries:
        state = states[entry.id]
        try:
            if state is None:
                unavailable.append(UnavailableModel(id=entry.id, format=entry.format, state="loading", detail=LOADING))
                continue
            if isinstance(state, CheckpointError):
                raise state
            models.append(build_model_view(state, entry))
        except (CheckpointError, QkovError) as exc:
            unavailable.append(UnavailableModel(id=entry.id, format=entry.format, detail=str(exc)))
    return ModelListView(models=models, unavailable=unavailable)


def build_tokenize_view(loaded: LoadedModel, p: PromptInput, limits: Limits) -> TokenizeView:
    ids = resolve_prompt(loaded, p.prompt, p.tokens, limits)
    return TokenizeView(model=model_ref(loaded), prompt=p.prompt, tokens=token_refs(loaded, ids), n_tokens=len(ids))


def tokenize_cost(loaded: LoadedModel, p: PromptInput, limits: Limits) -> Cost:
    """Tokenising costs no tensor memory; the answer is one (id, text) per token, at most max_prompt_tokens."""
    return Cost(0).with_answer(numbers=limits.max_prompt_tokens, labels=limits.max_prompt_tokens)


TOKENIZE = Analysis(
    name="tokenize",
    weights="attention",
    path="tokenize",
    params=PromptInput,
    view=TokenizeView,
    build=build_tokenize_view,
    cost=tokenize_cost,
    summary="Tokenise a prompt",
    tags=["models"],
    cache=False,
)
