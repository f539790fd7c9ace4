"""The snippets a page's context builds with what it knows (composition, logit paths, ...)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from app.snippets.script import TOP_K_IMPORT, load_lines


def composition(folder: Path, dtype: str, kind: str) -> str:
    """The composition page: every pair's score, the baseline and the strongest pair."""
    key = kind.lower()
    return (
        load_lines(folder, dtype)
        + f"""import numpy as np

from circuits_core.circuits.composition import composition_scores
from circuits_core.model.head_names import head_name

comp = composition_scores(model, kinds=({key!r},))
raw = comp.raw[{key!r}].double()  # [L, H, L, H]: earlier head (l1, h1) -> later head (l2, h2)
masked = torch.where(comp.mask, raw, torch.full_like(raw, -1.0))
l1, h1, l2, h2 = (int(i) for i in np.unravel_index(int(masked.argmax()), raw.shape))  # numpy's: no sympy import
result = {{
    "baseline": comp.baseline,
    "top_pair": (head_name(l1, h1), head_name(l2, h2), float(raw[l1, h1, l2, h2])),
}}
print(result)
"""
    )


def qk_score_terms(folder: Path, dtype: str, head: str, ids: Sequence[int], query: int, key: int, k: int) -> str:
    """The QK paths page's table of one score's terms."""
    return (
        load_lines(folder, dtype)
        + f"""from circuits_core.model.head_names import parse_head
from circuits_core.prompt.frozen import frozen_run
from circuits_core.prompt.qk_paths import expand_scores

tokens = torch.tensor({list(ids)!r})
layer, h = parse_head({head!r}, model.cfg)
with torch.no_grad():
    run = frozen_run(model, tokens)
    exp = expand_scores(model, tokens, (layer, h), run=run)
terms = exp.q_parts[:, {query}] @ exp.k_parts[:, {key}].T / exp.scale  # [C, C] query-side x key-side components
C = len(exp.components)
top = terms.flatten().abs().argsort(descending=True, stable=True)[:{k}].tolist()  # ties: (query, key) order
result = {{
    "score": float(exp.scores[{query}, {key}]),
    "attention": float(run.patterns[layer, h, {query}, {key}]),
    "terms": [(exp.components[i // C], exp.components[i % C], float(terms.flatten()[i])) for i in top],
}}
print(result)
"""
    )


def logit_paths(folder: Path, dtype: str, ids: Sequence[int], position: int, target: int, max_order: int) -> str:
    """The prompt page's path expansion: the model's logit and its total by path order."""
    return (
        load_lines(folder, dtype)
        + f"""from circuits_core.prompt.paths import expand_logits

tokens = torch.tensor({list(ids)!r})
with torch.no_grad():
    exp = expand_logits(model, tokens, {target}, positions={position}, max_order={max_order}, by_source=False)
result = {{
    "value": float(exp.value[0]),  # the model's logit of token {target} at position {position}
    "order_totals": exp.order_totals()[:, 0].tolist(),  # the terms of each path order, summed
    "remainder": float(exp.remainder[0]),  # paths longer than max_order
}}
print(result)
"""
    )


def composition_profile(folder: Path, dtype: str, source: str, target: str, kind: str, offsets: int) -> str:
    """The pair page's profile over δ (rotary models)."""
    return (
        load_lines(folder, dtype)
        + f"""from circuits_core.circuits.composition_rotary import pair_profile

with torch.no_grad():
    profile = pair_profile(model, {source!r}, {target!r}, {kind.lower()!r}, torch.arange({offsets}))
result = {{"scores": profile.tolist()}}  # C_{kind}(δ) for δ = 0..{offsets - 1}
print(result)
"""
    )


def detectors(folder: Path, dtype: str, seq_len: int, batch: int, seed: int, bos: int | None) -> str:
    """The detectors page on BOS + r + r: every head's detector scores."""
    return (
        load_lines(folder, dtype)
        + f"""from circuits_core.model.head_names import head_name
from circuits_core.prompt.detectors import detector_scores, repeated_random_tokens

tokens = repeated_random_tokens(model.cfg.d_vocab, {seq_len}, {batch}, seed={seed}, bos={bos!r})  # BOS + r + r
with torch.no_grad():
    scores = detector_scores(model, tokens)  # {{detector: [n_layers, n_heads]}}
result = {{
    name: {{head_name(layer, h): float(s[layer, h]) for layer in range(s.shape[0]) for h in range(s.shape[1])}}
    for name, s in scores.items()
}}
print(result["induction"])
"""
    )


def ov_table(
    folder: Path, dtype: str, head: str, k: int, ids: Sequence[int] | None, token: int | None, raw: bool
) -> str:
    """The head page's OV table: the global top-k of the full OV circuit W_E W_OV W_U over the ranked tokens, or
    one source token's row of it."""
    ranked = "None  # every token" if ids is None else f"torch.tensor({list(ids)!r})  # the ranked token set"
    if token is None:
        search = f"""with torch.no_grad():
    values, rows, cols = full_ov_circuit(model, layer, h, ids).topk_global({k})  # [k] each, positions in ids
if ids is not None:
    rows, cols = ids[rows], ids[cols]
result = {{"entries": [(int(r), int(c), float(v)) for v, r, c in zip(values, rows, cols)]}}  # (source, output, value)
"""
    else:
        search = f"""{TOP_K_IMPORT}with torch.no_grad():
    row = full_ov_row(model, layer, h, {token})  # [d_vocab]: the logits attending to token {token} raises
if ids is not None:  # rank only the token set
    row = torch.full_like(row, float("-inf")).index_copy(0, ids, row[ids])
values, cols = top_k(row, {k})
result = {{"entries": [({token}, int(c), float(v)) for v, c in zip(values, cols)]}}  # (source, output, value)
"""
    return (
        load_lines(folder, dtype, raw)
        + f"""from circuits_core.circuits.head_circuits import full_ov_circuit, full_ov_row
from circuits_core.model.head_names import parse_head

layer, h = parse_head({head!r}, model.cfg)
ids = {ranked}
"""
        + search
        + "print(result)\n"
    )
