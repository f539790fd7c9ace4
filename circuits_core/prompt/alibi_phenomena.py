"""What ALiBi's positions (model/alibi.py) look like in a trained two-layer induction circuit: the "alibi" section of
an ALiBi toy's model card (circuits_core/training/toy_card.py), beside the phenomena every toy reports.

Paper context (Elhage et al. 2021, "Two-Layer Attention-Only Transformers"): an induction head in layer 1 finds its
keys by K-composition with a previous-token head in layer 0. An ALiBi model has no positions in its residual stream:
a head's score is a content term plus the kernel −m_h (i − j), so a layer-0 head can only prefer the previous token
through its slope m_h (and through content, which random tokens do not offer). Measured on the app's inputs:

- kernel: the real scores minus their content term q_i·k_j / scale (hook_q, hook_k) over every causal entry of the
  detector input (detectors.standard_tokens), per head against −m_h (i − j): the largest deviation, and the slope of
  the least-squares line in δ = i − j (so "exactly linear" is a measurement, not a definition);
- offsets: the mean attention of the previous-token partner and of the induction head at δ = 0..OFFSETS−1 (queries
  i ≥ OFFSETS), with their slopes m_h;
- copy_losses: the mean loss of predicting each copy of r on Olsson et al.'s input BOS + r + r + r + r
  (detectors.olsson_tokens, r 25 uniform random tokens): the first copy cannot be predicted, the later ones can;
- ablation: the induction score and the second-repeat loss before and after the partner's output is removed, with
  later patterns recomputed (ablation.ablate_head): K-composition's effect on this model.
"""

from __future__ import annotations

import torch
from torch import Tensor

from circuits_core.errors import InvalidInputError
from circuits_core.model.alibi import alibi_slopes
from circuits_core.model.transformer import Transformer
from circuits_core.prompt.ablation import ablate_head
from circuits_core.prompt.detectors import OLSSON_REPEATS, induction_targets, olsson_tokens, standard_tokens
from circuits_core.prompt.phenomena import token_losses

OFFSETS = 5


def _pattern(layer: int) -> str:
    return f"blocks.{layer}.attn.hook_pattern"


def kernel_report(model: Transformer, tokens: Tensor) -> dict[str, object]:
    """Per layer and head: the fitted slope of (scores − content) against δ, and max |scores − content + m_h δ|."""
    cfg = model.cfg
    n = tokens.shape[1]
    with torch.no_grad():
        _, cache = model.run(tokens, names=lambda k: k.endswith(("hook_q", "hook_k", "hook_attn_scores")))
    i, j = torch.tril_indices(n, n)  # causal entries, j <= i
    delta = (i - j).double()  # [e]
    centred = delta - delta.mean()
    slopes, deviation = [], 0.0
    m = alibi_slopes(cfg)  # [H]
    for layer in range(cfg.n_layers):
        a = f"blocks.{layer}.attn"
        q, k = cache[f"{a}.hook_q"].double(), cache[f"{a}.hook_k"].double()  # [b, n, H, dh]
        content = torch.einsum("bqhe,bkhe->bhqk", q, k) / cfg.scale  # [b, H, n, n]
        positional = (cache[f"{a}.hook_attn_scores"].double() - content)[:, :, i, j]  # [b, H, e]
        deviation = max(deviation, float((positional + m[None, :, None] * delta).abs().max()))
        fit = ((positional - positional.mean(-1, keepdim=True)) * centred).sum(-1) / (centred**2).sum()  # [b, H]
        slopes.append([round(float(s), 6) for s in fit.mean(0)])
    return {"fitted_slopes": slopes, "max_deviation_from_linear": deviation}


def offset_attention(model: Transformer, tokens: Tensor, layer: int, head: int) -> list[float]:
    """Mean attention of L{layer}H{head} at δ = 0..OFFSETS−1 over queries i ≥ OFFSETS of `tokens`."""
    with torch.no_grad():
        _, cache = model.run(tokens, names={_pattern(layer)})
    A = cache[_pattern(layer)][:, head].double()  # [b, n, n]
    return [float(torch.diagonal(A, offset=-d, dim1=-2, dim2=-1)[:, OFFSETS - d :].mean()) for d in range(OFFSETS)]


def copy_losses(model: Transformer, tokens: Tensor, copies: int) -> list[float]:
    """Mean loss of predicting each of the `copies` copies of r in BOS + r + ... + r (token i+1 from position i)."""
    losses = token_losses(model, tokens)  # [b, n-1]: column i predicts token i + 1
    t = (tokens.shape[1] - 1) // copies
    return [float(losses[:, c * t : (c + 1) * t].mean()) for c in range(copies)]


def _induction_and_loss(pattern: Tensor, logits: Tensor, tokens: Tensor) -> tuple[float, float]:
    """(induction score of one head [b, n, n] as detectors.py defines it, mean loss on the second repeat)."""
    targets = induction_targets(tokens).to(pattern.device)  # [b, n, n] bool
    rows = targets.any(-1)
    score = float((pattern * targets).sum(-1)[rows].mean())
    t = (tokens.shape[1] - 1) // 2
    losses = torch.nn.functional.cross_entropy(logits[:, t:-1].flatten(0, 1).float(), tokens[:, t + 1 :].flatten())
    return score, float(losses)


def ablation_report(model: Transformer, tokens: Tensor, induction: tuple[int, int], partner: int) -> dict[str, float]:
    """The induction head's score and the second-repeat loss, clean and with layer-0 partner's output removed."""
    layer, head = induction
    names = _pattern(layer).__eq__
    with torch.no_grad():
        clean_logits, clean = model.run(tokens, names=names)
    cut_logits, cut = ablate_head(model, tokens, layer - 1, partner, recompute_patterns=True, names=names)
    before = _induction_and_loss(clean[_pattern(layer)][:, head], clean_logits, tokens)
    after = _induction_and_loss(cut[_pattern(layer)][:, head], cut_logits, tokens)
    return {
        "induction_score": before[0],
        "induction_score_without_partner": after[0],
        "rep2_loss": before[1],
        "rep2_loss_without_partner": after[1],
    }


def alibi_report(model: Transformer, induction_head: str, partner: str) -> dict[str, object]:
    """The card's "alibi" section for an ALiBi model whose induction head and K-composition partner are named
    L{l}H{h} (phenomena.induction_report)."""
    cfg = model.cfg
    if cfg.alibi is None or cfg.n_layers < 2:
        raise InvalidInputError("the ALiBi report needs an ALiBi model of at least two layers")
    (il, ih), (pl, ph) = ((int(s[1 : s.index("H")]), int(s[s.index("H") + 1 :])) for s in (induction_head, partner))
    model = model.eval()
    tokens = standard_tokens(model).to(model.device)
    m = alibi_slopes(cfg)
    olsson = olsson_tokens(model).to(model.device)
    return {
        "rule": cfg.alibi,
        "slopes": [float(s) for s in m],
        "kernel": kernel_report(model, tokens),
        "partner": partner,
        "partner_slope": float(m[ph]),
        "partner_offset_attention": offset_attention(model, tokens, pl, ph),
        "induction_head": induction_head,
        "induction_slope": float(m[ih]),
        "induction_offset_attention": offset_attention(model, tokens, il, ih),
        "copy_losses": copy_losses(model, olsson, OLSSON_REPEATS),
        "ablation": ablation_report(model, tokens, (il, ih), ph),
    }
