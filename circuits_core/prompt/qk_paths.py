"""Path expansion of a later head's attention scores, and the token-space K-composition circuit.

Paper section: "Two-layer path expansion of the QK circuit" (Elhage et al. 2021; docs/maths.md §2.12, §2.14).
Row-vector convention. With the clean run's patterns and LayerNorm scales frozen (frozen.py), the residual
stream read by layer l is a sum of components y_a [n, d_model]:
    "embed" (W_E[t]), "pos_embed" (standard positions: W_pos in the residual stream), each earlier head's
    actual output "L0H3" = A D (x C) diag(w) W_V W_O (its linear part), "mlp:L0" (actual MLP outputs),
    "bias" (sum of the earlier layers' constant outputs beta, frozen.layer_bias_rows: per position under sinks).
Query-side vectors: q_a = D_l (y_a C) diag(w) W_Q^h, plus "pos_embed" = W_pos W_Q for shortformer positions
(added after ln1: not centred, not scaled by D) and "b_Q" = b_ln1 W_Q + b_Q; keys alike. Then
    hook_attn_scores (before the mask) = sum_{a,b} q_a k_b^T / attn_scale      (rotary: rotate each q_a, k_b;
                                                                                ALiBi: + -m_h (i - j), `positional`)
(a, b) = (embed, embed) is no composition; (head, embed) Q-composition; (embed, head) K-composition.
The summary is the std of each (a, b) term over the positions the head sees (causal, and within a sliding window),
as ARENA's `decompose_attn_scores` plot, where an induction head's (embed, previous-token head) K term stands out.
The newest attention, frozen like the norm scales: under an output norm each earlier head's write carries
diag(gamma_post) / rho_post(i) (frozen.py); under QK-norm each query part is divided by the query's own rho_q(i) and
scaled by gamma_q before the rotation (keys alike), so the parts still sum to the model's q and k; under a score cap
every term is multiplied by the entry's frozen cap factor g = c tanh(s / c) / s (soft_cap.py), so the terms sum to
the capped score the softmax sees. Each layer rotates with its own rope (ModelConfig.layer_rope).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from circuits_core.circuits.copying_spectra import copying_score, embed_gram
from circuits_core.circuits.embedding import embed_eff, embed_eff_rows
from circuits_core.circuits.factored import FactoredMatrix
from circuits_core.circuits.folded import circuit_weight, head_weights, layer_weights
from circuits_core.circuits.head_circuits import check_head
from circuits_core.circuits.host_linalg import eigvals
from circuits_core.cost import Cost, check_stop, itemsize
from circuits_core.errors import InvalidInputError, LimitExceededError
from circuits_core.model.alibi import alibi_kernel
from circuits_core.model.head_names import head_name
from circuits_core.model.soft_cap import cap_factor, share_beyond_cap
from circuits_core.model.transformer import Transformer
from circuits_core.model.window import visible
from circuits_core.prompt.frozen import (
    FrozenRun,
    attention,
    centre,
    embed_source,
    frozen_run,
    ln_linear,
    post_gain,
    qk_positions,
    reading_bias,
    reading_weights,
    run_cost,
    value_inv_scale,
    written_bias,
)


@dataclass
class QKExpansion:
    """Scores of head `head` (layer >= 1) on one sequence, split into (query component, key component) terms."""

    head: str
    components: list[str]  # [C], the same list on both sides
    q_parts: Tensor  # [C, n, d_head]: q = sum_a q_parts[a] (after rotation for rotary models)
    k_parts: Tensor  # [C, n, d_head]
    std: Tensor  # [C (query), C (key)]: std over causal positions of each term
    scores: Tensor  # [n, n]: the model's actual scores q k^T / s (soft-capped if the model caps; before the mask)
    terms: Tensor | None  # [C, C, n, n] when keep_terms
    scale: float  # attn_scale s
    cap_factor: Tensor | None = None  # [n, n]: frozen g = c tanh(s / c) / s of each entry, None without a cap
    beyond_cap: float = 0.0  # share of the seen scores with |s| > c before the cap
    visible: Tensor | None = None  # [n, n] bool: the entries the head sees (causal, within its window)
    positional: Tensor | None = None  # [n, n] ALiBi's -m_h (i - j) (scores = sum of the terms + positional), else None

    def term(self, query_component: str, key_component: str) -> Tensor:
        """One (a, b) term [n, n] = q_a k_b^T / s (times the frozen cap factor under a cap)."""
        a, b = self.components.index(query_component), self.components.index(key_component)
        term = self.q_parts[a] @ self.k_parts[b].T / self.scale
        return term * self.cap_factor if self.cap_factor is not None else term

    def top_pairs(self, k: int = 10) -> list[tuple[str, str, float]]:
        """The k (query component, key component) pairs with the largest std over positions."""
        flat = self.std.flatten()
        idx = flat.argsort(descending=True, stable=True)[:k]  # ties: (query, key) order
        C = len(self.components)
        return [(self.components[int(i) // C], self.components[int(i) % C], float(flat[i])) for i in idx]


def residual_components(model: Transformer, run: FrozenRun, layer: int) -> tuple[list[str], Tensor]:
    """Names and vectors [C, n, d_model] of the residual stream read by `layer`; they sum to resid_pre."""
    names, parts = ["embed"], [run.cache["hook_embed"]]
    if model.cfg.positional_embedding_type == "standard":
        names.append("pos_embed")
        parts.append(embed_source(model, run) - run.cache["hook_embed"])
    bias = torch.zeros(1, model.cfg.d_model, dtype=model.dtype, device=model.device)
    for lay in range(layer):
        x = ln_linear(  # (its values' source factor: ln1's 1/sigma, and 1/rho_kv under latent attention)
            model, f"blocks.{lay}.ln1", run.cache[f"blocks.{lay}.hook_resid_pre"], value_inv_scale(model, run, lay)
        )
        v = torch.einsum("nd,hde->hne", x, attention(model, lay).W_V)  # [H, n, dh] (LN weight already applied)
        outs = torch.einsum("hqk,hke,hed->hqd", run.patterns[lay], v, attention(model, lay).W_O)  # [H, n, d]
        gamma = post_gain(model, lay)
        if gamma is not None:  # the output norm, frozen: diag(gamma) / rho_post(i)
            outs = outs * gamma * run.inv_scale(f"blocks.{lay}.ln1_post")[:, None]
        names += [head_name(lay, h) for h in range(model.cfg.n_heads)]
        parts += list(outs)
        if not model.cfg.attn_only:
            names.append(f"mlp:L{lay}")
            parts.append(run.cache[f"blocks.{lay}.hook_mlp_out"])
        bias = bias + written_bias(model, run, lay)  # [1 or n, d_model]
    names.append("bias")
    parts.append(bias.expand(run.n, -1))
    return names, torch.stack(parts)


def expand_scores(
    model: Transformer,
    tokens: Tensor,
    head: tuple[int, int],
    run: FrozenRun | None = None,
    keep_terms: bool = False,
    max_elements: int = 50_000_000,
    should_stop: Callable[[], bool] | None = None,
) -> QKExpansion:
    """Split head (layer, h)'s pre-softmax scores on `tokens` into query-component x key-component terms."""
    layer, h = head
    check_head(model, layer, h)
    if layer < 1:
        raise InvalidInputError(f"QK path expansion needs a head in layer >= 1, got {head_name(layer, h)}")
    run = run if run is not None else frozen_run(model, tokens)
    n = run.n
    with torch.no_grad():
        names, parts = residual_components(model, run, layer)  # [C0, n, d]
        normed = (
            centre(model, parts) * run.inv_scale(f"blocks.{layer}.ln1")[:, None]
        )  # D (y C); w is in reading_weights
        sides = []
        for W, b in (("W_Q", "Q"), ("W_K", "K")):
            weights = reading_weights(model, layer, W)[h]  # [d, dh]
            side = [normed @ weights]  # [C0, n, dh]
            pos = qk_positions(model, run)
            if pos is not None:
                side.append((pos @ getattr(attention(model, layer), W)[h])[None])
            side.append(reading_bias(model, layer, b)[h].expand(1, n, -1))
            sides.append(torch.cat(side))
        comps = names + (["pos_embed"] if qk_positions(model, run) is not None else []) + ["b_QK"]
        q_parts, k_parts = frozen_qk_norm(model, run, layer, h, *sides)  # [C, n, dh]
        if model.cfg.positional_embedding_type == "rotary":
            # each component rotated at its own position: q_a(i) R(i) . k_b(j) R(j) = q_a(i) R(i - j) k_b(j)^T
            positions = torch.arange(n, device=model.device)  # [n], against [C, n]
            q_parts, k_parts = model.rotate(q_parts, positions, layer), model.rotate(k_parts, positions, layer)
        s = model.cfg.scale
        C = len(comps)
        causal = visible(n, model.cfg.layer_window(layer), model.device)  # the entries the head sees
        q = run.cache[f"blocks.{layer}.attn.hook_q"][:, h]  # [n, dh]
        k = run.cache[f"blocks.{layer}.attn.hook_k"][:, h]
        raw = q @ k.T / s
        cap = model.cfg.attn_scores_soft_cap
        g = cap_factor(raw, cap) if cap is not None else None  # frozen per entry
        std = torch.zeros(C, C, dtype=model.dtype, device=model.device)
        keep = keep_terms and C * C * n * n <= max_elements
        if keep_terms and not keep:
            raise LimitExceededError(f"{C}x{C} terms of {n}x{n} scores exceed {max_elements} numbers; use term()")
        terms = torch.empty(C, C, n, n, dtype=model.dtype, device=model.device) if keep else None
        for a in range(C):
            check_stop(should_stop, "QK path expansion")
            row = torch.einsum("qe,bke->bqk", q_parts[a], k_parts) / s  # [C, n, n]
            if g is not None:
                row = row * g
            std[a] = row[:, causal].std(-1) if causal.sum() > 1 else 0.0
            if terms is not None:
                terms[a] = row
        scores = raw * g if g is not None else raw
        positional = None
        if model.cfg.alibi is not None:  # the linear positional kernel, outside the bilinear terms
            positional = alibi_kernel(model.cfg, n, model.device)[h].to(model.dtype)
            scores = scores + positional
    return QKExpansion(
        head_name(layer, h), comps, q_parts, k_parts, std, scores, terms, s, g, share_beyond_cap(raw[causal], cap),
        causal, positional,
    )  # fmt: skip


def frozen_qk_norm(
    model: Transformer, run: FrozenRun, layer: int, h: int, q_parts: Tensor, k_parts: Tensor
) -> tuple[Tensor, Tensor]:
    """Query and key parts [C, n, d_head] (before the rotation) through the layer's QK-norm with the run's rho
    frozen: part / rho(i) * gamma, so the parts still sum to the normalised q and k (unchanged without QK-norm).
    Under multi-head latent attention (gains already in the effective W_Q, W_K) the latent scales are frozen: every
    query part / rho_q(i), the content dims of every key part / rho_kv(j), the shared rotary key part unscaled."""
    if model.cfg.latent_attention:  # q / rho_q(i); the key's content dims / rho_kv(j), its rotary dims as they are
        rho_q = run.cache.get(f"blocks.{layer}.attn.q_latent_norm.hook_scale")  # [n, 1] (None: no query latent)
        rho_kv = run.cache[f"blocks.{layer}.attn.kv_latent_norm.hook_scale"]  # [n, 1]
        rd = model.cfg.rotary_dim or 0
        content = slice(rd, rd + model.cfg.mla_d_nope)  # the layout [rope | nope | 0]
        k_parts = k_parts.clone()
        k_parts[..., content] /= rho_kv
        return (q_parts if rho_q is None else q_parts / rho_q), k_parts
    if model.cfg.qk_norm is None:
        return q_parts, k_parts
    attn, group = attention(model, layer), h // model.cfg.group_size
    out = []
    for parts, norm, idx in ((q_parts, attn.q_norm, h), (k_parts, attn.k_norm, group)):
        rho = run.cache[f"{norm.name}.hook_scale"]  # [n, heads or 1, 1]
        rho = rho[:, idx if rho.shape[1] > 1 else 0]  # [n, 1]
        out.append(parts / rho * norm.gain()[idx])
    return out[0], out[1]


def n_components(model: Transformer, layer: int) -> int:
    """C, the number of query-side (= key-side) components of expand_scores for a head in `layer`."""
    cfg = model.cfg
    per_layer = cfg.n_heads + (0 if cfg.attn_only else 1)
    standard, shortformer = cfg.positional_embedding_type == "standard", cfg.positional_embedding_type == "shortformer"
    return 1 + standard + layer * per_layer + 1 + shortformer + 1  # embed, pos, heads/MLPs, bias, W_pos, b_QK


def cost(model: Transformer, layer: int, n: int, k: int) -> Cost:
    """expand_scores of a head in `layer` on n tokens, with k terms listed: the frozen run, the residual
    components and their normalised copies [C, n, d_model], q/k parts [C, n, d_head], one row of C terms
    [C, n, n] and the k listed terms; answer: the C x C std, k terms and the scores [n, n], n tokens."""
    cfg = model.cfg
    C = n_components(model, layer)
    work = (2 * C * n * cfg.d_model + 2 * C * n * cfg.d_head + (C + k) * n * n) * itemsize(model.dtype)
    return (run_cost(model, n) + Cost(work)).with_answer(numbers=C * C + (k + 1) * n * n + k, labels=C + 3 * k + n)


# -- token-space K-composition -------------------------------------------------------------------------
def k_composition_circuit(
    model: Transformer, head: tuple[int, int], earlier: tuple[int, int], tokens: Tensor | None = None
) -> FactoredMatrix:
    """[d_vocab, d_vocab] W_E W_Q^h W_K^{hT} (W_V^{h'} W_O^{h'})^T W_E^T / s (inner d_head); with `tokens` (ids [n])
    the [n, n] submatrix of those rows and columns, its factors formed on those tokens only.

    Rows: the query (destination) token; columns: the token at the position head h' reads from (for a
    previous-token h', the token before the key). W_E is A's W_E_eff (layer-0 LN applied row by row), and
    the LN at layer l is ignored (docs/maths.md §2.8: weight-only analyses ignore D).
    """
    (layer, h), (lay2, h2) = head, earlier
    check_head(model, layer, h)
    check_head(model, lay2, h2)
    if lay2 >= layer:
        raise InvalidInputError(f"{head_name(lay2, h2)} must be in an earlier layer than {head_name(layer, h)}")
    W_E = embed_eff(model) if tokens is None else embed_eff_rows(model, tokens)  # [V or n, d_model]
    (W_Q, W_K, _, _), (_, _, W_V2, W_O2) = head_weights(model, layer, h), head_weights(model, lay2, h2)  # folded
    left = W_E @ W_Q / model.cfg.scale  # [V, dh]
    right = (((W_E @ W_V2) @ W_O2) @ W_K).T  # [dh, V]
    return FactoredMatrix(left, right)


def k_composition_flops(model: Transformer, n_tokens: int) -> int:
    """k_composition_circuit's factors on n_tokens tokens: W_E W_Q, and W_E W_V' W_O' W_K left to right."""
    d, dh = model.cfg.d_model, model.cfg.d_head
    return 2 * n_tokens * d * dh + 2 * n_tokens * d * dh + 2 * n_tokens * dh * d + 2 * n_tokens * d * dh


def k_composition_positivity(
    model: Transformer,
    weights: Tensor,
    G_E: Tensor | None = None,
    G_E_W_Q: Tensor | None = None,
    layers: range | None = None,
) -> Tensor:
    """[L, H]: sum(eig)/sum(|eig|) of each head's K-composition token circuit with weighted earlier heads.

    For head h in layer l: M_K = W_E W_Q^h W_K^{hT} (sum_{h' in layers < l} w_{h'} W_V^{h'} W_O^{h'})^T W_E^T,
    whose nonzero eigenvalues are those of W_K^{hT} W_sum^T G_E W_Q^h [d_head, d_head] (G_E = W_E^T W_E).
    weights [L, H]: one-hot on a previous-token head (the paper's 2-D view) or previous-token scores
    (Olsson et al.'s weighted version). Layer-0 heads (nothing earlier) get 0. When the weighted heads' d_head
    columns number fewer than d_model (one-hot: d_head), W_sum = sum_j w_j W_V^j W_O^j stays factored and
    M = sum_j (W_O^j W_K^h)^T (w_j W_V^{jT} G_E W_Q^h): d_head x d_model products instead of d_model^2 ones.
    G_E_W_Q [L, H, d_model, d_head]: G_E W_Q when the caller has it (circuits.gram_queries, shared with the QK
    spectra), else formed here layer by layer. `layers`: only those layers' heads (the others' rows stay 0), so two
    threads can share the work (head_table.induction_view).
    """
    layers = range(1, model.cfg.n_layers) if layers is None else layers
    M = k_composition_matrices(model, weights, G_E, G_E_W_Q, layers)  # [len(layers), H, dh, dh]
    return k_composition_scores(model, eigvals(M.double()), layers)


def k_composition_scores(model: Transformer, eigenvalues: Tensor, layers: range) -> Tensor:
    """[L, H] float64: sum(eig)/sum(|eig|) of the heads of `layers` from the eigenvalues [len(layers), H, d_head] of
    their k_composition_matrices; the rows of other layers 0 (a zero matrix, nothing earlier, scores 0 too)."""
    out = torch.zeros(model.cfg.n_layers, model.cfg.n_heads, dtype=torch.float64, device=model.device)
    if len(layers):
        out[layers.start : layers.stop] = copying_score(eigenvalues)
    return out


def k_composition_matrices(
    model: Transformer,
    weights: Tensor,
    G_E: Tensor | None = None,
    G_E_W_Q: Tensor | None = None,
    layers: range | None = None,
) -> Tensor:
    """[len(layers), H, d_head, d_head]: M_h = W_K^{hT} W_sum^T G_E W_Q^h / s of k_composition_positivity for the heads
    of `layers` (consecutive, default 1..L-1; 0 where no weighted head is earlier), weights per layer read from the
    blocks (no stacked copies of all layers)."""
    cfg = model.cfg
    L, H = cfg.n_layers, cfg.n_heads
    if weights.shape != (L, H):
        raise InvalidInputError(f"weights must be [n_layers, n_heads] = [{L}, {H}], got {tuple(weights.shape)}")
    # Products in the weights' precision (float32 for half models), eigenvalues in float64, as circuits' spectra.
    dt = model.compute_dtype
    G_E = (embed_gram(model) if G_E is None else G_E).to(dt)  # [d, d]
    layers = range(1, L) if layers is None else layers
    if layers.step != 1 or (len(layers) and not 0 <= layers.start < layers.stop <= L):
        raise InvalidInputError(f"layers must be consecutive layers of 0..{L - 1}, got {layers}")
    M = torch.zeros(len(layers), H, cfg.d_head, cfg.d_head, dtype=dt, device=model.device)

    def G_E_W_Q_at(layer: int) -> Tensor:  # [H, d, dh]
        return G_E @ circuit_weight(model, layer, "W_Q").to(dt) if G_E_W_Q is None else G_E_W_Q[layer].to(dt)

    earlier = [(int(lay), int(h)) for lay, h in (weights[:-1] != 0).nonzero()]  # weighted heads that can be earlier
    if not earlier:  # W_sum = 0 (one layer, or no weight on an earlier head)
        return M
    if len(earlier) * cfg.d_head < cfg.d_model:  # W_sum has rank < d_model: stay in its factors
        W_Os = torch.stack([head_weights(model, lay, h)[3] for lay, h in earlier]).to(dt)  # [r, dh, d]
        VW = torch.stack([weights[lay, h] * head_weights(model, lay, h)[2].T for lay, h in earlier]).to(
            dt
        )  # [r, dh, d]
        for i, layer in enumerate(layers):
            sel = [j for j, (lay, _) in enumerate(earlier) if lay < layer]
            if sel:  # else nothing earlier: W_sum = 0
                left = W_Os[sel].flatten(0, 1) @ layer_weights(model, layer, "W_K").to(
                    dt
                )  # [H, r dh, dh]: W_O^{h'} W_K^h
                right = VW[sel].flatten(0, 1) @ G_E_W_Q_at(layer)  # [H, r dh, dh]: w W_V^{h'T} G_E W_Q^h
                M[i] = left.transpose(-2, -1) @ right / cfg.scale
        return M
    # Dense route, per key/value group g (GQA shares W_V^g, W_K^g within a group of query heads):
    # S_l = W_sum^T = S_{l-1} + sum_g (sum_{h in g} w_h W_O^h)^T W_V^{gT}   [d, d],   M_h = (W_K^{gT} S_l) (G_E W_Q^h).
    n_kv, group = H // cfg.group_size, cfg.group_size
    S = torch.zeros(cfg.d_model, cfg.d_model, dtype=dt, device=model.device)
    for layer in range(1, layers.stop if len(layers) else 1):  # S_l for every layer up to the last asked
        w = weights[layer - 1].to(dt)
        if bool((w != 0).any()):
            W_O = circuit_weight(model, layer - 1, "W_O").to(dt)  # output-norm gain folded (folded.py)
            O_w = (W_O * w[:, None, None]).unflatten(0, (n_kv, group)).sum(1)  # [n_kv, dh, d]
            W_V = circuit_weight(model, layer - 1, "W_V").to(dt)
            S = S.addmm(O_w.flatten(0, 1).T, W_V.transpose(-2, -1).flatten(0, 1))  # [d, d]
        if layer in layers:
            KS = circuit_weight(model, layer, "W_K").to(dt).transpose(-2, -1) @ S  # [n_kv, dh, d]: W_K^{gT} S_l
            M[layer - layers.start] = KS.repeat_interleave(group, dim=0) @ G_E_W_Q_at(layer) / cfg.scale  # [H, dh, dh]
    return M


def circuit_positivity(fm: FactoredMatrix) -> float:
    """sum(eig)/sum(|eig|) of a square FactoredMatrix through its small B A (e.g. a K-composition circuit)."""
    return float(copying_score(eigvals(fm.BA.double())))
