"""Declared snippets (Analysis.snippet) of the token tables, the residual stream and the rotary panels."""

from __future__ import annotations

from typing import Any

from app.snippets.script import ranked_line


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
        search = ranked_line(line, t, view.k) + (
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
        search = ranked_line(line, t, view.k) + "rows, cols = tokens, others\n"
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
