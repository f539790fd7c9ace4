"""Skip-trigrams "source ... destination -> out" through one head (the paper's "One-Layer Attn-Only Transformers";
docs/maths.md §2.6): for one source token, the destinations whose queries score it highest (a column of the full QK
circuit) and the outputs it raises most (a row of the full OV circuit), both from head_circuits.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from circuits_core.circuits.head_circuits import factors_cost, full_ov_row, full_qk_col, line_flops, top_cost
from circuits_core.cost import Cost
from circuits_core.errors import InvalidInputError
from circuits_core.model.transformer import Transformer
from circuits_core.ranking import top_k


@dataclass
class SkipTrigrams:
    """Skip-trigrams "source ... destination -> out" through one head, for one source token a.

    dest_tokens/dest_scores: the k query tokens b with the largest attention score qk[b, a] on key a
    (column a of the full QK circuit, real score units). Raw scores are not comparable across queries
    (only differences within a row set the pattern), so this ranking is the paper's "largest QK entries".
    out_tokens/out_scores: the k tokens c with the largest logit effect ov[a, c] (row a of the full OV).
    joint [k, k]: qk[b, a] * ov[a, c] for every (destination, out) pair -- a heuristic strength only, the
    paper defines no joint score. triples: (b, c, joint) sorted by joint, largest first. Equal scores rank by
    token id, the lower first, and equal joints by destination, then out (docs/maths.md §1.7).
    copying: whether a is among its own top-k out tokens. With `vocab` (token ids [n]) destinations and
    outs are ranked among those tokens only.
    """

    source: int
    dest_tokens: Tensor  # [k]
    dest_scores: Tensor  # [k]
    out_tokens: Tensor  # [k]
    out_scores: Tensor  # [k]
    joint: Tensor  # [k, k] rows destination, cols out
    triples: list[tuple[int, int, float]]
    copying: bool


def skip_trigrams(
    model: Transformer,
    layer: int,
    head: int,
    source_token: int,
    k: int = 10,
    vocab: Tensor | None = None,
    qk_col: Tensor | None = None,
) -> SkipTrigrams:
    """qk_col [d_vocab]: the QK column to rank destinations by instead of full_qk_col (rotary.full_qk_col_at
    passes the column at an offset)."""
    n = model.cfg.d_vocab if vocab is None else vocab.numel()
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
        raise InvalidInputError(f"k must be an integer in [1, {n}], got {k!r}")
    keep = slice(None) if vocab is None else vocab
    ids = torch.arange(model.cfg.d_vocab, device=model.W_E.device)[keep]  # [n]
    col = full_qk_col(model, layer, head, source_token) if qk_col is None else qk_col  # [V]
    dest_scores, dest = top_k(col[keep], k)  # [k]
    out_scores, out = top_k(full_ov_row(model, layer, head, source_token)[keep], k)  # [k]
    dest_tokens, out_tokens = ids[dest], ids[out]
    joint = dest_scores[:, None] * out_scores[None, :]  # [k, k]
    order = joint.flatten().argsort(descending=True, stable=True)  # equal joints: by destination, then out rank
    triples = [(int(dest_tokens[i // k]), int(out_tokens[i % k]), float(joint.flatten()[i])) for i in order.tolist()]
    return SkipTrigrams(
        source=source_token,
        dest_tokens=dest_tokens,
        dest_scores=dest_scores,
        out_tokens=out_tokens,
        out_scores=out_scores,
        joint=joint,
        triples=triples,
        copying=bool((out_tokens == source_token).any()),
    )


def skip_trigrams_cost(model: Transformer, k: int, budget_bytes: int, token: bool) -> Cost:
    """skip_trigrams (a QK column and an OV row) after, without a token, the global top-1 source search (on every
    token; the view prices its own token set)."""
    cfg, size = model.cfg, model.W_E.element_size()
    rotary = cfg.positional_embedding_type == "rotary"
    flops = line_flops(model, "qk-column-at" if rotary else "qk-column") + line_flops(model, "ov-row")
    lines = factors_cost(model).then(Cost(4 * cfg.d_vocab * size + k * k * (size + 8), flops=flops))
    search = top_cost(model, 1, budget_bytes, line=False) if not token else Cost(0)
    return search.then(lines).with_answer(numbers=3 * k + 2 * k * k, labels=2 * k + 3 * k * k)
