"""JSON answers of the composition and prompt analyses: composition, path expansions, prompts, virtual heads, QK paths,
term importance and the paper tour (docs/maths.md §2.9-2.16, §3).

Heads are named L{layer}H{head}; a path is the list of heads it passes through, earliest first, after an
optional source ("bias:L0", "mlp:L0", "bias:unembed"); [] is the direct path.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from app.schemas.common import Complex, MatrixEntry, ModelRef, QKFormed, TokenRef

CompositionKindName = Literal["Q", "K", "V"]
TermKind = Literal["direct", "head", "bias", "mlp", "unembed_bias", "remainder", "other"]


# -- composition --------------------------------------------------------------------------------------
class CompositionView(BaseModel):
    """Q-, K- or V-composition scores of every (earlier head, later head) pair (docs/maths.md §2.9)."""

    model: ModelRef
    kind: CompositionKindName
    basis: str = Field(
        description="which weights the scores come from: raw, or which processing (folded LayerNorm, centred writers)"
    )
    qk_form: str | None = Field(
        default=None,
        description="QK numbers: the form they are in (circuits_core.circuits.qk_forms): 'exact' without QK-norm; "
        "under QK-norm 'bilinear' (weight level: scales left out) or 'frozen-norm' (prompt level: the run's scales "
        "frozen)",
    )
    qk_form_note: str | None = Field(default=None, description="that form in words")
    sources: list[str] = Field(description="row heads: every head that has a later layer (earlier heads)")
    targets: list[str] = Field(description="column heads: every head that has an earlier layer (later heads)")
    scores: list[list[float | None]] = Field(
        description="raw scores in [0, 1], [source][target]; null unless source layer < target layer"
    )
    minus_baseline: list[list[float | None]] = Field(
        description="scores minus `baseline` (the paper's default), null like `scores`"
    )
    baseline: float = Field(
        description="expected score of random matrices of the same shapes, 1/sqrt(d_model) (subtracted)"
    )
    sampled_baseline: float = Field(
        description="mean score of ARENA's random generator (check of the analytic baseline)"
    )
    sampled_std: float = Field(description="standard deviation of the sampled random scores")
    top_pairs: list[CompositionPair] = Field(
        description="the strongest pairs, largest raw score first; equal scores by source, then target, in head order "
        "(docs/maths.md §1.7)"
    )
    offset: int | None = Field(
        default=None,
        description="rotary models: the query-key offset δ of the Q/K scores "
        "(Ω_B(δ) = W_Q R(δ) W_Kᵀ); None for other models and for V",
    )


class CompositionPair(BaseModel):
    source: str
    target: str
    score: float
    minus_baseline: float


class TokenCircuit(BaseModel):
    """Largest entries of a [d_vocab, d_vocab] token circuit and its eigenvalue statistic (docs/maths.md §2.8)."""

    row_label: str
    col_label: str
    entries: list[MatrixEntry] = Field(
        description="global top-k entries, largest first, equal values by row, then column (docs/maths.md §1.7)"
    )
    eigenvalues: list[Complex] = Field(description="the nonzero eigenvalues (from the d_head x d_head factor product)")
    copying: float | None = Field(
        description="sum(eig)/sum(|eig|) in [-1, 1]: +1 means 'same token' (copying / matching)"
    )


class VirtualHeadCircuit(BaseModel):
    """The OV circuit of a chain of heads h1 -> ... -> hk (docs/maths.md §2.10): W_E W_OV^{h1} ... W_OV^{hk} W_U."""

    heads: list[str]
    ov: TokenCircuit


class CompositionPairView(QKFormed):
    """One (earlier, later) pair: its three scores, the K-composition token circuit, and the virtual head."""

    model: ModelRef
    source: str
    target: str
    basis: str = Field(
        description="which weights the scores come from: raw, or which processing (folded LayerNorm, centred writers)"
    )
    scores: dict[str, float] = Field(description="raw Q, K, V composition scores")
    minus_baseline: dict[str, float]
    baseline: float
    token_set: str | None = Field(
        default=None, description="the tokens both token circuits rank, in words (None: every token)"
    )
    k_composition: TokenCircuit = Field(
        description="W_E W_Q^t W_K^tT (W_V^s W_O^s)^T W_E^T / s: rows query token, columns the token the source "
        "head reads at the key position; its copying statistic is the 'same-token matching' of the K term"
    )
    virtual_head: VirtualHeadCircuit


# -- logit path expansion ----------------------------------------------------------------------------
class PathTermView(BaseModel):
    path: list[str] = Field(description="source (if not the embedding) then heads, earliest first; [] = direct path")
    kind: TermKind
    order: int | None = Field(description="number of heads in the path; null for remainder / other")
    value: float
    by_source: list[float] | None = Field(
        default=None, description="the value split over source positions (sums to value)"
    )
    n_terms: int | None = Field(default=None, description="for 'other': how many small terms it sums")


class PathsView(BaseModel):
    """Frozen-attention path expansion of one logit (or logit difference) at one position (docs/maths.md §2.11)."""

    model: ModelRef
    tokens: list[int] = Field(description="token ids of the prompt (BOS first when the prompt was text)")
    prompt_tokens: list[TokenRef] = Field(description="the same tokens with their readable text")
    position: int = Field(description="destination position (0-based)")
    target: int = Field(description="token id whose logit is expanded (default: the model's top prediction)")
    target_token: TokenRef
    contrast: int | None = Field(description="token id whose logit is subtracted, if any")
    contrast_token: TokenRef | None
    value: float = Field(description="logit of target at position (minus the logit of contrast)")
    logit_cap: float | None = Field(
        default=None,
        description="soft cap c of the logits (Gemma 2): value is the capped logit c·tanh(z/c), and every term "
        "carries its logit's frozen cap factor c·tanh(z/c)/z at the position (target and contrast each their own), so "
        "the terms still sum to it",
    )
    beyond_cap: float | None = Field(
        default=None, description="share of the position's logits (whole vocabulary) with |z| > c before the cap"
    )
    max_order: int
    terms: list[PathTermView] = Field(
        description="largest |value| first, equal |values| (the zero terms of absent biases) in the expansion's own "
        "term order (order 0 from the embedding up, then each higher order, the unembedding bias last; docs/maths.md "
        "§1.7); then 'other' (the unlisted terms) and 'remainder' (orders > max_order)"
    )
    total: float = Field(description="sum of every term's value: equals `value`")
    order_totals: list[float] = Field(description="sum of the explicit terms of each order 0..max_order")
    n_terms: int = Field(description="number of explicit terms of the expansion")


# -- prompt: tokens and attention patterns -----------------------------------------------------------
class PromptHeadPattern(BaseModel):
    head: str
    pattern: list[list[float]] = Field(description="[query][key]; value-weighted entries A[i, j] ||v_j|| when weighted")
    sink_mass: list[float] | None = Field(
        default=None,
        description="learned sinks only: 1 - sum_j A[i, j] per query, the share the sink keeps (rows are never "
        "renormalised)",
    )
    beyond_cap: float | None = Field(
        default=None,
        description="soft-capped scores only: the share of the scores this head sees on the prompt (causal, within its "
        "window) with |s| > c before the cap",
    )


class PromptView(BaseModel):
    model: ModelRef
    tokens: list[TokenRef]
    weighted: bool = Field(description="value-weighted (docs/maths.md §2.16, not renormalised) or plain patterns")
    score_cap: float | None = Field(
        default=None, description="soft cap c of the attention scores (Gemma 2): the softmax sees c·tanh(s/c)"
    )
    heads: list[PromptHeadPattern]
    top_predictions: list[TokenRef] = Field(description="the model's top next-token prediction at each position")


# -- a chain of heads (virtual head) on a prompt -----------------------------------------------------
class SourceContribution(BaseModel):
    source: str = Field(description="'embed', 'bias:L0', 'mlp:L0': where the path starts")
    values: list[float] = Field(description="contribution at each destination position")


class ChainView(BaseModel):
    """A chain of heads in increasing layers on a prompt: pattern, OV circuit and logit contribution."""

    model: ModelRef
    heads: list[str]
    tokens: list[TokenRef]
    target: TokenRef = Field(description="the logit the contribution is measured on")
    pattern: list[list[float]] = Field(description="A^{hk} ... A^{h1}, [query][key] (row-stochastic, causal)")
    ov: TokenCircuit
    contribution: list[float] = Field(
        description="the path term (embedding source) of the target logit at each position"
    )
    by_source: list[SourceContribution] = Field(
        description="the same head chain started from every source that can enter it"
    )
    next_token_contribution: list[float] = Field(
        default_factory=list,
        description="the path term (embedding source) on the logit of each position's actual next token, positions "
        "0..n-2 (the paper's induction-head figure)",
    )


# -- QK path expansion ------------------------------------------------------------------------------
class QKPair(BaseModel):
    query: str
    key: str
    std: float = Field(
        description="standard deviation of this pair's score term over the causal (query, key) positions"
    )


class QKTerm(BaseModel):
    query: str = Field(description="query-side component")
    key: str = Field(description="key-side component")
    value: float = Field(description="q_a k_b^T / s at the chosen (query, key) positions")


class QKCell(BaseModel):
    """One score of the head split into its terms: the largest |term| first (they sum to `score`)."""

    query: int
    key: int
    score: float = Field(description="the real pre-softmax score q k^T / s")
    attention: float = Field(description="the head's attention weight there")
    terms: list[QKTerm] = Field(
        description="the k largest |terms| of C x C; equal |terms| (zero bias components) by query component, then "
        "key component, in the components' order (docs/maths.md §1.7)"
    )


class QKPathsView(BaseModel):
    """Component x component decomposition of one head's attention scores (docs/maths.md §2.12)."""

    model: ModelRef
    head: str
    tokens: list[TokenRef]
    components: list[str] = Field(description="query- and key-side components of the head's input")
    std: list[list[float]] = Field(description="[query component][key component] std of the term over causal positions")
    top_pairs: list[QKPair] = Field(
        description="the k pairs of largest std, equal stds (zero bias components) by query component, then key "
        "component, in the components' order (docs/maths.md §1.7)"
    )
    terms: dict[str, list[list[float]]] = Field(
        description="'query|key' -> [query][key] scores of the top pairs (masked entries are 0)"
    )
    scores: list[list[float | None]] = Field(description="the real attention scores (null above the diagonal)")
    max_abs_error: float = Field(
        description="max |sum of all terms (+ ALiBi's kernel -m_h (i - j)) - real scores| over causal positions"
    )
    qk_form: str = Field(
        default="exact",
        description="'exact' (no QK-norm) or 'frozen-norm' (QK-norm: each token's query and key scale frozen at this "
        "run's values, so the terms sum to the scores)",
    )
    score_cap: float | None = Field(
        default=None, description="soft cap c of the scores (Gemma 2): each term is multiplied by its entry's frozen "
        "factor c·tanh(s/c)/s, so the terms sum to the capped score",
    )  # fmt: skip
    beyond_cap: float | None = Field(default=None, description="share of the seen scores with |s| > c before the cap")
    window: int | None = Field(
        default=None, description="sliding window of the head's layer: keys at offsets ≥ window are not seen (null)"
    )
    at: QKCell | None = Field(default=None, description="the terms of one score (params query and key), else null")


# -- term importance -------------------------------------------------------------------------------
class HeadAblation(BaseModel):
    head: str
    loss_change: float = Field(
        description="loss with the head's output removed, patterns frozen (MLPs and LayerNorm recomputed), minus the "
        "clean loss"
    )
    loss_change_recomputed: float = Field(
        description="the same with the later layers' patterns recomputed from the ablated stream, so Q-/K-composition "
        "act"
    )


class TermImportanceView(BaseModel):
    """Loss when only paths up to each order are kept (docs/maths.md §2.13) and per-head ablations.

    MLP models: each MLP's clean output is an order-0 path source (as in the path expansion), kept in every rerun.
    """

    model: ModelRef
    text_source: str = Field(description="where the text came from: 'prompt', 'tokens', 'card' or 'builtin'")
    tokens: list[TokenRef]
    clean_loss: float
    loss_by_order: list[float] = Field(
        description="mean loss keeping paths of order <= k (k heads; an MLP's clean output is an order-0 source), k = "
        "0..n_layers (last = clean)"
    )
    marginal_by_order: list[float] = Field(
        description="loss[k-1] - loss[k]: what the order-k terms add, k = 1..n_layers"
    )
    first_order_by_layer: list[float] = Field(
        description="loss drop over the direct path from adding layer l's first-order terms alone"
    )
    heads_asked: str = Field(
        description="the `heads` selection answered: 'default', 'all', 'none' or the canonical list"
    )
    heads_note: str = Field(
        description="which heads `heads` holds, in one sentence (the default differs by model size)"
    )
    all_heads_gflop: float = Field(
        description="the engine's FLOP count (GFLOP) of this answer with every head ablated (heads=all)"
    )
    heads: list[HeadAblation] = Field(description="the ablated heads, in layer order")


CompositionView.model_rebuild()
