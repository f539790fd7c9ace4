"""'Copy as Python': for a panel, the circuits_core calls that reproduce its numbers in a notebook.

Each function returns the source of a self-contained script: it loads the model folder as the server does
(load_checkpoint with the folder's processing, the server's dtype), makes the engine call the panel's analysis
makes and leaves the panel's numbers in `result` (a dict named like the fields of the panel's JSON twin).
tests/app/test_snippets.py runs every snippet and compares `result` with the JSON answer.
Token ids are written out as the page used them, so no tokenizer call can differ.

Two kinds: the functions a page's context calls with what it knows (composition, logit paths, ...), and the
`Analysis.snippet` functions below "declared snippets", (params, view) -> the calls after the load, which every page
running that analysis offers (app/routers/rendering.py PageCall.run; tests/app/test_snippets.py enumerates them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HEADER = """import torch
from circuits_core.formats.checkpoint import load_checkpoint

loaded = load_checkpoint({folder!r}, dtype=torch.{dtype}{process})  # {basis}
model = loaded.model
"""


def _head(folder: Path, dtype: str, raw: bool = False) -> str:
    """The load: processed as the server serves it, or (raw) the weights as stored (the basis picker's 'raw')."""
    if raw:
        return HEADER.format(folder=str(folder), dtype=dtype, process=", process=False", basis="raw weights, as stored")
    return HEADER.format(folder=str(folder), dtype=dtype, process="", basis="processed as the server serves it")


def script(folder: Path, dtype: str, body: str, raw: bool = False) -> str:
    """A declared snippet (the `body` an Analysis.snippet below returns) after the model's load, printing `result`."""
    return _head(folder, dtype, raw) + body + "print(result)\n"


def composition(folder: Path, dtype: str, kind: str) -> str:
    """The composition page: every pair's score, the baseline and the strongest pair."""
    key = kind.lower()
    return (
        _head(folder, dtype)
        + f"""from circuits_core.circuits.composition import composition_scores
from circuits_core.model.head_names import head_name

comp = composition_scores(model, kinds=({key!r},))
raw = comp.raw[{key!r}].double()  # [L, H, L, H]: earlier head (l1, h1) -> later head (l2, h2)
masked = torch.where(comp.mask, raw, torch.full_like(raw, -1.0))
l1, h1, l2, h2 = (int(i) for i in torch.unravel_index(masked.argmax(), raw.shape))
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
        _head(folder, dtype)
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
top = terms.flatten().abs().argsort(descending=True)[:{k}].tolist()
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
        _head(folder, dtype)
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
        _head(folder, dtype)
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
        _head(folder, dtype)
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
        search = f"""with torch.no_grad():
    row = full_ov_row(model, layer, h, {token})  # [d_vocab]: the logits attending to token {token} raises
if ids is not None:  # rank only the token set
    row = torch.full_like(row, float("-inf")).index_copy(0, ids, row[ids])
values, cols = row.topk({k})
result = {{"entries": [({token}, int(c), float(v)) for v, c in zip(values, cols)]}}  # (source, output, value)
"""
    return (
        _head(folder, dtype, raw)
        + f"""from circuits_core.circuits.head_circuits import full_ov_circuit, full_ov_row
from circuits_core.model.head_names import parse_head

layer, h = parse_head({head!r}, model.cfg)
ids = {ranked}
"""
        + search
        + "print(result)\n"
    )


# -- declared snippets: (params, view) -> the engine calls after the load (Analysis.snippet) ------------------------
def _ids(view: Any) -> list[int]:
    return [t.id for t in view.tokens]


def attention_entropy_body(p: Any, view: Any) -> str:
    """Every head's attention entropy on the page's tokens: mean over query positions, and normalised by log(i + 1)."""
    return f"""from circuits_core.prompt import attention_entropy

tokens = torch.tensor({_ids(view)!r})
H = attention_entropy.head_entropies(model, tokens)  # [n_layers, n_heads, n]: H_i of each query position i
result = {{"mean": H.mean(-1).tolist(), "normalised": attention_entropy.normalised(H).mean(-1).tolist()}}
"""


def term_importance_body(p: Any, view: Any) -> str:
    """Loss by path order, each order's marginal effect, first-order terms by layer, and each head removed."""
    heads = [h.head for h in view.heads]
    return f"""from circuits_core.model.head_names import parse_head
from circuits_core.prompt.ablation import term_importance

tokens = torch.tensor([{_ids(view)!r}])  # [1, n]
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
    fm = head_circuits.direct_path(model)  # W_E W_U, factored
    if ids is not None:
        fm = FactoredMatrix(fm.A[ids], fm.B[:, ids])
    values, rows, cols = fm.topk_global({view.k})  # positions in ids
if ids is not None:
    rows, cols = ids[rows], ids[cols]
"""
    else:
        search = f"""with torch.no_grad():
    row = head_circuits.direct_row(model, {view.token.id})  # [d_vocab]: the direct logits of token {view.token.id}
if ids is not None:  # rank only the token set
    row = torch.full_like(row, float("-inf")).index_copy(0, ids, row[ids])
values, cols = row.topk({view.k})
rows = torch.full_like(cols, {view.token.id})
"""
    return (
        """from circuits_core.circuits import head_circuits
from circuits_core.circuits.factored import FactoredMatrix

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

tokens = torch.tensor([{_ids(view)!r}])  # [1, n]
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

tokens = torch.tensor({_ids(view)!r})
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


def _ranked_line(line: str, token: int, k: int) -> str:
    """One token's line of a token circuit (`line`: the code of a [d_vocab] tensor), ranked over `ids` (every token
    when None), as the `entries` of a table: (row, col) is (token, other) on a row, (other, token) on a column."""
    return f"""with torch.no_grad():
    line = {line}  # [d_vocab]
if ids is not None:  # rank only the token set
    line = torch.full_like(line, float("-inf")).index_copy(0, ids, line[ids])
values, others = line.topk({k})
tokens = torch.full_like(others, {token})
"""


def qk_body(p: Any, view: Any) -> str:
    """The head page's QK table: the global top-k of the full QK circuit W_E W_Q W_K^T W_E^T / s (rotary: with R(δ)
    at the page's offset), or one token's row (the keys it attends to) or column (the queries attending to it); a
    score cap applied as the softmax sees it."""
    ranked = "None  # every token" if view.token_ids is None else f"torch.tensor({view.token_ids!r})  # the ranked set"
    rotary = view.offset is not None
    circuit = (
        f"rotary.full_qk_circuit_at(model, layer, h, {view.offset}, tokens=ids)"
        if rotary
        else "head_circuits.full_qk_circuit(model, layer, h, ids)"
    )
    if view.token is None:
        search = f"""with torch.no_grad():
    values, rows, cols = {circuit}.topk_global({view.k})  # positions in ids
if ids is not None:
    rows, cols = ids[rows], ids[cols]
"""
    else:
        t, column = view.token.id, p.side == "key"
        if rotary:
            line = f"rotary.full_qk_{'col' if column else 'row'}_at(model, layer, h, {t}, {view.offset})"
        else:
            line = (
                f"head_circuits.full_qk_col(model, layer, h, {t})"
                if column
                else f"head_circuits.full_qk_circuit(model, layer, h).rows([{t}])[0]"
            )
        search = _ranked_line(line, t, view.k) + (
            "rows, cols = others, tokens  # the queries attending to the key\n"
            if column
            else "rows, cols = tokens, others  # the keys the query attends to\n"
        )
    return f"""from circuits_core.circuits import head_circuits, rotary
from circuits_core.model.head_names import parse_head

layer, h = parse_head({view.head!r}, model.cfg)
ids = {ranked}
{search}cap = model.cfg.attn_scores_soft_cap
if cap is not None:  # the score the softmax sees
    values = cap * torch.tanh(values / cap)
result = {{
    "entries": [
        {{"row": {{"id": int(r)}}, "col": {{"id": int(c)}}, "value": float(v)}} for v, r, c in zip(values, rows, cols)
    ]
}}  # (query token, key token, score)
"""


def skip_trigrams_body(p: Any, view: Any) -> str | None:
    """The head page's skip-trigrams of its source token (the page's token, or the largest OV entry's source the
    page found): destinations from the source's QK column (rotary: at δ), outs from its OV row. None (no snippet)
    with a min_count: its frequent-token set is the server's token counts, not a circuits_core call."""
    if p.min_count is not None:
        return None
    col = (
        f"rotary.full_qk_col_at(model, layer, h, source, {view.offset})  # the QK column at δ = {view.offset}"
        if view.offset is not None
        else "None  # the QK column at no offset"
    )
    return f"""from circuits_core.circuits import rotary, skip_trigrams
from circuits_core.model.head_names import parse_head

layer, h = parse_head({view.head!r}, model.cfg)
source = {view.source.id}  # the source token
with torch.no_grad():
    col = {col}
    st = skip_trigrams.skip_trigrams(model, layer, h, source, {view.k}, None, qk_col=col)
qk = dict(zip(st.dest_tokens.tolist(), st.dest_scores.tolist()))  # destination -> QK score
ov = dict(zip(st.out_tokens.tolist(), st.out_scores.tolist()))  # out -> OV logit
result = {{
    "source": {{"id": source}},
    "copying": st.copying,
    "trigrams": [
        {{"destination": {{"id": b}}, "out": {{"id": c}}, "qk": qk[b], "ov": ov[c], "joint": joint}}
        for b, c, joint in st.triples[:{view.k}]
    ],
}}
"""


def rotary_bands_body(p: Any, view: Any) -> str:
    """A rotary head's QK energy per frequency band: Ω(δ) = Σ_k [cos(δθ_k) A_k + sin(δθ_k) B_k] + C."""
    return f"""from circuits_core.circuits import rotary_bands
from circuits_core.model.head_names import parse_head

layer, h = parse_head({view.head!r}, model.cfg)
with torch.no_grad():
    bands = rotary_bands.band_energies(model)  # every head's, [n_layers, n_heads, K] each
energy = bands.energy[layer, h]  # ||A_k||^2 + ||B_k||^2, [K]
total = float(energy.sum() + bands.unrotated[layer, h])  # with the unrotated dims' ||C||^2
result = {{
    "theta": bands.theta[layer].tolist(),  # the head's own layer's frequencies
    "wavelength": bands.wavelength[layer].tolist(),
    "energy": energy.tolist(),
    "unrotated": float(bands.unrotated[layer, h]),
    "share": (energy / total if total > 0 else energy).tolist(),
}}
"""


def qk_copying_offset_body(p: Any, view: Any) -> str:
    """A rotary head's QK eigenvalue copying Σλ/Σ|λ| of W_E_eff Ω(δ) W_E_eff^T / s over δ, and its eigenvalues at the
    page's offset."""
    return f"""from circuits_core.circuits import rotary
from circuits_core.circuits.copying_spectra import copying_score
from circuits_core.model.head_names import parse_head

layer, h = parse_head({view.head!r}, model.cfg)
offsets = torch.arange({len(view.offsets)})  # δ = 0..{len(view.offsets) - 1}
with torch.no_grad():
    eig = rotary.head_qk_eigenvalues_at(model, layer, h, torch.cat([offsets, torch.tensor([{view.offset}])]))
result = {{
    "offsets": offsets.tolist(),
    "scores": copying_score(eig[:-1]).tolist(),  # [n]: one score per δ
    "score": float(copying_score(eig[-1])),  # at δ = {view.offset}
    "eigenvalues": [{{"re": float(z.real), "im": float(z.imag)}} for z in eig[-1]],
}}
"""


def residual_pair_body(p: Any, view: Any) -> str:
    """One virtual weight W_w W_r: its score, baseline, singular values and top singular directions, each side's
    largest entries (in its own space, and read in tokens where it is the residual stream)."""
    sides = [f"{s}_{end}" for s in ("input", "output", "input_tokens", "output_tokens") for end in ("top", "bottom")]
    return f"""from circuits_core.circuits import stream_components as sc
from circuits_core.circuits import virtual_weights as vw

writer, reader = sc.parse_writer(model, {view.writer!r}), sc.parse_reader(model, {view.reader!r})
report = vw.pair_report(model, writer, reader, k={p.k}, n_top={p.n_top}, offset={view.offset})
sides = {sides!r}  # each [(index, value)] or None
result = {{
    "score": report.score,  # ||W_w W_r|| / (||W_w|| ||W_r||)
    "baseline": report.baseline,
    "minus_baseline": report.score - report.baseline,
    "singular_values": list(report.singular_values),
    "directions": [
        {{
            "singular_value": d.value,
            **{{
                s: None if getattr(d, s) is None else [{{"index": i, "value": v}} for i, v in getattr(d, s)]
                for s in sides
            }},
        }}
        for d in report.directions
    ],
}}
"""


def copying_all_body(p: Any, view: Any) -> str | None:
    """Every head's copying, three ways: the eigenvalue score Σλ/Σ|λ| of W_E W_OV W_U, and over the source rows
    measured (every token, or a sample drawn with seed 0) the top-1 and top-k self-copy shares and the diagonal.
    None (no snippet) with a min_count (the server's token counts); the random-weights baseline row is left to
    the JSON."""
    if p.min_count is not None:
        return None
    rows = None if view.n_rows >= view.n_tokens else view.n_rows
    return f"""from circuits_core.circuits import copying, copying_spectra, head_circuits
from circuits_core.model.head_names import parse_head

names = {[h.head for h in view.heads]!r}
order = copying.sample_order(model.cfg.d_vocab, {rows!r}, seed=0)  # the source rows measured
with torch.no_grad():
    eig_score = copying_spectra.ov_copying_scores(model)  # [n_layers, n_heads]
    heads = []
    for name in names:
        layer, h = parse_head(name, model.cfg)
        ov = head_circuits.ov_circuit(model, layer, h)  # W_V [d_model, d_head] W_O [d_head, d_model]
        ranks = copying.row_ranks(model, ov.A, ov.B, {view.k}, order)  # each row's own-logit rank
        top1, topk, positive, median = ranks.shares().tolist()
        heads.append(
            {{
                "head": name,
                "ov_copying": float(eig_score[layer, h]),
                "top1": top1,  # own logit the largest of its row
                "topk": topk,  # among the {view.k} largest
                "diagonal_positive": positive,
                "diagonal_median": median,
            }}
        )
result = {{"heads": heads}}
"""


def expert_ov_body(p: Any, view: Any) -> str:
    """An MLP writer's token table expert(ln2(W_E[t])) W_U: its global top-k over the ranked tokens, or one token's
    row, with the router's weight of each row's token alone (None on a dense MLP)."""
    ranked = "None  # every token" if view.token_ids is None else f"torch.tensor({view.token_ids!r})  # the ranked set"
    if view.token is None:
        search = f"""with torch.no_grad():
    values, rows, cols = expert_circuits.full_expert_circuit(model, writer, ids).topk_global({view.k})
if ids is not None:
    rows, cols = ids[rows], ids[cols]
"""
    else:
        t = view.token.id
        line = f"expert_circuits.expert_row(model, writer, {t})"
        search = _ranked_line(line, t, view.k) + "rows, cols = tokens, others\n"
    return f"""from circuits_core.circuits import expert_circuits
from circuits_core.circuits.stream_components import parse_writer

writer = parse_writer(model, {view.mlp!r})
ids = {ranked}
{search}with torch.no_grad():
    route = expert_circuits.direct_route_weights(model, writer, rows)  # [k] router weights (1: dense)
result = {{
    "entries": [
        {{"row": {{"id": int(r)}}, "col": {{"id": int(c)}}, "value": float(v)}} for v, r, c in zip(values, rows, cols)
    ],  # (input token, output token, logit)
    "route_weight": route.tolist(),
}}
"""


def residual_usage_body(p: Any, view: Any) -> str:
    """How the writers use the residual stream: every component's effective rank and subspace dims, the bandwidth
    (each direction's load), and this answer's rows of the overlap tables (the erasure table is left to the JSON)."""
    rows = f"slice({view.writers_from}, {view.writers_from + len(view.rows)})"
    return f"""from circuits_core.circuits import residual_stream as rs

with torch.no_grad():
    usage = rs.stream_usage(model, energy={view.energy!r}, offset={p.offset})
bw = usage.bandwidth
rows = {rows}  # this answer's writer rows (a page of them)
result = {{
    "writers": list(usage.writers),
    "readers": list(usage.readers),
    "effective_rank": dict(usage.effective_rank),  # (sum s^2)^2 / sum s^4 of each component
    "dims": dict(usage.dims),  # its subspace: top singular directions holding {view.energy:g} of sum s^2
    "d_model": bw.d_model,
    "total_dims": bw.total_dims,
    "load": list(bw.load),  # eigenvalues of sum_w U_w U_w^T: the writers sharing each direction
    "used_dims": bw.used_dims,
    "overlap": usage.overlap[rows].tolist(),  # mean cos^2 of the principal angles, [writer rows, writers + readers]
    "overlap_excess": usage.overlap_excess[rows].tolist(),  # above chance
}}
"""


def positional_body(p: Any, view: Any) -> str:
    """A rotary (or ALiBi) head's positional kernel f(δ) = μ_l Ω(δ) μ_l^T / s, μ_l measured on the reference text as
    the server measures it (the text tokenised, or without a tokenizer seeded random ids)."""
    ref = view.reference
    if ref.tokenized:
        tokens = f"torch.tensor([loaded.tokenizer.encode(rotary.REFERENCE_TEXT)[: model.cfg.n_ctx]])  # {ref.name}"
    else:
        tokens = (
            f"torch.randint(0, model.cfg.d_vocab, (1, {ref.n_tokens}), generator=torch.Generator().manual_seed(0))"
            "  # no tokenizer: seeded random ids"
        )
    return f"""from circuits_core.circuits import alibi_kernel, rotary
from circuits_core.model.head_names import parse_head

layer, h = parse_head({view.head!r}, model.cfg)
tokens = {tokens}
offsets = torch.arange({len(view.offsets)})  # δ = 0..{len(view.offsets) - 1}
with torch.no_grad():
    mu = rotary.reference_means(model, tokens)  # [n_layers, d_model]: mean ln1 output, the first token left out
    kernel_of = rotary.positional_kernel if model.cfg.alibi is None else alibi_kernel.positional_kernel
    kernel = kernel_of(model, mu, offsets)[layer, h]  # [n]
result = {{"offsets": offsets.tolist(), "kernel": kernel.tolist(), "peak_offset": int(offsets[int(kernel.argmax())])}}
"""


def positivity_body(p: Any, view: Any) -> str:
    """The overview's scatter: every head above the previous-token head's layer, its OV copying score against the
    positivity of its K-composition term with that head, both from the heads table's pass on BOS + r + r."""
    inp = view.detector_input
    return f"""import math

from circuits_core.model.head_names import head_name, parse_head
from circuits_core.prompt.detectors import repeated_random_tokens
from circuits_core.prompt.head_table import head_table

tokens = repeated_random_tokens(model.cfg.d_vocab, {inp.seq_len}, {inp.batch}, seed={inp.seed}, bos={inp.bos!r})
with torch.no_grad():
    table = head_table(model, tokens)  # detectors, then the full circuits' spectra and the 2-D induction view
prev = table.induction.previous_token_head  # chosen from the detector scores (the heads that matter)
positivity = table.induction.qk_k_composition  # [L, H]: K-composition term with prev, positive part's share
above = parse_head(prev, model.cfg)[0]
result = {{
    "previous_token_head": prev,
    "points": [
        {{
            "head": head_name(layer, h),
            "ov_copying": float(table.ov_copying[layer, h]),
            "k_composition_positivity": float(positivity[layer, h]),
        }}
        for layer in range(above + 1, model.cfg.n_layers)
        for h in range(model.cfg.n_heads)
        if math.isfinite(float(positivity[layer, h]))
    ],
}}
"""
