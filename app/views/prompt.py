"""A prompt through the model: its tokens, attention patterns (plain or value-weighted), and the
frozen-attention path expansion of one logit (docs/maths.md §2.11, §2.16).

Value-weighted pattern (2.16): A[i, j] * ||v_j|| with v the head's value vectors (not renormalised).
Path expansion: circuits_core.prompt.paths.expand_logits at one destination position; its terms, plus the
explicit remainder (orders > max_order), sum to the model's actual logit (difference). The answer lists the
k largest terms and sums the rest into one 'other' term, so the listed terms always sum to the value.
"""

from __future__ import annotations

import torch

from app import snippets
from app.analysis import Analysis, split_heads
from app.params import PathsParams, PromptParams
from app.schemas.analyses import PathsView, PathTermView, PromptHeadPattern, PromptView, TermKind
from app.settings import Limits
from app.views.shared.inputs import (
    check_k,
    model_ref,
    parse_heads,
    resolve_prompt,
    resolve_token,
    token_ref,
    token_refs,
)
from circuits_core.circuits import sinks
from circuits_core.cost import Cost
from circuits_core.errors import InvalidInputError, LimitExceededError
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.head_names import head_name
from circuits_core.model.soft_cap import share_beyond_cap
from circuits_core.model.window import visible
from circuits_core.prompt import frozen, paths
from circuits_core.prompt.frozen import frozen_run
from circuits_core.prompt.paths import Target, expand_logits


def check_position(position: int | None, n: int) -> int:
    """A destination position in [-n, n) -> [0, n); None is the last position."""
    if position is None:
        return n - 1
    if not -n <= position < n:
        raise InvalidInputError(
            f"position {position} is outside the prompt of {n} tokens: give 0..{n - 1} (or -1 for the last)"
        )
    return position % n


def build_prompt_view(loaded: LoadedModel, p: PromptParams, limits: Limits) -> PromptView:
    """Tokens of a prompt and the (value-weighted) attention patterns of `heads` (default: the first max_heads)."""
    prompt, tokens, heads, weighted = p.prompt, p.tokens, split_heads(p.heads), p.weighted
    model = loaded.model
    ids = resolve_prompt(loaded, prompt, tokens, limits)
    cfg = model.cfg
    chosen = (
        parse_heads(heads, loaded, limits.max_heads)
        if heads
        else [(layer, h) for layer in range(cfg.n_layers) for h in range(cfg.n_heads)][: limits.max_heads]
    )
    run_tokens = torch.tensor([ids], dtype=torch.long, device=model.device)
    with torch.no_grad():
        kept = ("hook_pattern", "attn.hook_v", "hook_attn_scores_uncapped")  # the last only where scores are capped
        logits, cache = model.run(run_tokens, names=lambda n: n.endswith(kept))
        cap, n = cfg.attn_scores_soft_cap, len(ids)
        patterns = []
        for layer, h in chosen:
            A = cache[f"blocks.{layer}.attn.hook_pattern"][0, h]  # [n (query), n (key)]
            mass = sinks.sink_mass(A).double().tolist() if sinks.has_sinks(model) else None  # [n]
            beyond = None
            if cap is not None:  # the scores the head sees (causal, within its window), before the cap
                raw = cache[f"blocks.{layer}.attn.hook_attn_scores_uncapped"][0, h]  # [n, n]
                beyond = share_beyond_cap(raw[visible(n, cfg.layer_window(layer), raw.device)], cap)
            if weighted:
                A = A * cache[f"blocks.{layer}.attn.hook_v"][0, :, h].norm(dim=-1)[None, :]  # [n] value norms of keys
            patterns.append(
                PromptHeadPattern(
                    head=head_name(layer, h), pattern=A.double().tolist(), sink_mass=mass, beyond_cap=beyond
                )
            )
        top = logits[0].argmax(-1).tolist()  # [n]
    return PromptView(
        model=model_ref(loaded),
        tokens=token_refs(loaded, ids),
        weighted=weighted,
        score_cap=cfg.attn_scores_soft_cap,
        heads=patterns,
        top_predictions=[token_ref(loaded, i) for i in top],  # independent tokens, not a sequence
    )


# -- logit path expansion ----------------------------------------------------------------------------------
def term_kind(path: tuple[str, ...]) -> TermKind:
    if not path:
        return "direct"
    first = path[0]
    if first == "bias:unembed":
        return "unembed_bias"
    if first.startswith("bias:"):
        return "bias"
    if first.startswith("mlp:"):
        return "mlp"
    return "head"


def build_paths_view(loaded: LoadedModel, p: PathsParams, limits: Limits) -> PathsView:
    """Path terms of the target logit (minus the contrast logit) at `position`; the k largest are listed."""
    prompt, tokens, position, target, contrast = p.prompt, p.tokens, p.position, p.target, p.contrast
    max_order, by_source, k = p.max_order, p.by_source, p.k
    model = loaded.model
    if max_order > limits.max_order:
        raise LimitExceededError(f"max_order={max_order} is over the limit of {limits.max_order}")
    if max_order < 0:
        raise InvalidInputError(f"max_order must be >= 0, got {max_order}")
    ids = resolve_prompt(loaded, prompt, tokens, limits)
    n = len(ids)
    pos = check_position(position, n)
    k = check_k(k, limits, 10**9)
    run_tokens = torch.tensor(ids, dtype=torch.long, device=model.device)
    with torch.no_grad():
        run = frozen_run(model, run_tokens)
        t = resolve_token(loaded, target) if target is not None else int(run.logits_at([pos])[0].argmax())
        c = resolve_token(loaded, contrast) if contrast is not None else None
        goal: Target = t if c is None else (t, c)
        itemsize = torch.finfo(model.dtype).bits // 8
        exp = expand_logits(
            model,
            run_tokens,
            goal,
            positions=pos,
            max_order=max_order,
            by_source=by_source,
            run=run,
            max_elements=max(1, limits.peak_bytes // itemsize),  # the same budget the request was priced against
        )
        values = exp.values[:, 0].double()  # [T]
        order = exp.ranked(0)  # by |value|, equal values in the terms' own order
        listed, rest = order[:k].tolist(), order[k:]
        terms = [
            PathTermView(
                path=list(exp.paths[i]),
                kind=term_kind(exp.paths[i]),
                order=int(exp.orders[i]),
                value=float(values[i]),
                by_source=exp.by_source[i, 0].double().tolist() if exp.by_source is not None else None,
            )
            for i in listed
        ]
        if rest.numel():
            terms.append(
                PathTermView(
                    path=["other"], kind="other", order=None, value=float(values[rest].sum()), n_terms=int(rest.numel())
                )
            )
        if exp.max_order < model.cfg.n_layers:
            terms.append(PathTermView(path=["remainder"], kind="remainder", order=None, value=float(exp.remainder[0])))
        order_totals = exp.order_totals()[:, 0].double().tolist()
        logit_cap = model.cfg.output_logits_soft_cap
        beyond_cap = share_beyond_cap(run.uncapped_logits_at([pos]), logit_cap) if logit_cap is not None else None
    return PathsView(
        model=model_ref(loaded),
        tokens=ids,
        prompt_tokens=token_refs(loaded, ids),
        position=pos,
        target=t,
        target_token=token_ref(loaded, t),
        contrast=c,
        contrast_token=token_ref(loaded, c) if c is not None else None,
        value=float(exp.value[0]),
        logit_cap=logit_cap,
        beyond_cap=beyond_cap,
        max_order=exp.max_order,
        terms=terms,
        total=float(sum(term.value for term in terms)),
        order_totals=order_totals,
        n_terms=len(exp.paths),
    )


def prompt_cost(loaded: LoadedModel, p: PromptParams, limits: Limits) -> Cost:
    """One forward pass keeping patterns and values; answer: n x n per shown head, the tokens."""
    cfg, n = loaded.model.cfg, len(resolve_prompt(loaded, p.prompt, p.tokens, limits))
    shown = len(split_heads(p.heads)) or min(limits.max_heads, cfg.n_layers * cfg.n_heads)
    kept = cfg.n_heads * n * n + n * cfg.n_heads * cfg.d_head
    return frozen.forward_cost(loaded.model, n, 1, kept).with_answer(numbers=shown * n * n + 2 * n, labels=2 * n)


def paths_cost(loaded: LoadedModel, p: PathsParams, limits: Limits) -> Cost:
    n = len(resolve_prompt(loaded, p.prompt, p.tokens, limits))
    return frozen.run_cost(loaded.model, n).then(paths.cost(loaded.model, n, p.max_order, p.by_source, q=1, k=p.k))


PROMPT = Analysis(
    name="prompt",
    path="prompt",
    params=PromptParams,
    view=PromptView,
    build=build_prompt_view,
    cost=prompt_cost,
    summary="Tokens and attention patterns of chosen heads",
    snippet=snippets.prompt_body,
    tags=["prompts"],
)
PATHS = Analysis(
    name="paths",
    path="paths",
    params=PathsParams,
    view=PathsView,
    build=build_paths_view,
    cost=paths_cost,
    summary="Path expansion of a logit on a prompt",
    tags=["prompts"],
)
