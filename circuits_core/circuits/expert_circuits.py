"""An MLP writer's token table: what one expert (or a dense MLP, or a layer's shared experts) writes for a token on the
direct path, read through W_U (docs/maths.md §7.12).

An expert is nonlinear, so it has no OV matrix; its token table is the expert itself evaluated on each token's
embedding, the paper's "direct path through an MLP" (row vectors, layer l, expert e):

    x̂_t = ln2_l(W_E[t])                          [d_model]  the token's embedding through the layer's MLP input norm
    full_expert_circuit[t, c] = expert_e(x̂_t) W_U[:, c]     rows: source token t, cols: the logit of token c

with expert_e(x̂) = (act(x̂ W_gate[e]) ⊙ x̂ W_in[e]) W_out[e] (gpt-oss's clamped form, biases included), unweighted by
the router, an output norm's gain folded into W_out as the OV tables fold it (§7.8). The form is exact, not a
linearisation: no gate is frozen. It is the input a layer-0 MLP sees when attention writes nothing at the token,
and the direct-path reading of later layers (as the full OV circuit is for later heads). As a FactoredMatrix it is
[V, d_model] @ [d_model, V]: nothing V x V is formed.

The router's weight for e on the same x̂ (`direct_route_weights`: 0 where the token alone would not choose e; 1 for a
dense MLP or the shared experts, always on) says whether the row is one the model routes to that expert.
"""

from __future__ import annotations

import torch
from torch import Tensor

from circuits_core.circuits.embedding import EMBED_CHUNK, apply_ln_rows
from circuits_core.circuits.factored import FactoredMatrix
from circuits_core.circuits.global_topk import topk_global_cost, topk_global_flops
from circuits_core.circuits.stream_components import SHARED, Writer, mlp_width
from circuits_core.cost import Cost, check_stop
from circuits_core.errors import InvalidInputError
from circuits_core.model.hooks import Recorder
from circuits_core.model.moe import MoE, route
from circuits_core.model.transformer import Block, Transformer


def _block(model: Transformer, writer: Writer) -> Block:
    if writer.kind != "mlp":
        raise InvalidInputError(f"{writer.name} is not an MLP writer: name L<l>.mlp, L<l>.mlp.e<expert> or .shared")
    if writer.neurons is not None:
        raise InvalidInputError(f"{writer.name}: the token table is of a whole expert (no [neurons] selection)")
    block = model.blocks[writer.layer]
    assert isinstance(block, Block)
    return block


def expert_input(model: Transformer, writer: Writer, tokens: Tensor) -> Tensor:
    """x̂ [n, d_model]: the rows W_E[tokens] through the writer's layer's MLP input norm ln2."""
    return apply_ln_rows(_block(model, writer).ln2, model.W_E[tokens])


def expert_output(model: Transformer, writer: Writer, x: Tensor) -> Tensor:
    """expert_e(x) [n, d_model] of x [n, d_model] (unweighted; the dense MLP itself for L<l>.mlp), the output norm's
    gain folded in."""
    block = _block(model, writer)
    mlp = block.mlp
    if isinstance(mlp, MoE):
        out = mlp.shared(x) if writer.expert == SHARED else mlp.expert(writer.expert, x)  # [n, d_model]
    else:
        out = mlp(x[None], Recorder(None))[0]
    return out * block.ln2_post.w if model.cfg.post_norms else out


def expert_rows(model: Transformer, writer: Writer, tokens: Tensor | None = None) -> Tensor:
    """expert_e(x̂_t) [n, d_model] for the tokens (None: every token, EMBED_CHUNK rows at a time)."""
    if tokens is not None:
        return expert_output(model, writer, expert_input(model, writer, tokens))
    out = model.W_E.new_empty(model.cfg.d_vocab, model.cfg.d_model)
    for start in range(0, model.cfg.d_vocab, EMBED_CHUNK):
        check_stop(what="an expert's token table")
        ids = torch.arange(start, min(start + EMBED_CHUNK, model.cfg.d_vocab), device=model.W_E.device)
        out[start : start + len(ids)] = expert_rows(model, writer, ids)
    return out


def full_expert_circuit(model: Transformer, writer: Writer, tokens: Tensor | None = None) -> FactoredMatrix:
    """expert_e(x̂) W_U [V, V] (module docstring) as factors [V, d_model] @ [d_model, V]; with `tokens` (ids [n]) its
    [n, n] submatrix, formed on those tokens only."""
    W_U = model.W_U if tokens is None else model.W_U[:, tokens]  # [d_model, n]
    return FactoredMatrix(expert_rows(model, writer, tokens), W_U)


def expert_row(model: Transformer, writer: Writer, token: int) -> Tensor:
    """Row `token` of the table [V]: the logits expert e writes for that token's embedding."""
    return (expert_rows(model, writer, torch.tensor([token], device=model.W_E.device)) @ model.W_U)[0]


def direct_route_weights(model: Transformer, writer: Writer, tokens: Tensor) -> Tensor:
    """[n]: the router's weight for the writer's expert on each token's x̂ (0 where it is not among the chosen k);
    1 for a dense MLP and for shared experts (always on)."""
    mlp = _block(model, writer).mlp
    if not isinstance(mlp, MoE) or writer.expert == SHARED:
        return torch.ones(len(tokens), dtype=model.compute_dtype, device=model.W_E.device)
    x = expert_input(model, writer, tokens)  # [n, d_model]
    b_choice = mlp.b_choice if model.cfg.moe_scoring == "sigmoid" else None
    indices, weights = route(model.cfg, mlp.router_logits(x), b_choice)  # [n, k]
    return (weights * (indices == writer.expert)).sum(-1)


# -- prices (circuits_core.cost): the tables above as app/views/experts.py reads them --------------------------------
def expert_rows_flops(model: Transformer, writer: Writer, n: int) -> int:
    """expert_rows on n tokens: the gate and input products and the output (2 per multiply-add)."""
    d, m = model.cfg.d_model, mlp_width(model, writer.layer, writer.expert)
    gated = model.cfg.gated_mlp or model.cfg.layer_has_experts(writer.layer)  # experts are gated MLPs
    return 2 * n * d * m * (3 if gated else 2)


def route_flops(model: Transformer, writer: Writer, n: int) -> int:
    """direct_route_weights on n tokens: the router's logits (0 for a dense MLP or the shared experts)."""
    if not model.cfg.layer_has_experts(writer.layer) or writer.expert == SHARED:
        return 0
    return 2 * n * model.cfg.d_model * (model.cfg.num_experts or 0)


def expert_table_cost(
    model: Transformer, writer: Writer, k: int, budget_bytes: int, line: bool, n_tokens: int | None = None
) -> Cost:
    """A token's row (`line`: expert_row, then its top k) or the global top k of the n_tokens x n_tokens table
    (default every token), then the router's weight of each listed row token; answer: k entries and their weights."""
    cfg, size = model.cfg, model.W_E.element_size()
    m = mlp_width(model, writer.layer, writer.expert)
    if line:
        flops = expert_rows_flops(model, writer, 1) + 2 * cfg.d_model * cfg.d_vocab + route_flops(model, writer, 1)
        work = Cost((3 * m + 2 * cfg.d_model + 2 * cfg.d_vocab) * size, flops=flops)
        return work.with_answer(numbers=4 * k, labels=2 * k)
    n = cfg.d_vocab if n_tokens is None else n_tokens
    chunk = min(n, EMBED_CHUNK)
    factor = Cost(n * cfg.d_model * size)  # expert_e(x̂) [n, d_model], held through the search
    rows = Cost(chunk * (3 * m + 2 * cfg.d_model) * size, flops=expert_rows_flops(model, writer, n))  # one chunk's
    search = topk_global_cost(n, cfg.d_model, n, k, budget_bytes, size)
    search = Cost(search.peak_bytes, search.answer_bytes, topk_global_flops(n, cfg.d_model, n))
    weights = Cost(k * (cfg.d_model + 3 * m) * size, flops=route_flops(model, writer, k))
    return (factor + rows.then(search).then(weights)).with_answer(numbers=k, labels=2 * k)
