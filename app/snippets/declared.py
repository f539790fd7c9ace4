"""Declared snippets (Analysis.snippet), (params, view) -> the engine calls after the load: the prompt,
head and per-head panels."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from app.snippets.script import TOP_K_IMPORT, token_ids


def attention_entropy_body(p: Any, view: Any) -> str:
    """Every head's attention entropy on the page's tokens: mean over query positions, and normalised by log(i + 1)."""
    return f"""from circuits_core.prompt import attention_entropy

tokens = torch.tensor({token_ids(view)!r})
H = attention_entropy.head_entropies(model, tokens)  # [n_layers, n_heads, n]: H_i of each query position i
result = {{"mean": H.mean(-1).tolist(), "normalised": attention_entropy.normalised(H).mean(-1).tolist()}}
"""


def term_importance_body(p: Any, view: Any) -> str:
    """Loss by path order, each order's marginal effect, first-order terms by layer, and each head removed."""
    heads = [h.head for h in view.heads]
    return f"""from circuits_core.model.head_names import parse_head
from circuits_core.prompt.ablation import term_importance

tokens = torch.tensor([{token_ids(view)!r}])  # [1, n]
names = {heads!r}  # the heads removed, one at a time
with torch.no_grad():
    orders, frozen, recomputed = term_importance(model, tokens, [parse_head(h, model.cfg) for h in names])
result = {{
    "clean_loss": orders.clean_loss,
    "loss_by_order": orders.losses.tolist(),  # mean loss keeping paths up to each order
    "marginal_by_order": orders.marginal.tolist(),
    "first_order_by_layer": orders.first_order_gain.tolist(),
    "heads": [
        {{"head": h, "loss_change": float(frozen[i]), "loss_change_recomputed": float(recomputed[i])}}
        for i, h in enumerate(names)
    ],  # patterns frozen (Olsson et al.), and the later patterns recomputed
}}
"""


def heads_body(p: Any, view: Any) -> str:
    """The heads table's detector columns on its standard input, BOS + r + r."""
    inp = view.detector_input
    return f"""from circuits_core.model.head_names import head_name
from circuits_core.prompt.detectors import detector_scores, repeated_random_tokens

tokens = repeated_random_tokens(model.cfg.d_vocab, {inp.seq_len}, {inp.batch}, seed={inp.seed}, bos={inp.bos!r})
with torch.no_grad():
    scores = detector_scores(model, tokens)  # {{detector: [n_layers, n_heads]}}
L, H = model.cfg.n_layers, model.cfg.n_heads
result = {{
    "heads": [
        {{"head": head_name(layer, h), **{{name: float(s[layer, h]) for name, s in scores.items()}}}}
        for layer in range(L)
        for h in range(H)
    ]
}}
"""


def head_body(p: Any, view: Any) -> str:
    """One head's OV and QK singular values."""
    return f"""from circuits_core.circuits import head_circuits
from circuits_core.model.head_names import parse_head

layer, h = parse_head({view.head!r}, model.cfg)
with torch.no_grad():
    result = {{
        "ov_singular_values": head_circuits.ov_circuit(model, layer, h).S.tolist(),  # W_OV = W_V W_O, [d_head]
        "qk_singular_values": head_circuits.qk_circuit(model, layer, h).S.tolist(),  # W_QK = W_Q W_K^T
    }}
"""


def direct_body(p: Any, view: Any) -> str:
    """The direct path W_E W_U: the global top-k over the ranked tokens, or one token's row."""
    ranked = "None  # every token" if view.token_ids is None else f"torch.tensor({view.token_ids!r})  # the ranked set"
    if view.token is None:
        search = f"""with torch.no_grad():
    fm = head_circuits.direct_path(model, ids)  # W_E W_U on the ranked tokens, factored
    values, rows, cols = fm.topk_global({view.k})  # positions in ids
if ids is not None:
    rows, cols = ids[rows], ids[cols]
"""
    else:
        search = f"""{TOP_K_IMPORT}with torch.no_grad():
    row = head_circuits.direct_row(model, {view.token.id})  # [d_vocab]: the direct logits of token {view.token.id}
if ids is not None:  # rank only the token set
    row = torch.full_like(row, float("-inf")).index_copy(0, ids, row[ids])
values, cols = top_k(row, {view.k})
rows = torch.full_like(cols, {view.token.id})
"""
    return (
        """from circuits_core.circuits import head_circuits

"""
        + f"ids = {ranked}\n"
        + search
        + """result = {
    "entries": [
        {"row": {"id": int(r)}, "col": {"id": int(c)}, "value": float(v)} for v, r, c in zip(values, rows, cols)
    ]
}  # (current token, next token, W_E W_U entry)
"""
    )


def prompt_body(p: Any, view: Any) -> str:
    """The prompt's attention patterns of the heads shown (value-weighted when asked) and the top next-token
    predictions."""
    heads = [hp.head for hp in view.heads]
    weighted = """
        A = A * cache[f"blocks.{layer}.attn.hook_v"][0, :, h].norm(dim=-1)[None, :]  # keys' value norms ||v_j||"""
    return f"""from circuits_core.model.head_names import parse_head

tokens = torch.tensor([{token_ids(view)!r}])  # [1, n]
with torch.no_grad():
    logits, cache = model.run(tokens, names=lambda n: n.endswith(("hook_pattern", "attn.hook_v")))
    patterns = []
    for name in {heads!r}:
        layer, h = parse_head(name, model.cfg)
        A = cache[f"blocks.{{layer}}.attn.hook_pattern"][0, h]  # [n query, n key]{weighted if view.weighted else ""}
        patterns.append({{"head": name, "pattern": A.double().tolist()}})
result = {{
    "heads": patterns,
    "top_predictions": [{{"id": i}} for i in logits[0].argmax(-1).tolist()],  # the model's next token at each position
}}
"""


def path_body(p: Any, view: Any) -> str:
    """A chain of heads on the prompt: its pattern (the product of the heads' patterns), its terms of the target's
    logit from each source, and each position's own next-token term."""
    return f"""from circuits_core.model.head_names import parse_head
from circuits_core.prompt.frozen import frozen_run
from circuits_core.prompt.virtual import chain_next_token_terms, chain_terms

tokens = torch.tensor({token_ids(view)!r})
chain = [parse_head(h, model.cfg) for h in {view.heads!r}]
with torch.no_grad():
    run = frozen_run(model, tokens)  # patterns and norm scales frozen at their values on the prompt
    pattern = run.patterns[chain[0][0], chain[0][1]]  # [n, n]
    for layer, h in chain[1:]:
        pattern = run.patterns[layer, h] @ pattern  # A^h_i ... A^h_1
    terms = chain_terms(model, run, chain, {view.target.id})  # the chain's terms of token {view.target.id}'s logit
    result = {{
        "pattern": pattern.double().tolist(),
        "by_source": [{{"source": s, "values": v.double().tolist()}} for s, v in terms],
        "next_token_contribution": chain_next_token_terms(model, run, chain).double().tolist(),
    }}
"""


def residual_body(p: Any, view: Any) -> str:
    """Every (writer, later reader) pair's virtual-weight score ||W_w W_r|| / (||W_w|| ||W_r||) and the baseline."""
    return f"""from circuits_core.circuits import virtual_weight_table

with torch.no_grad():
    s = virtual_weight_table.all_scores(model, offset={view.offset or 0})  # scores [writers, readers]
nan = torch.full_like(s.raw, float("nan"))
result = {{
    "writers": [w.name for w in s.writers],
    "readers": [r.name for r in s.readers],
    "scores": torch.where(s.mask, s.raw, nan).tolist(),  # NaN: the reader does not see the writer
    "minus_baseline": torch.where(s.mask, s.minus_baseline, nan).tolist(),
    "baseline": s.baseline,
}}
"""


def composition_pair_body(p: Any, view: Any) -> str:
    """One pair's Q, K and V composition scores and baseline, and the top entries and copying statistic of its
    K-composition token circuit (over every token; a large vocabulary's stated token set is left to the page)."""
    k_circuit = ""
    if view.token_set is None:  # every token ranked
        k_circuit = f"""
    k_fm = k_composition_circuit(model, (l2, h2), (l1, h1))  # W_E W_Q W_K^T (W_OV of the earlier head)^T W_E^T / s
    values, rows, cols = k_fm.topk_global({len(view.k_composition.entries)})
    eig = torch.linalg.eigvals(k_fm.BA.double())  # [d_head]: its nonzero eigenvalues
    result["k_composition"] = {{
        "entries": [
            {{"row": {{"id": int(r)}}, "col": {{"id": int(c)}}, "value": float(v)}}
            for v, r, c in zip(values, rows, cols)
        ],
        "copying": float(copying_score(eig)),  # sum(eig) / sum(|eig|)
    }}"""
    return f"""from circuits_core.circuits.composition import composition_scores
from circuits_core.circuits.copying_spectra import copying_score
from circuits_core.model.head_names import parse_head
from circuits_core.prompt.qk_paths import k_composition_circuit

(l1, h1), (l2, h2) = parse_head({view.source!r}, model.cfg), parse_head({view.target!r}, model.cfg)
with torch.no_grad():
    comp = composition_scores(model)  # every pair's Q, K and V composition, [L, H, L, H] each
    result = {{
        "scores": {{kind.upper(): float(comp.raw[kind][l1, h1, l2, h2]) for kind in comp.raw}},
        "minus_baseline": {{kind.upper(): float(comp.minus_baseline[kind][l1, h1, l2, h2]) for kind in comp.raw}},
        "baseline": comp.baseline,
    }}{k_circuit}
"""


def per_head_body(values: Callable[..., Any], field: str) -> str:
    """One number per head (app/views/shared/per_head.py): the analysis's engine function, whose [n_layers, n_heads]
    answer the JSON holds under `field`."""
    package, module = values.__module__.rsplit(".", 1)
    return f"""from {package} import {module}

with torch.no_grad():
    values = {module}.{values.__name__}(model)  # [n_layers, n_heads]
result = {{{field!r}: values.tolist()}}
"""
