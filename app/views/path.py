"""A chain of heads h1 -> ... -> hk in increasing layers, i.e. a virtual attention head (docs/maths.md §2.10).

On a prompt: its pattern A^{hk} ... A^{h1} (product of the clean run's patterns), its OV circuit
W_E W_OV^{h1} ... W_OV^{hk} W_U (top entries and eigenvalue copying score, from d_head-sized factors), and
its contribution to a chosen logit at every position: the path term (embed, h1, ..., hk) of the
frozen-attention expansion (circuits_core.prompt.paths), also started from each bias / MLP source that can enter it:
only the chain's own terms are computed (virtual.chain_terms), not every path of its order.
"""

from __future__ import annotations

import torch

from app import snippets
from app.analysis import Analysis, split_heads
from app.params import ChainParams
from app.schemas.analyses import ChainView, SourceContribution
from app.settings import Limits
from app.views.shared.inputs import model_ref, resolve_prompt, resolve_token, token_ref, token_refs
from app.views.shared.token_circuits import VIRTUAL_LABELS, parse_chain, token_circuit, virtual_ov_circuit
from circuits_core.cost import Cost
from circuits_core.errors import LimitExceededError
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.head_names import head_name
from circuits_core.prompt import frozen
from circuits_core.prompt.frozen import frozen_run
from circuits_core.prompt.virtual import chain_cost, chain_next_token_terms, chain_terms


def build_path_view(loaded: LoadedModel, p: ChainParams, limits: Limits) -> ChainView:
    """The virtual head of `heads` on a prompt; `target` defaults to the model's top prediction at the last position."""
    heads, prompt, tokens, target, k = split_heads(p.heads), p.prompt, p.tokens, p.target, p.k
    model = loaded.model
    chain = parse_chain(loaded, heads, limits.max_heads)
    if len(chain) > limits.max_order:
        raise LimitExceededError(
            f"a chain of {len(chain)} heads is a path of order {len(chain)}; max_order is {limits.max_order}"
        )
    names = tuple(head_name(*c) for c in chain)
    ids = resolve_prompt(loaded, prompt, tokens, limits)
    run_tokens = torch.tensor(ids, dtype=torch.long, device=model.device)
    with torch.no_grad():
        run = frozen_run(model, run_tokens)
        t = resolve_token(loaded, target) if target is not None else int(run.logits_at([run.n - 1])[0].argmax())
        pattern = run.patterns[chain[0][0], chain[0][1]]  # [n, n]
        for layer, h in chain[1:]:
            pattern = run.patterns[layer, h] @ pattern  # A^{h_i} (A^{h_{i-1}} ... A^{h1})
        by_source = [
            SourceContribution(source=source, values=values.double().tolist())
            for source, values in chain_terms(model, run, list(chain), t)
        ]
        ov = token_circuit(loaded, virtual_ov_circuit(loaded, chain), k, limits, VIRTUAL_LABELS)
    contribution = next(s.values for s in by_source if s.source == "embed")
    with torch.no_grad():
        next_token = chain_next_token_terms(model, run, chain)  # [n - 1]: each position's own next token
    return ChainView(
        model=model_ref(loaded),
        heads=list(names),
        tokens=token_refs(loaded, ids),
        target=token_ref(loaded, t),
        pattern=pattern.double().tolist(),
        ov=ov,
        contribution=contribution,
        by_source=by_source,
        next_token_contribution=next_token.double().tolist(),
    )


def path_cost(loaded: LoadedModel, p: ChainParams, limits: Limits) -> Cost:
    """The frozen run, then the chain's own terms from each source (virtual.chain_cost), the virtual OV circuit's
    top entries and the pattern product; answer: the pattern [n, n] and a few [n] rows per source."""
    model = loaded.model
    n, order = len(resolve_prompt(loaded, p.prompt, p.tokens, limits)), max(1, len(split_heads(p.heads)))
    sources = 1 + model.cfg.n_layers * (1 if model.cfg.attn_only else 2)
    return (
        frozen.run_cost(model, n)
        .then(chain_cost(model, n, order, sources))
        .with_answer(numbers=n * n + (3 + sources) * n * order)
    )


PATH = Analysis(
    name="path",
    path="path",
    params=ChainParams,
    view=ChainView,
    build=build_path_view,
    cost=path_cost,
    summary="A chain of heads (virtual head) on a prompt",
    snippet=snippets.path_body,
    tags=["prompts"],
    needs_layers=1,
)
