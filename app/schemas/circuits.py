"""Top entries of the [d_vocab, d_vocab] circuits (OV, QK, direct path) and skip-trigram tables."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from app.schemas.common import MatrixEntry, ModelRef, QKFormed, ScoredToken, TokenRef

Circuit = Literal["ov", "qk", "direct", "expert"]
Side = Literal["row", "column"]


class CircuitTopView(BaseModel):
    """Largest entries of one circuit: of one row/column when a token is given, else of the whole matrix.

    Orientation (TransformerLens, row vectors): OV rows = source (attended-to) token, columns = output
    logit; QK rows = query (destination) token, columns = key (source) token; direct rows = current token,
    columns = next token.
    """

    model: ModelRef
    circuit: Circuit
    head: str | None = Field(default=None, description="L{layer}H{head}; None for the direct path")
    row_label: str = Field(description="what the rows are (e.g. 'source token')")
    col_label: str = Field(description="what the columns are (e.g. 'output token')")
    token: TokenRef | None = Field(
        default=None, description="the token whose row or column was read; None: global top-k"
    )
    side: Side | None = Field(default=None, description="whether `token` is the row or the column")
    k: int
    entries: list[MatrixEntry] = Field(
        description="sorted by value, largest first; equal values by token id, the lower first (of the global top k: "
        "by row, then column; docs/maths.md §1.7)"
    )
    diagonal: float | None = Field(
        default=None, description="the token's own entry (copying signature), when a token is given"
    )
    sink_logit: float | None = Field(
        default=None,
        description="QK views of a head with a learned sink (gpt-oss): its sink logit b_h; a query attends to a lone "
        "key with probability sigmoid(s - b_h)",
    )
    sink_attend: list[float] | None = Field(
        default=None,
        description="per entry (QK, learned sinks): sigmoid(s - b_h) with s the entry's full direct-path score, q/k "
        "biases included (the table's value leaves them out); above 1/2 the pair beats the sink",
    )
    latent_content: list[float] | None = Field(
        default=None,
        description="per entry (QK, multi-head latent attention): the position-free content term x A_h y^T / "
        "(s rho_q rho_kv) of the entry's value",
    )
    latent_rotary: list[float] | None = Field(
        default=None,
        description="per entry (QK, multi-head latent attention): the rotary term x C_h R(offset) D^T y^T / (s rho_q); "
        "content + rotary = value",
    )
    diagonal_rank: int | None = Field(
        default=None,
        description="rank of the token's own entry in its row/column (1 = top; among the kept tokens with min_count)",
    )
    basis: str | None = Field(default=None, description="which weights the values come from: raw, or which processing")
    corpus: str | None = Field(
        default=None, description="direct path: the held-out corpus of corpus_prob / corpus_count, if any"
    )
    min_count: int | None = Field(
        default=None, description="only tokens seen at least this often in training were ranked (None: every token)"
    )
    n_tokens: int | None = Field(
        default=None,
        description="how many tokens were ranked: those min_count kept, or the default set "
        "of a large vocabulary (None: every token)",
    )
    token_set: str | None = Field(
        default=None, description="which tokens a global table ranked, in words (None: every token)"
    )
    token_ids: list[int] | None = Field(
        default=None,
        description="the ids of the tokens ranked, sorted (None: every token): `token_set`'s tokens, or min_count's",
    )
    offset: int | None = Field(
        default=None,
        description="QK of a rotary model: the query-key offset δ of W_Q R(δ) W_Kᵀ "
        "(None: the model has no rotary positions)",
    )
    qk_form: str | None = Field(
        default=None,
        description="QK only: the form of the values (circuits_core.circuits.qk_forms): 'exact' (no QK-norm), "
        "'cosine' (QK-norm: each token's own normalisation, the score the softmax sees)",
    )
    qk_form_note: str | None = Field(default=None, description="QK only: that form in words")
    score_cap: float | None = Field(
        default=None,
        description="QK of a soft-capped model: the cap c; values are c·tanh(s/c), rankings unchanged (the cap is "
        "monotone)",
    )
    window: int | None = Field(
        default=None, description="QK of a sliding-window layer: the head never attends at offsets ≥ window"
    )
    beyond_cap: float | None = Field(
        default=None,
        description="QK of a soft-capped model, a token's row or column: the share of its d_vocab scores with |s| > c "
        "before the cap",
    )
    mlp: str | None = Field(
        default=None, description="expert tables: the MLP writer (L1.mlp.e3, L1.mlp.shared, a dense layer's L0.mlp)"
    )
    route_weight: list[float] | None = Field(
        default=None,
        description="expert tables, per entry: the router's weight for this expert on the row token's MLP input "
        "alone (0: that token alone would not be routed to it; 1 for shared experts and dense MLPs)",
    )
    form_note: str | None = Field(default=None, description="expert tables: what the values are, in words")


class SkipTrigram(BaseModel):
    source: TokenRef
    destination: TokenRef
    out: TokenRef
    qk: float = Field(description="QK[destination, source]: how much the destination attends to the source")
    ov: float = Field(description="OV[source, out]: the logit the source writes for out")
    joint: float = Field(description="qk * ov: a heuristic strength (the paper defines no joint score)")


class SkipTrigramView(QKFormed):
    """[source] ... [destination] -> [out] for one head and source token (paper 'skip-trigrams')."""

    model: ModelRef
    head: str
    source: TokenRef
    k: int
    destinations: list[ScoredToken] = Field(
        description="top QK column of the source: queries that attend to it (equal scores: the lower token id first, "
        "docs/maths.md §1.7)"
    )
    outs: list[ScoredToken] = Field(
        description="top OV row of the source: logits it raises when attended to (equal scores: the lower token id "
        "first)"
    )
    trigrams: list[SkipTrigram] = Field(
        description="the k strongest (destination, out) pairs of the destinations x outs grid by qk * ov "
        "(the grid is the factored cross-product, 'skip-trigram bugs' included); equal products in the order of "
        "destinations, then outs"
    )
    copying: bool = Field(description="whether the source is among its own top-k outs")
    min_count: int | None = Field(
        default=None,
        description="destinations, outs (and the default source) were tokens seen at least this often in training",
    )
    token_set: str | None = Field(
        default=None,
        description="without a token: which tokens the default source (the largest "
        "full-OV entry) was chosen among, in words (None: every token)",
    )
    offset: int | None = Field(
        default=None,
        description="rotary models: destinations ranked by the QK circuit at this "
        "query-key offset δ (the source δ positions before the destination); None otherwise",
    )
